"""The distillation loss of a causal LM: cross-entropy to the next token and/or KL to a teacher, summed over the
predicted positions; at once from the full logits (``distill_loss_sum``) or over chunks of positions from the final
hidden states (``chunked_loss_sum``), each chunk's logits recomputed in the backward, so that only one chunk's
logits (the student's and the teacher's) are alive at a time."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: hidden states [N, H] -> logits [N, V] (``lm_outputs.final_logits`` bound to a model)
Head = Callable[[torch.Tensor], torch.Tensor]


def distill_loss_sum(
    student_logits: torch.Tensor,
    shift_labels: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    loss: str = "ce",
    temperature: float = 1.0,
    kl_weight: float = 1.0,
    shift_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Summed loss over the predicted positions (``shift_labels != -100``) and their count.

    ``ce``: cross-entropy to the next token. ``kl``: ``T^2 * KL(teacher_T || student_T)`` per position, the
    distributions taken at temperature ``T``. ``ce+kl``: ``ce + kl_weight * kl``. ``shift_weights`` (shaped like
    ``shift_labels``) scales each position's loss; the count stays the number of positions.
    """
    mask = shift_labels != -100
    count = int(mask.sum())
    vocab = student_logits.shape[-1]
    logits = student_logits[mask].float()
    weights = None if shift_weights is None else shift_weights[mask].float()
    total = logits.new_zeros(())
    if loss in ("ce", "ce+kl"):
        ce = F.cross_entropy(logits.view(-1, vocab), shift_labels[mask].view(-1), reduction="none")
        total = total + (ce if weights is None else ce * weights).sum()
    if loss in ("kl", "ce+kl"):
        if teacher_logits is None:
            raise ValueError(f"stage 2: loss {loss!r} needs the teacher's logits")
        t = temperature
        log_p_teacher = F.log_softmax(teacher_logits[mask].float() / t, dim=-1)
        log_p_student = F.log_softmax(logits / t, dim=-1)
        kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1) * (t * t)
        kl = (kl if weights is None else kl * weights).sum()
        total = total + (kl_weight if loss == "ce+kl" else 1.0) * kl
    elif loss != "ce":
        raise ValueError(f"stage 2: unknown loss {loss!r}; use ce, kl or ce+kl")
    return total, count


def chunked_loss_sum(
    student_head: Head,
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    chunk_size: int,
    teacher_head: Head | None = None,
    teacher_hidden: torch.Tensor | None = None,
    loss: str = "ce",
    temperature: float = 1.0,
    kl_weight: float = 1.0,
    shift_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """``distill_loss_sum`` of the logits ``student_head(hidden)`` (and ``teacher_head(teacher_hidden)``), taken
    over chunks of ``chunk_size`` predicted positions: each chunk's logits are computed, reduced to its loss and
    freed, and computed again in the backward (``torch.utils.checkpoint``), so the gradient is exact while the
    logits of one chunk are alive at a time. The chunks' sums add up in order: the same value as the whole sum
    up to floating-point rounding."""
    if chunk_size <= 0:
        raise ValueError(f"loss_chunk_size must be a positive number of tokens, got {chunk_size!r}")
    if loss != "ce" and (teacher_head is None or teacher_hidden is None):
        raise ValueError(f"stage 2: loss {loss!r} needs the teacher's hidden states and LM head")
    mask = shift_labels != -100
    rows, labels = hidden[mask], shift_labels[mask]
    teacher_rows = None if teacher_hidden is None or loss == "ce" else teacher_hidden[mask]
    weights = None if shift_weights is None else shift_weights[mask]
    part_loss = partial(_chunk_loss, student_head, teacher_head, loss, temperature, kl_weight)
    if not rows.shape[0]:
        return rows.float().sum(), 0  # nothing predicted: a 0 that is still part of the graph
    total = None
    for start in range(0, rows.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        chunk = (labels[part], None if teacher_rows is None else teacher_rows[part],
                 None if weights is None else weights[part])
        value = checkpoint(part_loss, rows[part], *chunk, use_reentrant=False)
        total = value if total is None else total + value
    return total, rows.shape[0]


def _chunk_loss(
    student_head: Head,
    teacher_head: Head | None,
    loss: str,
    temperature: float,
    kl_weight: float,
    rows: torch.Tensor,
    labels: torch.Tensor,
    teacher_rows: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk's summed loss from its hidden states (the teacher's logits without a graph)."""
    teacher_logits = None
    if teacher_rows is not None:
        with torch.no_grad():
            teacher_logits = teacher_head(teacher_rows)
    total, _ = distill_loss_sum(student_head(rows), labels, teacher_logits, loss, temperature, kl_weight, weights)
    return total
