"""conversion/sittings.py: a conversion's sittings, an interrupted one closed at its last file, the total."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hf_recattn.conversion.sittings import SITTINGS_FILE, begin_sitting, end_sitting

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _file(folder: Path, name: str, mtime: float) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    os.utime(path, (mtime, mtime))


def test_one_sitting_runs_from_its_start_to_the_report(tmp_path: Path) -> None:
    begin_sitting(tmp_path, T0, "abc")
    done = end_sitting(tmp_path, T0 + 125.5)
    assert done["total_s"] == 125.5
    assert done["sittings"] == [{"began": "2027-01-15T08:00:00Z", "ended": "2027-01-15T08:02:05Z", "seconds": 125.5,
                                 "commit": "abc", "ended_by": "report"}]
    assert json.loads((tmp_path / SITTINGS_FILE).read_text()) == done["sittings"]


def test_an_interrupted_sitting_ends_at_the_newest_file_it_left(tmp_path: Path) -> None:
    begin_sitting(tmp_path, T0, "abc")
    _file(tmp_path, "stage1/progress/checkpoint-2/state.json", T0 + 30)
    _file(tmp_path, "evaluation/teacher/perplexity.json", T0 + 50)  # its last finished piece; then interrupted
    _file(tmp_path, "recipe.json", T0 + 101)  # written by the next sitting once it has begun: not the last one's
    sittings = begin_sitting(tmp_path, T0 + 100, "def")
    assert sittings[0]["seconds"] == 50.0 and sittings[0]["ended_by"] == "last_file"
    assert sittings[1] == {"began": "2027-01-15T08:01:40Z", "ended": None, "seconds": None, "commit": "def"}
    done = end_sitting(tmp_path, T0 + 130)
    assert done["total_s"] == 80.0 and [s["commit"] for s in done["sittings"]] == ["abc", "def"]


def test_a_sitting_with_no_file_after_its_start_counts_nothing(tmp_path: Path) -> None:
    begin_sitting(tmp_path, T0, None)
    sittings = begin_sitting(tmp_path, T0 + 60, None)
    assert sittings[0]["seconds"] == 0.0 and len(sittings) == 2


def test_a_run_that_kept_no_sittings_gets_its_first_from_the_folder(tmp_path: Path) -> None:
    _file(tmp_path, "run.json", T0 + 10)
    _file(tmp_path, "stage2/trainer/checkpoint-8/trainer_state.json", T0 + 40)
    sittings = begin_sitting(tmp_path, T0 + 100, "def")
    assert sittings[0]["began"] == "2027-01-15T08:00:10Z" and sittings[0]["seconds"] == 30.0
    assert sittings[0]["inferred"] and sittings[0]["ended_by"] == "last_file" and sittings[0]["commit"] is None
    assert end_sitting(tmp_path, T0 + 110)["total_s"] == 40.0
