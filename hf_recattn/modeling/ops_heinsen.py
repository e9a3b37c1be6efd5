"""Functional forms of Heinsen's log-space attention (seed 001): weights w_ts = exp(q_t) . exp(k_s).

    o_t = sum_s w_ts v_s / sum_s w_ts,   log w_ts = LSE_i(q_ti + k_si)

The states are log-cumulative sums over keys: H^Z_i = LSE_s(k_si) ([D]) and H^S_ie = LSE_s(k_si + log v_se)
([D, E]); a query reads them as log S_te = LSE_i(q_ti + H^S_ie) and log Z_t = LSE_i(q_ti + H^Z_i).

Signs: log v is real only for v > 0, so values are split into two strictly positive parts v = a - b with
a = max(v, 0) + delta and b = max(-v, 0) + delta (written (|v| +- v)/2 + delta; delta = sqrt(smallest normal
float)), each with its own log-space state, and o_t = exp(log S^a_t - log Z_t) - exp(log S^b_t - log Z_t).
Each term is a weighted average of positive numbers, so it stays within [delta, max |v| + delta] however large
the logits are; delta cancels exactly in the difference, keeps every log finite, and makes the gradient with
respect to v exact at v = 0 (through |v|' = 0 there; a plain max(v, 0) split would give 0 instead of 1).

log 0 (the empty sums of the initial state, and padded keys) is the finite ``log_zero(dtype)`` (a quarter of
the most negative float) rather than -inf: an all -inf log-sum-exp has a NaN gradient, while
exp(log_zero - anything finite) is exactly 0. Padded keys get k = log_zero, so they add nothing to any sum.

Queries are shifted by their own maximum entry first (q_t - max_i q_ti, a per-query factor that
cancels), which keeps the log-sums small and their fp32 rounding low. With |q|, |k| near 80 the log-weights
reach ~160, where the fp32 spacing is 1.5e-5: expect relative errors of that order there (1e-7 for
moderate logits).

Shapes: queries ``[B, Hkv, G, T, D]``, keys ``[B, Hkv, T, D]`` (both already scaled, keys of padded tokens set
to log_zero), values ``[B, Hkv, T, E]``. State: ``hz`` ``[B, Hkv, D]``, ``hs_pos`` / ``hs_neg``
``[B, Hkv, D, E]`` (the sums for a and b).
"""

from __future__ import annotations

import torch

State = dict[str, torch.Tensor]


def log_zero(dtype: torch.dtype) -> float:
    """The finite stand-in for log 0: two of them still add up to a finite number."""
    return -torch.finfo(dtype).max / 4


def signed_logs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a, log b) for the positive parts a - b = v (see the module docstring)."""
    delta = torch.finfo(v.dtype).tiny ** 0.5
    magnitude = v.abs()
    return torch.log((magnitude + v) * 0.5 + delta), torch.log((magnitude - v) * 0.5 + delta)


def shift_queries(q: torch.Tensor) -> torch.Tensor:
    """q_t - max_i q_ti: scales every weight of query t by the same factor, which cancels."""
    return q - q.amax(dim=-1, keepdim=True).detach()


def mask_keys(k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Set the keys of padded tokens to log_zero (key_mask: [B, T], True / 1 = real)."""
    if key_mask is None:
        return k
    real = key_mask.bool()[:, None, :, None]
    return torch.where(real, k, torch.full_like(k, log_zero(k.dtype)))


