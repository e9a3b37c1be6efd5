"""Functional forms of truncated-Taylor attention (seed 000): weights T_N(x) = sum_{n<=N} x^n / n!.

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
    """T_N(x) by Horner's rule: 1 + x(1 + x/2(1 + x/3(... (1 + x/N))))."""
    out = torch.ones_like(x)
    for n in range(order, 0, -1):
        out = 1.0 + out * x / n
    return out


def packed_dim(head_dim: int, order: int) -> int:
    """Entries of Phi for orders 0..N: sum_n C(d+n-1, n) = C(d+N, N)."""
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
    """Phi(x) = [1, phi_1(x), ..., phi_N(x)] over the last dim: ``[..., D] -> [..., C(D+N, N)]``."""
    parts = [torch.ones_like(x[..., :1])]
    mono = parts[0]  # the plain monomials of the current degree; the 1/sqrt(a!) weights go on each copy
    for parent, last, weight in _tables_on(x.shape[-1], order, x.device, x.dtype):
        mono = mono[..., parent] * x[..., last]
        parts.append(mono * weight)
    return torch.cat(parts, dim=-1)


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
    the denominator / count are computed when the state holds ``z`` / ``n``.
    """
    S, z, n = state["S"], state.get("z"), state.get("n")
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)  # float32 states of a half-precision model
    mask = None if key_mask is None else key_mask.to(k.dtype)[:, None, :]  # [B, 1, T]
    nums, dens, cnts = [], [], []
    for start in range(0, q.shape[3], chunk_size):
        stop = start + chunk_size
        qc, kc, vc = q[:, :, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        mc = None if mask is None else mask[..., start:stop]
        keep = _causal_keep(qc.shape[3], kc.shape[2], q.device).to(q.dtype)
        if mc is not None:
            keep = keep * mc[:, :, None, None, :]  # [B, 1, 1, C, C]
        weights = taylor_poly(torch.einsum("bhgtd,bhsd->bhgts", qc, kc), order) * keep
        fq = packed_powers(qc, order)
        fk = packed_powers(kc, order)
        if mc is not None:
            fk = fk * mc[..., None]
        nums.append(torch.einsum("bhgtp,bhpe->bhgte", fq, S) + torch.einsum("bhgts,bhse->bhgte", weights, vc))
        S = S + torch.einsum("bhsp,bhse->bhpe", fk, vc)
        if z is not None:
            dens.append(torch.einsum("bhgtp,bhp->bhgt", fq, z) + weights.sum(-1))
            z = z + fk.sum(2)
        if n is not None:
            cnts.append(n[:, :, None, None] + keep.expand_as(weights).sum(-1))
            n = n + (kc.new_full(kc.shape[:3], 1.0) if mc is None else mc.expand(kc.shape[:3])).sum(-1)
    new_state: State = {"S": S}
    if z is not None:
        new_state["z"] = z
    if n is not None:
        new_state["n"] = n
    den = torch.cat(dens, dim=3) if dens else None
    cnt = torch.cat(cnts, dim=3) if cnts else None
    return torch.cat(nums, dim=3), den, cnt, new_state


def taylor_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State,
    order: int,
    key_mask: torch.Tensor | None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, State]:
    """One token: fold Phi(k) v^T into the per-order states, then read them with Phi(q) (seed 000, eq. 3).

    ``in_place`` adds to the state buffers instead of allocating new ones: at order 2 the state is 2,145 x 64
    floats per key head, and a fresh copy per token costs more than the arithmetic.
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
    """Parallel-form weights: T_N(x) or exp(x) (minus the row max when ``stabilize``), zero where hidden."""
    if order == "exp":
        if stabilize:
            row_max = scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
            scores = scores - row_max
        weights = torch.exp(scores.masked_fill(~visible, 0.0))
    else:
        weights = taylor_poly(scores, int(order))
    return weights * visible.to(weights.dtype)
