"""Stage 2 of conversion: the training package's distillation finetune (``hf_recattn.training.distill``),
Trainer with LoRA adapters merged at the end or every weight, cross-entropy and/or KL to the teacher."""

from __future__ import annotations

from torch import nn

from ..training.distill import BlockDataset, DistillTrainer, distill_loss_sum, finetune, training_arguments
from ..training.distill_settings import DistillSettings
from ..training.trainable import merge_lora, wrap_lora

__all__ = [
    "BlockDataset",
    "DistillTrainer",
    "apply_lora",
    "distill_loss_sum",
    "finetune",
    "merge_lora",
    "training_arguments",
]


def apply_lora(student: nn.Module, settings: DistillSettings) -> nn.Module:
    """Wrap ``student`` with LoRA adapters on ``settings.lora.targets`` (optionally training the mixers)."""
    return wrap_lora(student, settings.lora, settings.train_mixer, "stage2: lora.targets")
