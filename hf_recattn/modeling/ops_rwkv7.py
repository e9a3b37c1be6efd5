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

every exponent a difference with s < t, so <= 0 however strong the decays (masked to -inf above the diagonal
before the exponential): nothing overflows. The chunk's queries then read
o_t = (q_t Γ_t) M_0 + sum_{s <= t} (q_t Γ_t / Γ_s) . (k_s^T v_s - b_s^T u_s) and it leaves
M_C = Γ_C M_0 + sum_s (Γ_C / Γ_s) (k_s^T v_s - b_s^T u_s). The parallel form is one chunk over the whole sequence
(exact, O(T^2 D) memory for the pairwise decays); the chunked form passes the state from chunk to chunk.

Shapes: q [B, Hk, G, T, D] (G query heads read one key head's state, already scaled), k, kk (= k^), log_w
(= log w <= 0) and a [B, Hk, T, D], v [B, Hk, T, E]; the state [B, Hk, D, E]. Everything is computed in the
state's dtype (float32 states of a half-precision model). Padding: ``mask_padding`` gives a padded token w = 1,
a = 0 and k = 0, so it leaves the state untouched.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def mask_padding(
    k: Tensor, log_w: Tensor, a: Tensor, token_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """k, log_w and a [B, Hk, T, D] with padded tokens (``token_mask`` [B, T] False) made no-ops: no write (k = 0),
    no decay (log w = 0), no correction (a = 0)."""
    if token_mask is None:
        return k, log_w, a
    keep = token_mask[:, None, :, None]
    return k * keep.to(k.dtype), log_w.masked_fill(~keep, 0.0), a * keep.to(a.dtype)


def _pairwise(cum_rows: Tensor, cum: Tensor, strict: bool) -> Tensor:
    """[..., T, T, D] e^{cum_rows_t - cum_s} for s < t (``strict``) or s <= t, zero elsewhere (masked before the
    exponential, so only exponents <= 0 are taken)."""
    t = cum.shape[-2]
    keep = torch.ones(t, t, dtype=torch.bool, device=cum.device).tril(-1 if strict else 0)[..., None]
    return (cum_rows[..., :, None, :] - cum[..., None, :, :]).masked_fill(~keep, -math.inf).exp()


def _chunk(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk from ``state`` (see the module docstring): (o [B, Hk, G, C, E], the state after the chunk)."""
    b = a * kk
    cum = log_w.cumsum(-2)  # log Γ_t, through token t
    prev = cum - log_w  # log Γ_{t-1}
    to_prev = _pairwise(prev, cum, strict=True)
    lower = torch.einsum("bhtd,bhsd,bhtsd->bhts", kk, b, to_prev)
    recall = torch.einsum("bhtd,bhsd,bhtsd->bhts", kk, k, to_prev)
    rhs = (kk * prev.exp()) @ state + recall @ v
    u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    to_query = _pairwise(cum, cum, strict=False)
    scores = torch.einsum("bhgtd,bhsd,bhtsd->bhgts", q, k, to_query)
    corrections = torch.einsum("bhgtd,bhsd,bhtsd->bhgts", q, b, to_query)
    out = (q * cum.exp()[:, :, None]) @ state[:, :, None] + scores @ v[:, :, None] - corrections @ u[:, :, None]
    last = cum[:, :, -1:]
    to_end = (last - cum).exp()  # [B, Hk, C, D]: each token's decay to the chunk's end
    new = last.transpose(-1, -2).exp() * state + (k * to_end).transpose(-1, -2) @ v - (b * to_end).transpose(-1, -2) @ u
    return out, new


def _cast(state: Tensor, *tensors: Tensor) -> list[Tensor]:
    return [t.to(state.dtype) for t in tensors]


def rwkv7_parallel(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The whole sequence as one chunk from ``state``: (o [B, Hk, G, T, E], final state)."""
    return _chunk(*_cast(state, q, k, v, log_w, kk, a), state)


def rwkv7_chunked(
    q: Tensor, k: Tensor, v: Tensor, log_w: Tensor, kk: Tensor, a: Tensor, state: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunks of ``chunk_size`` tokens (the last may be shorter), the state passed from one to the next:
    (o [B, Hk, G, T, E], final state). O(T * chunk_size * D) time."""
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
    state); ``in_place`` writes the new state into ``state``'s buffer."""
    q, k, v, log_w, kk, a = _cast(state, q, k, v, log_w, kk, a)
    recalled = kk @ state  # u = k^ M: [B, Hk, 1, E]
    decay = log_w.exp().transpose(-1, -2)  # [B, Hk, D, 1]
    write = torch.cat([k, -(a * kk)], dim=2).transpose(-1, -2)  # [B, Hk, D, 2]: k and -b side by side
    update = write @ torch.cat([v, recalled], dim=2)  # k^T v - b^T u
    state = state.mul_(decay).add_(update) if in_place else state * decay + update  # the same roundings
    return (q[:, :, :, 0] @ state).unsqueeze(3), state
