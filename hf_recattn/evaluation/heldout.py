"""Held-out perplexity: the same blocks for teacher and student, every predicted token weighted alike."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .generation import eval_mode, model_device
from .progress import progress_bar


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 4, progress: str | None = None) -> float:
    """exp(mean next-token NLL) over every predicted token of every block ([N, T] token ids, no padding).

    Token-weighted: each block contributes T - 1 predictions. Pass the same blocks to teacher and student.
    ``progress``: the label of a progress bar over the blocks (None: no bar).
    """
    if blocks.dim() != 2 or blocks.shape[1] < 2 or blocks.shape[0] == 0:
        raise ValueError(f"blocks must be [N >= 1, T >= 2] token ids, got shape {tuple(blocks.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = model_device(model)
    total_nll, count = 0.0, 0
    with eval_mode(model), progress_bar(blocks.shape[0], progress, "block") as bar:
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            for row in range(ids.shape[0]):  # one row at a time keeps the fp32 log-softmax copy small
                nll = F.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="sum")
                total_nll += float(nll)
                count += ids.shape[1] - 1
            del logits
            bar.update(ids.shape[0])
    if not math.isfinite(total_nll):
        return float("inf")
    return math.exp(total_nll / count)
