"""Functional forms of Heinsen's log-space attention (Heinsen, arXiv:2404.05843): weights w_ts = exp(q_t) . exp(k_s).

    o_t = sum_s w_ts v_s / sum_s w_ts,   log w_ts = LSE_i(q_ti + k_si)

The parallel form is the paper's: log-cumulative sums over keys H^Z_i = LSE_s(k_si) ([D]) and
H^S_ie = LSE_s(k_si + log v_se) ([D, E]), read as log S_te = LSE_i(q_ti + H^S_ie) and log Z_t = LSE_i(q_ti + H^Z_i).
Signs: log v is real only for v > 0, so values are split into two strictly positive parts v = a - b with
a = max(v, 0) + delta and b = max(-v, 0) + delta (written (|v| +- v)/2 + delta; delta = sqrt(smallest normal
float)), each with its own log-space sum, and o_t = exp(log S^a_t - log Z_t) - exp(log S^b_t - log Z_t).
Each term is a weighted average of positive numbers, so it stays within [delta, max |v| + delta] however large
the logits are; delta cancels exactly in the difference, keeps every log finite, and makes the gradient with
respect to v exact at v = 0 (through |v|' = 0 there; a plain max(v, 0) split would give 0 instead of 1).

The recurrent state (chunked and step forms) keeps H^Z in log space and the value sums relative to it:
M_ie = sum_s exp(k_si - H^Z_i) v_se = exp(H^S+_ie - H^Z_i) - exp(H^S-_ie - H^Z_i), for every key dimension i an
average of the values weighted by exp(k_si), so bounded by max |v| whatever the logits, and of either sign
without a split. A query reads o_t = softmax_i(q_ti + H^Z_i) @ M (the ratio of the paper's two log-sums), one
[D] softmax and one product instead of D x E exponentials; a new key takes the share sigmoid(k_i - H^Z_i) of
dimension i. The state is half the size of the two signed log-space sums.

log 0 (the empty sums of the initial state, and padded keys) is the finite ``log_zero(dtype)`` (a quarter of
the most negative float) rather than -inf: an all -inf log-sum-exp has a NaN gradient, while
exp(log_zero - anything finite) is exactly 0. Padded keys get k = log_zero, so they add nothing to any sum (a
padded key folded into an empty state leaves M holding its value, which the first real key's share of 1
overwrites).

Queries are shifted by their own maximum entry first (q_t - max_i q_ti, a per-query factor that
cancels), which keeps the log-sums small and their fp32 rounding low. With |q|, |k| near 80 the log-weights
reach ~160, where the fp32 spacing is 1.5e-5: expect relative errors of that order there (1e-7 for
moderate logits).

Shapes: queries ``[B, Hkv, G, T, D]``, keys ``[B, Hkv, T, D]`` (both already scaled, keys of padded tokens set
to log_zero), values ``[B, Hkv, T, E]``. State: ``hz`` ``[B, Hkv, D]`` and ``mean`` ``[B, Hkv, D, E]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

State = dict[str, torch.Tensor]


def log_zero(dtype: torch.dtype) -> float:
    """The finite stand-in for log 0: two of them still add up to a finite number.

    Args:
        dtype: the floating-point dtype the logs live in.

    Returns:
        A quarter of the most negative finite number of ``dtype``.

    Example:
        >>> zero = torch.tensor(log_zero(torch.float32))
        >>> bool(torch.isfinite(zero + zero)), torch.exp(zero).item()
        (True, 0.0)
    """
    return -torch.finfo(dtype).max / 4


def signed_logs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a, log b) for the positive parts a - b = v (see the module docstring).

    Args:
        v: values of any sign and shape.

    Returns:
        ``(log a, log b)``, each shaped like ``v``, with a, b > 0 and a - b = v.

    Example:
        >>> pos, neg = signed_logs(torch.tensor([2.0, -3.0]))
        >>> pos.exp() - neg.exp()
        tensor([ 2., -3.])
    """
    delta = torch.finfo(v.dtype).tiny ** 0.5
    magnitude = v.abs()
    return torch.log((magnitude + v) * 0.5 + delta), torch.log((magnitude - v) * 0.5 + delta)


def shift_queries(q: torch.Tensor) -> torch.Tensor:
    """q_t - max_i q_ti: scales every weight of query t by the same factor, which cancels.

    Args:
        q: ``[..., D]`` queries.

    Returns:
        ``[..., D]`` the queries less their largest entry (no gradient through the shift).

    Example:
        >>> shift_queries(torch.tensor([[1.0, 3.0]]))
        tensor([[-2.,  0.]])
    """
    return q - q.amax(dim=-1, keepdim=True).detach()


