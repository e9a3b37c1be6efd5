"""Functional forms of RWKV-7's generalized delta rule ("RWKV-7 'Goose' with Expressive Dynamic State Evolution",
Peng et al., arXiv:2503.14456; fla's ``chunk_rwkv7`` / ``fused_recurrent_rwkv7`` compute the same recurrence).

Per key head the paper keeps S [E, D] (values x keys) and updates it with row vectors k^_t (unit key), a_t (the
in-context learning rate), w_t (the decay, all in (0, 1)^D), k_t (the written key) and v_t:

    S_t = S_{t-1} (diag(w_t) - k^_t^T (a_t * k^_t)) + v_t^T k_t,        o_t = S_t q_t^T.

Here the state is stored transposed, M = S^T [D, E] (keys x values, as every state of the package), so that
M_t = diag(w_t) M_{t-1} - b_t^T u_t + k_t^T v_t and o_t = q_t M_t, with b_t = a_t * k^_t and u_t = k^_t M_{t-1}
(what the state recalls for the key it is about to correct).

Chunks: inside a chunk with start state M_0 and log Γ_t = sum_{r <= t} log w_r (per key dimension), the u_t solve
a unit lower-triangular C x C system,

    u_t + sum_{s < t} L_ts u_s = (k^_t Γ_{t-1}) M_0 + sum_{s < t} A_ts v_s,
    L_ts = sum_d k^_td b_sd e^{log Γ_{t-1,d} - log Γ_{s,d}},    A_ts = sum_d k^_td k_sd e^{log Γ_{t-1,d} - log Γ_{s,d}},

with exponents <= 0 (s < t). The chunk's queries then read
o_t = (q_t Γ_t) M_0 + sum_{s <= t} (q_t Γ_t / Γ_s) . (k_s^T v_s - b_s^T u_s) and it leaves
M_C = Γ_C M_0 + sum_s (Γ_C / Γ_s) (k_s^T v_s - b_s^T u_s). The C x C terms are products of [C, D] matrices: each
pair's decay is factored through the start of the query's sub-chunk of ``SUB_CHUNK`` tokens (see ``_chunk``), which
stays inside fp32's range because RWKV-7's decay is bounded, -log w < e^{-1/2} per token; pairs are masked (before
the exponential where a factor could overflow) so that no entry is inf or nan, however long the sequence. The
parallel form is one chunk over the whole sequence (O(T^2 D / SUB_CHUNK) memory for the factored keys); the chunked
form passes the state from chunk to chunk.

Shapes: q [B, Hk, G, T, D] (G query heads read one key head's state, already scaled), k, kk (= k^), log_w
(= log w, in [-e^{-1/2}, 0]: RWKV-7's range, which the factoring needs) and a [B, Hk, T, D], v [B, Hk, T, E]; the
state [B, Hk, D, E]. Everything is computed in the state's dtype (float32 states of a half-precision model).
Padding: ``mask_padding`` gives a padded token w = 1, a = 0 and k = 0, so it leaves the state untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .triangular import unit_lower_solve


def mask_padding(
    k: Tensor, log_w: Tensor, a: Tensor, token_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """k, log_w and a [B, Hk, T, D] with padded tokens (``token_mask`` [B, T] False) made no-ops: no write (k = 0),
    no decay (log w = 0), no correction (a = 0).

    Args:
        k: ``[B, Hk, T, D]`` written keys.
        log_w: ``[B, Hk, T, D]`` log decays.
        a: ``[B, Hk, T, D]`` in-context learning rates.
        token_mask: ``[B, T]`` bool (True = real token), or None.

    Returns:
        ``(k, log_w, a)``, each ``[B, Hk, T, D]``.

    Example:
        >>> k, log_w, a = mask_padding(*torch.ones(3, 1, 1, 2, 2).unbind(0), torch.tensor([[False, True]]))
        >>> k[0, 0, :, 0], log_w[0, 0, :, 0], a[0, 0, :, 0]
        (tensor([0., 1.]), tensor([0., 1.]), tensor([0., 1.]))
    """
    if token_mask is None:
        return k, log_w, a
    keep = token_mask[:, None, :, None]
    return k * keep.to(k.dtype), log_w.masked_fill(~keep, 0.0), a * keep.to(a.dtype)


#: -log w < e^{-1/2}: the strongest decay per token RWKV-7's w expresses
MAX_DECAY_RATE = math.exp(-0.5)
#: tokens per sub-chunk: inside a chunk, decays are factored through the start of each sub-chunk of this many tokens
SUB_CHUNK = 16


def _seen_from_sub_chunks(x: Tensor, cum: Tensor, ref: Tensor) -> Tensor:
    """[..., n, C, D] x_s e^{ref_i - cum_s}: the columns x [..., C, D] as rows of sub-chunk i (of n) see them, zero
    for s past sub-chunk i (masked before the exponential). The exponent is <= 0 for s before sub-chunk i and at most
    MAX_DECAY_RATE * SUB_CHUNK inside it."""
    c, n = cum.shape[-2], ref.shape[-2]
    index = torch.arange(c, device=cum.device)
    later = index[None, :] >= (torch.arange(1, n + 1, device=cum.device) * (c // n))[:, None]  # [n, C]
    exponent = (ref[..., :, None, :] - cum[..., None, :, :]).masked_fill(later[..., None], -math.inf)
    return x[..., None, :, :] * exponent.exp()


def _rows_times_columns(rows: Tensor, row_log: Tensor, ref: Tensor, columns: Tensor) -> Tensor:
    """[..., C, C'] sum_d rows_td e^{row_log_td - ref_i(t)d} columns[i(t)]_sd, with i(t) the sub-chunk of row t
    (row_log_t <= ref_i(t): every exponent <= 0). rows [..., C, D], ref [..., n, D], columns [..., n, C', D]."""
    *lead, c, d = rows.shape
    n = ref.shape[-2]
    scaled = rows * (row_log - ref.repeat_interleave(c // n, dim=-2)).exp()
    return (scaled.view(*lead, n, c // n, d) @ columns.transpose(-1, -2)).reshape(*lead, c, -1)


def _chunk(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk from ``state`` (see the module docstring): (o [B, Hk, G, C, E], the state after the chunk).

    Each pair (t, s) of the C x C terms takes its decay e^{log Γ_t' - log Γ_s} through the start r of t's sub-chunk,
    e^{log Γ_t' - log Γ_r} e^{log Γ_r - log Γ_s}: the first factor is <= 1, the second <= 1 for s in an earlier
    sub-chunk and at most e^{MAX_DECAY_RATE * SUB_CHUNK} (e^{9.7}) inside t's own, so that the terms are products of
    [C, D] matrices without leaving fp32's range, and pairs with s > t are masked after the product.
    """
    c = k.shape[-2]
    sub = min(SUB_CHUNK, c)
    pad = -c % sub  # a ragged chunk gets empty tokens at its end: no decay, no key, no query
    if pad:
        q, k, v, log_w, kk, a = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, log_w, kk, a))
    b = a * kk
    cum = log_w.cumsum(-2)  # log Γ_t, through token t
    prev = cum - log_w  # log Γ_{t-1}
    ref = prev[..., ::sub, :]  # log Γ just before each sub-chunk
    both = c + pad
    keys = torch.cat([_seen_from_sub_chunks(y, cum, ref) for y in (k, b)], dim=-2)  # [B, Hk, n, 2 C, D]
    index = torch.arange(both, device=k.device)
    strictly_lower = (index[:, None] > index[None, :]).repeat(1, 2)  # [C, 2 C]: s < t, for both halves
    recall, lower = _rows_times_columns(kk, prev, ref, keys).masked_fill(~strictly_lower, 0.0).split(both, dim=-1)
    u = unit_lower_solve(lower, (kk * prev.exp()) @ state + recall @ v)
    reads = _rows_times_columns(q, cum[:, :, None], ref[:, :, None], keys[:, :, None])
    scores, corrections = reads.masked_fill(index[:, None] < index[None, :].repeat(1, 2), 0.0).split(both, dim=-1)
    out = (q * cum.exp()[:, :, None]) @ state[:, :, None] + scores @ v[:, :, None] - corrections @ u[:, :, None]
    last = cum[:, :, -1:]
    to_end = (last - cum).exp()  # [B, Hk, C, D]: each token's decay to the chunk's end
    new = last.transpose(-1, -2).exp() * state + (k * to_end).transpose(-1, -2) @ v - (b * to_end).transpose(-1, -2) @ u
    return out[..., :c, :], new


def _cast(state: Tensor, *tensors: Tensor) -> list[Tensor]:
    return [t.to(state.dtype) for t in tensors]


def rwkv7_parallel(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The whole sequence as one chunk from ``state``: (o [B, Hk, G, T, E], final state).

    Args:
        q: ``[B, Hk, G, T, D]`` queries (receptance; already scaled), G query heads per key head.
        k: ``[B, Hk, T, D]`` written keys.
        v: ``[B, Hk, T, E]`` values.
        log_w: ``[B, Hk, T, D]`` log decays, in [-e^{-1/2}, 0].
        kk: ``[B, Hk, T, D]`` unit removal keys k^.
        a: ``[B, Hk, T, D]`` in-context learning rates in [0, 1].
        state: ``[B, Hk, D, E]`` start state (keys x values); the inputs are cast to its dtype.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
        >>> kk = torch.randn(1, 2, 5, 4)
        >>> log_w, kk, a = -0.6 * torch.rand(1, 2, 5, 4), kk / kk.norm(dim=-1, keepdim=True), torch.rand(1, 2, 5, 4)
        >>> o, s = rwkv7_parallel(q, k, v, log_w, kk, a, torch.zeros(1, 2, 4, 3))
        >>> o.shape, s.shape
        (torch.Size([1, 2, 1, 5, 3]), torch.Size([1, 2, 4, 3]))
    """
    return _chunk(*_cast(state, q, k, v, log_w, kk, a), state)


def rwkv7_chunked(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunks of ``chunk_size`` tokens (the last may be shorter), the state passed from one to the next:
    (o [B, Hk, G, T, E], final state). O(T * chunk_size * D) time.

    Args:
        q: ``[B, Hk, G, T, D]`` queries (already scaled).
        k: ``[B, Hk, T, D]`` written keys.
        v: ``[B, Hk, T, E]`` values.
        log_w: ``[B, Hk, T, D]`` log decays, in [-e^{-1/2}, 0].
        kk: ``[B, Hk, T, D]`` unit removal keys k^.
        a: ``[B, Hk, T, D]`` in-context learning rates in [0, 1].
        state: ``[B, Hk, D, E]`` start state.
        chunk_size: tokens per chunk.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 7, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 3)
        >>> kk = torch.randn(1, 1, 7, 4)
        >>> log_w, kk, a = -0.6 * torch.rand(1, 1, 7, 4), kk / kk.norm(dim=-1, keepdim=True), torch.rand(1, 1, 7, 4)
        >>> s0 = torch.zeros(1, 1, 4, 3)
        >>> o, s = rwkv7_chunked(q, k, v, log_w, kk, a, s0, chunk_size=3)
        >>> torch.allclose(o, rwkv7_parallel(q, k, v, log_w, kk, a, s0)[0], atol=1e-5)
        True
    """
    q, k, v, log_w, kk, a = _cast(state, q, k, v, log_w, kk, a)
    # split() (not slicing): the backward joins the chunks' gradients once
    pieces = zip(q.split(chunk_size, dim=3), *(y.split(chunk_size, dim=2) for y in (k, v, log_w, kk, a)), strict=True)
    outs = []
    for qc, kc, vc, wc, kkc, ac in pieces:
        out, state = _chunk(qc, kc, vc, wc, kkc, ac, state)
        outs.append(out)
    return torch.cat(outs, dim=3), state


def rwkv7_step(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor, in_place: bool = False
) -> tuple[Tensor, Tensor]:
    """One token (T == 1): M <- diag(w) M - b^T (k^ M) + k^T v, then o = q M. Returns (o [B, Hk, G, 1, E], new
    state); ``in_place`` writes the new state into ``state``'s buffer.

    Args:
        q: ``[B, Hk, G, 1, D]`` the token's queries (already scaled).
        k: ``[B, Hk, 1, D]`` its written key.
        v: ``[B, Hk, 1, E]`` its value.
        log_w: ``[B, Hk, 1, D]`` its log decay.
        kk: ``[B, Hk, 1, D]`` its unit removal key k^.
        a: ``[B, Hk, 1, D]`` its in-context learning rate.
        state: ``[B, Hk, D, E]`` state before the token.
        in_place: update the state in its buffer.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, 1, E]`` and the new state.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5)
        >>> kk = torch.randn(1, 2, 1, 4)
        >>> log_w, kk, a = -0.6 * torch.rand(1, 2, 1, 4), kk / kk.norm(dim=-1, keepdim=True), torch.rand(1, 2, 1, 4)
        >>> o, s = rwkv7_step(q, k, v, log_w, kk, a, torch.zeros(1, 2, 4, 5))
        >>> o.shape, s.shape
        (torch.Size([1, 2, 3, 1, 5]), torch.Size([1, 2, 4, 5]))
    """
    q, k, v, log_w, kk, a = _cast(state, q, k, v, log_w, kk, a)
    recalled = kk @ state  # u = k^ M: [B, Hk, 1, E]
    decay = log_w.exp().transpose(-1, -2)  # [B, Hk, D, 1]
    write = torch.cat([k, -(a * kk)], dim=2).transpose(-1, -2)  # [B, Hk, D, 2]: k and -b side by side
    update = write @ torch.cat([v, recalled], dim=2)  # k^T v - b^T u
    state = state.mul_(decay).add_(update) if in_place else state * decay + update  # the same roundings
    return (q[:, :, :, 0] @ state).unsqueeze(3), state
