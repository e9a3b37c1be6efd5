"""Functional forms of truncated-Taylor attention (Mongaras & Larson, arXiv:2507.23632): weights T_N(x) = sum_{n<=N}
x^n / n!.

The recurrent form keeps, per order n, the state H_n = sum_s K_s^{(x)n} V_s^T. A symmetric tensor power holds
only C(d+n-1, n) distinct entries (the monomials k^a with |a| = n), so we store it packed: with
phi_n(x)_a = x^a / sqrt(a!) (a a multi-index of degree n, a! = prod_i a_i!) the multinomial theorem gives

    phi_n(q) . phi_n(k) = sum_{|a|=n} q^a k^a / a! = (q . k)^n / n!,

and the concatenation Phi(x) = [1, phi_1(x), ..., phi_N(x)] (C(d+N, N) entries) turns T_N(q . k) into the
inner product Phi(q) . Phi(k): the recurrent form is linear attention with the feature map Phi.

Shapes: queries ``[B, Hkv, G, T, D]`` (already multiplied by the attention scale), keys ``[B, Hkv, T, D]``,
values ``[B, Hkv, T, E]``; ``key_mask`` is ``[B, T]`` (1 real, 0 padding) or None. States: ``S``
``[B, Hkv, P, E]`` (sum Phi(k) v^T), optionally ``z`` ``[B, Hkv, P]`` (sum Phi(k)) and ``n`` ``[B, Hkv]``
(number of real keys), P = C(D+N, N).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

State = dict[str, torch.Tensor]


def taylor_poly(x: torch.Tensor, order: int) -> torch.Tensor:
    """T_N(x) by Horner's rule: 1 + x(1 + x/2(1 + x/3(... (1 + x/N)))).

    Args:
        x: any tensor.
        order: N >= 0.

    Returns:
        T_N(x) = sum_{n <= N} x^n / n!, shaped like ``x``.

    Example:
        >>> taylor_poly(torch.tensor([0.0, 1.0, 2.0]), 2)
        tensor([1.0000, 2.5000, 5.0000])
    """
    out = torch.ones_like(x)
    for n in range(order, 0, -1):
        out = 1.0 + out * x / n
    return out


def packed_dim(head_dim: int, order: int) -> int:
    """Entries of Phi for orders 0..N: sum_n C(d+n-1, n) = C(d+N, N).

    Args:
        head_dim: d, the width of the vectors Phi maps.
        order: N.

    Returns:
        C(d + N, N), the width of Phi.

    Example:
        >>> packed_dim(64, 2)
        2145
    """
    return math.comb(head_dim + order, order)


@lru_cache(maxsize=32)
def _packing_tables(head_dim: int, order: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """Per order n >= 1: (parent, last, weight) on the CPU.

    Monomials of degree n are the sorted multi-sets c_1 <= ... <= c_n of coordinates, in lexicographic order;
    monomial(c) = monomial(c without its last coordinate) * x[last], and 1/sqrt(a!) follows from the run
    length of the last coordinate.
    """
    tables = []
    prev_codes = torch.zeros(1, dtype=torch.long)  # degree 0: the empty multi-set
    prev_last = torch.full((1,), -1, dtype=torch.long)
    prev_run = torch.zeros(1, dtype=torch.long)
    prev_weight = torch.ones(1, dtype=torch.float64)
    for n in range(1, order + 1):
        combos = torch.combinations(torch.arange(head_dim), n, with_replacement=True).view(-1, n)
        powers = head_dim ** torch.arange(n - 2, -1, -1) if n > 1 else torch.zeros(0, dtype=torch.long)
        parent_codes = (
            (combos[:, :-1] * powers).sum(-1) if n > 1 else torch.zeros(len(combos), dtype=torch.long)
        )
        parent = torch.searchsorted(prev_codes, parent_codes)
        last = combos[:, -1]
        run = torch.where(prev_last[parent] == last, prev_run[parent] + 1, torch.ones_like(last))
        weight = prev_weight[parent] / run.double().sqrt()
        tables.append((parent, last, weight))
        prev_codes = (combos * (head_dim ** torch.arange(n - 1, -1, -1))).sum(-1)
        prev_last, prev_run, prev_weight = last, run, weight
    return tuple(tables)


@lru_cache(maxsize=64)
def _tables_on(
    head_dim: int, order: int, device: torch.device, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """The packing tables moved once to where they are used (decoding calls this every token)."""
    return tuple(
        (parent.to(device), last.to(device), weight.to(device=device, dtype=dtype))
        for parent, last, weight in _packing_tables(head_dim, order)
    )


def packed_powers(x: torch.Tensor, order: int) -> torch.Tensor:
    """Phi(x) = [1, phi_1(x), ..., phi_N(x)] over the last dim: ``[..., D] -> [..., C(D+N, N)]``.

    Args:
        x: ``[..., D]`` vectors.
        order: N.

    Returns:
        ``[..., C(D+N, N)]`` features with Phi(q) . Phi(k) = T_N(q . k).

    Example:
        >>> q, k = torch.randn(3), torch.randn(3)
        >>> torch.allclose(packed_powers(q, 3) @ packed_powers(k, 3), taylor_poly(q @ k, 3), atol=1e-5)
        True
    """
    if order <= 2:
        return _packed_squares(x, order)
    parts = [torch.ones_like(x[..., :1])]
    mono = parts[0]  # the plain monomials of the current degree; the 1/sqrt(a!) weights go on each copy
    for parent, last, weight in _tables_on(x.shape[-1], order, x.device, x.dtype):
        mono = mono[..., parent] * x[..., last]
        parts.append(mono * weight)
    return torch.cat(parts, dim=-1)


#: rows of x from which ``_packed_squares`` builds degree 2 from slices rather than gathers (a decode step has 1-3)
_SLICES_FROM = 16


@lru_cache(maxsize=64)
def _square_weights(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """1 / sqrt(a!) of the degree-2 monomials in packing order: 1 / sqrt(2) for squares, 1 for products."""
    i, j = torch.triu_indices(head_dim, head_dim)
    squares = (i == j).to(torch.float64)
    return (1.0 - squares + squares * 0.5**0.5).to(device=device, dtype=dtype)


@lru_cache(maxsize=64)
def _square_factors(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each entry of Phi = [1, x, phi_2(x)] (order 2, packing order) takes its two factors from
    [1, x, x / sqrt(2)]: 1 * 1, 1 * x_i, x_i * x_j for i < j, x_i * (x_i / sqrt(2)) for squares."""
    d = head_dim
    i, j = torch.triu_indices(d, d)
    one = torch.zeros(1 + d, dtype=torch.long)
    left = torch.cat([one, i + 1])
    right = torch.cat([torch.arange(1 + d), torch.where(i == j, 1 + d + i, 1 + j)])
    return left.to(device), right.to(device)


