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

then, per query head, LayerNorm without bias: (o - mean o) / sqrt(var o + eps) times the head's gain, times
sigmoid(W_g x) (each optional). A padded token is skipped (the state is left as it was) and its output row is zero.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class RWKV7Params:
    """The mixer's parameters and options (tensors may be live, for gradients). Shapes: ``decay_down`` A_w
    [r_w, C], ``decay_up`` B_w [Hk D, r_w], ``decay_bias`` w0 [Hk D], the same for the rate (``iclr_*``: A_a, B_a,
    a0), ``key_gain`` k_k and ``key_mix`` k_a [Hk, D], ``norm_gain`` [H, E] (None: no output norm), ``gate_weight``
    W_g [H E, C] (None: no output gate)."""

    heads: int
    kv_heads: int
    scale: float
    eps: float
    decay_down: Tensor
    decay_up: Tensor
    decay_bias: Tensor
    iclr_down: Tensor
    iclr_up: Tensor
    iclr_bias: Tensor
    key_gain: Tensor
    key_mix: Tensor
    norm_gain: Tensor | None = None
    gate_weight: Tensor | None = None


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
    group = p.heads // p.kv_heads
    out = torch.zeros(bsz, seq_len, p.heads, v.shape[-1], dtype=torch.float64)
    finals = torch.zeros(bsz, p.kv_heads, d, v.shape[-1], dtype=torch.float64)
    for b, hk in itertools.product(range(bsz), range(p.kv_heads)):
        S = torch.zeros(v.shape[-1], d, dtype=torch.float64) if initial is None else initial[b, hk].double().T
        for t in range(seq_len):
            if mask is not None and not bool(mask[b, t]):
                continue
            xt = x[b, t]
            w_logit = _head(p.decay_bias.double() + p.decay_up.double() @ torch.tanh(p.decay_down.double() @ xt), hk, d)
            w = torch.exp(-math.exp(-0.5) * _sigmoid(w_logit))
            a = _sigmoid(_head(p.iclr_bias.double() + p.iclr_up.double() @ (p.iclr_down.double() @ xt), hk, d))
            scaled = k[b, hk, t] * p.key_gain[hk].double()
            kh = scaled / torch.sqrt(torch.dot(scaled, scaled) + p.eps)
            kw = k[b, hk, t] * (1.0 + (a - 1.0) * p.key_mix[hk].double())
            S = S @ (torch.diag(w) - torch.outer(kh, a * kh)) + torch.outer(v[b, hk, t], kw)
            for h in range(hk * group, (hk + 1) * group):
                out[b, t, h] = _gated(_layer_norm(S @ (p.scale * q[b, h, t]), h, p), h, xt, p)
        finals[b, hk] = S.T
    return out, finals


def _layer_norm(o: Tensor, head: int, p: RWKV7Params) -> Tensor:
    """(o - mean o) / sqrt(var o + eps) times the head's gain; o itself without an output norm."""
    if p.norm_gain is None:
        return o
    centred = o - o.mean()
    return centred / torch.sqrt((centred * centred).mean() + p.eps) * p.norm_gain[head].double()


def _gated(o: Tensor, head: int, x: Tensor, p: RWKV7Params) -> Tensor:
    """o times sigmoid(W_g x) for the head's rows of W_g; o itself without an output gate."""
    if p.gate_weight is None:
        return o
    e = o.shape[0]
    return o * _sigmoid(p.gate_weight[head * e : (head + 1) * e].double() @ x)
