"""What one conversion is asked to do (``Job``) and the teacher it runs with (``Teacher``): the inputs that the stages
of ``pipeline.py`` read and never change; and the records those stages leave in the output folder (``read_json``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..modeling.configuration import RecAttnConfig
from .recipe import Recipe

Log = Callable[[str], None]


@dataclass(frozen=True)
class Job:
    """``convert``'s arguments, the recipe resolved: which teacher (its spec: a folder, Hub id, GGUF file or
    ``embedded``) in which dtype, the recipe, the output folder, the corpus (None: the embedded one), whether to show
    progress bars and evaluate the models, where the log lines go, and whether both training stages shard the
    student over the processes (FSDP)."""

    teacher_spec: str
    recipe: Recipe
    output: Path
    data: str | None
    teacher_dtype: str
    progress: bool
    evaluate_models: bool
    log: Log
    fsdp: bool = False

    @property
    def model_dir(self) -> Path:
        """Where the converted checkpoint goes (its config.json there: both training stages are done)."""
        return self.output / "model"


@dataclass(frozen=True)
class Teacher:
    """The loaded teacher (eval mode, no gradients), its tokenizer, the student's config that the recipe check built
    from them, and the seconds loading and checking took."""

    model: nn.Module
    tokenizer: Any
    student_config: RecAttnConfig
    timings: dict[str, float]


def read_json(path: Path) -> dict[str, Any]:
    """A record an earlier stage or run wrote (a summary, the chosen heads, a report); {} when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
