"""LoLCATs-style hybrid: softmax over the last ``window`` tokens plus a linear / taylor mixer over the rest.

Query t sees keys t-W+1..t (W = window, itself included) through softmax and keys <= t-W through the "far"
mixer; a key enters the far state when it leaves the window. Per query head, a learnable g = sigmoid(lambda)
(``mix_init`` is g at initialization) weighs the two parts. ``combine`` says how:

* ``shared`` (default, as in LoLCATs): one normalization over both parts,

      o_t = (g sum_win e^{s q.k} v + (1-g) num_far) / (g sum_win e^{s q.k} + (1-g) den_far),

  where num_far / den_far are the far mixer's un-normalized numerator and denominator. It is computed stably
  as a softmax over the window logits (+ log g) plus one extra entry with logit log((1-g) den_far) whose
  value is the far mixer's own average num_far / den_far. This is the rule that converts best from a
  pretrained softmax model: with a taylor far part the layer *is* softmax with exp replaced by T_N on far
  keys (exactly so at g = 1/2, where the common factor cancels), and with any far mixer the split of
  attention mass between near and far keys depends on the query, as in softmax (a query with one dominant
  local key ignores the far estimate). It needs a far mixer with a positive denominator: linear with
  normalize="denominator" and a non-negative feature map, or taylor with denominator="exact".
* ``sum``: o_t = g softmax_window_t + (1-g) far_t, each part normalized on its own (any far mixer, e.g. a
  taylor far part with an l2 norm). The split between near and far is then a fixed per-head constant.

A ``delta`` far part (DeltaNet, Gated DeltaNet, Comba, DeltaProduct, or one of their preset names) needs
``combine='sum'`` and reads every token as it arrives, the window's and the sinks' included: its gates and short
convolution belong to the token's own layer input, so it cannot take keys late, when they leave the window.

``sink_tokens`` N keeps the first N real tokens of each sequence visible to every later query as exact softmax
keys beside the window (StreamingLLM's attention sinks: pretrained softmax models park attention on the first
token, and a window without it loses much of their quality). Sink tokens never enter the far state. ``far``
may be ``"none"``: softmax over the window and the sinks only (what the conversion report calls
window-only).

The recurrent state holds the last W keys / values (with a mask of which are real tokens), the N sink keys /
values (with a mask of the filled slots) and the far mixer's state (keys prefixed "far."). Both parts read
the same rotary-embedded q and k (the hybrid spec's ``rope`` decides; the nested far spec's ``rope`` is
ignored), and the window logits use s = 1/sqrt(d).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, ungroup_output, writable
from .mixer_delta import DeltaMixer
from .mixer_linear import LinearMixer
from .mixer_taylor import TaylorMixer
from .ops_linear import linear_chunked, linear_parallel, linear_step
from .options import Option, check_open_unit

FAR_MIXERS = ("linear", "taylor", "delta")
COMBINE = ("shared", "sum")
#: linear feature maps whose features are never negative (so the linear denominator is >= 0)
NONNEGATIVE_MAPS = ("elu", "relu", "exp", "hedgehog", "taylor2")
FAR_PREFIX = "far."
NO_FAR = "none"


def _far_spec_problem(far: dict[str, Any], combine: str) -> str | None:
    """Why a validated far spec cannot serve as the far part, or None."""
    if far["mixer"] not in FAR_MIXERS:
        return f"must be a {' or '.join(FAR_MIXERS)} spec, got mixer {far['mixer']!r}"
    if not far["causal"]:
        return "the far mixer must be causal"
    if far["mixer"] == "linear" and far["decay"] != "none":
        return "a linear far mixer cannot decay (the window hands keys to the far state undecayed)"
    if far["mixer"] == "linear" and far["sink"]:
        return "a linear far mixer cannot have a sink (the hybrid combines the far state's sums itself)"
    if far["mixer"] == "delta" and combine != "sum":
        return "a delta far mixer needs combine='sum' (its output is normalized on its own)"
    if far["mixer"] == "taylor" and (far["order"] == "exp" or far["cache"] == "kv"):
        return "a taylor far mixer needs a finite order and a recurrent state (not order='exp' or cache='kv')"
    if combine == "shared":
        positive = (
            far["mixer"] == "linear"
            and far["normalize"] == "denominator"
            and far["feature_map"] in NONNEGATIVE_MAPS
        ) or (far["mixer"] == "taylor" and far["denominator"] == "exact")
        if not positive:
            return (
                "combine='shared' needs a far mixer with a positive denominator: linear with "
                f"normalize='denominator' and feature_map in {list(NONNEGATIVE_MAPS)}, or taylor with "
                "denominator='exact'; use combine='sum' otherwise"
            )
    return None


def _far_state(state: State) -> State:
    """The far mixer's part of a hybrid state, without the prefix."""
    return {name[len(FAR_PREFIX) :]: x for name, x in state.items() if name.startswith(FAR_PREFIX)}


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


