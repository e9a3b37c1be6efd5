"""Results of finished probes kept on disk, so that an interrupted evaluation resumes where it stopped.

A ``ProbeStore`` is a folder of JSON files, one per finished piece of work (a probe, or one needle cell), each
written atomically once its piece is done. ``cached(key, run)`` returns the stored result when the piece finished
before, else runs it and stores what it returns. The store trusts its folder: the caller gives each model and each
set of probe settings a folder of its own (``conversion.comparison``: one per model in the run's folder, whose
``run.json`` fixes the recipe and so the probes), so a stored result is never read for other settings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..atomic import write_json

T = TypeVar("T")

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class ProbeStore:
    """Finished probe results under ``folder``, one JSON file per key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.resumed: list[str] = []  # the keys ``cached`` read back instead of running

    @staticmethod
    def file_name(key: str) -> str:
        """``key`` as a file name: characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``."""
        name = _SAFE.sub("_", key).strip("._")
        if not name:
            raise ValueError(f"probe store: {key!r} names no file")
        return name

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.folder / f"{self.file_name(key)}.json"

    def get(self, key: str) -> Any | None:
        """The stored result of ``key``, None when it has not finished."""
        path = self.path(key)
        if not path.is_file():
            return None
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            raise ValueError(f"{path}: holds the result of {stored.get('key')!r}, not of {key!r}")
        return stored["value"]

    def put(self, key: str, value: Any) -> Any:
        """Store ``value`` (JSON) as ``key``'s result, atomically; returns it as a later ``get`` reads it."""
        write_json(self.path(key), {"key": key, "value": value})
        return json.loads(json.dumps(value))

    def cached(self, key: str, run: Callable[[], T]) -> T:
        """``key``'s stored result, else ``run()``'s, stored first."""
        stored = self.get(key)
        if stored is None:
            return self.put(key, run())
        self.resumed.append(key)
        return stored


def cached(store: ProbeStore | None, key: str, run: Callable[[], T]) -> T:
    """``run()`` through ``store`` when one is given, else directly."""
    return run() if store is None else store.cached(key, run)
