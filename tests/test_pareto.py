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


# ----- the figure (benchmarks/pareto_plot.py) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def figure() -> ModuleType:
    return load_script("benchmarks", "pareto_plot")


def _row(cache: float, ppl: float, recall: float, **extra: object) -> dict:
    return {"cache_mib": cache, "perplexity_in-distribution": ppl, "passkey": {"1024": recall},
            "associative_recall_mean": recall, "associative_recall": {"1024": {"1": recall}}, "training_tokens": 0,
            **extra}


def test_frontier_drops_dominated_points(figure: ModuleType) -> None:
    points = {"small": (1.0, 9.0), "dominated": (2.0, 10.0), "better": (3.0, 2.0), "tie": (3.0, 4.0), "big": (9.0, 1.0)}
    assert figure.frontier(points, lower_is_better=True) == ["small", "better", "big"]
    assert figure.frontier({"a": (1.0, 0.0), "b": (2.0, 0.0), "c": (4.0, 0.5)}, lower_is_better=False) == ["a", "c"]


def test_constant_frontier_leaves_out_growing_caches(figure: ModuleType) -> None:
    rows = {"teacher": _row(100.0, 10.0, 1.0), "fixed": _row(5.0, 12.0, 0.2, cache_grows=False),
            "grows": _row(8.0, 10.5, 0.9, cache_grows=True), "best": _row(20.0, 11.0, 0.5, cache_grows=False)}
    ppl = figure.constant_frontier(rows, lambda r: r["perplexity_in-distribution"], lower_is_better=True)
    assert ppl == ["fixed", "best"]
    assert figure.constant_frontier(rows, lambda r: r["associative_recall_mean"], lower_is_better=False) == ppl


def test_which_caches_grow_without_the_field(figure: ModuleType) -> None:
    window = {"mixer": "hybrid", "window": 64, "far": "none", "sink_tokens": 4}
    assert figure.cache_grows("teacher", {})
    assert not figure.cache_grows("w", {"attention": {"attention": window}})
    assert figure.cache_grows("w", {"attention": {"attention": window,
                                                  "attention_overrides": {"3": {"mixer": "softmax"}}}})
    assert figure.cache_grows("f", {"recipe": "fox"})
    assert figure.cache_grows("r", {"recipe": "hybrid-w64-sink4-hedgehog-retrieval"})  # retrieval heads
    assert not figure.cache_grows("h", {"recipe": "hybrid-w64-sink4-gdn"})
    assert not figure.cache_grows("g", {"recipe": "gemma3-270m-full-hybrid-gdn"})  # sliding windows kept
    assert figure.cache_grows("t", {"cache_grows": True, "recipe": "gdn"})  # a measured field wins
    with pytest.raises(SystemExit, match="'x'"):
        figure.cache_grows("x", {"cache_mib": 1.0})


def test_numbers_are_stable_and_unique(figure: ModuleType) -> None:
    models = {"b": {"cache_mib": 2.0}, "teacher": {"cache_mib": 9.0}, "a": {"cache_mib": 2.0}}
    peers = {"p2": {"cache_mib": 1.0}, "p1": {"cache_mib": 3.0}}
    numbers = figure.numbering(models, peers)
    assert numbers == {"teacher": 1, "a": 2, "b": 3, "p1": 4, "p2": 5}
    assert figure.numbering(dict(reversed(models.items())), dict(reversed(peers.items()))) == numbers
    with pytest.raises(SystemExit, match="both a model and a peer"):
        figure.numbering(models, {"a": {"cache_mib": 1.0}})


def test_close_points_share_one_label(figure: ModuleType) -> None:
    groups = figure.label_groups([(3, 0.5, 0.5), (1, 0.1, 0.1), (2, 0.12, 0.11), (4, 0.9, 0.1)])
    assert [numbers for numbers, _, _ in groups] == [[1, 2], [3], [4]]


def test_plot_draws_a_tiny_result(figure: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = {"settings": {"context": 8192}, "models": {
        "teacher": _row(100.0, 10.0, 1.0), "fixed": _row(5.0, 12.0, 0.0, cache_grows=False),
        "grows": _row(8.0, 10.5, 0.5, cache_grows=True)}}
    peers = {"press 10 tokens (kvpress)": {"cache_mib": 5.0, "passkey": {"1024": 1.0},
                                           "perplexity_ratio": {"in-distribution": 1.1}, "training_tokens": 0}}
    path = tmp_path / "pareto.png"
    assert figure.plot(results, str(path), peers) == f"plot: {path}"
    assert path.stat().st_size > 0


def test_plot_only_measures_nothing(pareto: ModuleType, tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"benchmark": "decode"}))
    with pytest.raises(SystemExit, match="--plot PNG"):
        pareto.main(["--plot-only", str(bad)])
    with pytest.raises(SystemExit, match="not a benchmarks/pareto.py result file"):
        pareto.main(["--plot-only", str(bad), "--plot", str(tmp_path / "x.png")])


def test_merge_keeps_the_commands_of_a_file_merged_before(
    pareto: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merging a merged file with a new part lists every part's command once, the teacher's provenance kept."""
    monkeypatch.setattr(pareto, "table", lambda *_: "")

    def part(name: str, command: str, rows: list[str]) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"benchmark": "pareto", "settings": {"context": 8},
                                    "models": dict.fromkeys(rows, {}), "provenance": {"command": command}}))
        return path

    first = tmp_path / "first.json"
    pareto.merge([str(part("teacher", "a", ["teacher"])), str(part("b", "b", ["x"]))], first, None)
    joined = tmp_path / "joined.json"
    pareto.merge([str(first), str(part("c", "c", ["y"]))], joined, None)
    result = json.loads(joined.read_text())
    assert result["parts"] == ["a", "b", "c"]
    assert result["provenance"] == {"command": "a"} and sorted(result["models"]) == ["teacher", "x", "y"]
