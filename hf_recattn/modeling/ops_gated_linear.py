"""Functional forms of gated linear attention (GLA): a forget gate per key dimension.

S_t = diag(alpha_t) S_{t-1} + k_t v_t^T and o_t = q_t S_t, with ``log_a`` = log alpha <= 0. Key s then reaches query
t through sum_d q_td k_sd exp(L_td - L_sd), L the cumulative sum of ``log_a`` (inclusive).

Shapes: ``q`` is ``[B, Hkv, G, T, D]`` (G query heads share a key head, already scaled), ``k`` and ``log_a`` are
``[B, Hkv, T, D]``, ``v`` is ``[B, Hkv, T, E]``; the state ``S`` is ``[B, Hkv, D, E]``. Padding is the caller's
business: zero the keys and the log gates of padded tokens.

Stability: every exponent taken here is a difference L_t - L_s with s <= t (or a masked entry set to -inf before
the exponential), so it is <= 0 however strong the gates and however long the sequence; nothing overflows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backends import pick
from .fla_adapters import run_fla, too_wide

#: tokens per secondary chunk inside a chunk of the chunked form
SUB_CHUNK = 16


def _pairwise_decay(cum: torch.Tensor) -> torch.Tensor:
    """[..., T, D] inclusive cumulative log gates -> [..., T, T, D] exp(L_t - L_s), zero where s > t."""
    t = cum.shape[-2]
    diff = cum[..., :, None, :] - cum[..., None, :, :]
    keep = torch.ones(t, t, dtype=torch.bool, device=cum.device).tril()[..., None]
    return diff.masked_fill(~keep, -math.inf).exp()


def gla_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """Quadratic form from a zero state: [B, Hkv, G, T, E] (O(T^2 D) memory for the pairwise decays).

    Args:
        q: ``[B, Hkv, G, T, D]`` queries (already scaled), G query heads per key head.
        k: ``[B, Hkv, T, D]`` keys.
        v: ``[B, Hkv, T, E]`` values.
        log_a: ``[B, Hkv, T, D]`` log forget gates per key dimension (<= 0).

    Returns:
        ``[B, Hkv, G, T, E]`` outputs.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
        >>> gla_parallel(q, k, v, -torch.rand(1, 2, 5, 4)).shape
        torch.Size([1, 2, 1, 5, 3])
    """
    decay = _pairwise_decay(log_a.cumsum(-2))  # [B, Hkv, T, T, D]
    scores = torch.einsum("bhgtd,bhsd,bhtsd->bhgts", q, k, decay)
    return scores @ v.unsqueeze(2)


def _chunk_scores(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, sub: int) -> torch.Tensor:
    """Decayed causal scores [B, Hkv, G, C, C] of one chunk whose length C is a multiple of ``sub``.

    Two levels (GLA's secondary chunking): between sub-chunks i > j the decay factors through the boundary m_i
    just before sub-chunk i, exp(L_t - L_s) = exp(L_t - L_m) exp(L_m - L_s), both factors <= 1, so the block is
    one matrix product; inside a sub-chunk the pairwise decays are taken directly.
    """
    b, h, g, c, d = q.shape
    n = c // sub
    qs, ks, cs = q.view(b, h, g, n, sub, d), k.view(b, h, n, sub, d), cum.view(b, h, n, sub, d)
    # L just before each sub-chunk (0 before the first)
    ref = torch.cat([torch.zeros_like(cs[:, :, :1, 0]), cs[:, :, :-1, -1]], dim=2)  # [B, Hkv, n, D]
    q_in = qs * (cs - ref[:, :, :, None]).exp()[:, :, None]  # [B, Hkv, G, n, sub, D]
    # key s of sub-chunk j seen from sub-chunk i (j < i): exp(L_m_i - L_s); other pairs masked before exp
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)[:, :, None, None]
    k_log = (ref[:, :, :, None, None] - cs[:, :, None]).masked_fill(~lower, -math.inf)  # [B, Hkv, n, n, sub, D]
    k_in = ks[:, :, None] * k_log.exp()
    inter = torch.einsum("bhgitd,bhijsd->bhgijts", q_in, k_in)
    intra = torch.einsum("bhgitd,bhisd,bhitsd->bhgits", qs, ks, _pairwise_decay(cs))
    eye = torch.eye(n, dtype=q.dtype, device=q.device)[:, :, None, None]
    blocks = inter + eye * intra.unsqueeze(4)  # [B, Hkv, G, i, j, sub, sub]; inter is zero where j >= i
    return blocks.transpose(-3, -2).reshape(b, h, g, c, c)


def gla_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor,
    S: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise form from the state ``S``: exact inside a chunk, the state carried across chunks.

    Returns (output [B, Hkv, G, T, E], final S), computed in S's dtype (float32 states of a half-precision model).

    Args:
        q: ``[B, Hkv, G, T, D]`` queries (already scaled).
        k: ``[B, Hkv, T, D]`` keys.
        v: ``[B, Hkv, T, E]`` values.
        log_a: ``[B, Hkv, T, D]`` log forget gates per key dimension (<= 0).
        S: ``[B, Hkv, D, E]`` start state.
        chunk_size: tokens per chunk (each split into sub-chunks of ``SUB_CHUNK``).

    Returns:
        ``(o, S)``: o ``[B, Hkv, G, T, E]`` and the final state ``[B, Hkv, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 7, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 3)
        >>> log_a = -torch.rand(1, 1, 7, 4)
        >>> o, S = gla_chunked(q, k, v, log_a, torch.zeros(1, 1, 4, 3), chunk_size=4)
        >>> torch.allclose(o, gla_parallel(q, k, v, log_a), atol=1e-5), S.shape
        (True, torch.Size([1, 1, 4, 3]))
    """
    q, k, v, log_a = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype), log_a.to(S.dtype)
    kernel = pick("chunk_gla", q, k, v, log_a, S, unsupported=too_wide(k))
    if kernel is not None:
        return run_fla(kernel, q, k, v, S, g=log_a)
    outs = []
    qs, ks, vs = q.split(chunk_size, dim=3), k.split(chunk_size, dim=2), v.split(chunk_size, dim=2)
    for qc, kc, vc, lc in zip(qs, ks, vs, log_a.split(chunk_size, dim=2), strict=True):
        cum = lc.cumsum(-2)  # [B, Hkv, C, D] log decay from the state before the chunk to each token
        c = cum.shape[-2]
        sub = min(SUB_CHUNK, c)
        extra = -c % sub  # a ragged chunk is padded at its end with empty tokens (no key, no decay)
        if extra:
            scores = _chunk_scores(F.pad(qc, (0, 0, 0, extra)), F.pad(kc, (0, 0, 0, extra)),
                                   F.pad(cum, (0, 0, 0, extra), mode="replicate"), sub)[..., :c, :c]
        else:
            scores = _chunk_scores(qc, kc, cum, sub)
        q_state = qc * cum.exp().unsqueeze(2)
        outs.append(torch.matmul(q_state, S.unsqueeze(2)) + scores @ vc.unsqueeze(2))
        last = cum[:, :, -1]  # [B, Hkv, D]
        k_state = kc * (last[:, :, None] - cum).exp()  # each key's decay to the chunk's end
        S = S * last.exp()[..., None] + k_state.transpose(-1, -2) @ vc
    return torch.cat(outs, dim=3), S


