"""What decides which pairs the hybrid's exact cache keeps (its option ``cache_score``).

At each decision (mixer_hybrid.py, hybrid_cache.py) the cache's pairs and the pending ones are scored; the G highest
stay exact. A score is a function of the layer's ``ScoreParts`` (its far part, its retention head) and a
``Decision``: the candidates' keys and values, the far state, and the values of the window's tokens at that moment
(the W most recent, which every query still sees by softmax). Registered in ``CACHE_SCORES``; a new score is a
function here plus one line there.

* ``far``: the far part's own recall error, ``far_recall_error(k, v, state)`` (LoLA's rule): the pairs the state
  recalls worst stay. Needs a far family that declares the score.
* ``novelty``: how unlike every value in the window a candidate's value is, ``min_w |v - v_w| / |v|`` per KV head.
  A pair whose value the window holds again (text that repeats, a recurring phrase) adds little beside it; one
  unlike anything recent (a fact stated once) scores high for as long as nothing like it comes back, since the
  cached pairs are re-scored against each new window. It reads neither the far state nor its parameters.
* ``keydiff``: how far each candidate's key points from the others' (KeyDiff, Park et al., 2025): minus
  the cosine between the key and the mean of the real candidates' unit keys. Keys that point where most keys point
  (the resting places of attention, common words) score low; a key unlike the rest stays. It reads neither the far
  state nor its parameters. KeyDiff scores a whole prefilled cache against its mean; here the mean is that of the
  candidates of each decision (the cache and the pending pairs), so the memory stays constant.
* ``keydiff_span``: ``keydiff`` raised to the highest score among each candidate's ``SPAN_RADIUS`` neighbours on
  either side, in candidate order (token order): a key that stands out keeps the tokens around it, as SnapKV pools
  its attention scores, so a value written over several tokens (a number's digits) stays or leaves as a whole rather
  than losing the tokens whose own keys look common.
* ``recent``: the most recent candidates (the cache's slots and the pending pairs are in token order): the cache
  extends the window by its slots, a sliding window whose older part is held in the cache's ``cache_dtype`` (int8
  or int4 codes: several times the window's tokens in the same bytes). It reads neither the far state nor its
  parameters.
* ``learned``: the layer's retention head (retention_head.py, Locret's retaining heads) predicts from each pair
  the attention the teacher's later queries put on it; trained during conversion (training/retention_objective.py).
  It reads no far state, so it also serves a hybrid without a far part (a pure learned-eviction softmax cache).

Option ``cache_recent`` reserves some of the slots for the newest pairs whatever the score says
(``reserving_newest``): a fact stated just before the window's reach stays while the score picks the rest from the
whole context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class ScoreParts(NamedTuple):
    """What of the layer a score may read: its far part (None without one) and its retention head (None unless the
    score is learned)."""

    far: Any
    head: Any


class Decision(NamedTuple):
    """What a decision scores: ``keys`` / ``values`` [B, Hkv, N, D] of the N candidates (the cache's slots, then the
    pending pairs), the far ``state``, the window's values [B, Hkv, W, D] with their real-token mask [B, W], and
    which candidates hold a pair (``filled`` [B, N]; an empty cache slot does not)."""

    keys: torch.Tensor
    values: torch.Tensor
    state: dict[str, torch.Tensor]
    window: torch.Tensor
    window_real: torch.Tensor
    filled: torch.Tensor


def far_recall(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: the far part's recall error of each candidate against its state."""
    return parts.far.far_recall_error(decision.keys, decision.values, decision.state)


