"""The hybrid's exact cache over a block in one pass, where its decisions keep the newest pairs. Tensor functions
only; ``ExactCacheForms`` (hybrid_cached.py) decides when they apply and runs the softmax.

A decision keeps the G highest-scoring of the cache's pairs and the pending ones (hybrid_cache.py). Where that is
the G most recent, with ``cache_score: recent`` or in a block whose decisions evict nothing (the pairs cached
and decided fit the G slots, as in a training block shorter than the cache), what each query sees follows from the
decisions' timing alone: the pairs decided before query j are, in the order they left the window, the cache's
filled slots at the block's start (oldest first, left-aligned) and then the block's tokens by ``rank``; at j the
cache holds the last G of them. So a block's queries can run as one masked softmax instead of one span per decision.
"""

from __future__ import annotations

import torch

from .hybrid_cache import NEVER, Timing


def newest_visible(timing: Timing, cmask: torch.Tensor, window: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which cached pairs each query of the block sees: [B, 1, 1, T, G] of the cache's slots at the block's start
    (``cmask`` [B, G], filled slots first) and [B, 1, 1, T, 2W + T] of the block's U tokens (hybrid_cache.py's
    layout) that are decided by then and still among the G newest."""
    decided = (window * timing.done)[:, :, None]  # [B, T, 1]: the block's pairs decided before each query
    start = cmask.sum(1)[:, None, None]
    slot = torch.arange(cmask.shape[1], device=cmask.device)
    old = cmask[:, None, :] & (slot >= start + decided - slots)
    rank = timing.rank[:, None, :]
    new = (rank <= decided) & (rank > decided - slots)
    return old[:, None, None], new[:, None, None]


def newest_after(timing: Timing, cmask: torch.Tensor, window: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache once the block is through: per slot, the index [B, G] of its pair among the candidates (the cache's
    G slots, then the block's U tokens), the G newest decided pairs in token order, and the new mask [B, G]
    (filled slots first; an unfilled slot's index is 0)."""
    g = cmask.shape[1]
    start = cmask.sum(1, keepdim=True)
    total = start + window * timing.done_end[:, None]  # [B, 1]: every pair decided so far
    slot = torch.arange(g, device=cmask.device)[None]
    rank = timing.rank
    # each candidate's place in the order the pairs were decided; NEVER: not decided (an empty slot, a token inside)
    order = torch.cat([torch.where(cmask, slot, NEVER), torch.where(rank <= total - start, start + rank - 1, NEVER)],
                      dim=1)
    by_order = torch.argsort(order, dim=1, stable=True)  # the decided candidates first, in their order
    wanted = (total - slots).clamp_min(0) + slot  # the places the slots take, oldest first
    mask = wanted < total
    index = by_order.gather(1, wanted.clamp_max(order.shape[1] - 1))
    return torch.where(mask, index, 0), mask
