"""Independent float64 per-token references for gated linear attention (GLA) and RetNet's fixed decay.

Nothing here imports hf_recattn. GLA: one batch row, one key head, one token at a time, the state S [D, E] kept
as the paper writes it:

    alpha_t[j] = sigmoid(z_t[j]) ** (1 / tau),  z_t[j] = sum_r W2[j, r] (W1[r] . x_t) + b[j]
    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,    o_t = (scale q_t) S_t

then, per query head, o / sqrt(mean(o^2) + eps) times the head's gain, times silu(W_g x_t) (each optional). A
padded token is skipped (no decay, no write) and its output row is zero. RetNet: the factors
gamma_h = 1 - (1 - gamma_min)^(1 - h/(Hkv-1)) (1 - gamma_max)^(h/(Hkv-1)), gamma_max defaulting to
1 - 2^-(5 + Hkv - 1), written out with Python floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class GLAParams:
    """The GLA mixer's parameters and options (tensors may be live, for gradients)."""

    heads: int
    kv_heads: int
    gate_down: Tensor  # W1 [r, C]
    gate_up: Tensor  # W2 [Hkv D, r]
    gate_bias: Tensor  # b [Hkv D]
    temperature: float
    scale: float
    norm_gain: Tensor | None = None  # [H, E]
    gate_weight: Tensor | None = None  # [H E, C]
    eps: float = 1e-6


def _sigmoid(z: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def gla_reference(
    q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: Tensor | None, p: GLAParams, initial: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Outputs [B, T, H, E] and the final states [B, Hkv, D, E] (``initial``: [B, Hkv, D, E] or None)."""
    q, k, v, x = q.double(), k.double(), v.double(), x.double()
    bsz, _, seq_len, d = q.shape
    e = v.shape[-1]
    group = p.heads // p.kv_heads
    rows: dict[tuple[int, int, int], Tensor] = {}
    finals = []
    for b in range(bsz):
        states = []
        for hk in range(p.kv_heads):
            S = torch.zeros(d, e, dtype=torch.float64) if initial is None else initial[b, hk].double()
            for t in range(seq_len):
                if mask is not None and not bool(mask[b, t]):
                    continue
                low = torch.stack([torch.dot(p.gate_down[r].double(), x[b, t]) for r in range(p.gate_down.shape[0])])
                alpha = torch.stack([
                    _sigmoid(torch.dot(p.gate_up[hk * d + j].double(), low) + p.gate_bias[hk * d + j])
                    ** (1.0 / p.temperature)
                    for j in range(d)
                ])
                S = alpha[:, None] * S + torch.outer(k[b, hk, t], v[b, hk, t])
                for h in range(hk * group, (hk + 1) * group):
                    o = (p.scale * q[b, h, t]) @ S
                    if p.norm_gain is not None:
                        o = o / torch.sqrt(torch.mean(o * o) + p.eps) * p.norm_gain[h].double()
                    if p.gate_weight is not None:
                        g = p.gate_weight[h * e : (h + 1) * e].double() @ x[b, t]
                        o = o * g * _sigmoid(g)
                    rows[(b, t, h)] = o
            states.append(S)
        finals.append(torch.stack(states))
    zero = torch.zeros(e, dtype=torch.float64)
    out = torch.stack([
        torch.stack([torch.stack([rows.get((b, t, h), zero) for h in range(p.heads)]) for t in range(seq_len)])
        for b in range(bsz)
    ])
    return out, torch.stack(finals)


def retnet_gammas(kv_heads: int, gamma_min: float = 1.0 - 2.0**-5, gamma_max: float | None = None) -> list[float]:
    """RetNet's per-key-head decay factors (see the module docstring)."""
    if gamma_max is None:
        gamma_max = 1.0 - 2.0 ** -(5 + kv_heads - 1)
    if kv_heads == 1:
        return [gamma_min]
    return [1.0 - (1.0 - gamma_min) ** (1 - h / (kv_heads - 1)) * (1.0 - gamma_max) ** (h / (kv_heads - 1))
            for h in range(kv_heads)]


def retnet_forget(batch: int, seq_len: int, gammas: list[float]) -> Tensor:
    """[B, Hkv, T] forget factors for tests/reference.py's ``kernel_attention``: gamma_h at every token."""
    return torch.tensor(gammas, dtype=torch.float64)[None, :, None].expand(batch, -1, seq_len).clone()
