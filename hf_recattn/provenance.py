"""Where a measured figure comes from: code, corpus, packages, machine, threads, command and date.

Every benchmark and conversion writes ``provenance()`` beside its numbers; ``provenance_line`` is the one-line
summary printed under each table in the docs (``scripts/render_docs.py``).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: distributions whose versions can change a figure
PACKAGES = ("hf-recattn", "torch", "transformers", "tokenizers", "peft", "accelerate", "datasets", "gguf", "triton")


def _git_commit(where: Path) -> str | None:
    """The commit checked out at ``where`` ("+dirty" when tracked files differ from it); None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str:
    """The CPU's model name as the system reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def _threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _program(argv0: str) -> str:
    """``hf-recattn`` for the console script or ``python -m hf_recattn.cli``, else the path as given."""
    path = Path(argv0)
    if path.name == "hf-recattn" or path.parts[-3:] == ("hf_recattn", "cli", "__main__.py"):
        return "hf-recattn"
    return argv0


def provenance(command: Sequence[str] | str | None = None, corpus: bool = True) -> dict[str, Any]:
    """A JSON-ready record of what produced a result. ``command`` defaults to this process's command line;
    ``corpus`` adds the embedded corpus's version and pinned sha256."""
    if command is None:
        command = [_program(sys.argv[0]), *sys.argv[1:]]
    if not isinstance(command, str):
        command = shlex.join(str(part) for part in command)
    record: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": _git_commit(Path(__file__).resolve().parent) or _git_commit(Path.cwd()),
        "command": command,
        "packages": _versions(),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "gpu": _gpu(),
            "platform": platform.platform(terse=True),
        },
        "threads": _threads(),
    }
    if corpus:
        from .data.pinned import CORPUS_SHA256, CORPUS_VERSION

        record["corpus"] = {"version": CORPUS_VERSION, "sha256": CORPUS_SHA256}
    return record


def provenance_line(record: dict[str, Any]) -> str:
    """One line for under a table: corpus, machine, threads, packages, commit and date."""
    parts = []
    corpus = record.get("corpus")
    if corpus:
        parts.append(f"embedded corpus v{corpus['version']} (sha256 {corpus['sha256'][:12]})")
    machine = record.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cores')} cores"
    parts.append(where)
    if record.get("threads") is not None:
        parts.append(f"{record['threads']} thread{'s' if record['threads'] != 1 else ''}")
    packages = record.get("packages", {})
    parts.append(", ".join(f"{name} {packages[name]}" for name in ("torch", "transformers") if packages.get(name)))
    commit = record.get("commit")
    if commit:
        parts.append(f"commit {commit[:10]}{' (modified)' if commit.endswith('+dirty') else ''}")
    parts.append(str(record.get("date", "undated")))
    return "Measured on " + "; ".join(p for p in parts if p) + "."
