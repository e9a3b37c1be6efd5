"""The settings of a distillation finetune (``distill.py``): schedule, batch, optimizer groups, what trains,
and the loss. Each value is checked by ``check(source, section)``, the messages naming ``section.key``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .checks import check_schedule, positive
from .fused_loss import check_loss_kernel
from .trainable import METHODS, LoraSettings

#: what a distillation finetune trains (the mixers alone are what attention transfer trains)
DISTILL_METHODS = tuple(m for m in METHODS if m != "mixers")
LOSSES = ("ce", "kl", "ce+kl")


@dataclass(frozen=True)
class DistillSettings:
    """A distillation finetune with transformers' Trainer (LoRA adapters or every weight), cross-entropy and/or
    KL to the teacher."""

    tokens: int = 0  # training tokens in total
    lr: float = 1e-4
    block_size: int = 512
    batch_size: int = 4  # blocks per optimizer micro-step in all (shared by the processes of a parallel run)
    grad_accum: int = 1
    loss: str = "ce"
    temperature: float = 1.0  # softmax temperature of the KL term
    kl_weight: float = 1.0  # weight of the KL term in "ce+kl"
    train_mixer: bool = False  # also train the mixer parameters (feature maps, gains) beside the LoRA adapters
    #: with train_mixer, the mixer parameters' own optimizer group: its peak learning rate (None: lr) and
    #: Adam's eps (None: Trainer's adam_epsilon, 1e-8); no weight decay. A small eps makes Adam's step ~lr
    #: even for gradients far below 1e-8 (the FoX gates at their lossless start)
    mixer_lr: float | None = None
    mixer_eps: float | None = None
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_steps: int = 25
    lora: LoraSettings = field(default_factory=LoraSettings)
    #: ``lora`` (None: the adapters above, merged at the end) or ``full`` (every weight trains, the mixers'
    #: own parameters included; ``lora`` is then refused)
    method: str | None = None
    #: tokens per chunk of the loss, taken from the final hidden states with one chunk's logits (the student's and
    #: the teacher's) alive at a time and recomputed in the backward; 0: the whole block's logits at once (the
    #: chunks' sums add in another order: equal up to floating-point rounding); None: unset, which is 0 here and
    #: which conversion's stage 2 chooses from its memory (``conversion/memory.py``)
    loss_chunk_size: int | None = None
    #: recompute each student decoder layer's activations in the backward instead of keeping them; None: unset,
    #: which is false here and which conversion's stage 2 chooses from its memory
    gradient_checkpointing: bool | None = None
    #: what computes the loss (``fused_loss.py``): ``liger`` (Liger Kernel's fused linear + loss ops, no logits kept,
    #: CUDA), ``torch`` (the forms above) or ``auto`` (None: liger where it runs and takes the loss, else torch)
    loss_kernel: str | None = None

    @property
    def trains_mixer(self) -> bool:
        """Whether the mixers' own parameters train (asked for, or with every weight)."""
        return self.train_mixer or self.method == "full"

    def check(self, source: str, section: str) -> None:
        """Raise ValueError naming ``source: section.key`` for the first value out of range."""
        self._check_training(source, section)
        self._check_loss(f"{source}: {section}")

    def _check_training(self, source: str, section: str) -> None:
        """The schedule, the adapters, the optimizer's groups and the method."""
        at = f"{source}: {section}"
        check_schedule(self, at)
        self.lora.check(source, f"{section}.lora")
        for key in ("grad_accum", "save_steps", "temperature"):
            positive(getattr(self, key), f"{at}.{key}")
        for key in ("kl_weight", "weight_decay"):
            positive(getattr(self, key), f"{at}.{key}", allow_zero=True)
        for key in ("mixer_lr", "mixer_eps"):
            value = getattr(self, key)
            if value is None:
                continue
            if not self.trains_mixer:
                raise ValueError(f"{at}.{key} needs {section}.train_mixer: true or {section}.method: full "
                                 "(it sets the mixer's group)")
            if not math.isfinite(value):
                raise ValueError(f"{at}.{key} must be finite, got {value!r}")
            positive(value, f"{at}.{key}")
        if self.loss_chunk_size is not None:
            positive(self.loss_chunk_size, f"{at}.loss_chunk_size", allow_zero=True)
        if self.loss_kernel is not None:
            check_loss_kernel(self.loss_kernel, f"{at}.loss_kernel")
        if self.method is not None and self.method not in DISTILL_METHODS:
            raise ValueError(f"{at}.method must be one of {list(DISTILL_METHODS)}, got {self.method!r}")

    def _check_loss(self, at: str) -> None:
        """The loss, and tokens for at least one optimizer step."""
        if self.loss not in LOSSES:
            raise ValueError(f"{at}.loss must be one of {list(LOSSES)}, got {self.loss!r}")
        per_step = self.block_size * self.batch_size * self.grad_accum
        if self.tokens and self.tokens < per_step:
            raise ValueError(
                f"{at}.tokens ({self.tokens}) is less than one optimizer step "
                f"(block_size * batch_size * grad_accum = {per_step})"
            )
