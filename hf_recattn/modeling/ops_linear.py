"""Functional forms of (causal) linear attention: numerator and denominator of phi(q) . sum phi(k) v.

Shapes: ``q`` is ``[B, Hkv, G, T, F]`` (G query heads share a key head), ``k`` is ``[B, Hkv, T, F]``, ``v`` is
``[B, Hkv, T, E]``. States: ``S`` is ``[B, Hkv, F, E]`` (sum of k v^T), ``z`` is ``[B, Hkv, F]`` (sum of k).
Padding is the caller's business: zero the feature-mapped keys of padded tokens before calling.

States may be kept in a wider dtype than the inputs (float32 states for a bfloat16 model): the stateful forms
cast q, k, v and the decay to the state's dtype and return float32 outputs then.

Decay: an optional ``log_g`` [B, Hkv, T] (<= 0) makes every form compute S_t = g_t S_{t-1} + k_t v_t^T (and
z_t = g_t z_{t-1} + k_t), so key s reaches query t with the weight exp(sum_{s < r <= t} log g_r).
"""

from __future__ import annotations

import math

import torch

from .backends import pick
from .fla_adapters import run_fla_linear, too_wide


def _causal(scores: torch.Tensor) -> torch.Tensor:
    t, s = scores.shape[-2:]
    keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
    return scores.masked_fill(~keep, 0.0)


def decay_weights(log_g: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, T] log factors -> [B, Hkv, 1, T, T] causal weights exp(L_t - L_s) (zero above the diagonal).

    Args:
        log_g: ``[B, Hkv, T]`` log forget factors (<= 0); L is their inclusive cumulative sum.

    Returns:
        ``[B, Hkv, 1, T, T]``: the factor by which key s reaches query t (s <= t), zero for s > t.

    Example:
        >>> decay_weights(torch.log(torch.full((1, 1, 3), 0.5)))[0, 0, 0]
        tensor([[1.0000, 0.0000, 0.0000],
                [0.5000, 1.0000, 0.0000],
                [0.2500, 0.5000, 1.0000]])
    """
    cum = log_g.cumsum(-1)
    diff = cum[..., :, None] - cum[..., None, :]
    t = log_g.shape[-1]
    keep = torch.ones(t, t, dtype=torch.bool, device=log_g.device).tril()
    return diff.masked_fill(~keep, -math.inf).exp().unsqueeze(2)


def linear_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, log_g: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quadratic form: returns (numerator [B,Hkv,G,T,E], denominator [B,Hkv,G,T]).

    Args:
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries, G query heads per key head.
        k: ``[B, Hkv, T, F]`` feature-mapped keys (zero for padded tokens).
        v: ``[B, Hkv, T, E]`` values.
        causal: each query reads only keys up to its own position.
        log_g: ``[B, Hkv, T]`` log forget factors (<= 0) of a decayed state, or None (causal only).

    Returns:
        ``(num, den)``: ``sum_s w_ts v_s`` ``[B, Hkv, G, T, E]`` and ``sum_s w_ts`` ``[B, Hkv, G, T]``, with
        w_ts = q_t . k_s times the decay between s and t.

    Example:
        >>> q, k, v = torch.rand(1, 2, 1, 4, 3), torch.rand(1, 2, 4, 3), torch.randn(1, 2, 4, 5)
        >>> num, den = linear_parallel(q, k, v)
        >>> (num / den[..., None]).shape  # linear attention's output
        torch.Size([1, 2, 1, 4, 5])
    """
    scores = linear_scores(q, k, causal, log_g)
    return torch.einsum("bhgts,bhse->bhgte", scores, v), scores.sum(-1)


