"""Held-out perplexity: the same blocks for teacher and student, every predicted token weighted alike; and
perplexity on long blocks, each from one long document (``long_perplexity``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .generation import eval_mode, max_positions, model_device
from .progress import progress_bar

#: predicted positions per float32 log-softmax in ``perplexity``: at a 152k vocabulary and 4,096 positions the
#: whole log-softmax would hold 2.5 GB beside the logits
NLL_ROWS = 512


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
            for row in range(ids.shape[0]):
                total_nll += float(summed_nll(logits[row, :-1], ids[row, 1:]))
                count += ids.shape[1] - 1
            del logits
            bar.update(ids.shape[0])
    if not math.isfinite(total_nll):
        return float("inf")
    return math.exp(total_nll / count)


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token NLL of ``logits`` [N, V] at ``targets`` [N], bit for bit
    ``F.cross_entropy(logits.float(), targets, reduction="sum")``, with the float32 log-softmax of ``NLL_ROWS``
    positions alive at a time: each row's log-softmax does not depend on the others, and the sum is nll_loss's
    own over the gathered log-probabilities, in the same order."""
    picked = torch.empty(targets.shape[0], 1, dtype=torch.float32, device=logits.device)
    for start in range(0, targets.shape[0], NLL_ROWS):
        part = F.log_softmax(logits[start : start + NLL_ROWS].float(), dim=-1)
        picked[start : start + NLL_ROWS, 0] = part.gather(1, targets[start : start + NLL_ROWS, None])[:, 0]
    return F.nll_loss(picked, torch.zeros_like(targets), reduction="sum")


#: block lengths of the long-context perplexity, by default
LONG_LENGTHS = (4096, 16384)


def long_blocks(tokenizer: Any, documents: Sequence[str], length: int, count: int) -> torch.Tensor:
    """Up to ``count`` blocks ``[n, length]`` of consecutive tokens of one document each, from the documents
    with at least ``length`` tokens: the first block of each in turn, then the second, and so on. Never spans
    two documents, so a block is long-range text, not several short documents end to end."""
    if length < 2 or count < 1:
        raise ValueError(f"long_blocks needs length >= 2 and count >= 1, got {length}, {count}")
    encoded = tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"] if documents else []
    rows = [ids for ids in encoded if len(ids) >= length]
    chosen: list[list[int]] = []
    for k in range(max((len(ids) // length for ids in rows), default=0)):
        chosen += [ids[k * length : (k + 1) * length] for ids in rows if len(ids) >= (k + 1) * length]
    return torch.tensor(chosen[:count], dtype=torch.long).view(-1, length)


def long_perplexity(model: torch.nn.Module, tokenizer: Any, documents: Sequence[str],
                    lengths: Sequence[int] = LONG_LENGTHS, blocks: int = 4,
                    progress: str | None = None) -> dict[str, Any]:
    """Perplexity on long blocks (``long_blocks``) of each length: ``perplexity`` and ``blocks`` by length; a
    length beyond the model's ``max_position_embeddings``, or that no document reaches, is left out with the
    reason under ``skipped``. Pass the same documents to teacher and student."""
    if not lengths or any(length < 2 for length in lengths):
        raise ValueError(f"long_perplexity needs lengths >= 2, got {list(lengths)}")
    limit = max_positions(model)
    result: dict[str, Any] = {"perplexity": {}, "blocks": {}, "skipped": {}}
    for length in lengths:
        if limit is not None and length > limit:
            result["skipped"][str(length)] = f"beyond max_position_embeddings {limit}"
            continue
        rows = long_blocks(tokenizer, documents, length, blocks)
        if rows.shape[0] == 0:
            result["skipped"][str(length)] = f"no held-out document has {length} tokens"
            continue
        label = None if progress is None else f"{progress} {length}"
        result["perplexity"][str(length)] = perplexity(model, rows, batch_size=1, progress=label)
        result["blocks"][str(length)] = rows.shape[0]
    return result
