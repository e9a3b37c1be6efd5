"""Crash-safe files for the conversion pipeline: atomic writes, tensors, the run identity.

Everything the pipeline leaves in its output folder is written to a temporary sibling first and moved into
place with ``os.replace``, so an interrupt leaves either the old state or the new one, never half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..training.runner import latest_trainer_checkpoint  # noqa: F401 (its home before the training package)

RUN_FILE = "run.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces ``final`` (any old content is discarded)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders
        if final.exists():  # os.replace cannot replace a non-empty folder: move the old one aside first
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clean_temporaries(folder: str | os.PathLike) -> None:
    """Remove leftovers of interrupted atomic writes (``.tmp-*`` / ``.old-*``) directly inside ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.name.startswith((".tmp-", ".old-")):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


# ----- tensors ----------------------------------------------------------------------------------------------
def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(path))


# ----- the run identity -------------------------------------------------------------------------------------
def check_output_folder(output: str | os.PathLike, identity: dict[str, Any], overwrite: bool) -> str:
    """Decide what a run described by ``identity`` may do with ``output``, writing nothing.

    Returns ``"new"`` (absent or empty), ``"resume"`` (an earlier run with the same identity) or
    ``"overwrite"``. A folder holding another run (different teacher, recipe, budget, seed or data) or
    anything that is not a conversion run is refused (ValueError) unless ``overwrite``.
    """
    output = Path(output)
    if output.is_symlink() and not output.exists():
        raise ValueError(f"output {str(output)!r} is a link to {os.readlink(output)!r}, which does not exist; "
                         "create that folder or remove the link")
    if output.exists() and not output.is_dir():
        raise ValueError(f"output {str(output)!r} exists and is not a folder")
    if not output.is_dir() or not any(output.iterdir()):
        return "new"
    previous = _read_identity(output)
    if previous == identity:
        return "resume"
    if overwrite:
        _refuse_dangerous(output)
        return "overwrite"
    if previous is None:
        what = "files that are not a conversion run"
    else:
        diff = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
        what = f"another conversion (differs in: {', '.join(diff)})"
    raise ValueError(
        f"output {str(output)!r} already holds {what}; choose another folder or pass --overwrite"
    )


def claim_output_folder(output: str | os.PathLike, identity: dict[str, Any], decision: str) -> None:
    """Act on ``check_output_folder``'s decision: empty the folder (overwrite) or tidy it (resume), then
    record ``identity`` in ``run.json``."""
    output = Path(output)
    if decision == "overwrite":
        _refuse_dangerous(output)
        shutil.rmtree(output)
    elif decision == "resume":
        clean_temporaries(output)
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output / RUN_FILE, identity)


def _refuse_dangerous(output: Path) -> None:
    resolved = output.resolve()
    if resolved in (Path("/"), Path.home().resolve(), Path.cwd().resolve()) or (resolved / ".git").exists():
        raise ValueError(f"refusing to overwrite {str(output)!r}: it is a home, root, working or git folder")


def _read_identity(output: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((output / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