def linear_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool = True, log_g: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, Hkv, G, T, S]: what key s contributes to query t's numerator and denominator, q_t . k_s times the
    decay between them (zero above the diagonal when causal).

    Args:
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries.
        k: ``[B, Hkv, S, F]`` feature-mapped keys.
        causal: zero the scores of keys after the query (the last T of S positions are the queries').
        log_g: ``[B, Hkv, T]`` log forget factors (only with ``causal``), or None.

    Returns:
        ``[B, Hkv, G, T, S]`` scores.

    Example:
        >>> linear_scores(torch.ones(1, 1, 1, 2, 3), torch.ones(1, 1, 2, 3))[0, 0, 0]
        tensor([[3., 0.],
                [3., 3.]])
    """
    scores = torch.einsum("bhgtf,bhsf->bhgts", q, k)
    if log_g is not None:
        if not causal:
            raise ValueError("a decayed linear attention is causal only")
        return scores * decay_weights(log_g)
    return _causal(scores) if causal else scores


def linear_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    chunk_size: int,
    log_g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunkwise causal form, O(T * chunk): exact inside a chunk, state across chunks.

    Args:
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries.
        k: ``[B, Hkv, T, F]`` feature-mapped keys (zero for padded tokens).
        v: ``[B, Hkv, T, E]`` values.
        S: ``[B, Hkv, F, E]`` start state, sum of k v^T (the inputs are cast to its dtype).
        z: ``[B, Hkv, F]`` start key sum.
        chunk_size: tokens per chunk.
        log_g: ``[B, Hkv, T]`` log forget factors (<= 0), or None.

    Returns:
        ``(num, den, S, z)``: numerator ``[B, Hkv, G, T, E]``, denominator ``[B, Hkv, G, T]`` and the final S and z.

    Example:
        >>> q, k, v = torch.rand(1, 1, 2, 5, 3), torch.rand(1, 1, 5, 3), torch.randn(1, 1, 5, 4)
        >>> log_g = -torch.rand(1, 1, 5)
        >>> num, den, S, z = linear_chunked(q, k, v, torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3), 2, log_g)
        >>> ref_num, ref_den = linear_parallel(q, k, v, log_g=log_g)
        >>> torch.allclose(num, ref_num, atol=1e-5), torch.allclose(den, ref_den, atol=1e-5), S.shape
        (True, True, torch.Size([1, 1, 3, 4]))
    """
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    log_g = None if log_g is None else log_g.to(S.dtype)
    if log_g is None:
        kernel = pick("chunk_linear_attn", q, k, v, S, z, unsupported=too_wide(k))
        if kernel is not None:
            return run_fla_linear(kernel, q, k, v, S, z, normalize=False)
    else:
        kernel = pick("chunk_simple_gla", q, k, v, S, z, log_g, unsupported=too_wide(k))
        if kernel is not None:
            return run_fla_linear(kernel, q, k, v, S, z, g=log_g)
    # the denominator rides along as one more value column (of ones): one product reads both, one updates both;
    # the G query heads of a key head are stacked into one [G * C, F] block, batched over B * Hkv
    b, hk, g, t, f = q.shape
    e = v.shape[-1]
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).flatten(0, 1)
    table = torch.cat([S, z[..., None]], dim=-1).flatten(0, 1)  # [B * Hkv, F, E + 1]
    outs = []
    # split() rather than slicing: its backward joins the chunks' gradients once (slicing would allocate a
    # full-size gradient per chunk, quadratic in the length)
    qs, ks, vs = q.split(chunk_size, dim=3), k.flatten(0, 1).split(chunk_size, dim=1), values.split(chunk_size, 1)
    gs = [None] * len(qs) if log_g is None else log_g.split(chunk_size, dim=-1)
    for qc, kc, vc, lc in zip(qs, ks, vs, gs, strict=True):
        c = kc.shape[1]
        if lc is None:
            intra_scale = torch.ones(c, c, dtype=q.dtype, device=q.device).tril()  # [C, C]
            q_state, k_state, carry = qc, kc, None
        else:
            cum = lc.cumsum(-1)  # log decay from the state before the chunk to each token: [B, Hkv, C]
            intra_scale = decay_weights(lc)  # [B, Hkv, 1, C, C]
            q_state = qc * cum.exp()[:, :, None, :, None]
            k_state = kc * (cum[..., -1:] - cum).exp().flatten(0, 1)[..., None]  # each key's decay to the chunk end
            carry = cum[..., -1].exp().flatten(0, 1)[:, None, None]
        rows = qc.reshape(b * hk, g * c, f)
        intra = ((rows @ kc.transpose(-1, -2)).view(b, hk, g, c, c) * intra_scale).view(b * hk, g * c, c)
        state_rows = rows if q_state is qc else q_state.reshape(b * hk, g * c, f)
        outs.append(torch.baddbmm(intra @ vc, state_rows, table).view(b, hk, g, c, -1))
        if carry is not None:
            table = table * carry
        table = torch.baddbmm(table, k_state.transpose(-1, -2), vc)
    out = torch.cat(outs, dim=3)
    table = table.view(b, hk, f, e + 1)
    return out[..., :e], out[..., e], table[..., :e].contiguous(), table[..., e].contiguous()


