"""The delta-rule family (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033): DeltaNet, Gated
DeltaNet, Comba and DeltaProduct in one mixer.

Per key head, a state S [D, E] is updated by ``rule`` (see ops_delta.py / delta_gates.py):

* ``delta``  (DeltaNet):        S_t = S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T
* ``gated``  (Gated DeltaNet):  S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T
* ``comba``  (Comba, eq. 18):   S_t = a_t S_{t-1} + b_t (v_t - S_{t-1} k_t) k_t^T

(written values x keys as in Su's text), and the query reads o_t = S_t q_t. Around the update: an optional short
causal convolution on q, k and v (its inputs cached in the state), an optional SiLU, an optional feature map on q
and k (those of linear attention, e.g. Hedgehog: the state then has the map's width), L2-normalized q and k, and
an optional output RMSNorm per head times a SiLU gate from the layer input. ``householder_steps`` n > 1 gives
DeltaProduct: n keys, values and b per token applied as n successive updates (the extra n - 1 keys and values are
projected from the layer input by the mixer; the first ones are the layer's k and v).

Query heads of a group read their key head's state (GQA). Padded tokens leave the state untouched (b = 0, no
decay, zeroed conv inputs). ``causal=False`` (rule ``delta`` only) lets every query read the final state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .delta_gates import RULES, DeltaGates
from .far_part import ARRIVING, FarPart
from .feature_maps import FEATURE_MAPS, FeatureMap
from .gated_parts import (
    QK_NORMS,
    GatedMixer,
    chunk_options,
    conv_options,
    convert_init_options,
    output_options,
    qk_norm,
)
from .mixer_base import MixerInputs, MixerShape, State, group_queries, state_dtype, writable
from .ops_delta import delta_chunked, delta_parallel, delta_step
from .options import Option
from .short_conv import ShortConvolution, conv_step, convolve_streams

CONV_STATES = ("conv_q", "conv_k", "conv_v")


class DeltaMixer(GatedMixer, FarPart):
    """Delta-rule state S per key head, updated by `rule`, read by the queries.

    Paper: DeltaNet (``rule="delta"``), Schlag, Irie & Schmidhuber, "Linear Transformers Are Secretly Fast
    Weight Programmers", arXiv:2102.11174, with the chunkwise (UT transform) training of Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", arXiv:2406.06484.

    Options from other papers:

    * ``rule="gated"`` (the default): Gated DeltaNet, Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
      Improving Mamba2 with Delta Rule", arXiv:2412.06464;
    * ``rule="comba"``: Hu et al., "Comba: Improving Bilinear RNNs with Closed-loop Control",
      arXiv:2506.02475;
    * ``householder_steps`` > 1: Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs via
      Householder Products", arXiv:2502.10297;
    * ``negative_eigenvalues``: Grazzi et al., "Unlocking State-Tracking in Linear RNNs Through Negative
      Eigenvalues", arXiv:2411.12537;
    * ``feature_map``: the maps of ``linear`` (e.g. Hedgehog, arXiv:2402.04347).

    The equations follow Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033.
    """

    name = "delta"
    options = {
        "rule": Option((str,), "gated", "state update: delta (DeltaNet), gated (Gated DeltaNet) or comba",
                       choices=RULES),
        "householder_steps": Option((int,), 1, "delta updates per token (> 1: DeltaProduct)", minimum=1),
        **conv_options("q, k and v"),
        "feature_map": Option((str,), "identity", "phi applied to q and k before their norm (as in linear)",
                              choices=FEATURE_MAPS),
        "qk_norm": Option((str,), "l2", "normalization of q and k", choices=QK_NORMS),
        "negative_eigenvalues": Option((bool,), False, "b in (0, 2) instead of (0, 1)"),
        **output_options(gate=True),
        "scale": Option((float,), None, "query scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        **convert_init_options("identity convolution, input-independent gates", "decay", "write strength b"),
        **chunk_options("q/k and output norms"),
        "causal": Option((bool,), True, "causal (decoder) or bidirectional (rule delta only)"),
    }
    state_kind = "recurrent"
    has_chunked = True
    #: as a hybrid's far part (far_part.py): every token as it arrives (its gates and convolution read the token's
    #: own layer input), its output normalized on its own (combine='sum'); FarPart's defaults run its forms
    far_reads = ARRIVING

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if not spec["causal"] and spec["rule"] != "delta":
            raise ValueError(
                f"{where}: option 'causal' must be True with rule {spec['rule']!r} (a decay gate has a direction)"
            )
        super().check_spec(spec, where)

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        h, hk, d, c = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.steps = int(spec["householder_steps"])
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        self.gates = DeltaGates(spec, shape, self.initializer_range)
        self.feature_map = FeatureMap(spec["feature_map"], shape)
        if self.steps > 1:  # the extra keys and values of DeltaProduct, read from the layer input
            self.extra_kv_weight = nn.Parameter(torch.zeros(2 * (self.steps - 1) * hk * d, c))
        size = int(spec["conv_size"])
        channels = {"conv_q": h * d, "conv_k": self.steps * hk * d, "conv_v": self.steps * hk * d}
        self.convs = nn.ModuleDict(
            {name: ShortConvolution(n, size, self.convert_init) for name, n in channels.items()} if size else {}
        )
        self.build_output()

    def init_parameters(self, init: Any) -> None:
        """Extra DeltaProduct keys / values and the output gate: N(0, initializer_range); with init=convert the
        extra keys / values start at zero (their updates are then no-ops)."""
        if self.steps > 1:
            if self.convert_init:
                init.zeros_(self.extra_kv_weight)
            else:
                init.normal_(self.extra_kv_weight, 0.0, self.initializer_range)
        self.init_output_gate(init, self.initializer_range)

    def input_weights(self) -> dict[str, nn.Parameter]:
        """DeltaProduct's extra keys / values and the output gate, both read from the layer input."""
        extra = {"extra_kv": self.extra_kv_weight} if self.steps > 1 else {}
        return {**extra, **self.output_input_weights()}

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, State]:
        """Convolved, activated, feature-mapped, normalized q [B, Hk, G, T, F], k [B, Hk, T*n, F], v [B, Hk, T*n, E],
        and the new convolution states."""
        b, h, t, d = q.shape
        hk, n = self.shape.num_kv_heads, self.steps
        streams = {
            "conv_q": q.transpose(1, 2).reshape(b, t, h * d),
            "conv_k": k.transpose(1, 2).reshape(b, t, hk * d),
            "conv_v": v.transpose(1, 2).reshape(b, t, hk * d),
        }
        if n > 1:
            extra_k, extra_v = inputs.linear("extra_kv", self.extra_kv_weight).chunk(2, dim=-1)
            streams["conv_k"] = torch.cat([streams["conv_k"], extra_k], dim=-1)
            streams["conv_v"] = torch.cat([streams["conv_v"], extra_v], dim=-1)
        streams, new_state = convolve_streams(streams, self.convs, state, inputs.token_mask, self.spec["activation"])
        q = group_queries(streams["conv_q"].view(b, t, h, d).transpose(1, 2), hk)
        k = streams["conv_k"].view(b, t, n, hk, d).permute(0, 3, 1, 2, 4).reshape(b, hk, t * n, d)
        v = streams["conv_v"].view(b, t, n, hk, d).permute(0, 3, 1, 2, 4).reshape(b, hk, t * n, d)
        q, k = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
        return self._norm(q) * self.scale, self._norm(k), v, new_state

    def _prepare_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, State]:
        """``_prepare`` for one token (T == 1): the three streams as one [B, channels] row, so that masking, the
        convolution, the activation and the q/k norm run once over all of them (the same arithmetic per element,
        about half the small ops per decode step)."""
        b, h, _, d = q.shape
        hk, n = self.shape.num_kv_heads, self.steps
        parts = [q.reshape(b, h * d), k.reshape(b, hk * d)]
        if n > 1:
            extra_k, extra_v = inputs.linear("extra_kv", self.extra_kv_weight).reshape(b, -1).chunk(2, dim=-1)
            parts += [extra_k, v.reshape(b, hk * d), extra_v]
        else:
            parts.append(v.reshape(b, hk * d))
        row = torch.cat(parts, dim=1)  # [B, (H + 2 n Hk) D]: q | n keys | n values
        mask = inputs.token_mask
        if mask is not None:  # padded tokens enter the convolution as zeros
            row = row * mask.to(row.dtype)
        new_state: State = {}
        if self.convs:  # the three convolutions as one over the stacked channels
            convs = [self.convs[name] for name in CONV_STATES]
            old = torch.cat([state[name] for name in CONV_STATES], dim=1)
            row, kept = conv_step(row, old, torch.cat([conv.weight for conv in convs]))
            if mask is not None:  # a padded step leaves the inputs kept
                kept = torch.where(mask[:, :, None], kept, old)
            start = 0
            for name, conv in zip(CONV_STATES, convs, strict=True):
                new_state[name] = kept[:, start : start + conv.channels]
                start += conv.channels
        if self.spec["activation"] == "silu":
            row = F.silu(row)
        split = (h + n * hk) * d
        v = row[:, split:].view(b, n, hk, d).transpose(1, 2).reshape(b, hk, n, d)
        if self.feature_map.kind != "identity":  # feature widths differ: q and k each on their own
            qg = self.feature_map(row[:, : h * d].view(b, hk, h // hk, 1, d), is_query=True)
            k = self.feature_map(row[:, h * d : split].view(b, n, hk, d).transpose(1, 2), is_query=False)
            return self._norm(qg) * self.scale, self._norm(k), v, new_state
        qk = self._norm(row[:, :split].view(b, h + n * hk, d))
        qg = (qk[:, :h] * self.scale).view(b, hk, h // hk, 1, d)
        k = qk[:, h:].view(b, n, hk, d).transpose(1, 2).reshape(b, hk, n, d)
        return qg, k, v, new_state

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return qk_norm(x, self.spec["qk_norm"], self.eps)

    def _coefficients(self, inputs: MixerInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_alpha, beta, erase) of the rule, each [B, Hk, T * n] (see delta_gates.py)."""
        return self.gates(inputs.hidden_states, inputs.token_mask)

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        qg, kd, vd, _ = self._prepare(q, k, v, inputs, None)
        o, final = delta_parallel(qg, kd, vd, *self._coefficients(inputs), None, self.steps)
        if not self.is_causal_mixer:  # every query reads the state of the whole sequence
            o = qg @ final.unsqueeze(2)
        return self.finish_output(o, inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("chunked")
        qg, kd, vd, new_state = self._prepare(q, k, v, inputs, state)
        coefficients = self._coefficients(inputs)
        o, new_state["S"] = delta_chunked(qg, kd, vd, *coefficients, state["S"], self.chunk_size, self.steps,
                                          rule=self.gates.rule)
        return self.finish_output(o, inputs), new_state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("step")
        qg, kd, vd, new_state = self._prepare_step(q, k, v, inputs, state)
        start = state["S"]
        o, new_state["S"] = delta_step(qg, kd, vd, *self._coefficients(inputs), start, in_place=writable(start),
                                       rule=self.gates.rule)
        return self.finish_output(o, inputs), new_state

    # ----- beside the hybrid's exact cache (cache_slots) ----------------------------------------------------------
    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        return None

    def far_recall_error(self, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        """||v - k^ S||, the residual the rule's update computes, with k^ and v made as ``_prepare`` makes them for
        one token alone (activation, feature map, key norm): a cached pair's neighbours in the short convolution
        and its layer input (the write strength b) are gone when it is re-scored, so neither enters."""
        S = state["S"]
        if self.spec["activation"] == "silu":
            k, v = F.silu(k), F.silu(v)
        keys = self._norm(self.feature_map(k, is_query=False)).to(S.dtype)
        return (v.to(S.dtype) - keys @ S).norm(dim=-1)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        width = self.feature_map.out_dim
        state = {"S": torch.zeros(batch_size, hk, width, d, device=device, dtype=state_dtype(dtype))}
        state.update({name: conv.init_state(batch_size, device, dtype) for name, conv in self.convs.items()})
        return state

    def state_size(self, context_length: int) -> int:
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        return hk * self.feature_map.out_dim * d + sum(conv.channels * (conv.size - 1) for conv in self.convs.values())
