"""An independent float64 per-token reference for the delta-rule mixer, written from the equations of Su's "A Brief
History of Linear Attention".

Nothing here imports hf_recattn. One batch row, one token, one head at a time, the state kept as that text writes
it, values x keys (``S v`` is [E, D], ``o = S q``):

* delta:  S <- S (I - b k k^T) + b v k^T
* gated:  S <- a S (I - b k k^T) + b v k^T
* comba:  S <- a S + b (v - S k) k^T

with, per token: a short causal depthwise convolution over the raw q / k / v channels (a buffer of the last W-1
inputs), optional SiLU, a feature map on each q / k head vector, L2-normalized q and k, q scaled;
b = sigmoid(w_b . x + c_b) (times 2 with negative eigenvalues), a = exp(-exp(A_log) softplus(w_a . x + dt_bias)),
both reading x / sqrt(C); with n Householder steps the token's n keys, values and b are applied in order and the
decay only on the first. The output is RMS-normalized per query head
(gain g), then multiplied by silu(w_g . x). A padded token is skipped entirely (no state change, no convolution
input) and its output row is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from reference_conv import add_final_buffers, conv_buffers, conv_token, norm_and_gate, sigmoid, softplus

Tensor = torch.Tensor


@dataclass
class DeltaParams:
    """The mixer's parameters and options, as plain float64 tensors and values."""

    rule: str
    heads: int
    kv_heads: int
    head_dim: int
    steps: int = 1
    conv: dict[str, Tensor] = field(default_factory=dict)  # stream name -> [channels, W]
    activation: bool = False
    qk_norm: bool = True
    negative_eigenvalues: bool = False
    scale: float = 1.0
    beta_weight: Tensor | None = None  # [n * Hk, C]
    beta_bias: Tensor | None = None
    decay_weight: Tensor | None = None  # [Hk, C]
    dt_bias: Tensor | None = None
    A_log: Tensor | None = None
    extra_kv_weight: Tensor | None = None  # [2 (n-1) Hk D, C]
    norm_gain: Tensor | None = None  # [H, E]
    gate_weight: Tensor | None = None  # [H E, C]
    eps: float = 1e-6
    causal: bool = True
    #: phi(vector, head, is_query) on q / k head vectors before their norm; None: identity
    feature_map: Callable[[Tensor, int, bool], Tensor] | None = None


def _update(rule: str, S: Tensor, k: Tensor, v: Tensor, b: Tensor, a: Tensor) -> Tensor:
    eye = torch.eye(k.shape[0], dtype=k.dtype)
    if rule == "delta":
        return S @ (eye - b * torch.outer(k, k)) + b * torch.outer(v, k)
    if rule == "gated":
        return a * S @ (eye - b * torch.outer(k, k)) + b * torch.outer(v, k)
    return a * S + b * torch.outer(v - S @ k, k)


def delta_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    mask: Tensor | None,
    p: DeltaParams,
    initial: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """q [B, H, T, D], k / v [B, Hk, T, D], x [B, T, C]. ``initial`` (optional) holds the mixer-layout state:
    ``S`` [B, Hk, D(keys), E(values)] and ``conv_q`` / ``conv_k`` / ``conv_v`` [B, channels, W - 1].

    Returns the output [B, T, H, E] (zero rows on padding) and the final state in the same layout."""
    bsz, h, t_len, d = q.shape
    hk, n = p.kv_heads, p.steps
    group = h // hk
    out = torch.zeros(bsz, t_len, h, d, dtype=torch.float64)
    finals: dict[str, list[Tensor]] = {"S": []}
    for b in range(bsz):
        width = d if p.feature_map is None else p.feature_map(torch.zeros(d, dtype=torch.float64), 0, False).numel()
        states = [
            (initial["S"][b, j].double().T.clone() if initial else torch.zeros(d, width, dtype=torch.float64))
            for j in range(hk)
        ]
        buffers = conv_buffers(p.conv, initial, b)
        queries: list[tuple[int, list[Tensor]]] = []
        for t in range(t_len):
            if mask is not None and not bool(mask[b, t]):
                continue
            xt = x[b, t].double()
            raw = {"conv_q": q[b, :, t].double().reshape(-1), "conv_k": k[b, :, t].double().reshape(-1),
                   "conv_v": v[b, :, t].double().reshape(-1)}
            if n > 1:
                extra = p.extra_kv_weight @ xt
                half = extra.shape[0] // 2
                raw["conv_k"] = torch.cat([raw["conv_k"], extra[:half]])
                raw["conv_v"] = torch.cat([raw["conv_v"], extra[half:]])
            mixed = conv_token(p.conv, buffers, raw, p.activation)
            qs = mixed["conv_q"].reshape(h, d)
            ks = mixed["conv_k"].reshape(n, hk, d)
            vs = mixed["conv_v"].reshape(n, hk, d)
            if p.feature_map is not None:
                qs = torch.stack([p.feature_map(qs[hq], hq, True) for hq in range(h)])
                ks = torch.stack([torch.stack([p.feature_map(ks[i, j], j, False) for j in range(hk)])
                                  for i in range(n)])
            if p.qk_norm:
                qs = qs / torch.sqrt((qs * qs).sum(-1, keepdim=True) + p.eps)
                ks = ks / torch.sqrt((ks * ks).sum(-1, keepdim=True) + p.eps)
            qs = qs * p.scale
            xg = xt / xt.shape[0] ** 0.5  # the gates read x / sqrt(C)
            for j in range(hk):
                decay = torch.ones((), dtype=torch.float64)
                if p.rule != "delta":
                    dt = softplus(p.decay_weight[j] @ xg + p.dt_bias[j])
                    decay = torch.exp(-torch.exp(p.A_log[j]) * dt)
                for step in range(n):
                    b_t = sigmoid(p.beta_weight[step * hk + j] @ xg + p.beta_bias[step * hk + j])
                    if p.negative_eigenvalues:
                        b_t = 2.0 * b_t
                    a_t = decay if step == 0 else torch.ones((), dtype=torch.float64)
                    states[j] = _update(p.rule, states[j], ks[step, j], vs[step, j], b_t, a_t)
            if p.causal:
                queries.append((t, [states[hq // group] @ qs[hq] for hq in range(h)]))
            else:
                queries.append((t, [qs[hq] for hq in range(h)]))
        for t, reads in queries:
            xt = x[b, t].double()
            for hq in range(h):
                o = reads[hq] if p.causal else states[hq // group] @ reads[hq]
                out[b, t, hq] = norm_and_gate(o, hq, xt, p.norm_gain, p.gate_weight, p.eps)
        finals["S"].append(torch.stack([s.T for s in states]))
        add_final_buffers(finals, buffers)
    return out, {name: torch.stack(values) for name, values in finals.items()}