def linear_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    log_g: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token (T == 1): fold k v^T into the state, then read it with q. ``in_place`` updates S and z in their
    buffers (see ``mixer_base.writable``) instead of allocating new ones.

    Written with addcmul / matmul rather than einsum: a decode step runs this once per layer per token, and
    einsum's reshapes cost more than the arithmetic at these sizes.

    Args:
        q: ``[B, Hkv, G, 1, F]`` the token's feature-mapped queries.
        k: ``[B, Hkv, 1, F]`` its feature-mapped key.
        v: ``[B, Hkv, 1, E]`` its value.
        S: ``[B, Hkv, F, E]`` state before the token.
        z: ``[B, Hkv, F]`` key sum before the token.
        log_g: ``[B, Hkv, 1]`` the token's log forget factor, or None.
        in_place: update S and z in their buffers.

    Returns:
        ``(num, den, S, z)``: numerator ``[B, Hkv, G, 1, E]``, denominator ``[B, Hkv, G, 1]``, the new S and z.

    Example:
        >>> q, k, v = torch.rand(1, 2, 3, 1, 4), torch.rand(1, 2, 1, 4), torch.randn(1, 2, 1, 5)
        >>> num, den, S, z = linear_step(q, k, v, torch.zeros(1, 2, 4, 5), torch.zeros(1, 2, 4))
        >>> torch.allclose(num / den[..., None], v[:, :, None].expand(1, 2, 3, 1, 5))  # one key: its value
        True
    """
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    if log_g is None:
        kernel = pick("fused_recurrent_linear_attn", q, k, v, S, z, unsupported=too_wide(k))
        if kernel is not None:
            return run_fla_linear(kernel, q, k, v, S, z, in_place, normalize=False)
    else:
        kernel = pick("fused_recurrent_simple_gla", q, k, v, S, z, log_g, unsupported=too_wide(k))
        if kernel is not None:
            return run_fla_linear(kernel, q, k, v, S, z, in_place, g=log_g.to(S.dtype))
    if log_g is not None:
        g = log_g[:, :, 0].exp().to(S.dtype)
        if in_place:
            S.mul_(g[..., None, None])
            z.mul_(g[..., None])
        else:
            S, z = S * g[..., None, None], z * g[..., None]
    if in_place:
        S.addcmul_(k.transpose(-1, -2), v)
        z.add_(k[:, :, 0])
    else:
        S = torch.addcmul(S, k.transpose(-1, -2), v)
        z = z + k[:, :, 0]
    q1 = q[:, :, :, 0]  # [B, Hkv, G, F]
    return torch.matmul(q1, S).unsqueeze(3), torch.matmul(q1, z.unsqueeze(-1)), S, z


def noncausal_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bidirectional form in O(T): every query reads the state of the whole sequence.

    Args:
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries.
        k: ``[B, Hkv, T, F]`` feature-mapped keys.
        v: ``[B, Hkv, T, E]`` values.

    Returns:
        ``(num, den)``: numerator ``[B, Hkv, G, T, E]`` and denominator ``[B, Hkv, G, T]``.

    Example:
        >>> q, k, v = torch.rand(1, 1, 1, 4, 3), torch.rand(1, 1, 4, 3), torch.randn(1, 1, 4, 2)
        >>> num, den = noncausal_linear(q, k, v)
        >>> torch.allclose(num, linear_parallel(q, k, v, causal=False)[0], atol=1e-6)
        True
    """
    S = torch.einsum("bhsf,bhse->bhfe", k, v)
    z = k.sum(2)
    return torch.einsum("bhgtf,bhfe->bhgte", q, S), torch.einsum("bhgtf,bhf->bhgt", q, z)
