"""Crash-safe files for the conversion pipeline: tensors and the run identity.

Everything the pipeline leaves in its output folder is written through ``hf_recattn.atomic`` (a temporary sibling
moved into place), so an interrupt leaves either the old state or the new one, never half a file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..atomic import clean_temporaries, write_json

RUN_FILE = "run.json"


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
    write_json(output / RUN_FILE, identity)


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
