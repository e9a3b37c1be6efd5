"""Kimi Delta Attention (KDA) as a mixer: the gated delta rule with a decay per key channel (Kimi Team, "Kimi
Linear: An Expressive, Efficient Attention Architecture", arXiv:2510.26692; fla's ``naive_recurrent_kda`` is the
reference recurrence).

Per key head a state S [F, E] (keys x values; F = the feature map's width, the head dim without one):

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T q_t

* q, k, v are the layer's projections (RoPE applied unless ``rope: false``), through an optional short causal
  convolution (``conv_size`` taps, its inputs cached in the state), an optional SiLU (``activation``), an optional
  feature map (those of ``linear``) and L2-normalized (``qk_norm``); q times ``scale``;
* decay per key channel a_t = exp(-exp(A_log_h) softplus(W_up W_down x_t + dt_bias)), from the layer input x through
  a low-rank map (W_down [r, C], W_up [Hk F, r], rank r = ``decay_rank``, the head dim by default as in Kimi Linear),
  dt_bias [Hk F] per channel and A_log [Hk] per key head;
* write strength b_t = sigmoid(W_b x_t / sqrt(C) + c_b), one per key head (read from x / sqrt(C), as the delta
  family's gates: one optimizer step on W_b cannot swing it across its range);
* the output of each query head goes through an RMSNorm (``output_norm``) times sigmoid(W_g x_t) (``output_gate``,
  full rank here; Kimi Linear's gate is low rank).

Query heads of a group read their key head's state (GQA). A padded token leaves the state untouched (b = 0, no decay,
zeroed convolution inputs). ``causal=False`` is refused (a decayed state has a direction). As a ``hybrid``'s far part
it reads every token as it arrives and needs ``combine='sum'``.

Initializations (``init``):

* ``scratch``, Kimi Linear's (fla's KDA layer): A ~ U(1, 16) per key head, dt log-uniform in [1e-3, 0.1] per key
  channel with dt_bias = softplus^-1(dt), W_down, W_up and W_g ~ N(0, initializer_range), W_b such that its logits of
  x are N(0, initializer_range) per channel, c_b = 0; convolutions as torch's Conv1d;
* ``convert``, for distilling a softmax teacher: identity convolutions, W_up = 0 (the decay starts input-independent;
  W_down ~ N(0, initializer_range) so that it can learn), A = 1, dt_bias such that the F channels of every key head
  have half-lives spread log-uniformly from ``half_life_min`` to ``half_life_max`` tokens, W_b = 0 and c_b such that
  b = ``beta_init``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .delta_gates import half_life_dt_bias
from .far_part import ARRIVING, FarPart
from .feature_maps import FEATURE_MAPS, FeatureMap
from .gated_parts import (
    QK_NORMS,
    GatedMixer,
    chunk_options,
    conv_options,
    convert_init_options,
    head_gate_logits,
    logit,
    output_options,
    qk_norm,
)
from .mixer_base import MixerInputs, MixerShape, State, group_queries, state_dtype, writable
from .ops_kda import kda_chunked, kda_parallel, kda_step
from .options import Option
from .short_conv import ShortConvolution, convolve_streams


class KdaMixer(GatedMixer, FarPart):
    """Kimi Delta Attention: a gated delta-rule state per key head, decayed per key channel by a low-rank gate.

    Paper: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", arXiv:2510.26692; the delta rule
    with a scalar gate it refines is Gated DeltaNet, Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving
    Mamba2 with Delta Rule", arXiv:2412.06464.
    """

    name = "kda"
    options = {
        "decay_rank": Option((int,), None, "rank r of the decay's map W_up W_down x; None: head_dim (Kimi Linear)",
                             nullable=True, minimum=1),
        **conv_options("q, k and v"),
        "feature_map": Option((str,), "identity", "phi applied to q and k before their norm (as in linear)",
                              choices=FEATURE_MAPS),
        "qk_norm": Option((str,), "l2", "normalization of q and k", choices=QK_NORMS),
        **output_options(gate=True, activation="sigmoid"),
        "scale": Option((float,), None, "query scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        **convert_init_options("identity convolution, input-independent decay and write strength", "decay",
                               "write strength b"),
        **chunk_options("q/k and output norms"),
        "causal": Option((bool,), True, "must be True: a decayed state has no bidirectional form"),
    }
    state_kind = "recurrent"
    has_chunked = True
    causal_only = "for kda (a decayed state has a direction; there is no bidirectional form)"
    gate_activation = "sigmoid"
    #: as a hybrid's far part (far_part.py): every token as it arrives (its gates and convolution read the token's
    #: own layer input), its output normalized on its own (combine='sum'); FarPart's defaults run its forms
    far_reads = ARRIVING

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        h, hk, d, c = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        self.feature_map = FeatureMap(spec["feature_map"], shape)
        width = self.feature_map.out_dim
        rank = d if spec["decay_rank"] is None else int(spec["decay_rank"])
        # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
        self.decay_down = nn.Parameter(torch.zeros(rank, c))
        self.decay_up = nn.Parameter(torch.zeros(hk * width, rank))
        self.dt_bias = nn.Parameter(torch.zeros(hk * width))
        self.A_log = nn.Parameter(torch.zeros(hk))
        self.beta_weight = nn.Parameter(torch.zeros(hk, c))
        self.beta_bias = nn.Parameter(torch.zeros(hk))
        size = int(spec["conv_size"])
        channels = {"conv_q": h * d, "conv_k": hk * d, "conv_v": hk * d}
        self.convs = nn.ModuleDict(
            {name: ShortConvolution(n, size, self.convert_init) for name, n in channels.items()} if size else {}
        )
        self.build_output()

    def init_parameters(self, init: Any) -> None:
        """See the module docstring (``init`` skips loaded parameters)."""
        hk, std = self.shape.num_kv_heads, self.initializer_range
        width = self.feature_map.out_dim
        init.normal_(self.decay_down, 0.0, std)
        self.init_output_gate(init, std)
        if self.convert_init:
            init.zeros_(self.decay_up)
            init.zeros_(self.A_log)
            lives = (float(self.spec["half_life_min"]), float(self.spec["half_life_max"]))
            init.copy_(self.dt_bias, half_life_dt_bias(width, *lives).repeat(hk).to(self.dt_bias))
            init.zeros_(self.beta_weight)
            init.constant_(self.beta_bias, logit(float(self.spec["beta_init"])))
            return
        init.normal_(self.decay_up, 0.0, std)
        device = self.A_log.device
        init.copy_(self.A_log, torch.empty(hk, device=device).uniform_(1.0, 16.0).log())
        dt = torch.empty(hk * width, device=device).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        init.normal_(self.beta_weight, 0.0, std * math.sqrt(self.beta_weight.shape[1]))  # logits of x / sqrt(C)
        init.zeros_(self.beta_bias)

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The decay's down projection, the write strength's weights and the output gate, read from the layer
        input."""
        return {"decay_down": self.decay_down, "beta": self.beta_weight, **self.output_input_weights()}

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, ...]:
        """Convolved, activated, feature-mapped, normalized q [B, Hk, G, T, F] and k [B, Hk, T, F], v [B, Hk, T, E],
        the log decays [B, Hk, T, F], the write strengths [B, Hk, T] (padded tokens: no decay, no write) and the new
        convolution states."""
        b, h, t, d = q.shape
        hk = self.shape.num_kv_heads
        streams = {
            "conv_q": q.transpose(1, 2).reshape(b, t, h * d),
            "conv_k": k.transpose(1, 2).reshape(b, t, hk * d),
            "conv_v": v.transpose(1, 2).reshape(b, t, hk * d),
        }
        streams, new_state = convolve_streams(streams, self.convs, state, inputs.token_mask, self.spec["activation"])
        q = group_queries(streams["conv_q"].view(b, t, h, d).transpose(1, 2), hk)
        k = streams["conv_k"].view(b, t, hk, d).transpose(1, 2)
        v = streams["conv_v"].view(b, t, hk, d).transpose(1, 2)
        q, k = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
        q = qk_norm(q, self.spec["qk_norm"], self.eps) * self.scale
        k = qk_norm(k, self.spec["qk_norm"], self.eps)
        return q, k, v, *self._gates(inputs), new_state

    def _gates(self, inputs: MixerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """log a [B, Hk, T, F] and b [B, Hk, T] from the layer input; zero on padded tokens."""
        x = inputs.hidden_states
        b, t, c = x.shape
        hk = self.shape.num_kv_heads
        low = inputs.linear("decay_down", self.decay_down)
        dt = F.softplus(head_gate_logits(low, self.decay_up, self.dt_bias)).view(b, t, hk, -1)
        log_a = (dt * -self.A_log.to(dt.dtype).exp()[:, None]).transpose(1, 2)
        beta = torch.sigmoid(inputs.linear("beta", self.beta_weight) * c**-0.5 + self.beta_bias.to(x.dtype))
        beta = beta.transpose(1, 2)
        mask = inputs.token_mask
        if mask is not None:
            keep = mask[:, None, :].to(beta.dtype)
            log_a, beta = log_a * keep[..., None], beta * keep
        return log_a, beta

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        qg, kd, vd, log_a, beta, _ = self._prepare(q, k, v, inputs, None)
        return self.finish_output(kda_parallel(qg, kd, vd, log_a, beta)[0], inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, kd, vd, log_a, beta, new_state = self._prepare(q, k, v, inputs, state)
        o, new_state["S"] = kda_chunked(qg, kd, vd, log_a, beta, state["S"], self.chunk_size)
        return self.finish_output(o, inputs), new_state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, kd, vd, log_a, beta, new_state = self._prepare(q, k, v, inputs, state)
        start = state["S"]
        o, new_state["S"] = kda_step(qg, kd, vd, log_a, beta, start, in_place=writable(start))
        return self.finish_output(o, inputs), new_state

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        """S [B, Hk, F, E] (float32 in a half-precision model) and the convolutions' last inputs."""
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        state = {"S": torch.zeros(batch_size, hk, self.feature_map.out_dim, d, device=device, dtype=state_dtype(dtype))}
        state.update({name: conv.init_state(batch_size, device, dtype) for name, conv in self.convs.items()})
        return state

    def state_size(self, context_length: int) -> int:
        """Hk F E plus the convolutions' last inputs, whatever the context."""
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        return hk * self.feature_map.out_dim * d + sum(conv.channels * (conv.size - 1) for conv in self.convs.values())