def _packed_squares(x: torch.Tensor, order: int) -> torch.Tensor:
    """``packed_powers`` for order <= 2. Degree 2 in packing order is x_a * x_b for b >= a, row a after row
    a - 1: for many rows built from contiguous slices, for a decode step's few rows by two gathers from
    [1, x, x / sqrt(2)] (each the cheaper there; index gathers over many rows cost ~6x the slices)."""
    ones = torch.ones_like(x[..., :1])
    if order < 2:
        return ones if order == 0 else torch.cat([ones, x], dim=-1)
    d = x.shape[-1]
    if x.numel() < _SLICES_FROM * d:
        left, right = _square_factors(d, x.device)
        factors = torch.cat([ones, x, x * 2.0**-0.5], dim=-1)
        shape = (*x.shape[:-1], left.numel())
        return factors.gather(-1, left.expand(shape)) * factors.gather(-1, right.expand(shape))
    out = torch.cat([ones, x, *(x[..., a : a + 1] * x[..., a:] for a in range(d))], dim=-1)
    out[..., 1 + d :].mul_(_square_weights(d, x.device, x.dtype))
    return out


def _causal_keep(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[t, s] bool: query i (the last t of s positions) sees key j <= its own position."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)


def taylor_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State,
    order: int,
    chunk_size: int,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, State]:
    """Causal chunkwise form: T_N of the score matrix inside a chunk, Phi(q) . state across chunks.

    Returns (numerator [B,Hkv,G,T,E], denominator [B,Hkv,G,T] or None, key count [B,Hkv,G,T] or None, state);
    the denominator / count are computed when the state holds ``z`` / ``n``. The denominator rides along as one
    more value column (of ones) and padded keys get zero value rows, so one product per chunk reads both and one
    updates both; the G query heads of a key head are stacked into one [G * C, P] block.

    Args:
        q: ``[B, Hkv, G, T, D]`` queries (already scaled).
        k: ``[B, Hkv, T, D]`` keys.
        v: ``[B, Hkv, T, E]`` values.
        state: ``{"S": [B, Hkv, P, E]}``, optionally with ``"z": [B, Hkv, P]`` and ``"n": [B, Hkv]`` (P =
            ``packed_dim(D, order)``); the inputs are cast to S's dtype.
        order: N.
        chunk_size: tokens per chunk.
        key_mask: ``[B, T]`` (1 = real token, 0 = padding), or None.

    Returns:
        ``(num, den, count, state)``: numerator ``[B, Hkv, G, T, E]``, denominator ``[B, Hkv, G, T]`` (with z, else
        None), real keys seen ``[B, Hkv, G, T]`` (with n, else None) and the final state.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 5, 3) / 2, torch.randn(1, 1, 5, 3) / 2, torch.randn(1, 1, 5, 4)
        >>> state = {"S": torch.zeros(1, 1, packed_dim(3, 2), 4), "z": torch.zeros(1, 1, packed_dim(3, 2))}
        >>> num, den, _, state = taylor_chunked(q, k, v, state, 2, chunk_size=2, key_mask=None)
        >>> w = taylor_poly(q @ k[:, :, None].transpose(-1, -2), 2).tril()
        >>> torch.allclose(num, w @ v[:, :, None], atol=1e-5), torch.allclose(den, w.sum(-1), atol=1e-5)
        (True, True)
    """
    S, z, n = state["S"], state.get("z"), state.get("n")
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)  # float32 states of a half-precision model
    b, hk, g, t, d = q.shape
    mask = None if key_mask is None else key_mask.to(k.dtype)[:, None, :]  # [B, 1, T]
    values = v if z is None else torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if mask is not None:
        values = values * mask[..., None]
    table = S if z is None else torch.cat([S, z[..., None]], dim=-1)  # [B, Hkv, P, E'] (E' = E + 1 with z)
    # batched over B * Hkv from here on
    table, q, k, values = table.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1), values.flatten(0, 1)
    outs, cnts = [], []
    # split() rather than slicing: its backward joins the chunks' gradients once
    chunks = zip(q.split(chunk_size, dim=2), k.split(chunk_size, dim=1), values.split(chunk_size, dim=1),
                 strict=True)
    for index, (q_part, kc, vc) in enumerate(chunks):
        start, c = index * chunk_size, kc.shape[1]
        stop = start + c
        qc = q_part.reshape(b * hk, g * c, d)
        keep = _causal_keep(c, c, q.device).to(q.dtype).repeat(g, 1)  # [G * C, C]
        weights = taylor_poly(qc @ kc.transpose(-1, -2), order) * keep
        outs.append(torch.baddbmm(weights @ vc, packed_powers(qc, order), table).view(b, hk, g, c, -1))
        table = torch.baddbmm(table, packed_powers(kc, order).transpose(-1, -2), vc)
        if n is not None:
            real = keep if mask is None else keep * mask[..., start:stop, None].transpose(-1, -2)
            cnts.append((n[:, :, None] + real.sum(-1)).view(b, hk, g, c))
            n = n + (c if mask is None else mask[..., start:stop].sum(-1))
    out = torch.cat(outs, dim=3)
    table = table.view(b, hk, *table.shape[1:])
    new_state: State = {"S": table[..., : v.shape[-1]].contiguous()}
    den = None
    if z is not None:
        new_state["z"] = table[..., -1].contiguous()
        den, out = out[..., -1], out[..., :-1]
    if n is not None:
        new_state["n"] = n
    cnt = torch.cat(cnts, dim=3) if cnts else None
    return out, den, cnt, new_state