class HybridMixer(Mixer):
    """Sliding-window softmax + a recurrent far mixer, mixed per head by a learnable weight."""

    name = "hybrid"
    options = {
        "window": Option((int,), 64, "softmax keys per query, the current token included", minimum=1),
        "far": Option(
            (dict, str),
            {"mixer": "linear", "feature_map": "hedgehog"},
            "spec of the far mixer: linear or taylor (tokens before the window), delta (every token), or 'none'",
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
    }
    state_kind = "window"

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        """A softmax window beside a recurrent far state; the window alone without one."""
        return "sliding_attention" if spec["far"] == NO_FAR else "hybrid_sliding"
    has_chunked = True

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        from .mixers import validate_spec  # the registry imports this module

        check_open_unit(spec, where, "mix_init")
        if spec["far"] == NO_FAR:
            return
        far = {"mixer": spec["far"]} if isinstance(spec["far"], str) else dict(spec["far"])
        far = validate_spec(far, f"{where}: option 'far'")
        problem = _far_spec_problem(far, spec["combine"])
        if problem is not None:
            raise ValueError(f"{where}: option 'far' {problem}")
        spec["far"] = far

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.window = int(spec["window"])
        self.combine = spec["combine"]
        self.chunk_size = int(spec["chunk_size"])
        self.scale = shape.head_dim**-0.5
        self.mix_init = float(spec["mix_init"])
        self.sink_tokens = int(spec["sink_tokens"])
        self.far: Mixer | None = None
        if spec["far"] != NO_FAR:
            far = dict(spec["far"])
            if far["mixer"] == "taylor":  # the far part must be recurrent: a budget overrun is an error here
                far["cache"] = "recurrent"
                self.far = TaylorMixer(far, shape, config)
            elif far["mixer"] == "delta":
                self.far = DeltaMixer(far, shape, config)
            else:
                self.far = LinearMixer(far, shape, config)
        self.mix_logit = nn.Parameter(torch.full((shape.num_heads,), self._logit_init()))

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The far mixer's (a delta far part reads the layer input through its own weights)."""
        return {} if self.far is None else self.far.input_weights()

    def _logit_init(self) -> float:
        return math.log(self.mix_init / (1.0 - self.mix_init))

    def init_parameters(self, init: Any) -> None:
        init.constant_(self.mix_logit, self._logit_init())

    # ----- the far part through one interface -----------------------------------------------------------
    def _far_terms(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State, form: str
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, State | None]:
        """The far part's (numerator, denominator, count, state) in q's dtype; its state keeps its own (float32
        in a half-precision model: only the terms read from it are cast)."""
        far = self.far
        if isinstance(far, TaylorMixer):
            num, den, cnt, state = far.terms(q, k, v, inputs, state, form)
            return _cast(num, q.dtype), _cast(den, q.dtype), _cast(cnt, q.dtype), state
        qf, kf = far.features(q, k, inputs)
        if form == "parallel":
            num, den = linear_parallel(qf, kf, v)
            return num, den, None, None
        if form == "step":
            S, z = state["S"], state["z"]
            num, den, S, z = linear_step(qf, kf, v, S, z, in_place=writable(S, z))
        else:
            num, den, S, z = linear_chunked(qf, kf, v, state["S"], state["z"], far.chunk_size)
        return num.to(q.dtype), den.to(q.dtype), None, {"S": S, "z": z}

    def _far_sums(
        self,
        q: torch.Tensor,
        leaving: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        inputs: MixerInputs,
        state: State,
        new_state: State,
        form: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, MixerInputs]:
        """The far part's (numerator, denominator, count) for queries q over its state plus the keys / values
        ``leaving`` the window (query j reads keys W+T indices <= j), and the inputs it read them with; its next
        state moves into ``new_state``."""
        old_k, old_v, old_real = leaving
        far_inputs = MixerInputs(
            hidden_states=inputs.hidden_states, padding_mask=old_real, past_length=inputs.past_length
        )
        num, den, cnt, far_state = self._far_terms(q, old_k, old_v, far_inputs, _far_state(state), form)
        if far_state is not None:
            new_state.update({FAR_PREFIX + name: x for name, x in far_state.items()})
        return num, den, cnt, far_inputs

    def _far_finish(
        self, num: torch.Tensor, den: torch.Tensor | None, cnt: torch.Tensor | None, inputs: MixerInputs
    ) -> torch.Tensor:
        if isinstance(self.far, TaylorMixer):
            return self.far.finish(num, den, cnt, inputs)
        return self.far.finish(num, den)

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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State, form: str
    ) -> tuple[torch.Tensor, State]:
        w, t = self.window, q.shape[2]
        new_real = inputs.token_mask
        if new_real is None:
            new_real = torch.ones(q.shape[0], t, dtype=torch.bool, device=q.device)
        new_real = new_real.bool()
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
            scores = torch.cat([sink_scores, scores], dim=-1)
            visible = torch.cat([sink_visible, visible], dim=-1)
            soft_values = torch.cat([sink_values, values], dim=2)
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.far is None:
            out = ungroup_output(torch.einsum("bhgts,bhse->bhgte", torch.softmax(scores, dim=-1), soft_values))
        else:
            leaving = (keys[:, :, :t], values[:, :, :t], real[:, :t])
            out = self._with_far(q, (k, v), leaving, scores, soft_values, inputs, state, new_state, form)
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
        scores[..., n:].masked_fill_(hidden[:, None, None, :], float("-inf"))
        new_state: State = {"wk": keys[:, :, n:], "wv": values[:, :, n:], "wmask": real}
        if n:
            new_state.update({"sk": keys[:, :, :n], "sv": values[:, :, :n], "smask": state["smask"]})
        if self.far is None:
            return ungroup_output((torch.softmax(scores, dim=-1) @ values)[:, :, :, None]), new_state
        leaving = (old_k[:, :, :1], old_v[:, :, :1], old_real[:, :1])
        if self.combine == "shared":
            return self._shared_one(q, leaving, scores, values, inputs, state, new_state), new_state
        scores = scores[..., None, :]  # [B, Hkv, G, 1, N + W]
        return self._with_far(q, (k, v), leaving, scores, values, inputs, state, new_state, "step"), new_state

    def _shared_one(
        self,
        q: torch.Tensor,
        leaving: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scores: torch.Tensor,
        values: torch.Tensor,
        inputs: MixerInputs,
        state: State,
        new_state: State,
    ) -> torch.Tensor:
        """combine='shared' for one token in fewer ops than ``_with_far``: the softmax is shifted by
        -log g, so the far entry's logit is log den_far - lambda (log((1-g)/g) = -lambda), and its weight divides
        into the far numerator (a far part with no mass, den_far <= 0, gets logit -inf and weight 0)."""
        num_f, den_f, _, _ = self._far_sums(q, leaving, inputs, state, new_state, "step")
        den = den_f[..., 0, None]  # [B, Hkv, G, 1]
        far_logit = den.clamp_min(0.0).log() - self.mix_logit.view(*den.shape[1:3], 1)
        p = torch.softmax(torch.cat([scores, far_logit], dim=-1), dim=-1)  # [B, Hkv, G, N + W + 1]
        near = (p[..., :-1] @ values)[:, :, :, None]  # [B, Hkv, G, 1, E]
        far_weight = p[..., -1:, None] / den[..., None].clamp_min(torch.finfo(den.dtype).tiny)
        return ungroup_output(torch.addcmul(near, far_weight, num_f))

    def _with_far(
        self,
        q: torch.Tensor,
        entering: tuple[torch.Tensor, torch.Tensor],
        leaving: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scores: torch.Tensor,
        soft_values: torch.Tensor,
        inputs: MixerInputs,
        state: State,
        new_state: State,
        form: str,
    ) -> torch.Tensor:
        """Combine the softmax part (``scores`` over ``soft_values``: sinks, then window) with the far part, which
        reads the T keys / values ``leaving`` the window (with their real-token mask), or, a delta far part, the T
        ``entering`` it; the far state moves into ``new_state``."""
        hk, g = self.shape.num_kv_heads, self.shape.groups
        if isinstance(self.far, DeltaMixer):  # every new token, as it arrives
            far_state = _far_state(state)
            return self._with_delta_far(q, *entering, scores, soft_values, inputs, far_state, new_state, form)
        num_f, den_f, cnt_f, far_inputs = self._far_sums(q, leaving, inputs, state, new_state, form)
        mix = self.mix_logit.view(hk, g, 1)  # against [B, Hkv, G, T]
        if self.combine == "shared":
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
        return self._sum(scores, soft_values, self._far_finish(num_f, den_f, cnt_f, far_inputs))

    def _sum(self, scores: torch.Tensor, soft_values: torch.Tensor, far_out: torch.Tensor) -> torch.Tensor:
        """combine='sum': g softmax(scores) soft_values + (1 - g) far_out, g per query head."""
        near = ungroup_output(torch.einsum("bhgts,bhse->bhgte", torch.softmax(scores, dim=-1), soft_values))
        share = torch.sigmoid(self.mix_logit)[:, None]  # [H, 1] against [B, T, H, E]
        return share * near + (1.0 - share) * far_out

    def _with_delta_far(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scores: torch.Tensor,
        soft_values: torch.Tensor,
        inputs: MixerInputs,
        far_state: State,
        new_state: State,
        form: str,
    ) -> torch.Tensor:
        far = self.far
        if form == "parallel":
            far_out = far.parallel(q, k, v, inputs)
        else:
            far_out, far_state = (far.step if form == "step" else far.chunked)(q, k, v, inputs, far_state)
            new_state.update({FAR_PREFIX + name: x for name, x in far_state.items()})
        return self._sum(scores, soft_values, far_out)

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        out, _ = self._block(q, k, v, inputs, self.init_state(q.shape[0], q.device, q.dtype), "parallel")
        return out

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        t = q.shape[2]
        outs = []
        for start in range(0, t, self.chunk_size):
            stop = min(start + self.chunk_size, t)
            mask = inputs.padding_mask
            sub = MixerInputs(
                hidden_states=inputs.hidden_states[:, start:stop],
                padding_mask=None if mask is None else mask[:, : mask.shape[1] - t + stop],
                past_length=inputs.past_length + start,
            )
            out, state = self._block(
                q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], sub, state, "chunked"
            )
            outs.append(out)
        return torch.cat(outs, dim=1), state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        if q.shape[2] == 1 and (not self.sink_tokens or self._sinks_settled(state)):
            return self._step_one(q, k, v, inputs, state)
        return self._block(q, k, v, inputs, state, "step")

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
        if self.far is not None:
            state.update(
                {FAR_PREFIX + name: x for name, x in self.far.init_state(batch_size, device, dtype).items()}
            )
        return state

    def state_size(self, context_length: int) -> int:
        kept = self.window + self.sink_tokens
        buffers = 2 * self.shape.num_kv_heads * self.shape.head_dim * kept + kept
        return buffers + (0 if self.far is None else self.far.state_size(context_length))
