"""An independent float64 per-token reference for the MesaNet mixer, written from eq. 35 of Su's "A Brief History of
Linear Attention".

Nothing here imports hf_recattn. One batch row, one token, one head at a time, the states kept as that text writes
them (G is values x keys):

    G <- gamma G + beta v k^T,    H <- gamma H + beta k k^T,    o = G (H + diag(Lambda_h))^-1 q

with, per token: a short causal depthwise convolution over the raw q / k channels (a buffer of the last W - 1
inputs), optional SiLU on q and k, L2-normalized q and k; gamma = sigmoid(w_f . x + c_f), beta = sigmoid(w_b . x +
c_b), both reading x / sqrt(C), one per key head; Lambda_h = softplus(lambda_param_h) + lambda_min per query head;
the solve is torch.linalg.solve (LU). The output is RMS-normalized per query head (gain g), then multiplied by
silu(w_g . x). A padded token is skipped entirely (no state change, no convolution input); its output row is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from reference_conv import add_final_buffers, conv_buffers, conv_token, norm_and_gate, sigmoid, softplus

Tensor = torch.Tensor


@dataclass
class MesaParams:
    """The mixer's parameters and options, as plain float64 tensors and values."""

    heads: int
    kv_heads: int
    head_dim: int
    forget_weight: Tensor  # [Hk, C]
    forget_bias: Tensor  # [Hk]
    beta_weight: Tensor  # [Hk, C]
    beta_bias: Tensor  # [Hk]
    lambda_param: Tensor  # [H, D]
    lambda_min: float
    conv: dict[str, Tensor] = field(default_factory=dict)  # "conv_q" / "conv_k" -> [channels, W]
    activation: bool = True
    qk_norm: bool = True
    norm_gain: Tensor | None = None  # [H, E]
    gate_weight: Tensor | None = None  # [H E, C]
    eps: float = 1e-6


def mesa_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    mask: Tensor | None,
    p: MesaParams,
    initial: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """q [B, H, T, D], k / v [B, Hk, T, D], x [B, T, C]. ``initial`` (optional) holds the mixer-layout state:
    ``H`` [B, Hk, D, D], ``G`` [B, Hk, D(keys), E(values)] and ``conv_q`` / ``conv_k`` [B, channels, W - 1].

    Returns the output [B, T, H, E] (zero rows on padding) and the final state in the same layout."""
    bsz, h, t_len, d = q.shape
    hk = p.kv_heads
    group = h // hk
    out = torch.zeros(bsz, t_len, h, d, dtype=torch.float64)
    finals: dict[str, list[Tensor]] = {"H": [], "G": []}
    for b in range(bsz):
        big_h = [initial["H"][b, j].double().clone() if initial else torch.zeros(d, d, dtype=torch.float64)
                 for j in range(hk)]
        big_g = [initial["G"][b, j].double().T.clone() if initial else torch.zeros(d, d, dtype=torch.float64)
                 for j in range(hk)]
        buffers = conv_buffers(p.conv, initial, b)
        for t in range(t_len):
            if mask is not None and not bool(mask[b, t]):
                continue
            xt = x[b, t].double()
            raw = {"conv_q": q[b, :, t].double().reshape(-1), "conv_k": k[b, :, t].double().reshape(-1)}
            mixed = conv_token(p.conv, buffers, raw, p.activation)
            qs, ks = mixed["conv_q"].reshape(h, d), mixed["conv_k"].reshape(hk, d)
            if p.qk_norm:
                qs = qs / torch.sqrt((qs * qs).sum(-1, keepdim=True) + p.eps)
                ks = ks / torch.sqrt((ks * ks).sum(-1, keepdim=True) + p.eps)
            xg = xt / xt.shape[0] ** 0.5  # the gates read x / sqrt(C)
            for j in range(hk):
                gamma = sigmoid(p.forget_weight[j] @ xg + p.forget_bias[j])
                beta = sigmoid(p.beta_weight[j] @ xg + p.beta_bias[j])
                vj = v[b, j, t].double()
                big_g[j] = gamma * big_g[j] + beta * torch.outer(vj, ks[j])
                big_h[j] = gamma * big_h[j] + beta * torch.outer(ks[j], ks[j])
            for hq in range(h):
                j = hq // group
                lam = softplus(p.lambda_param[hq]) + p.lambda_min
                o = big_g[j] @ torch.linalg.solve(big_h[j] + torch.diag(lam), qs[hq])
                out[b, t, hq] = norm_and_gate(o, hq, xt, p.norm_gain, p.gate_weight, p.eps)
        finals["H"].append(torch.stack(big_h))
        finals["G"].append(torch.stack([g.T for g in big_g]))
        add_final_buffers(finals, buffers)
    return out, {name: torch.stack(values) for name, values in finals.items()}
