"""``distill_loss_sum`` from the final hidden states on Liger Kernel's fused linear + loss ops (``liger-kernel``, the
``fused`` extra), which never hold a [N, V] tensor of logits, and the ``loss_kernel`` choice between them and the
torch forms (``auto`` | ``torch`` | ``liger``).

What each op computes here, on the predicted positions only (the -100 labels masked out first):

* ``ce``: ``LigerFusedLinearCrossEntropyLoss`` summed (``reduction="sum"``); with per-position weights, its
  per-position losses (``reduction="none"``, whose backward computes the logits again) times the weights. It
  takes the head's bias and the final soft-cap (Gemma).
* ``kl``: ``LigerFusedLinearJSD`` at ``jsd_beta=0``, which is the forward ``KL(teacher_T || student_T)`` at its
  ``temperature`` T, averaged over the positions: times their count and T^2. It takes no bias, no soft-cap and no
  per-position weights (``liger_kernel.chunked_loss``'s distillation losses neither, and they take the softmax in
  the model's dtype, where the torch forms take it in float32).
* ``ce+kl``: both ops on the same hidden states, the KL times ``kl_weight``.

A head's ``logits_scaling`` (Granite) divides its hidden states (and bias) before the op. ``auto`` runs these ops
on a CUDA device with liger-kernel installed where they take the loss, the torch forms otherwise; ``liger`` runs
them or stops with one error naming the reason (on the CPU it runs them only in Triton's interpreter,
``TRITON_INTERPRET=1``, as the tests do). liger-kernel is imported only when a loss runs on it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch
from torch import nn

from ..extras import install_command
from .lm_outputs import LinearHead, linear_head

LOSS_KERNELS = ("auto", "torch", "liger")
#: the dtypes of an LM head the Liger ops take
LIGER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KL_OP = "Liger's fused KL (LigerFusedLinearJSD)"
_NOT_LINEAR = "the {who}'s LM head is not a plain nn.Linear (LoRA on lm_head, or sharded)"


@functools.cache
def liger_installed() -> bool:
    """Whether liger-kernel can be imported (found without importing it; asked once)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_loss_kernel(choice: str, setting: str) -> None:
    """ValueError naming ``setting`` for a choice out of ``LOSS_KERNELS``, or ``liger`` where it cannot run at all:
    liger-kernel not installed, or neither a CUDA device nor Triton's interpreter. Call it before any work."""
    if choice not in LOSS_KERNELS:
        raise ValueError(f"{setting} must be one of {list(LOSS_KERNELS)}, got {choice!r}")
    if choice != "liger":
        return
    if not liger_installed():
        raise ValueError(f"{setting}: liger needs the fused extra: {install_command('fused')}")
    if not torch.cuda.is_available() and not _interpreted():
        raise ValueError(f"{setting}: liger needs a CUDA device (or TRITON_INTERPRET=1 set before triton is "
                         "imported: Triton's interpreter, for tests on the CPU)")


def check_weighted_kl(choice: str | None, setting: str, loss: str, weighted_by: str | None) -> None:
    """ValueError naming ``setting`` for ``liger`` with a KL term and per-position weights (set by the setting
    ``weighted_by``), which its KL op cannot take."""
    if choice == "liger" and weighted_by and loss != "ce":
        raise refusal(setting, f"{_KL_OP} takes no per-position weights ({weighted_by} sets them)")


def liger_misfit(student: nn.Module, teacher: nn.Module | None, loss: str, weighted: bool) -> str | None:
    """Why the Liger ops cannot compute ``loss`` from these models' hidden states (``weighted``: with per-position
    weights), or None."""
    heads = {"student": linear_head(student)}
    if loss != "ce":
        heads["teacher"] = None if teacher is None else linear_head(teacher)
    for who, head in heads.items():
        if head is None:
            return _NOT_LINEAR.format(who=who)
        if head.weight.dtype not in LIGER_DTYPES:
            return f"the {who}'s LM head is {head.weight.dtype} (Liger takes float32, bfloat16 and float16)"
    if loss == "ce":
        return None
    if weighted:
        return f"{_KL_OP} takes no per-position weights"
    for who, head in heads.items():
        if head.bias is not None:
            return f"{_KL_OP} takes no LM-head bias (the {who}'s has one)"
        if head.softcap is not None:
            return _softcapped(who, head.softcap)
    return None


def config_misfit(loss: str, configs: dict[str, Any], lora_on_head: bool) -> str | None:
    """``liger_misfit`` as far as the models' configs (by who: student, teacher) and the LoRA targets tell, before
    the models exist: a soft-capped KL, an LM head wrapped by LoRA."""
    if lora_on_head:
        return _NOT_LINEAR.format(who="student")
    if loss == "ce":
        return None
    for who, config in configs.items():
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            return _softcapped(who, cap)
    return None


