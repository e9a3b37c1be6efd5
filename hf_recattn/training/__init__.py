"""Pretraining, finetuning, and conversion's attention transfer (stage 1) and distillation finetune (stage 2),
with transformers' Trainer, ``datasets`` and ``peft`` (see docs/training.md)."""

from .finetune import finetune
from .pretrain import pretrain
from .runner import RunResult

__all__ = ["RunResult", "finetune", "pretrain"]
