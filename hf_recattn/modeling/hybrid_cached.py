"""The hybrid's exact cache (``cache_slots``) as forms of its own: ``ExactCacheForms``, which ``HybridMixer`` mixes in,
runs a block (or one decode step) with the cache on through hybrid_cache.py's bookkeeping around the hybrid's
softmax and far part; the pieces the hybrid's plain forms share with it (the far state's prefix, real-token masks,
slices of a block's inputs) are here too.

A decision scores the cache's pairs and the pending ones with the layer's ``cache_score`` (cache_scores.py), which
reads the layer's ``ScoreParts``: its far part and, for ``learned``, its retention head (retention_head.py). Without
a far part (``far: none``, a score that reads no far state) the evicted pairs are dropped and the queries see only
the sinks, the cache and the tokens not decided yet: a learned-eviction softmax cache. The cache's options
(``CACHE_OPTIONS``), their checks and its share of the state size are here; a coded ``cache_dtype`` (``int8``,
``int4``, ``int4g16``, ``k8v4g16``) holds its pairs as cache_precision.py says.

A block runs its queries in spans cut after each decision; where the decisions keep the newest pairs (``recent``, or
nothing evicted) and no far part takes them, in one pass instead (hybrid_cache_newest.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .cache_precision import (
    CACHE_DTYPES,
    MODEL,
    CodeFormat,
    PairCodes,
    coded_slot_bytes,
    pair_codes,
    scale_dtype,
    slot_elements,
)
from .cache_scores import CACHE_SCORES, Decision, ScoreParts, recency
from .far_part import ARRIVING, FarTerms
from .hybrid_cache import (
    Timing,
    block_timing,
    decision_spans,
    gather_heads,
    gather_tokens,
    keep_slots,
    pending_after,
    pending_pairs,
    undecided_visible,
)
from .hybrid_cache_newest import newest_after, newest_visible
from .key_distance import CLAMP, KeyDistance, query_positions
from .mixer_base import MixerInputs, MixerShape, State, group_queries, ungroup_output
from .options import Option

FAR_PREFIX = "far."
#: the hybrid's options of the exact cache
CACHE_OPTIONS = {
    "cache_slots": Option(
        (int,), 0, "exact key/value slots per KV head, filled as 'cache_score' says (0: none)", minimum=0,
    ),
    "cache_score": Option(
        (str,), "far", "what the exact cache keeps: the pairs the far state recalls worst ('far'), the values "
        "least like any in the window ('novelty'), the keys least like the others ('keydiff'), the tokens around "
        "them ('keydiff_span'), the most recent ('recent') or what a retention head trained on the teacher's "
        "attention predicts later queries need ('learned'); see modeling/cache_scores.py", choices=tuple(CACHE_SCORES),
    ),
    "cache_recent": Option(
        (int,), 0, "of the exact cache's slots, how many always hold the newest pairs past the window, whatever "
        "'cache_score' says of them (the others go as it says; 0: none)", minimum=0,
    ),
    "cache_dtype": Option(
        (str,), MODEL, "how the exact cache holds its keys and values: as the model computes them ('model') or "
        "as int8 codes with a float32 scale per key and per value ('int8', about a quarter of float32's bytes) or "
        "as int4 codes with a float32 scale per 32 dimensions ('int4', 1.7 times int8's pairs per byte at 64 "
        "dimensions) or a float16 scale per 16 ('int4g16', int4's bytes, finer steps), or keys as int8 and values as "
        "int4g16 ('k8v4g16'); modeling/cache_precision.py",
        choices=CACHE_DTYPES,
    ),
}
#: what each cache option does, for the error when it is set with the cache off
CACHE_OPTION_ROLES = {"cache_score": "scores the exact cache",
                      "cache_recent": "reserves slots of the exact cache for the newest pairs",
                      "cache_dtype": "sets how the exact cache holds its pairs"}
#: the far part's terms of the queries over the keys it reads, and its next state (None in the parallel form)
FarForm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MixerInputs, State], tuple[FarTerms, State | None]]


class Cache(NamedTuple):
    """The exact cache as the forms carry it: keys and values [B, Hkv, G, D] as its queries read them (dequantized
    when coded: ``cache_dtype`` int8 or int4), the filled slots [B, G], their positions [B, Hkv, G] with the clamp
    (else None) and, when coded, the keys' and values' scales [B, Hkv, G, groups] (else None)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor | None
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None


