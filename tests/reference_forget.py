"""Independent float64 per-token references for softmax attention with forget factors (ALiBi, FoX).

Nothing here imports hf_recattn. For query t and a visible real key s <= t of query head h,

    logit = scale * q_t . k_s + sum_{u = s+1..t, u real} log f[h, u],

then a softmax over those keys (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eq. 22). Padded
tokens are never keys and add no forget factor
(f = 1 there); padded query rows are zero (compare real rows only). Conventions as in ``reference.py``.
"""

from __future__ import annotations

import math

import torch
from reference import is_real, softmax_attention

Tensor = torch.Tensor


def alibi_log_forget(slopes: list[float], batch: int, seq_len: int) -> Tensor:
    """[B, H, T] log f = -slope of the head, for every token."""
    out = torch.zeros(batch, len(slopes), seq_len, dtype=torch.float64)
    for b in range(batch):
        for h, slope in enumerate(slopes):
            for t in range(seq_len):
                out[b, h, t] = -slope
    return out


def fox_log_forget(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """[B, H, T] log f = log(1 / (1 + exp(-(w_h . x_t / sqrt(C) + b_h)))), one token and head at a time."""
    x = x.double()
    bsz, seq_len, channels = x.shape
    rows = []
    for b in range(bsz):
        heads = []
        for h in range(bias.shape[0]):
            tokens = []
            for t in range(seq_len):
                z = torch.dot(weight[h].double(), x[b, t]) / math.sqrt(channels) + bias[h].double()
                tokens.append(-torch.log1p(torch.exp(-z)))
            heads.append(torch.stack(tokens))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def forget_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_forget: Tensor,
    padding_mask: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """o_t = sum_s softmax_s(q_t . k_s / sqrt(d) + sum of real log f in (s, t]) v_s over visible real keys."""
    log_forget = log_forget.double()

    def decay(b: int, h: int, s: int, t: int) -> Tensor:
        return sum(
            (log_forget[b, h, u] for u in range(s + 1, t + 1) if is_real(padding_mask, b, u)),
            torch.zeros((), dtype=torch.float64),
        )

    return softmax_attention(q, k, v, padding_mask, window, causal=True, logit_bias=decay)
