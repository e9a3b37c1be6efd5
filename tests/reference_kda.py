"""An independent float64 per-token reference for Kimi Delta Attention (the ``kda`` mixer), written from the
equations of Kimi Linear (Kimi Team, arXiv:2510.26692).

Nothing here imports hf_recattn. One batch row, one token, one key head at a time, the state S [F, E] (keys x values)
updated with explicit matrices:

    S <- (I - b k k^T) Diag(a) S + b k v^T,        o = S^T q

with, per token: a short causal depthwise convolution over the raw q / k / v channels, optional SiLU, a feature map
on each q / k head vector, L2-normalized q and k, q scaled; a = exp(-exp(A_log_h) softplus(W_up (W_down x) +
dt_bias)) per key channel, b = sigmoid(w_b . x / sqrt(C) + c_b) per key head. The output is RMS-normalized per query
head (gain g), then multiplied by sigmoid(w_g . x). A padded token is skipped entirely (no state change, no
convolution input) and its output row is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from reference_conv import add_final_buffers, conv_buffers, conv_token, sigmoid, softplus

Tensor = torch.Tensor


@dataclass
class KdaParams:
    """The mixer's parameters and options, as plain tensors and values."""

    heads: int
    kv_heads: int
    head_dim: int
    decay_down: Tensor  # [r, C]
    decay_up: Tensor  # [Hk F, r]
    dt_bias: Tensor  # [Hk F]
    A_log: Tensor  # [Hk]
    beta_weight: Tensor  # [Hk, C]
    beta_bias: Tensor  # [Hk]
    conv: dict[str, Tensor] = field(default_factory=dict)  # stream name -> [channels, W]
    activation: bool = False
    qk_norm: bool = True
    scale: float = 1.0
    norm_gain: Tensor | None = None  # [H, E]
    gate_weight: Tensor | None = None  # [H E, C]
    eps: float = 1e-6
    #: phi(vector, head, is_query) on q / k head vectors before their norm; None: identity
    feature_map: Callable[[Tensor, int, bool], Tensor] | None = None


def _features(p: KdaParams, vectors: Tensor, is_query: bool) -> Tensor:
    """Feature map, L2 norm (per head vector)."""
    if p.feature_map is not None:
        vectors = torch.stack([p.feature_map(vectors[j], j, is_query) for j in range(vectors.shape[0])])
    if p.qk_norm:
        vectors = vectors / torch.sqrt((vectors * vectors).sum(-1, keepdim=True) + p.eps)
    return vectors


def _finish(o: Tensor, hq: int, xt: Tensor, p: KdaParams) -> Tensor:
    """RMSNorm with gain, then times sigmoid(w_g . x)."""
    e = o.shape[0]
    if p.norm_gain is not None:
        o = o / torch.sqrt((o * o).mean() + p.eps) * p.norm_gain[hq]
    if p.gate_weight is not None:
        o = o * sigmoid(p.gate_weight[hq * e : (hq + 1) * e] @ xt)
    return o


def kda_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    mask: Tensor | None,
    p: KdaParams,
    initial: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """q [B, H, T, D], k / v [B, Hk, T, D], x [B, T, C]. ``initial`` (optional): ``S`` [B, Hk, F, E] and
    ``conv_q`` / ``conv_k`` / ``conv_v`` [B, channels, W - 1]. Returns the output [B, T, H, E] (zero rows on padding)
    and the final state in the same layout."""
    bsz, h, t_len, d = q.shape
    hk = p.kv_heads
    width = p.dt_bias.shape[0] // hk
    out = torch.zeros(bsz, t_len, h, d, dtype=torch.float64)
    finals: dict[str, list[Tensor]] = {"S": []}
    for b in range(bsz):
        states = [initial["S"][b, j].double().clone() if initial else torch.zeros(width, d, dtype=torch.float64)
                  for j in range(hk)]
        buffers = conv_buffers(p.conv, initial, b)
        for t in range(t_len):
            if mask is not None and not bool(mask[b, t]):
                continue
            xt = x[b, t].double()
            raw = {"conv_q": q[b, :, t].double().reshape(-1), "conv_k": k[b, :, t].double().reshape(-1),
                   "conv_v": v[b, :, t].double().reshape(-1)}
            mixed = conv_token(p.conv, buffers, raw, p.activation)
            qs = _features(p, mixed["conv_q"].reshape(h, d), True) * p.scale
            ks = _features(p, mixed["conv_k"].reshape(hk, d), False)
            vs = mixed["conv_v"].reshape(hk, d)
            dt = softplus(p.decay_up @ (p.decay_down @ xt) + p.dt_bias).reshape(hk, width)
            for j in range(hk):
                a = torch.exp(-torch.exp(p.A_log[j]) * dt[j])
                b_t = sigmoid(p.beta_weight[j] @ xt / xt.shape[0] ** 0.5 + p.beta_bias[j])
                transition = torch.eye(width, dtype=torch.float64) - b_t * torch.outer(ks[j], ks[j])
                states[j] = transition @ torch.diag(a) @ states[j] + b_t * torch.outer(ks[j], vs[j])
            for hq in range(h):
                out[b, t, hq] = _finish(states[hq // (h // hk)].T @ qs[hq], hq, xt, p)
        finals["S"].append(torch.stack(states))
        add_final_buffers(finals, buffers)
    return out, {name: torch.stack(values) for name, values in finals.items()}
