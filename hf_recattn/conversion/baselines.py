"""Untrained baselines a student is read against: the teacher's own weights with a cheap attention, built from the
teacher at evaluation time (``eval.baselines`` of a recipe, ``hf-recattn eval --baselines``, the recall
benchmarks). A baseline is one entry of ``BASELINES``: its row label and the attention spec."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

#: name -> (row label, attention spec); ``window``: softmax over the last 512 tokens and the first 4 (StreamingLLM),
#: the constant-memory cache every recall figure is read against
BASELINES: dict[str, tuple[str, dict[str, Any]]] = {
    "window": ("window 512 + 4 sinks", {"mixer": "hybrid", "window": 512, "far": "none", "sink_tokens": 4}),
}
#: the baselines an evaluation measures when it names none
DEFAULT_BASELINES = ("window",)
#: the window baseline's row label in reports and tables
WINDOW_LABEL = BASELINES["window"][0]


def check_baseline_names(names: Sequence[str], option: str) -> None:
    """ValueError naming ``option`` when a name is not in ``BASELINES``."""
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise ValueError(f"{option}: unknown baseline(s) {unknown}; known: {list(BASELINES)}")


def baseline_models(teacher: nn.Module, names: Sequence[str]) -> Iterator[tuple[str, nn.Module]]:
    """(row label, model in eval mode) of each baseline in ``names``, built from ``teacher``'s weights one at a time
    (a caller that drops each after use holds one copy at most)."""
    from .from_teacher import from_teacher  # the models only when asked: the names are read by the CLI's help

    check_baseline_names(names, "baselines")
    for name in names:
        label, spec = BASELINES[name]
        yield label, from_teacher(teacher, dict(spec)).eval()
