"""Functional forms of Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel. Per key head a
state S [D, E] (keys x values, as fla's ``naive_recurrent_kda`` keeps it) is updated per token as

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T q_t,

that is S_t = Diag(a_t) S_{t-1} + k_t u_t^T with the new value u_t = b_t (v_t - S_{t-1}^T Diag(a_t) k_t): the key
reads the state after its token's decay. ``log_a`` = log a_t <= 0 per key channel, b_t one per key head.

Chunks: inside a chunk with start state S_0 and G_t = sum_{r <= t} log a_r (per key channel, inclusive),

    u_t + b_t sum_{s < t} L_ts u_s = b_t v_t - b_t (k_t e^{G_t})^T S_0,       L_ts = sum_d k_td k_sd e^{G_td - G_sd},
    o_t = (q_t e^{G_t})^T S_0 + sum_{s <= t} A_ts u_s,                      A_ts = sum_d q_td k_sd e^{G_td - G_sd},
    S_C = Diag(e^{G_C}) S_0 + sum_s (k_s e^{G_C - G_s}) u_s^T,

a unit lower-triangular C x C system for the u (one triangular solve for both right-hand sides). L and A are the
decayed causal scores of gated linear attention, computed in two levels (``_scores``): every
exponent is a difference G_t - G_s with s <= t, or a masked entry set to -inf before the exponential, so nothing
overflows however strong the decays. The parallel form is one chunk over the whole sequence; the chunked form
passes the state from chunk to chunk.

Shapes: q [B, Hk, G, T, D] (G query heads read one key head's state, already scaled), k and log_a [B, Hk, T, D],
v [B, Hk, T, E], beta [B, Hk, T]; the state [B, Hk, D, E]. Everything is computed in the state's dtype (float32
states of a half-precision model). Padding is the caller's business: beta = 0 and log_a = 0 leave the state
untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backends import pick
from .fla_adapters import run_fla, too_wide
from .triangular import unit_lower_solve

#: tokens per sub-chunk of the decayed scores
SUB_CHUNK = 8


def _scores(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """sum_d q_td k_sd e^{G_td - G_sd} for s <= t, zero above the diagonal: [B, Hk, G, C, C] for q [B, Hk, G, C, D],
    k and cum [B, Hk, C, D] (cum: G, the inclusive cumulative log decay).

    Two levels: between sub-chunks i > j the decay factors through G_m, m the last token before sub-chunk i, as
    e^{G_t - G_m} e^{G_m - G_s} (both <= 1), so each pair of sub-chunks is one product of [sub, D] matrices; inside a
    sub-chunk the pairwise decays are taken directly. A ragged end is padded with empty tokens.
    """
    c = cum.shape[-2]
    sub = min(SUB_CHUNK, c)
    extra = -c % sub
    if extra:
        q, k = F.pad(q, (0, 0, 0, extra)), F.pad(k, (0, 0, 0, extra))
        cum = F.pad(cum, (0, 0, 0, extra), mode="replicate")
    b, h, g, length, d = q.shape
    n = length // sub
    qs, ks, cs = q.view(b, h, g, n, sub, d), k.view(b, h, n, sub, d), cum.view(b, h, n, sub, d)
    before = torch.cat([torch.zeros_like(cs[:, :, :1, 0]), cs[:, :, :-1, -1]], dim=2)  # G_m of each sub-chunk
    rows = (qs * (cs - before[:, :, :, None]).exp()[:, :, None]).transpose(2, 3)  # [B, Hk, n, G, sub, D]
    earlier = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)[:, :, None, None]
    seen = (before[:, :, :, None, None] - cs[:, :, None]).masked_fill(~earlier, -math.inf)  # [B, Hk, n, n, sub, D]
    columns = (ks[:, :, None] * seen.exp()).view(b, h, n, length, d)  # the whole chunk seen from sub-chunk i
    blocks = rows.reshape(b, h, n, g * sub, d) @ columns.transpose(-1, -2)  # [B, Hk, n, G sub, C]
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()[..., None]
    inside = (cs[..., :, None, :] - cs[..., None, :, :]).masked_fill(~causal, -math.inf).exp()  # [B, Hk, n, t, s, D]
    # inside a sub-chunk: per token t, its G queries against the keys s <= t decayed to t
    diagonal = qs.permute(0, 1, 3, 4, 2, 5) @ (ks[:, :, :, None] * inside).transpose(-1, -2)  # [B, Hk, n, t, G, s]
    blocks = blocks.view(b, h, n, g, sub, n, sub)
    torch.diagonal(blocks, dim1=2, dim2=5).add_(diagonal.permute(0, 1, 4, 3, 5, 2))  # the blocks (i, i)
    return blocks.transpose(2, 3).reshape(b, h, g, length, length)[..., :c, :c]


def _chunk(
    operands: tuple[torch.Tensor, ...], state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (q, k, v, log_a, beta) from ``state``: (o [B, Hk, G, C, E], the state after it)."""
    q, k, v, log_a, beta = operands
    d = k.shape[-1]
    cum = log_a.cumsum(-2)
    decayed = cum.exp()
    # the queries' scores and the keys' against each other at once: the decays of the keys are the same
    scores = _scores(torch.cat([q, k.unsqueeze(2)], dim=2), k, cum)
    lower = scores[:, :, -1] * beta[..., None]  # only its strict lower part is read
    solved = unit_lower_solve(lower, beta[..., None] * torch.cat([k * decayed, v], dim=-1))
    new = solved[..., d:] - solved[..., :d] @ state  # u = U~ - W S_0
    out = torch.matmul(q * decayed.unsqueeze(2), state.unsqueeze(2)) + scores[:, :, :-1] @ new.unsqueeze(2)
    last = cum[:, :, -1]  # [B, Hk, D]
    k_state = k * (last[:, :, None] - cum).exp()  # each key's decay to the chunk's end
    return out, state * last.exp()[..., None] + k_state.transpose(-1, -2) @ new