def mask_keys(k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Set the keys of padded tokens to log_zero (key_mask: [B, T], True / 1 = real).

    Args:
        k: ``[B, Hkv, T, D]`` keys.
        key_mask: ``[B, T]`` (True / 1 = real token), or None.

    Returns:
        ``[B, Hkv, T, D]``: padded tokens' keys at ``log_zero``, so that they add nothing to any sum.

    Example:
        >>> k = mask_keys(torch.zeros(1, 1, 2, 3), torch.tensor([[0, 1]]))
        >>> bool((k[0, 0, 0] == log_zero(torch.float32)).all()), bool((k[0, 0, 1] == 0).all())
        (True, True)
    """
    if key_mask is None:
        return k
    real = key_mask.bool()[:, None, :, None]
    return torch.where(real, k, torch.full_like(k, log_zero(k.dtype)))


def _key_value_logs(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_si + log a_se and k_si + log b_se: two [B, Hkv, T, D, E] tensors."""
    pos, neg = signed_logs(v)
    return k[..., :, None] + pos[..., None, :], k[..., :, None] + neg[..., None, :]


def read_out(q: torch.Tensor, hz: torch.Tensor, hs_pos: torch.Tensor, hs_neg: torch.Tensor) -> torch.Tensor:
    """o = exp(LSE_i(q_i + H+_i) - LSE_i(q_i + Hz_i)) - (same with H-); states broadcast against [G, T].

    Args:
        q: ``[..., T, D]`` queries.
        hz: ``[..., T or 1, D]`` log-sums over keys of exp(k) (H^Z).
        hs_pos: ``[..., T or 1, D, E]`` log-sums of exp(k) times the positive parts of the values (H^S+).
        hs_neg: ``[..., T or 1, D, E]`` the same for the negative parts (H^S-).

    Returns:
        ``[..., T, E]`` the weighted averages of the values.

    Example:
        >>> k, v = torch.randn(1, 4), torch.randn(1, 3)
        >>> pos, neg = signed_logs(v)
        >>> o = read_out(torch.randn(1, 4), k, k[..., None] + pos[:, None], k[..., None] + neg[:, None])
        >>> torch.allclose(o, v, atol=1e-5)  # one key: its value
        True
    """
    log_z = torch.logsumexp(q + hz, dim=-1)[..., None]  # [..., T, 1]
    log_pos = torch.logsumexp(q[..., None] + hs_pos, dim=-2)  # [..., T, E]
    log_neg = torch.logsumexp(q[..., None] + hs_neg, dim=-2)
    return torch.exp(log_pos - log_z) - torch.exp(log_neg - log_z)


def heinsen_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Heinsen's eqs. 3 / 4: log-(cumulative-)sums over keys of all the states, then one read-out per query.

    Memory is O(T * D * E) per head (the paper's parallel-scan form); the chunked form avoids it.

    Args:
        q: ``[B, Hkv, G, T, D]`` queries (already scaled), G query heads per key head.
        k: ``[B, Hkv, T, D]`` keys (already scaled; padded tokens at ``log_zero``).
        v: ``[B, Hkv, T, E]`` values.
        causal: each query reads only keys up to its own position.

    Returns:
        ``[B, Hkv, G, T, E]`` outputs.

    Example:
        >>> q, k, v = torch.randn(1, 1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 2)
        >>> w = (q.exp() @ k.exp().transpose(-1, -2)).tril()  # exp(q_t) . exp(k_s), causal
        >>> torch.allclose(heinsen_parallel(q, k, v), (w / w.sum(-1, keepdim=True)) @ v[:, :, None], atol=1e-5)
        True
    """
    kv_pos, kv_neg = _key_value_logs(k, v)
    if causal:
        hz, hs_pos, hs_neg = (torch.logcumsumexp(x, dim=2) for x in (k, kv_pos, kv_neg))
    else:
        hz, hs_pos, hs_neg = (torch.logsumexp(x, dim=2, keepdim=True) for x in (k, kv_pos, kv_neg))
    return read_out(q, hz[:, :, None], hs_pos[:, :, None], hs_neg[:, :, None])


def read_state(q: torch.Tensor, hz: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What queries q [..., T, D] read from a state hz [..., D], mean [..., D, E] (leading dims alike): log Z_t
    [..., T] and the state's weighted average of values [..., T, E] = softmax_i(q_ti + H^Z_i) @ M.

    Args:
        q: ``[..., T, D]`` queries.
        hz: ``[..., D]`` the state's log key sums H^Z.
        mean: ``[..., D, E]`` the state's value sums relative to them, M.

    Returns:
        ``(log_z, average)``: ``[..., T]`` and ``[..., T, E]``.

    Example:
        >>> log_z, average = read_state(torch.randn(2, 3, 4), torch.zeros(2, 4), torch.ones(2, 4, 5))
        >>> log_z.shape, average.shape
        (torch.Size([2, 3]), torch.Size([2, 3, 5]))
    """
    logits = q + hz[..., None, :]
    return torch.logsumexp(logits, dim=-1), torch.softmax(logits, dim=-1) @ mean


def heinsen_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, in_place: bool = False
) -> tuple[torch.Tensor, State]:
    """Heinsen's eqs. 5-6 for one token: fold it into H^Z and M, then read them (``in_place``: into the state's
    buffers). With d = k - H^Z the new key's share of dimension i is sigmoid(d_i), the old sums keep the rest.

    Args:
        q: ``[B, Hkv, G, 1, D]`` the token's queries.
        k: ``[B, Hkv, 1, D]`` its key.
        v: ``[B, Hkv, 1, E]`` its value.
        state: ``{"hz": [B, Hkv, D], "mean": [B, Hkv, D, E]}`` before the token (see ``init_heinsen_state``).
        in_place: update the state's buffers.

    Returns:
        ``(o, state)``: o ``[B, Hkv, G, 1, E]`` and the new state.

    Example:
        >>> state = init_heinsen_state(1, 2, 4, 3, torch.device("cpu"), torch.float32)
        >>> v = torch.randn(1, 2, 1, 3)
        >>> o, state = heinsen_step(torch.randn(1, 2, 1, 1, 4), torch.randn(1, 2, 1, 4), v, state)
        >>> torch.allclose(o[:, :, 0], v, atol=1e-6)  # one key so far: its value
        True
    """
    hz, mean = state["hz"], state["mean"]
    q, k, v = q.to(hz.dtype), k[:, :, 0].to(hz.dtype), v[:, :, 0].to(hz.dtype)
    gap = k - hz
    keep, take = torch.sigmoid(-gap)[..., None], torch.sigmoid(gap)[..., None]
    new_hz = torch.logaddexp(hz, k)
    if in_place:
        new_mean = mean.mul_(keep).addcmul_(take, v[:, :, None, :])
        new_hz = hz.copy_(new_hz)
    else:
        new_mean = torch.addcmul(mean * keep, take, v[:, :, None, :])
    b, hk, g, _, d = q.shape
    weights = torch.softmax(q.view(b, hk, g, d) + new_hz[:, :, None], dim=-1)
    out = (weights @ new_mean).view(b, hk, g, 1, -1)
    return out, {"hz": new_hz, "mean": new_mean}


#: a pairwise weight sum below this (relative to its offsets) loses precision: taken exactly instead
_SAFE_SUM = 1e-30


def chunk_log_weights(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """log w_ts = LSE_i(q_ti + k_si) for queries [..., C, D] and keys [..., C, D] (leading dims broadcast):
    [..., C, C].

    One product: with each query and each key shifted by its own largest entry (a_t, b_s),
    w_ts = exp(a_t + b_s) sum_i exp(q_ti - a_t) exp(k_si - b_s), every factor in (0, 1] and the sum at least
    the product of the two factors at any one i. Where a visible pair's sum falls below 1e-30 (entries hundreds
    apart, far beyond trained models) the exact all-pairs log-sum-exp replaces the product, one query block
    at a time.

    Args:
        q: ``[..., C, D]`` queries.
        k: ``[..., C, D]`` keys.
        visible: ``[C, C]`` bool (broadcast): the pairs whose precision counts.

    Returns:
        ``[..., C, C]`` log-weights.

    Example:
        >>> q, k = torch.randn(3, 4), torch.randn(3, 4)
        >>> exact = torch.logsumexp(q[:, None] + k[None], dim=-1)
        >>> torch.allclose(chunk_log_weights(q, k, torch.ones(3, 3, dtype=torch.bool)), exact, atol=1e-5)
        True
    """
    query_max = q.amax(dim=-1, keepdim=True).detach()
    key_max = k.amax(dim=-1, keepdim=True).detach()
    sums = torch.exp(q - query_max) @ torch.exp(k - key_max).transpose(-1, -2)
    if not bool(((sums < _SAFE_SUM) & visible).any()):
        return torch.log(sums) + query_max + key_max.transpose(-1, -2)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q, k = q.expand(*lead, *q.shape[-2:]), k.expand(*lead, *k.shape[-2:])
    exact = [torch.logsumexp(qb[:, None, :] + kb[None, :, :], dim=-1)
             for qb, kb in zip(q.flatten(0, -3), k.flatten(0, -3), strict=True)]
    return torch.stack(exact).view(*q.shape[:-1], k.shape[-2])


def _state_passing(
    hz: torch.Tensor, mean: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state each chunk starts from, for keys [B, Hkv, N, C, D] and values [B, Hkv, N, C, E]: (hz [B, Hkv, N,
    D], mean [B, Hkv, N, D, E]) at the chunk starts, and the final (hz, mean). Each chunk's own sums are formed
    at once; only their merging runs chunk by chunk (a few small ops each)."""
    chunk_hz = torch.logsumexp(k, dim=3)  # [B, Hkv, N, D]
    chunk_mean = torch.exp(k - chunk_hz[:, :, :, None]).transpose(-1, -2) @ v  # [B, Hkv, N, D, E]
    starts_hz, starts_mean = [], []
    for part_hz, part_mean in zip(chunk_hz.unbind(2), chunk_mean.unbind(2), strict=True):
        starts_hz.append(hz)
        starts_mean.append(mean)
        new_hz = torch.logaddexp(hz, part_hz)
        mean = torch.exp(hz - new_hz)[..., None] * mean + torch.exp(part_hz - new_hz)[..., None] * part_mean
        hz = new_hz
    return torch.stack(starts_hz, 2), torch.stack(starts_mean, 2), hz, mean


def heinsen_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, chunk_size: int
) -> tuple[torch.Tensor, State]:
    """Chunkwise causal form: exact pairwise weights inside a chunk (``chunk_log_weights``), the state across
    chunks. Both parts are brought to a common per-query offset m_t (the largest log-weight) before leaving
    log space, so nothing overflows however large the logits are. A padded tail (keys log 0, values and
    queries 0) completes the last chunk and is dropped.

    Args:
        q: ``[B, Hkv, G, T, D]`` queries (already scaled).
        k: ``[B, Hkv, T, D]`` keys (padded tokens at ``log_zero``).
        v: ``[B, Hkv, T, E]`` values.
        state: ``{"hz": [B, Hkv, D], "mean": [B, Hkv, D, E]}`` start state; the inputs are cast to its dtype.
        chunk_size: tokens per chunk.

    Returns:
        ``(o, state)``: o ``[B, Hkv, G, T, E]`` and the final state.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 5, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
        >>> state = init_heinsen_state(1, 1, 4, 3, torch.device("cpu"), torch.float32)
        >>> o, state = heinsen_chunked(q, k, v, state, chunk_size=2)
        >>> torch.allclose(o, heinsen_parallel(q, k, v), atol=1e-5)
        True
    """
    hz, mean = state["hz"], state["mean"]
    q, k, v = q.to(hz.dtype), k.to(hz.dtype), v.to(hz.dtype)  # float32 states of a half-precision model
    b, hk, g, t, d = q.shape
    e = v.shape[-1]
    c = min(chunk_size, t)
    pad = (-t) % c
    zero = log_zero(q.dtype)
    if pad:
        q, v = F.pad(q, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad), value=zero)
    n = (t + pad) // c
    # the query heads of a key head side by side in each chunk: [B, Hkv, N, G * C, D]
    qc = q.view(b, hk, g, n, c, d).transpose(2, 3).reshape(b, hk, n, g * c, d)
    kc, vc = k.view(b, hk, n, c, d), v.view(b, hk, n, c, e)
    start_hz, start_mean, hz, mean = _state_passing(hz, mean, kc, vc)
    visible = torch.ones(c, c, dtype=torch.bool, device=q.device).tril().repeat(g, 1)  # [G * C, C]
    log_w = chunk_log_weights(qc, kc, visible).masked_fill(~visible, zero)  # [B, Hkv, N, G * C, C]
    log_z, average = read_state(qc, start_hz, start_mean)
    m = torch.maximum(log_w.amax(-1), log_z).detach()
    w = torch.exp(log_w - m[..., None])
    share = torch.exp(log_z - m)[..., None]
    out = (w @ vc + share * average) / (w.sum(-1, keepdim=True) + share)
    out = out.view(b, hk, n, g, c, e).transpose(2, 3).reshape(b, hk, g, n * c, e)
    return out[:, :, :, :t], {"hz": hz, "mean": mean}


def init_heinsen_state(
    batch: int, kv_heads: int, d_k: int, d_v: int, device: torch.device, dtype: torch.dtype
) -> State:
    """Empty sums: H^Z = log 0 and M = 0.

    Args:
        batch: B.
        kv_heads: Hkv, the key heads (one state each).
        d_k: D, the key width.
        d_v: E, the value width.
        device: where the state lives.
        dtype: its dtype.

    Returns:
        ``{"hz": [B, Hkv, D], "mean": [B, Hkv, D, E]}``.

    Example:
        >>> state = init_heinsen_state(1, 2, 4, 3, torch.device("cpu"), torch.float32)
        >>> state["hz"].shape, state["mean"].shape
        (torch.Size([1, 2, 4]), torch.Size([1, 2, 4, 3]))
    """
    return {
        "hz": torch.full((batch, kv_heads, d_k), log_zero(dtype), device=device, dtype=dtype),
        "mean": torch.zeros((batch, kv_heads, d_k, d_v), device=device, dtype=dtype),
    }
