"""transformers' ``TrainingArguments`` from a ``training`` section: its keys checked (close matches suggested), a
few defaults of ours under it, device defaults from the machine."""

from __future__ import annotations

import dataclasses
from typing import Any

from .checks import check_keys

#: TrainingArguments values we change from transformers' defaults (the YAML wins)
TRAINING_DEFAULTS: dict[str, Any] = {
    "logging_steps": 10,
    "save_strategy": "steps",
    "save_steps": 100,
    "save_total_limit": 2,
    "report_to": "none",
    "dataloader_num_workers": 0,
}


def _device_defaults() -> dict[str, Any]:
    """Without CUDA, train on the CPU explicitly: accelerate then runs several processes as MULTI_CPU (gloo)."""
    import torch

    cuda = torch.cuda.is_available()
    return {"use_cpu": not cuda, "dataloader_pin_memory": cuda}


def training_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def build_training_arguments(values: dict[str, Any], where: str, has_eval: bool, **forced: Any) -> Any:
    """TrainingArguments from the ``training`` section over ``TRAINING_DEFAULTS``; ``forced`` wins over both.

    With evaluation data and no ``eval_strategy`` given, evaluation runs every ``eval_steps`` (default: the
    ``save_steps``)."""
    from transformers import TrainingArguments

    check_keys(values, training_fields(), f"{where}: training", "a TrainingArguments field")
    merged = {**TRAINING_DEFAULTS, **_device_defaults(), **values, **{k: v for k, v in forced.items() if v is not None}}
    if not merged.get("output_dir"):
        raise ValueError(f"{where}: training.output_dir: missing (or pass --output)")
    if has_eval and "eval_strategy" not in values:
        merged["eval_strategy"] = "steps"
        merged.setdefault("eval_steps", merged["save_steps"])
    if not has_eval and values.get("eval_strategy", "no") != "no":
        raise ValueError(f"{where}: training.eval_strategy: no evaluation data (set data.eval_fraction, "
                         "data.eval_documents or data.eval_source)")
    try:
        return TrainingArguments(**merged)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: training: {err}") from err
