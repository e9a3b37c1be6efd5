"""The bookkeeping of the hybrid's exact cache (``cache_slots``, LoLA-style): when decisions fall, which tokens a
query sees, which pairs stay cached. Tensor functions only; the hybrid (mixer_hybrid.py) runs the far part.

A block of T new tokens is laid out as U = [pending (W slots), window (W slots), new (T)], in token order: the
token at U index W + j leaves the window at query j (the window is the last W positions, as without a cache), and
each real token that leaves joins the pending buffer. ``rank`` numbers the tokens that have left, 1, 2, ... in
the order they left (the pending buffer's tokens first); when a row's pending buffer holds W tokens (rank a
multiple of W), a decision follows that query: the cache's pairs and the W pending ones are scored, the top G
stay cached, the rest are evicted. A token is decided before query j when its rank is at most W times the number
of decisions before j; every real token not decided yet (pending or window) stays a softmax key.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: the rank of a token that has not left the window (or is padding): above every real rank
NEVER = 1 << 62


class Timing(NamedTuple):
    """When a block's decisions fall, per row: ``rank`` [B, 2W + T] of the tokens of U that have left the window
    (NEVER for the others), ``done`` [B, T] the decisions before each query, ``decide`` [B, T] whether a decision
    follows each query, ``done_end`` [B] the decisions once the block is through."""

    rank: torch.Tensor
    done: torch.Tensor
    decide: torch.Tensor
    done_end: torch.Tensor


def block_timing(pmask: torch.Tensor, wmask: torch.Tensor, new_real: torch.Tensor, window: int) -> Timing:
    """The decisions of a block from the pending and window masks [B, W] and the new tokens' [B, T] (real tokens,
    sinks excluded), counted from the block's start."""
    t = new_real.shape[1]
    leaves = torch.cat([wmask, new_real], dim=1)[:, :t]  # the token leaving at query j
    count = pmask.sum(1, keepdim=True) + leaves.long().cumsum(1)  # tokens that have left, pending included
    never = torch.full_like(count[:, :1], NEVER)
    rank = torch.cat(
        [
            torch.where(pmask, pmask.long().cumsum(1), never),
            torch.where(leaves, count, never),
            never.expand(-1, window),  # the window's last W: still inside
        ],
        dim=1,
    )
    return Timing(rank, (count - leaves.long()) // window, leaves & (count % window == 0), count[:, -1] // window)


def decision_spans(decide: torch.Tensor) -> list[tuple[int, int, bool]]:
    """The block's queries cut after each decision of any row: (start, stop, a decision follows query stop - 1).
    A one-token block is one span, with a decision when a row decides; on an accelerator always (run masked, so
    that no step waits for the host)."""
    t = decide.shape[1]
    if t == 1:
        return [(0, 1, decide.device.type != "cpu" or bool(decide.any()))]
    ends = [j + 1 for j in decide.any(0).nonzero().flatten().tolist()]
    spans, start = [], 0
    for stop in sorted({*ends, t}):
        spans.append((start, stop, stop in ends))
        start = stop
    return spans


def undecided_visible(
    timing: Timing, real: torch.Tensor, window: int, start: int, stop: int, new_sink: torch.Tensor | None
) -> torch.Tensor:
    """[B, 1, 1, stop - start, 2W + stop]: which tokens of U the queries start..stop-1 see: the real ones up to
    the query not decided yet (a padded query sees itself, so that no row is empty; a sink query sees itself as a
    sink instead)."""
    columns = 2 * window + stop
    index = torch.arange(columns, device=real.device)
    me = 2 * window + torch.arange(start, stop, device=real.device)  # the queries' own U indices
    causal = index[None, :] <= me[:, None]
    undecided = timing.rank[:, None, :columns] > window * timing.done[:, start:stop, None]
    visible = causal[None] & undecided & real[:, None, :columns]
    itself = (index[None, :] == me[:, None])[None]
    if new_sink is not None:
        itself = itself & ~new_sink[:, start:stop, None]
    return (visible | itself)[:, None, None]


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, N, D] at the token indices [B, M] of each row -> [B, Hkv, M, D]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def gather_heads(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, N, D] at the token indices [B, Hkv, M] of each head -> [B, Hkv, M, D]."""
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[3]))


def pending_pairs(timing: Timing, j: int, window: int) -> torch.Tensor:
    """[B, W]: the U indices of the W pending tokens a decision after query j scores (those that left since the
    row's last decision, in token order; meaningful in the rows deciding there)."""
    low = (window * timing.done[:, j])[:, None]
    chosen = (timing.rank > low) & (timing.rank <= low + window)
    # a copy: a view would keep the whole [B, U] order alive for the backward of each decision's gathers
    return torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :window].clone()


def keep_slots(
    score: torch.Tensor, filled: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decision over N candidates (the cache's G slots, then the pending pairs) from their scores [B, Hkv, N]
    and filled slots [B, N]: the candidate indices [B, Hkv, G] that stay cached (filled ones first, in candidate
    order, which is token order), the evicted candidates [B, Hkv, N] and the new cache mask [B, G]. The highest
    scores stay (ties: the older pair); a score that is not a number counts as the highest, an empty slot below
    every filled one."""
    n = score.shape[-1]
    empty = torch.full_like(score, -float("inf"))  # below any score, of either sign
    key = torch.where(filled[:, None, :], score.nan_to_num(nan=float("inf")), empty)
    top = torch.argsort(key, dim=-1, descending=True, stable=True)[..., :slots]
    unfilled = ~filled[:, None, :].expand_as(score).gather(-1, top)
    keep = top.gather(-1, torch.argsort(top + n * unfilled.long(), dim=-1))
    kept = torch.zeros_like(filled[:, None, :].expand_as(score)).scatter(-1, top, True)
    count = filled.sum(1, keepdim=True).clamp_max(slots)
    cmask = torch.arange(slots, device=score.device)[None, :] < count
    return keep, filled[:, None, :] & ~kept, cmask


def pending_after(timing: Timing, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pending buffer once the block is through: the U indices [B, W] of the tokens that have left and are
    not decided, right-aligned in token order (fewer than W: a full buffer is decided at once), and its mask."""
    rank = timing.rank
    pending = (rank != NEVER) & (rank > window * timing.done_end[:, None])
    index = torch.arange(rank.shape[1], device=rank.device).expand_as(rank)
    slots = torch.argsort(torch.where(pending, index, -1), dim=1, stable=True)[:, -window:]
    return slots, pending.gather(1, slots)
