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
from .kernel_adapters import run_linear_chunked, run_linear_step, too_wide

#: the kernels carry the denominator z as one more value column
DENOMINATOR_COLUMNS = 1


def _causal(scores: torch.Tensor) -> torch.Tensor:
    t, s = scores.shape[-2:]
    keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
    return scores.masked_fill(~keep, 0.0)


def decay_weights(log_g: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, T] log factors -> [B, Hkv, 1, T, T] causal weights exp(L_t - L_s) (zero above the diagonal)."""
    cum = log_g.cumsum(-1)
    diff = cum[..., :, None] - cum[..., None, :]
    t = log_g.shape[-1]
    keep = torch.ones(t, t, dtype=torch.bool, device=log_g.device).tril()
    return diff.masked_fill(~keep, -math.inf).exp().unsqueeze(2)


def linear_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, log_g: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quadratic form: returns (numerator [B,Hkv,G,T,E], denominator [B,Hkv,G,T])."""
    scores = linear_scores(q, k, causal, log_g)
    return torch.einsum("bhgts,bhse->bhgte", scores, v), scores.sum(-1)


def linear_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool = True, log_g: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, Hkv, G, T, S]: what key s contributes to query t's numerator and denominator, q_t . k_s times the
    decay between them (zero above the diagonal when causal)."""
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

    Returns (numerator, denominator, final S, final z).
    """
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    log_g = None if log_g is None else log_g.to(S.dtype)
    kernel = pick("chunk_linear", q, k, v, S, z, log_g,
                  unsupported=too_wide("chunk_linear", k, v, DENOMINATOR_COLUMNS))
    if kernel is not None:
        return run_linear_chunked(kernel, q, k, v, S, z, g=log_g)
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
    """
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    kernel = pick("linear_step", q, k, v, S, z, log_g,
                  unsupported=too_wide("linear_step", k, v, DENOMINATOR_COLUMNS))
    if kernel is not None:
        g = None if log_g is None else log_g[:, :, 0].to(S.dtype)
        return run_linear_step(kernel, q, k, v, S, z, in_place, g=g)
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
    """Bidirectional form in O(T): every query reads the state of the whole sequence."""
    S = torch.einsum("bhsf,bhse->bhfe", k, v)
    z = k.sum(2)
    return torch.einsum("bhgtf,bhfe->bhgte", q, S), torch.einsum("bhgtf,bhf->bhgt", q, z)
