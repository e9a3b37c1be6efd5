"""The sittings of a conversion: when each began and how long it ran, so that a run resumed after an interrupt still
reports its whole wall time.

``sittings.json`` in the output folder lists one entry per ``convert`` call on the folder: when it began and ended
(UTC), its seconds, the commit it ran and whether it ran to the report. A sitting that was interrupted never wrote its
end: the next one closes it at the newest file it left in the folder (its last finished piece of work; what it was
doing after that was lost and is done again), and says so (``ended_by: last_file``). A folder resumed from a run
that began before this file existed gets its first sitting the same way, begun at the folder's oldest file.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from ..atomic import write_json

SITTINGS_FILE = "sittings.json"


def _stamp(seconds: float) -> str:
    """A UTC time in ISO 8601, to the second."""
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(stamp: str) -> float:
    return _dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()


def _file_times(output: Path) -> list[float]:
    """The modification times of the files a conversion left in ``output`` (its sittings file aside)."""
    return [p.stat().st_mtime for p in output.rglob("*") if p.is_file() and p.name != SITTINGS_FILE]


def _entry(began: float, commit: str | None, **extra: Any) -> dict[str, Any]:
    """A sitting that began at ``began`` and has not ended."""
    return {"began": _stamp(began), "ended": None, "seconds": None, "commit": commit, **extra}


def _close(sitting: dict[str, Any], ended: float, ended_by: str) -> None:
    """Give ``sitting`` its end, its seconds and what ended it (``report``, or ``last_file`` after an interrupt)."""
    sitting.update(ended=_stamp(ended), seconds=round(ended - _seconds(sitting["began"]), 1), ended_by=ended_by)


def begin_sitting(output: Path, began: float, commit: str | None) -> list[dict[str, Any]]:
    """Record in ``output/sittings.json`` a sitting that began at ``began`` (``time.time()``), first closing an
    earlier one that never wrote its end; returns every sitting so far. Call it once the folder is the run's."""
    path = output / SITTINGS_FILE
    sittings = json.loads(path.read_text()) if path.is_file() else []
    if not sittings or sittings[-1]["ended"] is None:  # the folder's files tell where an earlier sitting stopped
        times = [t for t in _file_times(output) if t <= began]
        if not sittings and times:  # resumed from a run that kept no sittings
            sittings.append(_entry(min(times), None, inferred="began at the folder's oldest file"))
        if sittings:
            _close(sittings[-1], max([_seconds(sittings[-1]["began"]), *times]), "last_file")
    sittings.append(_entry(began, commit))
    write_json(path, sittings)
    return sittings


def end_sitting(output: Path, ended: float) -> dict[str, Any]:
    """Close the sitting ``begin_sitting`` opened; returns ``{"sittings": [...], "total_s": seconds}`` for the
    report: every sitting, and their seconds summed."""
    path = output / SITTINGS_FILE
    sittings = json.loads(path.read_text())
    _close(sittings[-1], ended, "report")
    write_json(path, sittings)
    return {"sittings": sittings, "total_s": round(sum(s["seconds"] for s in sittings), 1)}
