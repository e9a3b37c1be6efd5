"""benchmarks/needles.py keeps what it measured: the results file is rewritten after every model, and a rerun with
the same settings measures only the models it has not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from script_modules import load_script

needles = load_script("benchmarks", "needles")

CELL = {"accuracy": 0.5, "interval": [0.1, 0.9], "n": 2, "repeated": 0}


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: list[str], fail_on: str | None = None,
         prompts: int = 2) -> list[str]:
    measured: list[str] = []

    def fake(spec: str, args: Any) -> dict[str, Any]:
        if spec == fail_on:
            raise KeyboardInterrupt
        measured.append(spec)
        return {"cells": {"single_number": {"heldout": {"1024": CELL}}}, "skipped": [], "seconds": 0.0}

    monkeypatch.setattr(needles, "measure", fake)
    needles.main(["--models", *models, "--tasks", "single_number", "--lengths", "1024", "--prompts",
                  str(prompts), "--out", str(tmp_path / "n.json")])
    return measured


def test_an_interrupted_run_keeps_its_models_and_a_rerun_measures_the_rest(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, monkeypatch, ["a", "b"], fail_on="b")
    assert list(json.loads((tmp_path / "n.json").read_text())["models"]) == ["a"]
    assert _run(tmp_path, monkeypatch, ["a", "b"]) == ["b"]
    assert list(json.loads((tmp_path / "n.json").read_text())["models"]) == ["a", "b"]
    assert _run(tmp_path, monkeypatch, ["a", "b"], prompts=3) == ["a", "b"]  # other settings: measured again


def test_hybrid_layers_are_parsed_labelled_and_kept_in_the_settings(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--hybrid-layers 0-2 7``: the layer set, named in the label and the row, each choice a row of the same
    file; a bad item or the flag without ``--hybrid-options`` refused."""
    assert needles.parse_layers(["7", "0-2", "2"]) == [0, 1, 2, 7]
    assert needles._label("m", {"window": 9}, [0, 1, 2, 7]) == "m, window=9 on layers 0-2, 7"
    assert needles._label("m", {"window": 9}) == "m, window=9"
    for bad in (["a"], ["3-1"], ["1-x"], ["0-"]):
        with pytest.raises(ValueError, match=f"--hybrid-layers: {bad[0]!r}"):
            needles.parse_layers(bad)
    monkeypatch.setattr(needles, "measure", lambda spec, args: {
        "cells": {"single_number": {"heldout": {"1024": CELL}}}, "skipped": [], "seconds": 0.0,
        "layers": args.hybrid_layers})
    needles.main(["--models", "a", "--tasks", "single_number", "--lengths", "1024", "--hybrid-options",
                  '{"window": 9}', "--hybrid-layers", "0-2", "--out", str(tmp_path / "n.json")])
    needles.main(["--models", "a", "--tasks", "single_number", "--lengths", "1024", "--hybrid-options",
                  '{"window": 9}', "--hybrid-layers", "5", "--out", str(tmp_path / "n.json")])
    saved = json.loads((tmp_path / "n.json").read_text())
    assert "hybrid_layers" not in saved["settings"]  # another layer choice adds its row to the same file
    assert saved["models"]["a, window=9 on layers 0-2"]["layers"] == [0, 1, 2]
    assert saved["models"]["a, window=9 on layers 0-2"]["hybrid_layers"] == [0, 1, 2]
    assert saved["models"]["a, window=9 on layers 5"]["hybrid_layers"] == [5]
    with pytest.raises(SystemExit):
        needles.main(["--models", "a", "--hybrid-layers", "0-2", "--out", str(tmp_path / "m.json")])
