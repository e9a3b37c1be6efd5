"""The pretrain sweep's bookkeeping (benchmarks/pretrain_sweep.py): run list, resume and atomic results file.

No training here: only the pure functions that decide which runs a rerun skips, when a results file may be
continued, and that the file is replaced whole. Exact comparisons, no tolerances.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "pretrain_sweep.py"


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pretrain_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_sweep"] = module
    spec.loader.exec_module(module)
    return module


def _config(sweep: ModuleType, *argv: str) -> dict:
    return sweep.sweep_config(sweep.parse_args(list(argv)))


def test_default_runs_cover_the_seed_grid(sweep: ModuleType) -> None:
    runs = sweep.RUNS
    assert list(runs)[0] == "softmax"
    taylor = {(s["order"], s["denominator"]) for s in runs.values() if s["mixer"] == "taylor"}
    # every order 1..4 with every denominator, except the exact one for odd orders (the mixer refuses it)
    assert taylor == {(n, d) for n in (1, 2, 3, 4) for d in sweep.TAYLOR_DENOMINATORS if not (d == "exact" and n % 2)}
    assert {"linear elu", "linear relu", "linear cosine", "heinsen", "deltanet", "gdn"} <= set(runs)
    assert len(runs) == 25
    assert not set(sweep.EXTRA_RUNS) & set(runs)


def test_every_run_spec_is_valid(sweep: ModuleType) -> None:
    from hf_recattn.modeling.mixers import validate_spec

    for label in sweep.ALL_RUNS:
        spec = sweep.run_spec(label, 256)
        validate_spec(spec, label)
        assert (spec.get("chunk_size") == 256) == (spec["mixer"] == "taylor")
    assert "chunk_size" not in sweep.ALL_RUNS["taylor2 exact"]  # run_spec copies, never edits the table


def test_unknown_run_is_a_clear_error(sweep: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown --runs \\['taylor3 exact'\\]"):
        sweep.parse_labels(["softmax", "taylor3 exact"])
    assert sweep.parse_labels(None) == list(sweep.RUNS)


def test_pending_skips_only_finished_runs(sweep: ModuleType) -> None:
    results = {"config": {}, "runs": {"softmax": {"status": "done"}, "heinsen": {"status": "failed"},
                                      "gdn": {"status": "done"}}}
    assert sweep.pending_runs(["gdn", "heinsen", "linear elu", "softmax", "linear elu"], results) == [
        "heinsen", "linear elu"]
    assert sweep.pending_runs(["softmax"], results) == []


def test_resume_requires_the_same_configuration(sweep: ModuleType) -> None:
    config = _config(sweep)
    assert sweep.start_results(None, config, fresh=False, where="f") == {"config": config, "runs": {}}
    saved = {"config": json.loads(json.dumps(config)), "runs": {"softmax": {"status": "done"}}}
    saved["config"]["tokenizer"]["vocab_digest"] = "abc"  # added once the tokenizer is trained: not a mismatch
    assert sweep.start_results(saved, config, fresh=False, where="f") is saved
    other = _config(sweep, "--lr", "1e-3", "--steps", "10")
    with pytest.raises(ValueError, match=r"differs in train\.lr, train\.steps"):
        sweep.start_results(saved, other, fresh=False, where="f")
    assert sweep.config_mismatch(saved["config"], other) == ["tokenizer.vocab_digest", "train.lr", "train.steps"]
    assert sweep.start_results(saved, other, fresh=True, where="f")["runs"] == {}
    # the threads do not change a run's losses, so they are not part of the configuration
    assert sweep.config_mismatch(config, _config(sweep, "--threads", "2")) == []


def test_scale_grows_the_model_and_the_tokens(sweep: ModuleType) -> None:
    one, two = _config(sweep), _config(sweep, "--scale", "2")
    assert two["model"]["hidden_size"] == 2 * one["model"]["hidden_size"]
    assert two["model"]["num_hidden_layers"] == 2 * one["model"]["num_hidden_layers"]
    tokens = [c["train"]["steps"] * c["train"]["batch_size"] for c in (one, two)]
    assert tokens[1] == 4 * tokens[0]


def test_results_file_round_trip_and_atomic_replace(sweep: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "results.json"
    assert sweep.load_results(path) is None
    data = {"config": {"a": 1}, "runs": {"softmax": {"status": "done", "final_heldout_loss": 3.5}}}
    sweep.write_json_atomic(path, data)
    sweep.write_json_atomic(path, {**data, "runs": {}})
    assert sweep.load_results(path) == {**data, "runs": {}}
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # no temporary file left
    path.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="not a pretrain_sweep results file"):
        sweep.load_results(path)


def test_eval_points_end_at_the_last_step(sweep: ModuleType) -> None:
    assert sweep._eval_steps(80, 4) == [20, 40, 60, 80]
    assert sweep._eval_steps(3, 4) == [1, 2, 3]
