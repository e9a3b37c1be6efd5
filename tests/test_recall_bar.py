"""benchmarks/recall_bar.py: which cells a student misses the bar on, read from natural-text result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_modules import load_script

bar = load_script("benchmarks", "recall_bar")

WINDOW_ROW = "window 512 + 4 sinks"
RECORD = {"commit": "0123456789abcdef", "date": "2026-11-30T00:00:00"}
LENGTHS = {"single_number": ("1024", "4096"), "multi_key": ("2048",), "multi_query": ("2048",)}


def _row(accuracy: dict[str, float], mib: float = 22.0) -> dict:
    """A natural_recall row answering ``accuracy[task]`` on every haystack and length of the task."""
    cells = {task: {h: {n: {"accuracy": acc, "prompts": 20} for n in LENGTHS[task]} for h in ("heldout", "ood")}
             for task, acc in accuracy.items()}
    return {"cache_mib": {"1024": mib, "4096": mib, "8192": mib}, "cells": cells}


def _ppl(value: float) -> dict:
    return {"perplexity": {h: {"512": value, "4096": value} for h in ("heldout", "ood")}}


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps({"provenance": RECORD, **data}))


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    teacher = _row({"single_number": 0.8, "multi_key": 0.6, "multi_query": 0.6}, mib=180.0)
    models = {
        "teacher": teacher,
        "within": _row({"single_number": 0.7, "multi_key": 0.4, "multi_query": 0.4}),
        "short": _row({"single_number": 0.65, "multi_key": 0.35, "multi_query": 0.6}),
        WINDOW_ROW: _row({"single_number": 0.1}, mib=22.7),
    }
    _write(tmp_path, "single.json", {"models": models})
    _write(tmp_path, "multi.json", {"models": models})
    _write(tmp_path, "ppl.json", {"models": {"teacher": _ppl(10.0), "within": _ppl(11.0), "short": _ppl(11.2)}})
    pressed = [{"cache_tokens": 3_269}, {"cache_tokens": 3_269}]  # 4k prompts cut to the kept tokens
    press = {"press": "StreamingLLM", "mode": "question-agnostic", "cache_mib": 22.01, "kept_tokens": 3_269,
             "cells": {"single_number": {"heldout": {"4096": {"summary": {"accuracy": 0.7}, "prompts": pressed}}}}}
    bigger = {"press": "KeyDiff", "cache_mib": 30.0, "kept_tokens": 4_450, "cells": {"single_number": {
        "ood": {"4096": {"summary": {"accuracy": 0.9}, "prompts": pressed}}}}}
    _write(tmp_path, "presses.json", {"settings": {"cache_dtype": "int4"},
                                      "rows": {"streaming": press, "keydiff": bigger}})
    monkeypatch.setattr(bar, "RESULTS", tmp_path)
    monkeypatch.setattr(bar, "SOURCES", {"t": {"label": "T", "single": "single.json", "multi": "multi.json",
                                               "perplexity": "ppl.json", "presses": ["presses.json"]}})
    return tmp_path


def test_a_student_within_every_margin_misses_only_where_a_press_ties_it(results: Path) -> None:
    row = bar.collect({"t": ["within"]})["teachers"]["t"]["students"]["within"]
    assert row["misses"] == ["single 4k heldout (not ahead of StreamingLLM agnostic, int4)"]
    assert row["perplexity"]["ppl x teacher 512/heldout"] == pytest.approx(1.1)
    assert row["rivals"]["single 4k/ood"]["name"] == "window 512 + 4 sinks"  # the 30 MiB press keeps more bytes


def test_multi_key_and_multi_query_cells_have_their_rivals(results: Path) -> None:
    """The presses' multi-query cells and the window's multi-key cells are rivals of those cells: a press at no more
    bytes that answers as many multi-query queries as the student is a miss there, named as holding every prompt
    whole where its budget pressed none of them (one held-out prompt longer than the budget: pressed there)."""
    multi = json.loads((results / "multi.json").read_text())
    multi["models"][WINDOW_ROW] = _row({"multi_key": 0.2}, mib=22.7)
    (results / "multi.json").write_text(json.dumps(multi))
    presses = json.loads((results / "presses.json").read_text())
    fits = {"heldout": [{"cache_tokens": 1_900}, {"cache_tokens": 3_269}], "ood": [{"cache_tokens": 1_900}] * 2}
    cells = {h: {"2048": {"summary": {"accuracy": 0.4}, "prompts": fits[h]}} for h in ("heldout", "ood")}
    presses["rows"]["turns"] = {"press": "KNorm", "mode": "question-agnostic", "cache_mib": 21.0,
                                "kept_tokens": 3_269, "cells": {"multi_query": cells}}
    (results / "presses.json").write_text(json.dumps(presses))
    row = bar.collect({"t": ["within"]})["teachers"]["t"]["students"]["within"]
    assert row["rivals"]["multi-key 2k/heldout"] == {"accuracy": 0.2, "name": "window 512 + 4 sinks",
                                                     "student": 0.4}
    whole = "KNorm agnostic, int4, every prompt whole"
    assert row["rivals"]["multi-query 2k/ood"] == {"accuracy": 0.4, "name": whole, "student": 0.4}
    assert row["misses"] == ["single 4k heldout (not ahead of StreamingLLM agnostic, int4)",
                             "multi-query 2k heldout (not ahead of KNorm agnostic, int4)",
                             f"multi-query 2k ood (not ahead of {whole})"]


def test_a_student_past_a_margin_misses_that_cell(results: Path) -> None:
    row = bar.collect({"t": ["short"]})["teachers"]["t"]["students"]["short"]
    assert "single 1k heldout" in row["misses"] and "multi-key 2k ood" in row["misses"]
    assert "multi-query 2k heldout" not in row["misses"]
    assert "ppl x teacher 4096 ood" in row["misses"]


def test_the_table_shows_each_cell_beside_the_teacher(results: Path) -> None:
    data = bar.collect({"t": ["within"]})
    table = bar.render_markdown({**data, "provenance": RECORD})
    line = next(line for line in table.splitlines() if "| within |" in line)
    assert "70 / 70 (80 / 80)" in line and "1.100 / 1.100" in line


def test_a_cell_measured_on_more_prompts_is_read_with_its_teacher_and_rivals_at_that_count(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wider run (40 prompts) holding the student and the teacher replaces their 20-prompt multi-key cells, its
    window and only the presses measured on 40 prompts are the rivals there; a student the wider run lacks keeps its
    own file's cells, and a 40-prompt press is no rival of a 20-prompt cell."""
    def multi_key(accuracy: float, prompts: int) -> dict:
        cell = {"accuracy": accuracy, "prompts": prompts}
        return {"cells": {"multi_key": {h: {"2048": cell} for h in ("heldout", "ood")}}}

    wider = {"teacher": multi_key(0.6, 40), "short": multi_key(0.45, 40), WINDOW_ROW: multi_key(0.1, 40)}
    _write(results, "wider.json", {"models": wider})
    cells = {h: {"2048": {"summary": {"accuracy": 0.45, "prompts": 40}, "prompts": [{"cache_tokens": 1_900}]}}
             for h in ("heldout", "ood")}
    press = {"press": "KNorm", "mode": "question-agnostic", "cache_mib": 21.0, "kept_tokens": 1_721,
             "cells": {"multi_key": cells}}
    _write(results, "wider_presses.json", {"settings": {"cache_dtype": "int4"}, "rows": {"knorm": press}})
    monkeypatch.setitem(bar.SOURCES["t"], "wider", ["wider.json"])
    monkeypatch.setitem(bar.SOURCES["t"], "wider_presses", ["wider_presses.json"])
    rows = bar.collect({"t": ["short", "within"]})["teachers"]["t"]["students"]
    short, within = rows["short"], rows["within"]
    assert short["recall"]["multi-key 2k/ood"] == {"student": 0.45, "teacher": 0.6, "prompts": 40}
    assert "multi-key 2k ood" not in short["misses"]  # 35 against 60 on 20 prompts; 45 against 60 on 40
    assert short["rivals"]["multi-key 2k/ood"] == {"accuracy": 0.45, "name": "KNorm agnostic, int4", "student": 0.45}
    assert "multi-key 2k ood (not ahead of KNorm agnostic, int4)" in short["misses"]
    assert within["recall"]["multi-key 2k/ood"]["student"] == 0.4  # not in the wider run: its own 20 prompts
    assert "multi-key 2k/ood" not in within["rivals"]  # the 40-prompt press answered other prompts
    table = bar.render_markdown({**bar.collect({"t": ["short"]}), "provenance": RECORD})
    assert "45 / 45 (60 / 60), 40 prompts" in table


def test_a_student_without_a_row_is_named(results: Path) -> None:
    with pytest.raises(SystemExit, match="no row 'absent'"):
        bar.collect({"t": ["absent"]})


def test_a_cell_missed_on_both_kinds_of_text_is_named_once() -> None:
    assert bar._misses(["single 4k heldout", "single 4k ood", "multi-key 2k heldout"]) == (
        "single 4k (both), multi-key 2k heldout")
    assert bar._misses(["multi-key 2k ood"]) == "multi-key 2k ood"
    assert bar._misses([]) == "none"



def test_student_rows_given_on_the_command_line_replace_that_teachers(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bar.STUDENTS, "t", ["within"])
    out = results / "bar.json"
    assert bar.main(["--teachers", "t", "--student", "t", "short", "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["teachers"]["t"]["students"]) == ["short"]
    with pytest.raises(SystemExit):  # a teacher without result files is refused before any reading
        bar.main(["--teachers", "t", "--student", "nobody", "x", "--out", str(out)])
