"""An independent float64 per-token reference for RWKV-7's generalized delta rule (the ``generalized_delta`` mixer),
written from the recurrence of "RWKV-7 'Goose' with Expressive Dynamic State Evolution" (Peng et al.,
arXiv:2503.14456). Nothing here imports hf_recattn.

One batch row, one key head, one token at a time, the state kept as the paper writes it, S [E, D] (values x keys),
with the token's vectors (each of length D unless said otherwise):

    w = exp(-e^{-1/2} sigmoid(w0 + B_w tanh(A_w x)))       decay
    a = sigmoid(a0 + B_a (A_a x))                          in-context learning rate
    kh = (k * k_k) / sqrt(|k * k_k|^2 + eps)               removal key
    kw = k * (1 + (a - 1) * k_a)                           written key
    S <- S (diag(w) - outer(kh, a * kh)) + outer(v, kw),   o = S (scale q)

then, per query head, LayerNorm without bias: (o - mean o) / sqrt(var o + eps) times the head's gain. A padded
token is skipped (the state is left as it was) and its output row is zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class RWKV7Params:
    """The mixer's parameters and options (tensors may be live, for gradients)."""

    heads: int
    kv_heads: int
    decay_down: Tensor  # A_w [r_w, C]
    decay_up: Tensor  # B_w [Hk D, r_w]
    decay_bias: Tensor  # w0 [Hk D]
    iclr_down: Tensor  # A_a [r_a, C]
    iclr_up: Tensor  # B_a [Hk D, r_a]
    iclr_bias: Tensor  # a0 [Hk D]
    key_gain: Tensor  # k_k [Hk, D]
    key_mix: Tensor  # k_a [Hk, D]
    scale: float
    norm_gain: Tensor | None = None  # [H, E]
    eps: float = 1e-5


def _sigmoid(z: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def _head(vector: Tensor, head: int, d: int) -> Tensor:
    return vector[head * d : (head + 1) * d]


def rwkv7_reference(
    q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: Tensor | None, p: RWKV7Params, initial: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """q [B, H, T, D], k / v [B, Hk, T, D], x [B, T, C]; ``initial`` in the mixer's layout [B, Hk, D(keys), E] or
    None. Returns the outputs [B, T, H, E] and the final states in the mixer's layout."""
    q, k, v, x = q.double(), k.double(), v.double(), x.double()
    bsz, _, seq_len, d = q.shape
    e = v.shape[-1]
    group = p.heads // p.kv_heads
    rows: dict[tuple[int, int, int], Tensor] = {}
    finals = []
    for b in range(bsz):
        states = []
        for hk in range(p.kv_heads):
            S = torch.zeros(e, d, dtype=torch.float64) if initial is None else initial[b, hk].double().T
            for t in range(seq_len):
                if mask is not None and not bool(mask[b, t]):
                    continue
                xt = x[b, t]
                w_logit = _head(p.decay_bias.double() + p.decay_up.double() @ torch.tanh(p.decay_down.double() @ xt),
                                hk, d)
                w = torch.exp(-math.exp(-0.5) * _sigmoid(w_logit))
                a = _sigmoid(_head(p.iclr_bias.double() + p.iclr_up.double() @ (p.iclr_down.double() @ xt), hk, d))
                scaled = k[b, hk, t] * p.key_gain[hk].double()
                kh = scaled / torch.sqrt(torch.dot(scaled, scaled) + p.eps)
                kw = k[b, hk, t] * (1.0 + (a - 1.0) * p.key_mix[hk].double())
                S = S @ (torch.diag(w) - torch.outer(kh, a * kh)) + torch.outer(v[b, hk, t], kw)
                for h in range(hk * group, (hk + 1) * group):
                    o = S @ (p.scale * q[b, h, t])
                    if p.norm_gain is not None:
                        centred = o - o.mean()
                        o = centred / torch.sqrt((centred * centred).mean() + p.eps) * p.norm_gain[h].double()
                    rows[(b, t, h)] = o
            states.append(S.T)
        finals.append(torch.stack(states))
    zero = torch.zeros(e, dtype=torch.float64)
    out = torch.stack([
        torch.stack([torch.stack([rows.get((b, t, h), zero) for h in range(p.heads)]) for t in range(seq_len)])
        for b in range(bsz)
    ])
    return out, torch.stack(finals)