def _key_value_logs(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_si + log a_se and k_si + log b_se: two [B, Hkv, T, D, E] tensors."""
    pos, neg = signed_logs(v)
    return k[..., :, None] + pos[..., None, :], k[..., :, None] + neg[..., None, :]


def read_out(q: torch.Tensor, hz: torch.Tensor, hs_pos: torch.Tensor, hs_neg: torch.Tensor) -> torch.Tensor:
    """o = exp(LSE_i(q_i + H+_i) - LSE_i(q_i + Hz_i)) - (same with H-); states broadcast against [G, T]."""
    log_z = torch.logsumexp(q + hz, dim=-1)[..., None]  # [..., T, 1]
    log_pos = torch.logsumexp(q[..., None] + hs_pos, dim=-2)  # [..., T, E]
    log_neg = torch.logsumexp(q[..., None] + hs_neg, dim=-2)
    return torch.exp(log_pos - log_z) - torch.exp(log_neg - log_z)


def heinsen_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Seed 001 eq. 3 / 4: log-(cumulative-)sums over keys of all the states, then one read-out per query.

    Memory is O(T * D * E) per head (the paper's parallel-scan form); the chunked form avoids it.
    """
    kv_pos, kv_neg = _key_value_logs(k, v)
    if causal:
        hz, hs_pos, hs_neg = (torch.logcumsumexp(x, dim=2) for x in (k, kv_pos, kv_neg))
    else:
        hz, hs_pos, hs_neg = (torch.logsumexp(x, dim=2, keepdim=True) for x in (k, kv_pos, kv_neg))
    return read_out(q, hz[:, :, None], hs_pos[:, :, None], hs_neg[:, :, None])


def heinsen_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, in_place: bool = False
) -> tuple[torch.Tensor, State]:
    """Seed 001 eqs. 5-6: fold one token into the log-space states, then read them (``in_place``: into the
    state's buffers)."""
    dtype = state["hz"].dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kv_pos, kv_neg = _key_value_logs(k, v)
    terms = {"hz": k[:, :, 0], "hs_pos": kv_pos[:, :, 0], "hs_neg": kv_neg[:, :, 0]}
    new = {name: torch.logaddexp(state[name], term, out=state[name] if in_place else None)
           for name, term in terms.items()}
    out = read_out(
        q, new["hz"][:, :, None, None], new["hs_pos"][:, :, None, None], new["hs_neg"][:, :, None, None]
    )
    return out, new


def heinsen_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, chunk_size: int
) -> tuple[torch.Tensor, State]:
    """Chunkwise causal form, O(T * chunk * D) memory: exact all-pairs log-weights inside a chunk, the
    log-space states across chunks. Both parts are brought to a common per-query offset m_t (the largest
    log-weight) before leaving log space, so nothing overflows and signed values need no split inside a chunk.
    """
    hz, hs_pos, hs_neg = state["hz"], state["hs_pos"], state["hs_neg"]
    q, k, v = q.to(hz.dtype), k.to(hz.dtype), v.to(hz.dtype)  # float32 states of a half-precision model
    zero = log_zero(q.dtype)
    outs = []
    for start in range(0, q.shape[3], chunk_size):
        qc, kc, vc = (
            q[:, :, :, start : start + chunk_size],
            k[:, :, start : start + chunk_size],
            v[:, :, start : start + chunk_size],
        )
        c = kc.shape[2]
        log_w = torch.logsumexp(qc[..., :, None, :] + kc[:, :, None, None, :, :], dim=-1)  # [B, Hkv, G, C, C]
        keep = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        log_w = log_w.masked_fill(~keep, zero)
        log_z = torch.logsumexp(qc + hz[:, :, None, None], dim=-1)  # [B, Hkv, G, C]
        log_pos = torch.logsumexp(qc[..., None] + hs_pos[:, :, None, None], dim=-2)  # [B, Hkv, G, C, E]
        log_neg = torch.logsumexp(qc[..., None] + hs_neg[:, :, None, None], dim=-2)
        m = torch.maximum(log_w.amax(-1), log_z).detach()[..., None]
        w = torch.exp(log_w - m)
        num = torch.einsum("bhgts,bhse->bhgte", w, vc) + torch.exp(log_pos - m) - torch.exp(log_neg - m)
        den = w.sum(-1, keepdim=True) + torch.exp(log_z[..., None] - m)
        outs.append(num / den)
        kv_pos, kv_neg = _key_value_logs(kc, vc)
        hz = torch.logaddexp(hz, torch.logsumexp(kc, dim=2))
        hs_pos = torch.logaddexp(hs_pos, torch.logsumexp(kv_pos, dim=2))
        hs_neg = torch.logaddexp(hs_neg, torch.logsumexp(kv_neg, dim=2))
    return torch.cat(outs, dim=3), {"hz": hz, "hs_pos": hs_pos, "hs_neg": hs_neg}


def init_log_state(
    batch: int, kv_heads: int, d_k: int, d_v: int, device: torch.device, dtype: torch.dtype
) -> State:
    """Empty sums: every entry log 0."""
    zero = log_zero(dtype)
    return {
        "hz": torch.full((batch, kv_heads, d_k), zero, device=device, dtype=dtype),
        "hs_pos": torch.full((batch, kv_heads, d_k, d_v), zero, device=device, dtype=dtype),
        "hs_neg": torch.full((batch, kv_heads, d_k, d_v), zero, device=device, dtype=dtype),
    }
