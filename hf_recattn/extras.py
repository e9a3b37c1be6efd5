"""The optional extras of the package (pyproject's optional-dependencies) and the error that names a missing one."""

from __future__ import annotations

import importlib.util

#: the import names each extra installs, for the extras some job of the package cannot run without
EXTRAS: dict[str, tuple[str, ...]] = {
    "gguf": ("gguf",),
    "train": ("datasets", "peft", "accelerate", "evaluate"),
    "serve": ("fastapi", "uvicorn", "openai", "pydantic", "starlette", "rich"),
    "eval": ("lm_eval",),
    "fused": ("liger_kernel",),
}


def install_command(extra: str) -> str:
    return f'pip install "hf-recattn[{extra}]"'


class MissingExtra(ImportError):
    """``needed_by`` cannot run: a module of the extra ``extra`` is not installed."""

    def __init__(self, extra: str, needed_by: str) -> None:
        super().__init__(f"{needed_by} needs the {extra} extra: {install_command(extra)}")
        self.extra = extra


def require(extra: str, needed_by: str) -> None:
    """Raise MissingExtra unless every module of ``extra`` can be imported (found without importing it)."""
    if any(importlib.util.find_spec(name) is None for name in EXTRAS[extra]):
        raise MissingExtra(extra, needed_by)