def check_cache_spec(spec: dict[str, Any], where: str, has_far: bool) -> None:
    """Raise when a cache option is set with the cache off, or a score reading the far state has none to read."""
    for name, role in CACHE_OPTION_ROLES.items():
        if spec[name] != CACHE_OPTIONS[name].default and not spec["cache_slots"]:
            raise ValueError(f"{where}: option {name!r}={spec[name]!r} {role}, which is off (cache_slots: 0)")
    if spec["cache_recent"] > spec["cache_slots"]:
        raise ValueError(f"{where}: option 'cache_recent'={spec['cache_recent']} reserves more slots than the exact "
                         f"cache has (cache_slots: {spec['cache_slots']})")
    if spec["cache_recent"] and spec["cache_score"] == "recent":
        raise ValueError(f"{where}: option 'cache_recent'={spec['cache_recent']} with cache_score='recent': every "
                         "slot already holds the newest pairs; set one of the two")
    if not has_far and spec["cache_slots"] and CACHE_SCORES[spec["cache_score"]].reads_far:
        raise ValueError(f"{where}: option 'cache_slots' with cache_score={spec['cache_score']!r} needs a far "
                         "part (its state scores the pairs), got far='none'; a score that reads no far state "
                         "('novelty', 'learned') drops the evicted pairs instead")


def check_cache_fits(spec: dict[str, Any], shape: MixerShape, config: Any) -> None:
    """Raise when a layer's cache does not fit its model: more slots than a sequence has positions (unless distant
    keys are clamped), or codes of ``cache_dtype`` that its heads' dimensions do not divide into."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and spec["cache_slots"] > limit and spec["distant_positions"] != CLAMP:
        raise ValueError(f"layer {shape.layer_idx}: option 'cache_slots'={spec['cache_slots']} exceeds "
                         f"max_position_embeddings={limit}, the most tokens a sequence can hold")
    unfit = None if spec["cache_dtype"] == MODEL else pair_codes(spec["cache_dtype"]).unfit(shape.head_dim)
    if unfit:
        raise ValueError(f"layer {shape.layer_idx}: option 'cache_dtype'={spec['cache_dtype']!r} {unfit}")


def far_state(state: State) -> State:
    """The far mixer's part of a hybrid state, without the prefix."""
    return {name[len(FAR_PREFIX) :]: x for name, x in state.items() if name.startswith(FAR_PREFIX)}


def real_tokens(inputs: MixerInputs, q: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: which of the block's tokens are real."""
    mask = inputs.token_mask
    return torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device) if mask is None else mask.bool()


def slice_inputs(inputs: MixerInputs, start: int, stop: int) -> MixerInputs:
    """The inputs of tokens start..stop-1 of the block (``inputs`` itself when that is the whole block)."""
    t = inputs.hidden_states.shape[1]
    if start == 0 and stop == t:
        return inputs
    mask = inputs.padding_mask
    return MixerInputs(
        hidden_states=inputs.hidden_states[:, start:stop],
        padding_mask=None if mask is None else mask[:, : mask.shape[1] - t + stop],
        past_length=inputs.past_length + start,
    )