def learned_retention(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: the retention head's predicted log importance of each candidate."""
    return parts.head(decision.keys, decision.values)


def window_novelty(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: the distance from each candidate's value to the nearest real value of the window, over the
    candidate's own norm (in float32 at least; +inf where the window holds no real token)."""
    dtype = torch.promote_types(decision.values.dtype, torch.float32)
    values, window = decision.values.to(dtype), decision.window.to(dtype)
    # the direct form: the matrix-product one leaves ~1e-4 between equal vectors, and a repeat must score ~0
    distance = torch.cdist(values, window, compute_mode="donot_use_mm_for_euclid_dist")
    distance = distance.masked_fill(~decision.window_real[:, None, None, :], float("inf"))
    return distance.amin(-1) / values.norm(dim=-1).clamp_min(torch.finfo(dtype).tiny)


def key_diversity(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: minus the cosine between each candidate's key and the mean unit key of the filled candidates (in
    float32 at least)."""
    dtype = torch.promote_types(decision.keys.dtype, torch.float32)
    units = F.normalize(decision.keys.to(dtype), dim=-1)
    filled = decision.filled[:, None, :, None].to(dtype)
    anchor = (units * filled).sum(2, keepdim=True) / filled.sum(2, keepdim=True).clamp_min(1.0)
    return -(units * F.normalize(anchor, dim=-1)).sum(-1)


#: the neighbours on either side whose highest KeyDiff score a candidate takes (``keydiff_span``)
SPAN_RADIUS = 3


def key_diversity_span(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: ``key_diversity`` pooled to the highest among the ``SPAN_RADIUS`` nearest filled candidates on
    either side (neighbours in token order: empty slots between the cache's pairs and the pending ones are skipped;
    an empty slot keeps its own score)."""
    score = key_diversity(parts, decision)
    filled = decision.filled[:, None, :].expand_as(score)
    order = torch.argsort((~filled).to(torch.int8), dim=-1, stable=True)  # the filled first, in token order
    packed = torch.where(filled, score, torch.full_like(score, -float("inf"))).gather(-1, order)
    pooled = F.max_pool1d(packed, 2 * SPAN_RADIUS + 1, stride=1, padding=SPAN_RADIUS)
    return torch.where(filled, torch.empty_like(score).scatter(-1, order, pooled), score)


def recency(parts: ScoreParts, decision: Decision) -> torch.Tensor:
    """[B, Hkv, N]: each candidate's index, which orders the filled candidates as their tokens are ordered (the
    cache's filled slots first, oldest first, then the pending pairs), so the newest score highest."""
    keys = decision.keys
    order = torch.arange(keys.shape[2], device=keys.device, dtype=torch.promote_types(keys.dtype, torch.float32))
    return order.expand(keys.shape[:3])


def newest_first(score: torch.Tensor, filled: torch.Tensor, reserve: int) -> torch.Tensor:
    """``score`` [B, Hkv, N] raised to +inf for the ``reserve`` newest filled candidates (``filled`` [B, N], in token
    order), so that a decision keeps them before any other."""
    filled_after = filled.flip(-1).long().cumsum(-1).flip(-1) - filled.long()  # the filled candidates newer than each
    newest = filled & (filled_after < reserve)
    return torch.where(newest[:, None, :], torch.full_like(score, float("inf")), score)


def reserving_newest(
    score: Callable[[ScoreParts, Decision], torch.Tensor], reserve: int
) -> Callable[[ScoreParts, Decision], torch.Tensor]:
    """``score`` with its decisions keeping the ``reserve`` newest pairs first (option ``cache_recent``); ``score``
    itself when ``reserve`` is 0."""
    if not reserve:
        return score

    def reserved(parts: ScoreParts, decision: Decision) -> torch.Tensor:
        return newest_first(score(parts, decision), decision.filled, reserve)

    return reserved


class CacheScore(NamedTuple):
    """One choice of option ``cache_score``: the ``score`` (score parts, decision) -> [B, Hkv, N], whether it
    ``reads_far`` (needs the far family's ``far_recall_error``), what the cache ``keeps``, in words (cards), and
    whether it is ``learned`` (the layer then holds a retention head, whose parameters the score reads)."""

    score: Callable[[ScoreParts, Decision], torch.Tensor]
    reads_far: bool
    keeps: str
    learned: bool = False


CACHE_SCORES: dict[str, CacheScore] = {
    "far": CacheScore(far_recall, reads_far=True, keeps="the key / value pairs its far state recalls worst"),
    "novelty": CacheScore(window_novelty, reads_far=False,
                          keeps="the key / value pairs whose values are least like any value in the window"),
    "keydiff": CacheScore(key_diversity, reads_far=False,
                          keeps="the key / value pairs whose keys point furthest from the mean direction of the "
                          "candidates' keys"),
    "keydiff_span": CacheScore(key_diversity_span, reads_far=False,
                               keeps="the key / value pairs within a few tokens of a key that points furthest from "
                               "the mean direction of the candidates' keys"),
    "recent": CacheScore(recency, reads_far=False, keeps="the most recent key / value pairs past the window"),
    "learned": CacheScore(learned_retention, reads_far=False, learned=True,
                          keeps="the key / value pairs its retention head, trained on the teacher's attention, "
                          "predicts later queries will attend to most"),
}