def _softcapped(who: str, cap: float) -> str:
    return f"{_KL_OP} takes no final_logit_softcapping (the {who}'s is {cap:g})"


def liger_unavailable(choice: str, device: torch.device) -> str | None:
    """Why the Liger ops cannot run on ``device`` for ``choice`` (``auto`` or ``liger``), or None."""
    return _unavailable(choice, device)


def _unavailable(choice: str, device: torch.device) -> str | None:
    """Why the Liger ops cannot run on ``device`` for ``choice``, or None."""
    if device.type != "cuda" and not (choice == "liger" and device.type == "cpu" and _interpreted()):
        return f"the model is on {device.type}, not a CUDA device"
    if not liger_installed():
        return f"liger-kernel is not installed ({install_command('fused')})"
    return None


def use_liger(
    choice: str, setting: str, student: nn.Module, teacher: nn.Module | None = None, loss: str = "ce",
    weighted: bool = False,
) -> bool:
    """Whether the loss runs on the Liger ops: ``torch`` never, ``auto`` where they run and take the loss, ``liger``
    there or a ValueError naming ``setting`` and the reason."""
    if choice == "torch":
        return False
    head = student.get_output_embeddings()
    reason = _unavailable(choice, head.weight.device) or liger_misfit(student, teacher, loss, weighted)
    if reason is None:
        return True
    if choice == "liger":
        raise refusal(setting, reason)
    return False


def refusal(setting: str, reason: str) -> ValueError:
    """The error of ``loss_kernel: liger`` where the Liger ops cannot compute the loss."""
    return ValueError(f"{setting}: liger cannot compute this loss: {reason}; use auto or torch")


def fused_loss_sum(
    student: nn.Module,
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    teacher: nn.Module | None = None,
    teacher_hidden: torch.Tensor | None = None,
    loss: str = "ce",
    temperature: float = 1.0,
    kl_weight: float = 1.0,
    shift_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """``distill_loss_sum`` of ``student``'s logits of ``hidden`` (and ``teacher``'s of ``teacher_hidden``) on the
    Liger ops, with its count of predicted positions: the same value and gradients up to rounding. The caller has
    chosen them (``use_liger``)."""
    if loss not in ("ce", "kl", "ce+kl"):
        raise ValueError(f"stage 2: unknown loss {loss!r}; use ce, kl or ce+kl")
    if loss != "ce" and (teacher is None or teacher_hidden is None):
        raise ValueError(f"stage 2: loss {loss!r} needs the teacher's hidden states and LM head")
    mask = shift_labels != -100
    rows, labels = hidden[mask], shift_labels[mask]
    if not rows.shape[0]:
        return rows.float().sum(), 0  # nothing predicted: a 0 that is still part of the graph
    head = _head(student, "student")
    inputs = head.inputs(rows)
    total = None
    if loss in ("ce", "ce+kl"):
        total = _cross_entropy_sum(head, inputs, labels, None if shift_weights is None else shift_weights[mask])
    if loss in ("kl", "ce+kl"):
        teacher_head = _head(teacher, "teacher")
        kl = _kl_sum(head, inputs, teacher_head, teacher_head.inputs(teacher_hidden[mask].detach()), temperature)
        kl = kl if loss == "kl" else kl_weight * kl
        total = kl if total is None else total + kl
    return total, rows.shape[0]


def _head(lm: nn.Module, who: str) -> LinearHead:
    head = linear_head(lm)
    if head is None:
        raise ValueError(f"{_NOT_LINEAR.format(who=who)}: the Liger ops cannot take it")
    return head


def _cross_entropy_sum(
    head: LinearHead, inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """The summed cross-entropy of the rows (each times its weight, if any)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    op = LigerFusedLinearCrossEntropyLoss(reduction="sum" if weights is None else "none", softcap=head.softcap)
    value = op(head.weight, inputs, labels, head.scaled_bias())
    return value if weights is None else (value * weights.float()).sum()


def _kl_sum(
    head: LinearHead, inputs: torch.Tensor, teacher_head: LinearHead, teacher_inputs: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``T^2 * KL(teacher_T || student_T)`` summed over the rows: the op's mean times their count and T^2."""
    from liger_kernel.transformers import LigerFusedLinearJSD

    op = LigerFusedLinearJSD(jsd_beta=0.0, temperature=temperature)
    mean = op(inputs, head.weight, teacher_inputs, teacher_head.weight, None)
    return mean * (inputs.shape[0] * temperature * temperature)