def where_rows(rows: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` in the batch rows [B] marked, ``old`` in the others."""
    return torch.where(rows.view(-1, *(1,) * (old.dim() - 1)), new, old)


def sink_reach(new_sink: torch.Tensor, sinks: int) -> int:
    """How many sink candidates (the N slots, then a block's T tokens) any row can see: the slots and the block's
    tokens up to its last new sink in any row; the later candidates are never sinks."""
    seen = new_sink.any(0).nonzero()
    return sinks + (int(seen.max()) + 1 if seen.numel() else 0)


def first_seen(visible: torch.Tensor) -> int:
    """The first column [..., C] of a visibility mask that any row or query sees."""
    return int(visible.flatten(0, -2).any(0).to(torch.int8).argmax())


class CacheBlock(NamedTuple):
    """A block of new tokens with the cache on: the queries, keys and values and their inputs, U's keys, values
    and real tokens (pending, window, new: see hybrid_cache.py), the decisions' timing and the sinks (their keys,
    values and visibility [B, 1, 1, T, N + T] and which new tokens are sinks), or None without sinks; with
    ``distant_positions: clamp`` the positions [B, 2W + T] of U's tokens (key_distance.py), else None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    inputs: MixerInputs
    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor
    timing: Timing
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    positions: torch.Tensor | None = None


class ExactCacheForms:
    """The hybrid's forms with the exact cache on (mixed into ``HybridMixer``, whose attributes they read: ``window``,
    ``chunk_size``, ``sink_tokens``, ``cache_slots``, ``cache_dtype``, ``cache_score``, ``far``, ``retention``,
    ``shape``, ``_sinks``, ``_combine``)."""

    window: int
    chunk_size: int
    sink_tokens: int
    cache_slots: int
    cache_dtype: str
    cache_score: Callable[[ScoreParts, Decision], torch.Tensor]
    far: Any
    retention: Any
    distance: KeyDistance | None
    shape: Any
    scale: float
    _sinks: Callable[..., Any]
    _combine: Callable[..., torch.Tensor]
    _far_step: FarForm
    #: run a block in one pass where its decisions keep the newest pairs (False: span by span, as a reference)
    newest_pass: bool = True

    def _cached_block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State, far_form: FarForm,
        coded: bool = True,
    ) -> tuple[torch.Tensor, State]:
        """``_block`` with the cache: the queries run in spans cut after each decision; a decision moves pairs
        between the cache and (a far part reading leaving keys) the far state. Where the decisions keep the newest
        pairs and there is no far part, in one pass instead (``_newest_pass``). ``coded=False``: the state carries
        a coded cache as its codes give it (for the next block of the same call, which would decode it again)."""
        blk, new_state = self._cache_block_of(q, k, v, inputs, state)
        cache, far = self._cache_in(state), far_state(state)
        if self._keeps_newest(blk, cache):
            out, cache = self._newest_pass(blk, cache)
        else:
            outs = []
            for start, stop, decides in decision_spans(blk.timing.decide):
                out, far = self._cached_span(blk, start, stop, cache, far, far_form)
                outs.append(out)
                if decides:
                    cache, far = self._decide(blk, stop - 1, cache, far)
            out = torch.cat(outs, dim=1)
        w = self.window
        slots, pmask = pending_after(blk.timing, w)
        keep = pmask[:, None, :, None]
        new_state.update({
            "wk": blk.keys[:, :, -w:], "wv": blk.values[:, :, -w:], "wmask": blk.real[:, -w:],
            "pk": torch.where(keep, gather_tokens(blk.keys, slots), 0.0),
            "pv": torch.where(keep, gather_tokens(blk.values, slots), 0.0),
            "pmask": pmask, **self._cache_out(cache, coded),
        })
        if blk.positions is not None:
            new_state.update({"ppos": torch.where(pmask, blk.positions.gather(1, slots), 0),
                              "wpos": blk.positions[:, -w:], "cpos": cache.positions})
        new_state.update({FAR_PREFIX + name: x for name, x in far.items()})
        return out, new_state

    def _cache_block_of(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[CacheBlock, State]:
        """The block laid out for the cache (``CacheBlock``) and the sinks' part of the next state."""
        w = self.window
        new_real = real_tokens(inputs, q)
        new_state: State = {}
        sinks = None
        if self.sink_tokens:
            sink_keys, sink_values, new_sink, sink_visible, sink_state = self._sinks(k, v, new_real, state)
            new_state.update(sink_state)
            new_real = new_real & ~new_sink
            reach = sink_reach(new_sink, self.sink_tokens) if q.shape[2] > 1 else sink_keys.shape[2]
            sinks = (sink_keys[:, :, :reach], sink_values[:, :, :reach], sink_visible[..., :reach], new_sink)
        real = torch.cat([state["pmask"], state["wmask"], new_real], dim=1)  # U: pending, window, new
        timing = block_timing(state["pmask"], state["wmask"], new_real, w)
        positions = None
        if self.distance is not None:
            new_pos = query_positions(inputs, q.shape[2], q.device).expand(q.shape[0], -1)
            positions = torch.cat([state["ppos"], state["wpos"], new_pos], dim=1)
        blk = CacheBlock(q, k, v, inputs, torch.cat([state["pk"], state["wk"], k], dim=2),
                         torch.cat([state["pv"], state["wv"], v], dim=2), real, timing, sinks, positions)
        return blk, new_state

    def _keeps_newest(self, blk: CacheBlock, cache: Cache) -> bool:
        """Whether the block's decisions keep the G newest pairs (``cache_score: recent``, or nothing is evicted:
        the pairs cached and decided fit the slots) and no far part takes the evicted ones, so that
        ``_newest_pass`` gives the spans' outputs and cache (a host check on the number of pairs, except with
        ``recent``)."""
        if not self.newest_pass or self.far is not None:
            return False
        if self.cache_score is recency:
            return True
        decided = cache.mask.sum(1) + self.window * blk.timing.done_end
        return bool((decided <= self.cache_slots).all())

    def _newest_pass(self, blk: CacheBlock, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """The block's outputs and the cache after it, where the decisions keep the newest pairs
        (hybrid_cache_newest.py): one softmax over the sinks, the cache's slots, the block's tokens as the cache
        holds them (coded with ``cache_dtype``) while they are among the G newest decided, and as computed while
        they are not decided."""
        w, g, t = self.window, self.cache_slots, blk.q.shape[2]
        old_visible, new_visible = newest_visible(blk.timing, cache.mask, w, g)
        # the cache's filled slots come first: the columns past the fullest row's are empty in every row, so the
        # softmax leaves them out (the same weights: an empty slot's weight is zero)
        filled = int(cache.mask.sum(1).max()) if cache.mask.device.type == "cpu" else g  # no host wait elsewhere
        old_visible = old_visible[..., :filled]
        new_sink = None if blk.sinks is None else blk.sinks[3]
        undecided = undecided_visible(blk.timing, blk.real, w, 0, t, new_sink)
        held_keys, held_values, key_scales, value_scales = blk.keys, blk.values, None, None
        if cache.key_scales is not None:
            codes = self._pair_codes
            held_keys, key_scales = codes.keys.round_trip(blk.keys)
            held_values, value_scales = codes.values.round_trip(blk.values)
        keys, values = [cache.keys[:, :, :filled], held_keys], [cache.values[:, :, :filled], held_values]
        visible = [old_visible.expand(-1, -1, -1, t, -1), new_visible]
        if key_scales is None:  # the cache holds the keys as computed: one set of columns for both
            visible[1] = new_visible | undecided
        else:
            keys.append(blk.keys)
            values.append(blk.values)
            visible.append(undecided)
        if blk.sinks is not None:
            keys.insert(0, blk.sinks[0])
            values.insert(0, blk.sinks[1])
            visible.insert(0, blk.sinks[2])
        qg = group_queries(blk.q, self.shape.num_kv_heads)
        keys = torch.cat(keys, dim=2)
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg, keys) * self.scale
        cached_positions = None  # of the cache's slots, then the block's tokens
        if self.distance is not None:  # the cached columns clamped (the undecided ones are within the window's reach)
            held_positions = blk.positions[:, None].expand(-1, cache.positions.shape[1], -1)
            cached_positions = torch.cat([cache.positions, held_positions], dim=2)
            read_positions = torch.cat([cache.positions[..., :filled], held_positions], dim=2)
            key_pos, new_pos = self._clamped_positions(blk, read_positions)
            scores = self.distance.clamp(scores, qg, keys, key_pos, new_pos, self.scale)
        scores = scores.masked_fill(~torch.cat(visible, dim=-1), float("-inf"))
        out, _ = self._mix_cached(blk.q, blk.k, blk.v, blk.inputs, {}, scores, torch.cat(values, dim=2),
                                  self._far_step)
        index, mask = newest_after(blk.timing, cache.mask, w, g)
        filled = mask[:, None, :, None]

        def kept(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.where(filled, gather_tokens(torch.cat([old, new], dim=2), index), 0.0)

        positions = None
        if cached_positions is not None:
            chosen = cached_positions.gather(2, index[:, None].expand(-1, cached_positions.shape[1], -1))
            positions = torch.where(mask[:, None], chosen, 0)
        scales = (None, None) if key_scales is None else (kept(cache.key_scales, key_scales),
                                                          kept(cache.value_scales, value_scales))
        return out, Cache(kept(cache.keys, held_keys), kept(cache.values, held_values), mask, positions, *scales)

    def _cached_span(
        self, blk: CacheBlock, start: int, stop: int, cache: Cache, far: State, far_form: FarForm
    ) -> tuple[torch.Tensor, State]:
        """The outputs of queries start..stop-1 over the sinks, the cache, the tokens not decided yet and the far
        state, and the far state after them (one reading arriving tokens has read theirs)."""
        q = blk.q[:, :, start:stop]
        inputs = slice_inputs(blk.inputs, start, stop)
        ck, cv, cmask, cpos = cache[:4]
        columns = 2 * self.window + stop
        new_sink = None if blk.sinks is None else blk.sinks[3]
        undecided = undecided_visible(blk.timing, blk.real, self.window, start, stop, new_sink)
        first = first_seen(undecided) if blk.q.shape[2] > 1 else 0  # a longer block: tokens decided before are out
        keys, values = [ck, blk.keys[:, :, first:columns]], [cv, blk.values[:, :, first:columns]]
        visible = [cmask[:, None, None, None, :].expand(-1, 1, 1, stop - start, -1), undecided[..., first:]]
        if blk.sinks is not None:
            keys.insert(0, blk.sinks[0])
            values.insert(0, blk.sinks[1])
            visible.insert(0, blk.sinks[2][..., start:stop, :])
        qg = group_queries(q, self.shape.num_kv_heads)
        keys = torch.cat(keys, dim=2)
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg, keys) * self.scale
        if self.distance is not None:
            key_pos, new_pos = self._clamped_positions(blk, cpos)
            scores = self.distance.clamp(scores, qg, keys, key_pos, new_pos[:, start:stop], self.scale)
        scores = scores.masked_fill(~torch.cat(visible, dim=-1), float("-inf"))
        k, v = blk.k[:, :, start:stop], blk.v[:, :, start:stop]
        return self._mix_cached(q, k, v, inputs, far, scores, torch.cat(values, dim=2), far_form)

    def _clamped_positions(self, blk: CacheBlock, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With the clamp: the positions [B, Hkv, S] of the leading exact columns (the sink candidates the block
        reaches, then the ``cached`` ones [B, Hkv, C]) and of the block's new tokens [B, T]."""
        new_pos = blk.positions[:, 2 * self.window :]
        sink_pos = None if blk.sinks is None else KeyDistance.sink_positions(self.sink_tokens, new_pos)
        sink_pos = None if sink_pos is None else sink_pos[..., : blk.sinks[0].shape[2]]
        return KeyDistance.exact_positions(sink_pos, cached), new_pos

    def _mix_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, far: State,
        scores: torch.Tensor, values: torch.Tensor, far_form: FarForm,
    ) -> tuple[torch.Tensor, State]:
        """The softmax part (``scores`` over ``values``) combined with the far part's terms of the queries, and the far
        state after them (one reading arriving tokens reads this block's ``k``, ``v`` by ``far_form``); the softmax
        part alone without a far part."""
        if self.far is None:
            return ungroup_output(torch.einsum("bhgts,bhse->bhgte", torch.softmax(scores, dim=-1), values)), far
        if self.far.far_reads == ARRIVING:
            terms, far = far_form(q, k, v, inputs, far)
        else:
            terms = self.far.far_read(q, inputs, far)
        return self._combine(terms, inputs, scores, values), far

    def _decide(
        self, blk: CacheBlock, j: int, cache: Cache, far: State
    ) -> tuple[Cache, State]:
        """The decision after query j in the rows whose pending buffer is then full (see ``_evict``)."""
        w = self.window
        pending = pending_pairs(blk.timing, j, w)
        pending_pos = None if blk.positions is None else blk.positions.gather(1, pending)
        pending_pair = (gather_tokens(blk.keys, pending), gather_tokens(blk.values, pending), pending_pos)
        after = slice(j + w + 1, j + 2 * w + 1)  # U indices of the window once query j is through
        window = (blk.values[:, :, after], blk.real[:, after])
        return self._evict(blk.timing.decide[:, j], pending_pair, window, cache, far)

    def _evict(
        self, rows: torch.Tensor, pending: tuple[torch.Tensor, ...], window: tuple[torch.Tensor, torch.Tensor],
        cache: Cache, far: State,
    ) -> tuple[Cache, State]:
        """The decision in the ``rows`` [B] marked: the cache's pairs and the W ``pending`` ones (keys and values
        [B, Hkv, W, D], in token order, and their positions [B, W] or None; meaningful in those rows) scored by
        ``cache_score`` (against the far state or the ``window``'s values [B, Hkv, W, D] and real tokens [B, W] after
        the deciding query), the G highest kept (with their positions), the others added to the far state in token
        order (a far part reading leaving keys) or dropped. The other rows keep their cache and far state. With
        a coded ``cache_dtype`` the pending pairs are scored and kept as the codes hold them; the far state takes
        them as computed."""
        ck, cv, cmask, cpos, key_scales, value_scales = cache
        pending_keys, pending_values = pending[0], pending[1]
        if key_scales is not None:
            codes = self._pair_codes
            pending_keys, pending_key_scales = codes.keys.round_trip(pending[0])
            pending_values, pending_value_scales = codes.values.round_trip(pending[1])
        keys = torch.cat([ck, pending_keys], dim=2)
        values = torch.cat([cv, pending_values], dim=2)
        filled = torch.cat([cmask, torch.ones_like(cmask[:, :1]).expand(-1, self.window)], dim=1)
        # the choice is discrete: no gradient
        decision = Decision(keys, values, far, *window, filled)
        score = self.cache_score(ScoreParts(self.far, self.retention), decision).detach()
        keep, evicted, new_mask = keep_slots(score, filled, self.cache_slots)
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if key_scales is not None:
            scales = tuple(  # type: ignore[assignment]
                where_rows(rows, gather_heads(torch.cat([old, new], dim=2), keep), old)
                for old, new in ((key_scales, pending_key_scales), (value_scales, pending_value_scales))
            )
        cache = Cache(
            where_rows(rows, gather_heads(keys, keep), ck),
            where_rows(rows, gather_heads(values, keep), cv),
            where_rows(rows, new_mask, cmask),
            None if cpos is None else where_rows(rows, KeyDistance.kept_positions(cpos, pending[2], keep), cpos),
            *scales,
        )
        if self.far is not None and self.far.far_reads != ARRIVING:
            if key_scales is not None:
                keys, values = torch.cat([ck, pending[0]], dim=2), torch.cat([cv, pending[1]], dim=2)
            added = self.far.far_add(keys, values, evicted.to(values.dtype), far)
            far = {name: where_rows(rows, added[name], x) for name, x in far.items()}
        return cache, far

    def _cached_step_one(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        """``_cached_block`` for one token once the sinks are settled, bit for bit, in fewer ops: its keys and values
        are concatenated once in the general block's column order (the sinks and the new token as a sink
        candidate, never visible once they are settled; the cache; the pending buffer, the window and the new
        token), so that the softmax and the far part run the same ops on the same tensors; the timing is whether
        the oldest window token leaves and fills the pending buffer, and the next window and pending buffer are
        slices of that one buffer (``_pending_after_step``; with the clamp, the positions of pending, window and new
        token laid out as ``real``)."""
        n, w = self.sink_tokens, self.window
        mask = inputs.token_mask
        itself = torch.ones(q.shape[0], 1, dtype=torch.bool, device=q.device)
        new_real = itself if mask is None else mask.bool()
        sink_k, sink_v = ([state["sk"], k], [state["sv"], v]) if n else ([], [])
        cache = self._cache_in(state)
        keys = torch.cat([*sink_k, cache.keys, state["pk"], state["wk"], k], dim=2)  # [B, Hkv, N' + G + 2W + 1, D]
        values = torch.cat([*sink_v, cache.values, state["pv"], state["wv"], v], dim=2)
        real = torch.cat([state["pmask"], state["wmask"], new_real], dim=1)  # [B, 2W + 1]: pending, window, new
        sinks = [state["smask"], ~itself] if n else []  # settled: every sink visible, the new token not a sink
        visible = torch.cat([*sinks, state["cmask"], real[:, :-1], itself], dim=1)  # a padded query sees itself
        qg = group_queries(q, self.shape.num_kv_heads)
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg, keys) * self.scale
        positions = None
        if self.distance is not None:
            scores, positions = self.distance.cached_step(scores, qg, keys, inputs, state, n, self.scale)
        scores = scores.masked_fill(~visible[:, None, None, None, :], float("-inf"))
        out, far = self._mix_cached(q, k, v, inputs, far_state(state), scores, values, self._far_step)
        new_state: State = {"wk": keys[:, :, -w:], "wv": values[:, :, -w:], "wmask": real[:, -w:]}
        if n:
            new_state.update({"sk": state["sk"], "sv": state["sv"], "smask": state["smask"]})
        new_state.update(self._pending_after_step(keys, values, real, state, cache, far, positions))
        return out, new_state

    def _pending_after_step(
        self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor, state: State, cache: Cache, far: State,
        positions: torch.Tensor | None = None,
    ) -> State:
        """The pending buffer, cache and far state after a one-token step (``keys`` / ``values``: its buffer, ending
        in pending, window, new token; ``real``: their mask): a real leaving token joins the pending buffer, which
        is then the buffer's slice one position on (that slice itself when every row's leaving token is real, as
        on the CPU a host check finds); a row whose buffer is then full decides, and it empties."""
        w, s = self.window, keys.shape[2]
        leaves = real[:, w : w + 1]  # [B, 1]: the oldest window token, when real
        pk, pv, pmask = keys[:, :, s - 2 * w : s - w], values[:, :, s - 2 * w : s - w], real[:, 1 : w + 1]
        if leaves.device.type != "cpu" or not bool(leaves.all()):
            pmask = torch.where(leaves, pmask, real[:, :w])
            pk = torch.where(leaves[:, :, None, None], pk, state["pk"])
            pv = torch.where(leaves[:, :, None, None], pv, state["pv"])
        ppos = None if positions is None else torch.where(leaves, positions[:, 1 : w + 1], state["ppos"])
        full = pmask.all(1)  # [B]: fewer than W wait between steps, so only a leaving token fills it
        ((_, _, decides),) = decision_spans(full[:, None])
        if decides:
            cache, far = self._evict(full, (pk, pv, ppos), (values[:, :, s - w :], real[:, -w:]), cache, far)
            empty = full[:, None, None, None]
            pk, pv, pmask = torch.where(empty, 0.0, pk), torch.where(empty, 0.0, pv), pmask & ~full[:, None]
        # without a decision the cache is the state's own: its entries pass through, not re-encoded
        held = self._cache_out(cache) if decides else {n: state[n] for n in self._cache_out_names()}
        new_state: State = {"pk": pk, "pv": pv, "pmask": pmask, **held}
        if positions is not None:
            new_state.update({"ppos": torch.where(pmask, ppos, 0), "wpos": positions[:, -w:],
                              "cpos": cache.positions})
        new_state.update({FAR_PREFIX + name: x for name, x in far.items()})
        return new_state

    def _cache_size(self) -> int:
        """The pending buffer and the cache in state elements (keys, values, masks; a coded cache's bytes over
        four, cache_precision.slot_elements); 0 without a cache."""
        if not self.cache_slots:
            return 0
        hk, d, w = self.shape.num_kv_heads, self.shape.head_dim, self.window
        return 2 * hk * d * w + w + slot_elements(hk, d, self.cache_slots, self.cache_dtype) + self.cache_slots

    def backward_numbers(self, tokens: int) -> int:
        """An estimate of what the chunked form with the cache keeps for the backward over ``tokens`` tokens: each
        query's attention weights over its span's columns (the sinks and their candidates, the cache, the pending
        buffer, the window and the chunk), the keys and values each span concatenates and those each decision scores
        and gathers; 0 without a cache (then of the order of the layer's own activations)."""
        if not self.cache_slots:
            return 0
        hk, d, w, c = self.shape.num_kv_heads, self.shape.head_dim, self.window, self.chunk_size
        columns = self.sink_tokens + c + self.cache_slots + 2 * w + c
        spans, decisions = -(-tokens // c) + -(-tokens // w), -(-tokens // w)
        weights = self.shape.num_heads * tokens * columns
        return weights + 2 * spans * hk * d * columns + 4 * decisions * hk * d * (self.cache_slots + w)

    def code_bytes(self) -> int:
        """The bytes of the cache held as integer codes and their scales, which ``_cache_size`` counts at a quarter
        (float32 elements); 0 unless ``cache_dtype`` is coded."""
        if not self.cache_slots or self.cache_dtype == MODEL:
            return 0
        return coded_slot_bytes(self.shape.num_kv_heads, self.shape.head_dim, self.cache_slots, self.cache_dtype)

    @property
    def _pair_codes(self) -> PairCodes:
        return pair_codes(self.cache_dtype)

    def _cache_in(self, state: State) -> Cache:
        """The cache of a state as the forms carry it (codes dequantized to the window's dtype; a state that carries
        it dequantized, ``_cache_out`` under autograd, as it is)."""
        if self.cache_dtype == MODEL:
            return Cache(state["ck"], state["cv"], state["cmask"], state.get("cpos"))
        dtype = state["wk"].dtype
        key_scales, value_scales = (state[name].to(scale_dtype(dtype)) for name in ("cks", "cvs"))
        keys, values = state["ck"], state["cv"]
        if not keys.is_floating_point():
            codes = self._pair_codes
            keys = codes.keys.dequantize(keys, key_scales, dtype)
            values = codes.values.dequantize(values, value_scales, dtype)
        return Cache(keys, values, state["cmask"], state.get("cpos"), key_scales, value_scales)

    def _cache_out(self, cache: Cache, coded: bool = True) -> State:
        """The state's entries of the cache (its positions aside): keys, values (codes and scales when coded) and
        mask. While autograd records through the cache (a chunked training forward), or with ``coded=False``, coded
        keys and values stay as the queries read them, the same numbers as their codes give, so that their gradients
        reach the next chunk (and the next chunk need not decode them)."""
        if cache.key_scales is None:
            return {"ck": cache.keys, "cv": cache.values, "cmask": cache.mask}
        codes = self._pair_codes
        scales_and_mask = {"cks": codes.keys.stored_scales(cache.key_scales),
                           "cvs": codes.values.stored_scales(cache.value_scales), "cmask": cache.mask}
        if not coded or torch.is_grad_enabled() and (cache.keys.requires_grad or cache.values.requires_grad):
            return {"ck": cache.keys, "cv": cache.values, **scales_and_mask}
        return {"ck": codes.keys.codes_of(cache.keys, cache.key_scales),
                "cv": codes.values.codes_of(cache.values, cache.value_scales), **scales_and_mask}

    def _cache_out_names(self) -> tuple[str, ...]:
        """The state's entries ``_cache_out`` writes."""
        return ("ck", "cv", "cmask") if self.cache_dtype == MODEL else ("ck", "cv", "cks", "cvs", "cmask")

    def _init_cache(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        """The pending buffer (W slots) and the cache (G slots per KV head), empty; codes with their scales (as the
        format stores them) when ``cache_dtype`` is coded."""
        hk, d, w, slots = self.shape.num_kv_heads, self.shape.head_dim, self.window, self.cache_slots
        coded = None if self.cache_dtype == MODEL else self._pair_codes
        keys, values = (None, None) if coded is None else (coded.keys, coded.values)

        def slots_of(vectors: CodeFormat | None) -> torch.Tensor:
            if vectors is None:
                return torch.zeros(batch_size, hk, slots, d, device=device, dtype=dtype)
            return torch.zeros(batch_size, hk, slots, vectors.stored_dims(d), device=device, dtype=vectors.codes_dtype)

        state = {
            "pk": torch.zeros(batch_size, hk, w, d, device=device, dtype=dtype),
            "pv": torch.zeros(batch_size, hk, w, d, device=device, dtype=dtype),
            "pmask": torch.zeros(batch_size, w, dtype=torch.bool, device=device),
            "ck": slots_of(keys),
            "cv": slots_of(values),
            "cmask": torch.zeros(batch_size, slots, dtype=torch.bool, device=device),
        }
        if coded:
            for name, vectors in (("cks", keys), ("cvs", values)):
                scales = torch.zeros(batch_size, hk, slots, vectors.groups(d), device=device, dtype=scale_dtype(dtype))
                state[name] = vectors.stored_scales(scales)
        return state