def taylor_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State,
    order: int,
    key_mask: torch.Tensor | None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, State]:
    """One token: fold Phi(k) v^T into the per-order states, then read them with Phi(q) (Mongaras & Larson, eq. 3).

    ``in_place`` adds to the state buffers instead of allocating new ones: at order 2 the state is 2,145 x 64
    floats per key head, and a fresh copy per token costs more than the arithmetic.

    Args:
        q: ``[B, Hkv, G, 1, D]`` the token's queries (already scaled).
        k: ``[B, Hkv, 1, D]`` its key.
        v: ``[B, Hkv, 1, E]`` its value.
        state: ``{"S": [B, Hkv, P, E]}``, optionally with ``"z"`` and ``"n"`` (see ``taylor_chunked``).
        order: N.
        key_mask: ``[B, 1]`` (1 = real token), or None.
        in_place: add to the state's buffers.

    Returns:
        ``(num, den, count, state)``: numerator ``[B, Hkv, G, 1, E]``, denominator ``[B, Hkv, G, 1]`` or None,
        count ``[B, Hkv, G, 1]`` or None, and the new state.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5)
        >>> state = {"S": torch.zeros(1, 2, packed_dim(4, 2), 5), "z": torch.zeros(1, 2, packed_dim(4, 2))}
        >>> num, den, _, state = taylor_step(q, k, v, state, 2, key_mask=None)
        >>> torch.allclose(num / den[..., None], v[:, :, None].expand(1, 2, 3, 1, 5), atol=1e-5)  # one key: its value
        True
    """
    S = state["S"]
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    fk = packed_powers(k, order)  # [B, Hkv, 1, P]
    real = None if key_mask is None else key_mask.to(k.dtype)[:, None, :].expand(k.shape[:3])
    if real is not None:
        fk = fk * real[..., None]
    fq = packed_powers(q, order)
    outer = (fk.transpose(-1, -2), v)  # [B, Hkv, P, 1] x [B, Hkv, 1, E]
    new_state: State = {"S": S.addcmul_(*outer) if in_place else torch.addcmul(S, *outer)}
    # [B, Hkv, G, P] @ [B, Hkv, P, E]: one batched product per key head (broadcasting S over G would copy it)
    fq = fq[:, :, :, 0]
    num = torch.matmul(fq, new_state["S"]).unsqueeze(3)  # [B, Hkv, G, 1, E]
    den = cnt = None
    if "z" in state:
        z = state["z"]
        new_state["z"] = z.add_(fk[:, :, 0]) if in_place else z + fk[:, :, 0]
        den = torch.matmul(fq, new_state["z"].unsqueeze(-1))  # [B, Hkv, G, 1]
    if "n" in state:
        count = k.new_ones(k.shape[:2]) if real is None else real.sum(-1)
        new_state["n"] = state["n"].add_(count) if in_place else state["n"] + count
        cnt = new_state["n"][:, :, None, None].expand(q.shape[:4])  # [B, Hkv, G, 1]
    return num, den, cnt, new_state


def quadratic_weights(
    scores: torch.Tensor, visible: torch.Tensor, order: int | str, stabilize: bool
) -> torch.Tensor:
    """Parallel-form weights: T_N(x) or exp(x) (minus the row max when ``stabilize``), zero where hidden.

    Args:
        scores: ``[..., T, S]`` scaled scores q . k.
        visible: ``[..., T, S]`` bool (broadcast): the pairs that count.
        order: N, or ``"exp"`` for the exponential.
        stabilize: with ``"exp"``, subtract each row's largest visible score first (a factor that cancels in a ratio).

    Returns:
        ``[..., T, S]`` weights, zero where not visible.

    Example:
        >>> quadratic_weights(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool).tril(), 2, False)
        tensor([[2.5000, 0.0000],
                [2.5000, 2.5000]])
    """
    if order == "exp":
        if stabilize:
            row_max = scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
            scores = scores - row_max
        weights = torch.exp(scores.masked_fill(~visible, 0.0))
    else:
        weights = taylor_poly(scores, int(order))
    return weights * visible.to(weights.dtype)