def gla_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor, S: torch.Tensor, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (T == 1): decay the state per key dimension, add k v^T, read it with q (``in_place``: in S's
    buffer).

    Args:
        q: ``[B, Hkv, G, 1, D]`` the token's queries (already scaled).
        k: ``[B, Hkv, 1, D]`` its key.
        v: ``[B, Hkv, 1, E]`` its value.
        log_a: ``[B, Hkv, 1, D]`` its log forget gates.
        S: ``[B, Hkv, D, E]`` state before the token.
        in_place: update S in its buffer.

    Returns:
        ``(o, S)``: o ``[B, Hkv, G, 1, E]`` and the new state.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 2)
        >>> log_a, S, outs = -torch.rand(1, 1, 3, 4), torch.zeros(1, 1, 4, 2), []
        >>> for t in range(3):
        ...     o, S = gla_step(q[..., t:t + 1, :], k[:, :, t:t + 1], v[:, :, t:t + 1], log_a[:, :, t:t + 1], S)
        ...     outs.append(o)
        >>> torch.allclose(torch.cat(outs, dim=3), gla_parallel(q, k, v, log_a), atol=1e-5)
        True
    """
    q, k, v, log_a = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype), log_a.to(S.dtype)
    kernel = pick("fused_recurrent_gla", q, k, v, log_a, S, unsupported=too_wide(k))
    if kernel is not None:
        return run_fla(kernel, q, k, v, S, in_place, gk=log_a)
    decay = log_a[:, :, 0, :, None].exp()
    if in_place:
        S = S.mul_(decay).addcmul_(k.transpose(-1, -2), v)
    else:
        S = torch.addcmul(S * decay, k.transpose(-1, -2), v)
    return torch.matmul(q[:, :, :, 0], S).unsqueeze(3), S  # no broadcast copy of S over the groups
