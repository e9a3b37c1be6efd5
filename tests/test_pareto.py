"""The Pareto table's bookkeeping (benchmarks/pareto.py): model specs, cache sizes and the table's order."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from script_modules import load_script
from tiny_lm import tiny_dims

from hf_recattn import RecAttnConfig


@pytest.fixture(scope="module")
def pareto() -> ModuleType:
    return load_script("benchmarks", "pareto")


def test_swap_specs(pareto: ModuleType) -> None:
    window = {"mixer": "hybrid", "window": 8, "far": "none"}
    assert pareto.parse_swap(f"w={json.dumps(window)}") == ("w", {"attention": window})
    both = {"attention": window, "attention_overrides": {"1": {"mixer": "softmax"}}}
    assert pareto.parse_swap(f"w, exact 1={json.dumps(both)}") == ("w, exact 1", both)
    for bad, why in (("no-spec", "NAME=SPEC"), ("w={oops", "not JSON"), ("w=[1]", "JSON object"),
                     ('w={"attention": {}, "extra": 1}', "unknown keys")):
        with pytest.raises(SystemExit, match=why):
            pareto.parse_swap(bad)


def test_converted_folder_reads_the_run(pareto: ModuleType, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "run.json").write_text(json.dumps({"recipe": "r", "budget": "quick"}))
    (run / "recipe.json").write_text(json.dumps({"stage1": {"tokens": 100}, "stage2": {"tokens": 20}}))
    name, model_dir, facts = pareto.converted_folder(str(run))
    assert (name, model_dir, facts["training_tokens"], facts["recipe"]) == ("r (quick)", run / "model", 120, "r")
    assert pareto.converted_folder(str(run / "model"))[1] == run / "model"
    with pytest.raises(SystemExit, match="config.json"):
        pareto.converted_folder(str(tmp_path))


def test_cache_size_of_softmax_is_the_kv_cache(pareto: ModuleType) -> None:
    dims = tiny_dims(64)
    config = RecAttnConfig(**dims, attention="softmax")
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    kv_bytes = dims["num_hidden_layers"] * 2 * dims["num_key_value_heads"] * head_dim * 1000 * 4
    assert pareto.cache_mib(config, 1000) == pytest.approx(kv_bytes / 2**20)
    window = RecAttnConfig(**dims, attention={"mixer": "hybrid", "window": 8, "far": "none"})
    assert pareto.cache_mib(window, 1000) == pareto.cache_mib(window, 5000) < pareto.cache_mib(config, 1000)


def test_table_orders_columns_and_cells_by_number_after_the_json_round_trip(pareto: ModuleType) -> None:
    def row(cache: float, ppl: float, recall: dict[str, float]) -> dict:
        return {"cache_mib": cache, "perplexity_in": ppl, "passkey": {"4096": 1.0, "16384": 0.5},
                "associative_recall": {"1024": recall}, "associative_recall_mean": 0.5, "training_tokens": 0}

    results = {"settings": {"context": 8192},
               "models": {"teacher": row(100.0, 10.0, {"1": 1.0, "4": 0.5, "16": 0.25}),
                          "small": row(1.0, 20.0, {"1": 0.0, "4": 0.125, "16": 0.0})}}
    stored = json.loads(json.dumps(results, sort_keys=True))  # as the results file keeps it: "16" before "4"
    lines = pareto.table(stored).splitlines()
    assert "| passkey 4096 | passkey 16384 | recall 1024 (1/4/16 pairs) |" in lines[0]
    assert lines[2].startswith("| teacher | 100.00 | 1.000 | 1.000 | 100% | 50% | 100/50/25% |")
    assert lines[3].startswith("| small | 1.00 | 0.010 | 2.000 | 100% | 50% | 0/12/0% |")
