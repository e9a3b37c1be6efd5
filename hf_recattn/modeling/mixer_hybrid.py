"""LoLCATs-style hybrid: softmax over the last ``window`` tokens plus a recurrent "far" mixer over the rest.

The far mixer is any family that declares the far-part protocol (far_part.py); the hybrid names none. Query t
sees keys t-W+1..t (W = window, itself included) through softmax and keys <= t-W through the far mixer; a key
enters the far state when it leaves the window (``far_reads = LEAVING``). Per query head, a learnable
g = sigmoid(lambda) (``mix_init`` is g at initialization) weighs the two parts. ``combine`` says how:

* ``shared`` (default, as in LoLCATs): one normalization over both parts,

      o_t = (g sum_win e^{s q.k} v + (1-g) num_far) / (g sum_win e^{s q.k} + (1-g) den_far),

  where num_far / den_far are the far mixer's un-normalized numerator and denominator. It is computed stably
  as a softmax over the window logits (+ log g) plus one extra entry with logit log((1-g) den_far) whose
  value is the far mixer's own average num_far / den_far. This is the rule that converts best from a
  pretrained softmax model: with a taylor far part the layer *is* softmax with exp replaced by T_N on far
  keys (exactly so at g = 1/2, where the common factor cancels), and with any far mixer the split of
  attention mass between near and far keys depends on the query, as in softmax (a query with one dominant
  local key ignores the far estimate). It needs a far mixer that declares ``far_shared`` and whose spec gives a
  positive denominator (e.g. linear with normalize="denominator" and a non-negative feature map, or taylor with
  denominator="exact"; its ``far_part_problem`` says).
* ``sum``: o_t = g softmax_window_t + (1-g) far_t, each part normalized on its own (any far mixer, e.g. a
  taylor far part with an l2 norm). The split between near and far is then a fixed per-head constant.

A far part that declares ``far_reads = ARRIVING`` (e.g. ``delta``: DeltaNet, Gated DeltaNet, Comba,
DeltaProduct, or one of their preset names) reads every token as it arrives, the window's and the sinks'
included: its gates and short convolution belong to the token's own layer input, so it cannot take keys late,
when they leave the window.

``sink_tokens`` N keeps the first N real tokens of each sequence visible to every later query as exact softmax
keys beside the window (StreamingLLM's attention sinks: pretrained softmax models park attention on the first
token, and a window without it loses much of their quality). Sink tokens never enter the far state. ``far``
may be ``"none"``: softmax over the window and the sinks only (what the conversion report calls
window-only).

``cache_slots`` G keeps, per KV head, G pairs as exact softmax keys (LoLA; by default those the far state recalls
worst): a real token leaving the window waits in a pending buffer (still a softmax key); when a row's buffer holds W
tokens, the cache and the buffer are scored (``cache_score``, cache_scores.py: by default the far part's
``far_recall_error``), the top G stay cached and the rest are evicted (into the far state, for a far part reading
leaving keys; dropped without a far part, which a score reading no far state allows: ``novelty``, ``learned``).
hybrid_cache.py keeps the books and hybrid_cached.py runs the forms with the cache on; docs/mixers.md gives the
rule and its timing. The state then also holds the pending buffer (W slots) and the cache (G slots).
``cache_score: learned`` adds a retention head (retention_head.py), trained during conversion on the teacher's
attention (training/retention_objective.py).

``distant_positions: clamp`` scores a sink or cache slot more than ``clamp_distance`` D tokens back (default: the
model's max_position_embeddings - 1) as if it sat exactly D back, so that no exact logit meets a RoPE angle the
teacher never saw and the layer runs past its context (key_distance.py); within D it is the ``absolute`` layer.

The recurrent state holds the last W keys / values (with a mask of which are real tokens), the N sink keys /
values (with a mask of the filled slots) and the far mixer's state (keys prefixed "far."). Both parts read
the same rotary-embedded q and k (the hybrid spec's ``rope`` decides; the nested far spec's ``rope`` is
ignored), and the window logits use s = 1/sqrt(d).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .cache_scores import CACHE_SCORES, reserving_newest
from .far_part import ARRIVING, FarTerms, serves_as_far_part
from .gated_parts import logit
from .hybrid_cached import (
    CACHE_OPTIONS,
    FAR_PREFIX,
    ExactCacheForms,
    FarForm,
    check_cache_fits,
    check_cache_spec,
    far_state,
    real_tokens,
    slice_inputs,
)
from .key_distance import ABSOLUTE, CLAMP, DISTANT_POSITIONS, KeyDistance, check_distance_spec, key_distance
from .mixer_base import KeyMap, Mixer, MixerInputs, MixerShape, State, group_queries, ungroup_output
from .options import Option, check_open_unit
from .registry import MIXERS, build_mixer, mixer_class, validate_spec
from .retention_head import RetentionHead

COMBINE = ("shared", "sum")
NO_FAR = "none"
RETENTION_PREFIX = "retention."


class FarRead(NamedTuple):
    """What the far part reads for one block: the queries, the keys / values ``entering`` the window and those
    ``leaving`` it (with their real-token mask), the block's inputs, the state before the block, the next state
    (the far part's moves into it) and the form that runs the far part."""

    q: torch.Tensor
    entering: tuple[torch.Tensor, torch.Tensor]
    leaving: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    inputs: MixerInputs
    state: State
    new_state: State
    form: FarForm


def _far_spec_problem(far: dict[str, Any], combine: str) -> str | None:
    """Why a validated far spec cannot serve as the far part, or None: the family's protocol decides."""
    family = MIXERS[far["mixer"]]
    if not serves_as_far_part(family):
        names = [name for name, cls in MIXERS.items() if serves_as_far_part(cls)]
        return f"must be a {' or '.join(names)} spec, got mixer {far['mixer']!r}"
    if not far.get("causal", True):
        return "the far mixer must be causal"
    if combine == "shared" and not family.far_shared:
        return f"a {family.name} far mixer needs combine='sum' (its output is normalized on its own)"
    return family.far_part_problem(far, combine)


def _window_key(key: str) -> str | None:
    """window-only: the far part's and the retention head's keys have no place (the cache goes with the far part);
    the hybrid's own (``mix_logit``, kept by a window with sinks, which never reads it) keep their names."""
    return None if key.startswith((FAR_PREFIX, RETENTION_PREFIX)) else key


def _far_key(key: str) -> str | None:
    """far-only: the far part's keys without the prefix; the mixing weights have no place."""
    return key[len(FAR_PREFIX) :] if key.startswith(FAR_PREFIX) else None


class HybridMixer(ExactCacheForms, Mixer):
    """Sliding-window softmax + a recurrent far mixer, mixed per head by a learnable weight.

    Paper: LoLCATs, Zhang et al., "LoLCATs: On Low-Rank Linearizing of Large Language Models",
    arXiv:2410.10254 (the window + linear-attention layer and ``combine="shared"``).

    Options from other papers:

    * ``sink_tokens``: the attention sinks of StreamingLLM, Xiao et al., "Efficient Streaming Language Models
      with Attention Sinks", arXiv:2309.17453;
    * ``far``: any family declaring the far-part protocol; each names its own paper;
    * ``cache_slots``: the sparse cache of LoLA, McDermott et al., "LoLA: Low-Rank Linear Attention With Sparse
      Caching", arXiv:2505.23666;
    * ``cache_score: learned``: the retaining heads of Locret, Huang et al., "Locret: Enhancing Eviction in
      Long-Context LLM Inference with Trained Retaining Heads", arXiv:2410.01805.
    """

    name = "hybrid"
    options = {
        "window": Option((int,), 64, "softmax keys per query, the current token included", minimum=1),
        "far": Option(
            (dict, str),
            {"mixer": "linear", "feature_map": "hedgehog"},
            "spec of the far mixer: a family that declares the far-part protocol (modeling/far_part.py), or 'none'",
        ),
        "sink_tokens": Option(
            (int,), 0, "the first N real tokens stay visible to every query as softmax keys", minimum=0
        ),
        "combine": Option(
            (str,),
            "shared",
            "one shared normalization, or a weighted sum of normalized parts",
            choices=COMBINE,
        ),
        "mix_init": Option((float,), 0.5, "initial window weight g = sigmoid(lambda), in (0, 1)"),
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        **CACHE_OPTIONS,
        "distant_positions": Option(
            (str,), ABSOLUTE, "sinks and cache slots farther back than 'clamp_distance': scored at their own RoPE "
            "distance ('absolute') or as if at that distance ('clamp': the layer then runs past the teacher's "
            "context; modeling/key_distance.py)", choices=DISTANT_POSITIONS,
        ),
        "clamp_distance": Option(
            (int,), None, "D of distant_positions='clamp' (None: max_position_embeddings - 1)", minimum=1,
            nullable=True,
        ),
    }
    state_kind = "window"
    #: the sinks and the exact cache keep keys at any distance back (mixer_base.position_need)
    distant_key_options = ("sink_tokens", "cache_slots")

    @classmethod
    def position_need(cls, spec: dict[str, Any]) -> str | None:
        """None with ``distant_positions: clamp`` (no exact key is compared farther back than D): the window's
        reach is bounded."""
        return None if spec.get("distant_positions") == CLAMP else super().position_need(spec)

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        """A softmax window beside a recurrent far state; the window alone without one."""
        return "sliding_attention" if spec["far"] == NO_FAR else "hybrid_sliding"
    has_chunked = True

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        check_open_unit(spec, where, "mix_init")
        check_distance_spec(spec, where)
        check_cache_spec(spec, where, has_far=spec["far"] != NO_FAR)
        if spec["far"] == NO_FAR:
            return
        far = {"mixer": spec["far"]} if isinstance(spec["far"], str) else dict(spec["far"])
        far = validate_spec(far, f"{where}: option 'far'")
        problem = _far_spec_problem(far, spec["combine"])
        if problem is not None:
            raise ValueError(f"{where}: option 'far' {problem}")
        reads_far = CACHE_SCORES[spec["cache_score"]].reads_far
        problem = MIXERS[far["mixer"]].far_recall_problem(far) if spec["cache_slots"] and reads_far else None
        if problem is not None:
            raise ValueError(f"{where}: option 'cache_slots' {problem}")
        spec["far"] = far

    @classmethod
    def variants(cls, spec: dict[str, Any]) -> dict[str, tuple[dict[str, Any], KeyMap]]:
        """window-only: softmax over the window (and the sinks: then a hybrid without far part); far-only: the
        far mixer alone. None without a far part."""
        if spec["far"] == NO_FAR:
            return {}
        window: dict[str, Any] = {"mixer": "sliding_window", "window": int(spec["window"])}
        if spec["sink_tokens"]:
            window = {"mixer": cls.name, "window": int(spec["window"]), "far": NO_FAR,
                      "sink_tokens": int(spec["sink_tokens"])}
            if spec["distant_positions"] != ABSOLUTE:
                window.update({k: spec[k] for k in ("distant_positions", "clamp_distance")})
        return {"window-only": (window, _window_key), "far-only": (dict(spec["far"]), _far_key)}

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.window = int(spec["window"])
        self.combine = spec["combine"]
        self.chunk_size = int(spec["chunk_size"])
        self.scale = shape.head_dim**-0.5
        self.mix_init = float(spec["mix_init"])
        self.sink_tokens = int(spec["sink_tokens"])
        self.cache_slots = int(spec["cache_slots"])
        self.cache_dtype = spec["cache_dtype"]
        check_cache_fits(spec, shape, config)
        chosen = CACHE_SCORES[spec["cache_score"]]
        self.cache_score = reserving_newest(chosen.score, int(spec["cache_recent"]))  # cache_scores.py
        # the learned score's parameters (retention_head.py); only with the cache on, which is what they score
        self.retention = RetentionHead(shape) if chosen.learned and self.cache_slots else None
        #: the clamp of distant sinks and cache slots (key_distance.py), None for distant_positions='absolute'
        self.distance: KeyDistance | None = key_distance(spec, shape, config)
        self.far: Mixer | None = None
        if spec["far"] != NO_FAR:
            family = mixer_class(spec["far"]["mixer"], f"layer {shape.layer_idx}: option 'far'")
            self.far = build_mixer(family.far_part_spec(dict(spec["far"])), shape, config)
        self.mix_logit = nn.Parameter(torch.full((shape.num_heads,), logit(self.mix_init)))

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The far mixer's (a far part may read the layer input through weights of its own)."""
        return {} if self.far is None else self.far.input_weights()

    def init_parameters(self, init: Any) -> None:
        init.constant_(self.mix_logit, logit(self.mix_init))

    # ----- the far part, through the protocol of far_part.py -------------------------------------------------
    def _far_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, None]:
        return self.far.far_parallel(q, k, v, inputs), None

    def _far_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        return self.far.far_chunked(q, k, v, inputs, state)

    def _far_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        return self.far.far_step(q, k, v, inputs, state)

    def _far_terms(self, read: FarRead) -> tuple[FarTerms, MixerInputs]:
        """The far part's terms for the queries over the tokens it reads, and the inputs it read them with: the T
        keys / values ``entering`` the window (a far part that reads every token as it arrives) or the T
        ``leaving`` it (with their real-token mask). Its next state moves into ``read.new_state``."""
        inputs = read.inputs
        if self.far.far_reads == ARRIVING:
            (k, v), far_inputs = read.entering, inputs
        else:
            k, v, real = read.leaving
            far_inputs = MixerInputs(
                hidden_states=inputs.hidden_states, padding_mask=real, past_length=inputs.past_length
            )
        terms, after = read.form(read.q, k, v, far_inputs, far_state(read.state))
        if after is not None:
            read.new_state.update({FAR_PREFIX + name: x for name, x in after.items()})
        return terms, far_inputs

    # ----- one block of new tokens against the sinks, the window buffer and the far state --------------------
    def _sinks(
        self, k: torch.Tensor, v: torch.Tensor, new_real: torch.Tensor, state: State
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, State]:
        """Sink candidates (the kept sinks, then this block's tokens), which of the new tokens are sinks,
        the visibility [B, 1, 1, T, N + T] of the candidates, and the sink part of the next state."""
        n, t = self.sink_tokens, k.shape[2]
        kept = state["smask"]  # [B, N] filled slots
        rank = kept.sum(1, keepdim=True) + new_real.long().cumsum(1) - 1  # rank among the real tokens so far
        new_sink = new_real & (rank < n)
        keys = torch.cat([state["sk"], k], dim=2)
        values = torch.cat([state["sv"], v], dim=2)
        causal = torch.ones(t, t, dtype=torch.bool, device=k.device).tril()
        visible = torch.cat(
            [kept[:, None, :].expand(-1, t, -1), new_sink[:, None, :] & causal[None]], dim=2
        )[:, None, None]
        candidates = torch.cat([kept, new_sink], dim=1)
        order = torch.argsort((~candidates).to(torch.int8), dim=1, stable=True)[:, :n]  # filled slots first
        gather = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        sink_state = {
            "sk": keys.gather(2, gather),
            "sv": values.gather(2, gather),
            "smask": candidates.gather(1, order),
        }
        return keys, values, new_sink, visible, sink_state

    def _block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State, far_form: FarForm,
        coded: bool = True,
    ) -> tuple[torch.Tensor, State]:
        w, t = self.window, q.shape[2]
        if self.cache_slots:
            return self._cached_block(q, k, v, inputs, state, far_form, coded)
        new_real = real_tokens(inputs, q)
        new_state: State = {}
        qg = group_queries(q, self.shape.num_kv_heads)
        if self.sink_tokens:
            sink_keys, sink_values, new_sink, sink_visible, sink_state = self._sinks(k, v, new_real, state)
            new_state.update(sink_state)
            new_real = new_real & ~new_sink  # sinks take no part in the window or the far state
        keys = torch.cat([state["wk"], k], dim=2)  # [B, Hkv, W+T, D]: the last W old keys, then the new ones
        values = torch.cat([state["wv"], v], dim=2)
        real = torch.cat([state["wmask"], new_real], dim=1)  # [B, W+T]

        # softmax part: query j sees window indices j+1 .. j+W (itself is j+W; a padded query sees itself so
        # that no row is empty, a sink query sees itself as a sink), then the sinks before the window keys
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg, keys) * self.scale
        rel = torch.arange(w + t, device=q.device)[None, :] - torch.arange(t, device=q.device)[:, None]
        itself = rel == w
        if self.sink_tokens:
            itself = itself & ~new_sink[:, None, None, :, None]
        visible = (((rel >= 1) & (rel <= w)) & real[:, None, None, None, :]) | itself
        soft_values = values
        if self.sink_tokens:
            sink_scores = torch.einsum("bhgtd,bhsd->bhgts", qg, sink_keys) * self.scale
            if self.distance is not None:
                sink_scores = self.distance.sinks(sink_scores, qg, sink_keys, inputs, self.sink_tokens, self.scale)
            scores = torch.cat([sink_scores, scores], dim=-1)
            visible = torch.cat([sink_visible, visible], dim=-1)
            soft_values = torch.cat([sink_values, values], dim=2)
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.far is None:
            out = ungroup_output(torch.einsum("bhgts,bhse->bhgte", torch.softmax(scores, dim=-1), soft_values))
        else:
            leaving = (keys[:, :, :t], values[:, :, :t], real[:, :t])
            read = FarRead(q, (k, v), leaving, inputs, state, new_state, far_form)
            out = self._with_far(read, scores, soft_values)
        new_state.update({"wk": keys[:, :, -w:], "wv": values[:, :, -w:], "wmask": real[:, -w:]})
        return out, new_state

    def _sinks_settled(self, state: State) -> bool:
        """Every sink slot filled, so a new token cannot become a sink (checked on the CPU only: on an
        accelerator the check would wait for the device once per layer and token)."""
        mask = state["smask"]
        return mask.device.type == "cpu" and bool(mask.all())

    def _step_one(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        """``_block`` for one token once the sinks are settled, in fewer ops: the sinks, the window's last W - 1
        keys and the new one are concatenated once into one buffer, whose slices are the next state (settled
        sinks are all visible, so only window slots are masked); the oldest key goes to the far part."""
        b, n = q.shape[0], self.sink_tokens
        hk, g = self.shape.num_kv_heads, self.shape.groups
        mask = inputs.token_mask
        new_real = torch.ones(b, 1, dtype=torch.bool, device=q.device) if mask is None else mask.bool()
        old_k, old_v, old_real = state["wk"], state["wv"], state["wmask"]
        sink_k, sink_v = ([state["sk"]], [state["sv"]]) if n else ([], [])
        keys = torch.cat([*sink_k, old_k[:, :, 1:], k], dim=2)  # [B, Hkv, N + W, D]
        values = torch.cat([*sink_v, old_v[:, :, 1:], v], dim=2)
        real = torch.cat([old_real[:, 1:], new_real], dim=1)  # [B, W]
        hidden = ~real
        if mask is not None:
            hidden[:, -1] = False  # a padded query sees itself, so that no row is empty
        q1 = q.view(b, hk, g, q.shape[-1])  # one token: [B, Hkv, G, D] against [B, Hkv, N + W, D]
        scores = (q1 @ keys.transpose(-1, -2)).mul_(self.scale)  # [B, Hkv, G, N + W]
        if self.distance is not None and n:  # settled sinks only: the new token is no candidate
            one = self.distance.sinks(scores[..., None, :], q1[..., None, :], keys, inputs, n, self.scale, False)
            scores = one[..., 0, :]
        scores[..., n:].masked_fill_(hidden[:, None, None, :], float("-inf"))
        new_state: State = {"wk": keys[:, :, n:], "wv": values[:, :, n:], "wmask": real}
        if n:
            new_state.update({"sk": keys[:, :, :n], "sv": values[:, :, :n], "smask": state["smask"]})
        if self.far is None:
            return ungroup_output((torch.softmax(scores, dim=-1) @ values)[:, :, :, None]), new_state
        leaving = (old_k[:, :, :1], old_v[:, :, :1], old_real[:, :1])
        read = FarRead(q, (k, v), leaving, inputs, state, new_state, self._far_step)
        if self.combine == "shared":
            return self._shared_one(read, scores, values), new_state
        scores = scores[..., None, :]  # [B, Hkv, G, 1, N + W]
        return self._with_far(read, scores, values), new_state

    def _shared_one(self, read: FarRead, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """combine='shared' for one token in fewer ops than ``_with_far``: the softmax is shifted by
        -log g, so the far entry's logit is log den_far - lambda (log((1-g)/g) = -lambda), and its weight divides
        into the far numerator (a far part with no mass, den_far <= 0, gets logit -inf and weight 0)."""
        (num_f, den_f, _), _ = self._far_terms(read)
        den = den_f[..., 0, None]  # [B, Hkv, G, 1]
        far_logit = den.clamp_min(0.0).log() - self.mix_logit.view(*den.shape[1:3], 1)
        p = torch.softmax(torch.cat([scores, far_logit], dim=-1), dim=-1)  # [B, Hkv, G, N + W + 1]
        near = (p[..., :-1] @ values)[:, :, :, None]  # [B, Hkv, G, 1, E]
        far_weight = p[..., -1:, None] / den[..., None].clamp_min(torch.finfo(den.dtype).tiny)
        return ungroup_output(torch.addcmul(near, far_weight, num_f))

    def _with_far(self, read: FarRead, scores: torch.Tensor, soft_values: torch.Tensor) -> torch.Tensor:
        """Combine the softmax part (``scores`` over ``soft_values``: sinks, then window) with the far part (see
        ``_far_terms``); the far state moves into ``read.new_state``."""
        terms, far_inputs = self._far_terms(read)
        return self._combine(terms, far_inputs, scores, soft_values)

    def _combine(
        self, terms: FarTerms, far_inputs: MixerInputs, scores: torch.Tensor, soft_values: torch.Tensor
    ) -> torch.Tensor:
        """The softmax part (``scores`` over ``soft_values``) and the far part's ``terms`` by ``combine``."""
        hk, g = self.shape.num_kv_heads, self.shape.groups
        mix = self.mix_logit.view(hk, g, 1)  # against [B, Hkv, G, T]
        if self.combine == "shared":
            num_f, den_f = terms.num, terms.den
            has_far = den_f > 0
            log_den = torch.where(
                has_far,
                torch.log(den_f.clamp_min(torch.finfo(den_f.dtype).tiny)),
                torch.full_like(den_f, float("-inf")),
            )
            far_avg = num_f / torch.where(has_far, den_f, torch.ones_like(den_f))[..., None]
            logits = torch.cat(
                [scores + F.logsigmoid(mix)[..., None], (F.logsigmoid(-mix) + log_den)[..., None]], dim=-1
            )
            p = torch.softmax(logits, dim=-1)
            out = torch.einsum("bhgts,bhse->bhgte", p[..., :-1], soft_values) + p[..., -1:] * far_avg
            return ungroup_output(out)
        return self._sum(scores, soft_values, self.far.far_output(terms, far_inputs))

    def _sum(self, scores: torch.Tensor, soft_values: torch.Tensor, far_out: torch.Tensor) -> torch.Tensor:
        """combine='sum': g softmax(scores) soft_values + (1 - g) far_out, g per query head."""
        near = ungroup_output(torch.einsum("bhgts,bhse->bhgte", torch.softmax(scores, dim=-1), soft_values))
        share = torch.sigmoid(self.mix_logit)[:, None]  # [H, 1] against [B, T, H, E]
        return share * near + (1.0 - share) * far_out

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        # with the cache an arriving far part runs chunked: each decision scores against its state at that token
        form = self._far_chunked if self.cache_slots else self._far_parallel
        out, _ = self._block(q, k, v, inputs, self.init_state(q.shape[0], q.device, q.dtype), form, coded=False)
        return out

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        t = q.shape[2]
        outs = []
        for start in range(0, t, self.chunk_size):
            stop = min(start + self.chunk_size, t)
            sub = slice_inputs(inputs, start, stop)
            out, state = self._block(  # a coded cache coded once, after the last chunk
                q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], sub, state, self._far_chunked, stop == t
            )
            outs.append(out)
        return torch.cat(outs, dim=1), state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        if q.shape[2] == 1 and (not self.sink_tokens or self._sinks_settled(state)):
            one = self._cached_step_one if self.cache_slots else self._step_one
            return one(q, k, v, inputs, state)
        return self._block(q, k, v, inputs, state, self._far_step)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        shape = (batch_size, self.shape.num_kv_heads, self.window, self.shape.head_dim)
        state = {
            "wk": torch.zeros(shape, device=device, dtype=dtype),
            "wv": torch.zeros(shape, device=device, dtype=dtype),
            "wmask": torch.zeros(batch_size, self.window, dtype=torch.bool, device=device),
        }
        if self.sink_tokens:
            sinks = (batch_size, self.shape.num_kv_heads, self.sink_tokens, self.shape.head_dim)
            state["sk"] = torch.zeros(sinks, device=device, dtype=dtype)
            state["sv"] = torch.zeros(sinks, device=device, dtype=dtype)
            state["smask"] = torch.zeros(batch_size, self.sink_tokens, dtype=torch.bool, device=device)
        if self.cache_slots:
            state.update(self._init_cache(batch_size, device, dtype))
            if self.distance is not None:
                state.update(KeyDistance.init_positions(batch_size, self.window, self.shape.num_kv_heads,
                                                        self.cache_slots, device))
        if self.far is not None:
            state.update(
                {FAR_PREFIX + name: x for name, x in self.far.init_state(batch_size, device, dtype).items()}
            )
        return state

    def state_size(self, context_length: int) -> int:
        """Window, sinks, pending buffer and cache (keys, values and masks) and the far state: fixed."""
        kept = self.window + self.sink_tokens
        buffers = 2 * self.shape.num_kv_heads * self.shape.head_dim * kept + kept + self._cache_size()
        return buffers + (0 if self.far is None else self.far.state_size(context_length))