def _cast(state: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(state.dtype) for x in tensors)


def kda_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence as one chunk (O(T^2 D / 8) memory for the decayed scores).

    Args:
        q: ``[B, Hk, G, T, D]`` queries (already scaled), G query heads per key head.
        k: ``[B, Hk, T, D]`` keys.
        v: ``[B, Hk, T, E]`` values.
        log_a: ``[B, Hk, T, D]`` log decay per key channel (<= 0).
        beta: ``[B, Hk, T]`` write strength.
        state: ``[B, Hk, D, E]`` start state (the inputs are cast to its dtype), or None for zeros.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), F.normalize(torch.randn(1, 2, 5, 4), dim=-1), torch.randn(1, 2, 5, 3)
        >>> o, s = kda_parallel(q, k, v, -torch.rand(1, 2, 5, 4), torch.full((1, 2, 5), 0.5))
        >>> o.shape, s.shape
        (torch.Size([1, 2, 1, 5, 3]), torch.Size([1, 2, 4, 3]))
    """
    if state is None:
        state = q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    return _chunk(_cast(state, q, k, v, log_a, beta), state)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of ``chunk_size`` tokens, each solved exactly from the state the previous one left.

    Args:
        q: ``[B, Hk, G, T, D]`` queries (already scaled).
        k: ``[B, Hk, T, D]`` keys.
        v: ``[B, Hk, T, E]`` values.
        log_a: ``[B, Hk, T, D]`` log decay per key channel (<= 0).
        beta: ``[B, Hk, T]`` write strength.
        state: ``[B, Hk, D, E]`` start state; the inputs are cast to its dtype.
        chunk_size: tokens per chunk (any T works: the last chunk is shorter).

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 7, 4), F.normalize(torch.randn(1, 1, 7, 4), dim=-1), torch.randn(1, 1, 7, 3)
        >>> log_a, b, s0 = -torch.rand(1, 1, 7, 4), torch.rand(1, 1, 7), torch.zeros(1, 1, 4, 3)
        >>> o, s = kda_chunked(q, k, v, log_a, b, s0, chunk_size=3)
        >>> o_ref, s_ref = kda_parallel(q, k, v, log_a, b, s0)
        >>> torch.allclose(o, o_ref, atol=1e-5), torch.allclose(s, s_ref, atol=1e-5)
        (True, True)
    """
    q, k, v, log_a, beta = _cast(state, q, k, v, log_a, beta)
    kernel = pick("chunk_kda", q, k, v, log_a, beta, state, unsupported=too_wide(k))
    if kernel is not None:
        return run_fla(kernel, q, k, v, state, g=log_a, beta=beta)
    outs = []
    pieces = zip(q.split(chunk_size, dim=3), *(x.split(chunk_size, dim=2) for x in (k, v, log_a, beta)), strict=True)
    for operands in pieces:
        out, state = _chunk(operands, state)
        outs.append(out)
    return torch.cat(outs, dim=3) if len(outs) > 1 else outs[0], state


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (T == 1): decay the state per key channel, correct what it recalls for the key, read it.

    Args:
        q: ``[B, Hk, G, 1, D]`` the token's queries (already scaled).
        k: ``[B, Hk, 1, D]`` its key.
        v: ``[B, Hk, 1, E]`` its value.
        log_a: ``[B, Hk, 1, D]`` its log decay per key channel.
        beta: ``[B, Hk, 1]`` its write strength.
        state: ``[B, Hk, D, E]`` the state before the token.
        in_place: write the new state into ``state``'s buffer.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, 1, E]`` and the new state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 3, 4), F.normalize(torch.randn(1, 1, 3, 4), dim=-1), torch.randn(1, 1, 3, 2)
        >>> log_a, b, s, outs = -torch.rand(1, 1, 3, 4), torch.rand(1, 1, 3), torch.zeros(1, 1, 4, 2), []
        >>> for t in range(3):
        ...     o, s = kda_step(q[..., t:t + 1, :], k[:, :, t:t + 1], v[:, :, t:t + 1], log_a[:, :, t:t + 1],
        ...                     b[..., t:t + 1], s)
        ...     outs.append(o)
        >>> torch.allclose(torch.cat(outs, dim=3), kda_parallel(q, k, v, log_a, b)[0], atol=1e-5)
        True
    """
    q, k, v, log_a, beta = _cast(state, q, k, v, log_a, beta)
    kernel = pick("fused_recurrent_kda", q, k, v, log_a, beta, state, unsupported=too_wide(k))
    if kernel is not None:
        return run_fla(kernel, q, k, v, state, in_place, g=log_a, beta=beta)
    decay = log_a[:, :, 0, :, None].exp()  # [B, Hk, D, 1]
    state = state.mul_(decay) if in_place else state * decay
    new = beta[..., None] * (v - k @ state)  # [B, Hk, 1, E]
    state = state.addcmul_(k.transpose(-1, -2), new) if in_place else torch.addcmul(state, k.transpose(-1, -2), new)
    return torch.matmul(q[:, :, :, 0], state).unsqueeze(3), state  # no broadcast copy of the state over the groups
