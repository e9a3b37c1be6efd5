"""benchmarks/natural_recall.py's ``--converted-swap`` rows: a converted checkpoint's own weights under another
attention (its cache changed, nothing trained), refused where the weights and the attention do not fit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_teacher
from script_modules import load_script

from hf_recattn import from_teacher

natural_recall = load_script("benchmarks", "natural_recall")

SAVED = {"mixer": "hybrid", "window": 4, "sink_tokens": 1, "far": "none", "cache_slots": 3, "cache_score": "keydiff"}
SWAPPED = {"mixer": "hybrid", "window": 2, "sink_tokens": 1, "far": "none", "cache_slots": 5,
           "cache_score": "recent", "cache_dtype": "int8"}


def _rows(folder: Path, teacher: torch.nn.Module, *swaps: str) -> dict[str, tuple]:
    args = argparse.Namespace(swap=[], converted=[], converted_swap=list(swaps))
    return {name: (model, facts) for name, model, _, facts in natural_recall.models(args, teacher)}


def test_a_converted_swap_keeps_the_weights_and_takes_the_new_attention(tmp_path: Path) -> None:
    teacher = tiny_teacher(64, layers=2)
    student = from_teacher(teacher, SAVED)
    with torch.no_grad():  # weights the teacher does not have: the row must read the checkpoint's
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    student.save_pretrained(tmp_path / "model")
    spec = {"weights": str(tmp_path), "attention": SWAPPED, "attention_overrides": {"1": SAVED}}
    model, facts = _rows(tmp_path, teacher, f"re-cached={json.dumps(spec)}")["re-cached"]
    specs = model.config.layer_specs()
    assert [s["window"] for s in specs] == [2, 4]
    assert specs[0]["cache_dtype"] == "int8" and specs[1]["cache_score"] == "keydiff"
    saved = student.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
    assert facts["weights"] == str(tmp_path) and facts["attention"]["attention"] == SWAPPED


def test_weights_that_do_not_fit_the_attention_are_refused(tmp_path: Path) -> None:
    teacher = tiny_teacher(64, layers=2)
    from_teacher(teacher, SAVED).save_pretrained(tmp_path / "model")
    learned = SAVED | {"cache_score": "learned"}  # a retention head the checkpoint does not hold
    spec = json.dumps({"weights": str(tmp_path), "attention": learned})
    with pytest.raises(SystemExit, match=r"--converted-swap x: the weights in .* do not fit this attention.*missing"):
        _rows(tmp_path, teacher, f"x={spec}")


@pytest.mark.parametrize("text", ['x={"attention": {"mixer": "softmax"}}', "x=[1]", "x={", 'x={"weights": 3}'])
def test_a_spec_without_its_weights_folder_is_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="--converted-swap x: SPEC"):
        natural_recall.parse_converted_swap(text)


def _measured_run(monkeypatch: pytest.MonkeyPatch, out: Path, commit: str, rows: list[str],
                  merge: list[Path] | None = None, settings: dict | None = None) -> dict:
    """``measure_rows`` at ``commit`` with ``rows`` to measure (each answering its name's length), no model run."""
    monkeypatch.setattr(natural_recall, "run_record", lambda: {"commit": commit, "date": f"day of {commit}"})
    monkeypatch.setattr(natural_recall, "load_teacher", lambda spec: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(natural_recall, "models", lambda args, teacher: ((name, None, None, {}) for name in rows))
    args = argparse.Namespace(threads=None, out=out, merge=merge or [], teacher="tiny")
    return natural_recall.measure_rows(args, "natural_recall", settings or {"prompts": 20}, [],
                                       lambda name, *_: {"accuracy": len(name), "seconds": 0.0}, "accuracy")


def test_rows_keep_the_commit_they_were_measured_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun measures only the new rows; every row keeps its own commit and date (one from a file written before
    rows kept theirs takes that file's), and the rendered notes name the rows measured at another commit."""
    out = tmp_path / "out.json"
    first = _measured_run(monkeypatch, out, "aaa", ["teacher", "old"])
    del first["models"]["old"]["measured"]  # as files written before rows kept their commit
    out.write_text(json.dumps(first))
    again = _measured_run(monkeypatch, out, "bbb", ["teacher", "old", "new"])
    stamps = {name: row["measured"]["commit"] for name, row in again["models"].items()}
    assert stamps == {"teacher": "aaa", "old": "aaa", "new": "bbb"}
    assert again["provenance"]["commit"] == "bbb"
    assert natural_recall.measured_elsewhere(again) == ("Rows measured at another commit than the line below: "
                                                        "teacher (aaa, day of aaa); old (aaa, day of aaa).")
    assert natural_recall.measured_elsewhere(first) == ""


def test_merge_takes_in_the_rows_the_output_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--merge``: rows of another run's file that ``--out`` lacks come in with their own commit, rows it has stay
    as they are, nothing is measured again; a file of other settings is refused, named."""
    out, side = tmp_path / "out.json", tmp_path / "side.json"
    _measured_run(monkeypatch, out, "aaa", ["teacher", "old"])
    _measured_run(monkeypatch, side, "bbb", ["teacher", "swap"])
    merged = _measured_run(monkeypatch, out, "ccc", ["teacher", "old", "swap"], merge=[side])
    stamps = {name: row["measured"]["commit"] for name, row in merged["models"].items()}
    assert stamps == {"teacher": "aaa", "old": "aaa", "swap": "bbb"}
    assert json.loads(out.read_text())["models"] == merged["models"]
    _measured_run(monkeypatch, tmp_path / "other.json", "ddd", ["teacher"], settings={"prompts": 40})
    with pytest.raises(SystemExit, match=r"other\.json: measured with other settings"):
        _measured_run(monkeypatch, out, "eee", ["teacher"], merge=[tmp_path / "other.json"])
