"""Triton kernels for one decode step of the recurrent rules: one launch per layer per token, state updated in place.

Per batch row and head, with a float32 state S of shape [K, V] (keys x values) and G query heads reading it::

    linear:  S <- diag(exp(gk)) exp(g) S + k v^T                   (either decay optional)
    delta:   S <- exp(a) S - e k (k^T S) + b k v^T                  (a = log_alpha, b = beta, e = erase)
    o_j = S^T q_j for each of the G queries (after the update)

A program owns one [K, BV] block of the state (every rule here is independent per column of S): it reads the
block once, updates it in registers, writes it back and reads it with the queries. Decode only: no autograd (the
functions run under ``torch.no_grad``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .delta import check_tensor, runs_on

Tensor = torch.Tensor

__all__ = ["fused_delta_step", "fused_linear_step"]

#: the largest key / value head dimension (a program holds whole key vectors)
MAX_HEAD_DIM = 256
#: value columns per program (half that above 128 keys, to keep the state block in registers)
BLOCK_V = 32


# ----- device helpers -----------------------------------------------------------------------------------------
@triton.jit
def _load_vector(ptr, idx, n):
    return tl.load(ptr + idx, mask=idx < n, other=0.0).to(tl.float32)


@triton.jit
def _state_block(s_ptr, rk, rv, K, V):
    """The [BK, BV] block of a row-major [K, V] state (zero outside it) and its pointers and mask."""
    at = s_ptr + rk[:, None] * V + rv[None, :]
    mask = (rk[:, None] < K) & (rv[None, :] < V)
    return tl.load(at, mask=mask, other=0.0), at, mask


@triton.jit
def _read_out(q_ptr, o_ptr, state, rk, rv, G, K, V):
    """o_j = S^T q_j for the G queries [G, K] of this head, into o [G, V] (this value block)."""
    for j in range(G):
        q = _load_vector(q_ptr + j * K, rk, K)
        o = tl.sum(q[:, None] * state, 0)
        tl.store(o_ptr + j * V + rv, o.to(o_ptr.dtype.element_ty), mask=rv < V)


# ----- kernels ------------------------------------------------------------------------------------------------
@triton.jit
def _linear_step_kernel(
    q_ptr, k_ptr, v_ptr, s_ptr, g_ptr, gk_ptr, o_ptr, G, K, V,
    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_GK: tl.constexpr,
):
    """One head, one value block: S <- decay S + k v^T, then o = S^T q."""
    i_bh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    state, at, mask = _state_block(s_ptr + i_bh * K * V, rk, rv, K, V)
    k = _load_vector(k_ptr + i_bh * K, rk, K)
    v = _load_vector(v_ptr + i_bh * V, rv, V)
    if HAS_G:
        state *= tl.exp(tl.load(g_ptr + i_bh).to(tl.float32))
    if HAS_GK:
        state *= tl.exp(_load_vector(gk_ptr + i_bh * K, rk, K))[:, None]
    state += k[:, None] * v[None, :]
    tl.store(at, state, mask=mask)
    _read_out(q_ptr + i_bh * G * K, o_ptr + i_bh * G * V, state, rk, rv, G, K, V)


@triton.jit
def _delta_step_kernel(
    q_ptr, k_ptr, v_ptr, s_ptr, la_ptr, beta_ptr, erase_ptr, o_ptr, G, K, V,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """One head, one value block: S <- exp(a) S + k (b v - e S^T k)^T, then o = S^T q."""
    i_bh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    state, at, mask = _state_block(s_ptr + i_bh * K * V, rk, rv, K, V)
    k = _load_vector(k_ptr + i_bh * K, rk, K)
    v = _load_vector(v_ptr + i_bh * V, rv, V)
    alpha = tl.exp(tl.load(la_ptr + i_bh).to(tl.float32))
    beta = tl.load(beta_ptr + i_bh).to(tl.float32)
    erase = tl.load(erase_ptr + i_bh).to(tl.float32)
    new = beta * v - erase * tl.sum(k[:, None] * state, 0)
    state = alpha * state + k[:, None] * new[None, :]
    tl.store(at, state, mask=mask)
    _read_out(q_ptr + i_bh * G * K, o_ptr + i_bh * G * V, state, rk, rv, G, K, V)


# ----- launchers ----------------------------------------------------------------------------------------------
def _check(
    fn: str, q: Tensor, k: Tensor, v: Tensor, state: Tensor, gates: dict[str, tuple[Tensor | None, bool]]
) -> None:
    """ValueError unless the shapes agree, the state is float32 and contiguous and the device can run Triton.
    ``gates``: name -> (tensor or None, whether it is per key)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"{fn}: q must be a [B, H, G, K] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(state, Tensor) or state.dim() != 4:
        raise ValueError(f"{fn}: state must be a [B, H, K, V] tensor, got "
                         f"{getattr(state, 'shape', type(state).__name__)}")
    b, h, _, dk = q.shape
    dv = state.shape[-1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"{fn}: state must be a contiguous float32 tensor (it is updated in place), got "
                         f"{state.dtype}{'' if state.is_contiguous() else ', not contiguous'}")
    if tuple(state.shape) != (b, h, dk, dv) or state.device != q.device:
        raise ValueError(f"{fn}: state must be [B, H, K, V] = {(b, h, dk, dv)} on {q.device}, got "
                         f"{tuple(state.shape)} on {state.device}")
    check_tensor(fn, "q", q, tuple(q.shape), "[B, H, G, K]", q)
    check_tensor(fn, "k", k, (b, h, dk), "[B, H, K]", q)
    check_tensor(fn, "v", v, (b, h, dv), "[B, H, V]", q)
    for name, (x, per_key) in gates.items():
        if x is not None:
            check_tensor(fn, name, x, (b, h, dk) if per_key else (b, h), "[B, H, K]" if per_key else "[B, H]", q)
    if min(q.shape) == 0 or dv == 0 or max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: sizes must be positive and K, V at most {MAX_HEAD_DIM}, got q {tuple(q.shape)}, "
                         f"V = {dv}")
    if not runs_on(q):
        raise ValueError(f"{fn}: tensors on {q.device} need a CUDA device (or TRITON_INTERPRET=1 set before "
                         "triton is imported)")


def _layout(q: Tensor, state: Tensor) -> tuple[tuple[int, int], dict[str, int], Tensor]:
    """(grid, block sizes, empty output [B, H, G, V] in q's dtype) of one step."""
    dk, dv = state.shape[-2:]
    bv = min(triton.next_power_of_2(dv), BLOCK_V if dk <= 128 else BLOCK_V // 2)
    grid = (q.shape[0] * q.shape[1], triton.cdiv(dv, bv))
    sizes = dict(BK=triton.next_power_of_2(dk), BV=bv)
    return grid, sizes, q.new_empty(*q.shape[:3], dv)


@torch.no_grad()
def fused_linear_step(
    q: Tensor, k: Tensor, v: Tensor, state: Tensor, g: Tensor | None = None, gk: Tensor | None = None
) -> Tensor:
    """One token of (decayed) linear attention: S <- diag(exp(gk)) exp(g) S + k v^T in place, o = S^T q.

    q [B, H, G, K] (G query heads read one state), k [B, H, K], v [B, H, V], ``state`` [B, H, K, V] float32
    contiguous (updated in place), ``g`` [B, H] a scalar log decay, ``gk`` [B, H, K] a log decay per key (either,
    both or neither). Returns o [B, H, G, V] in q's dtype. Decode only: no autograd.
    """
    _check("fused_linear_step", q, k, v, state, {"g": (g, False), "gk": (gk, True)})
    grid, sizes, o = _layout(q, state)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g_arg = state if g is None else g.contiguous()
    gk_arg = state if gk is None else gk.contiguous()
    _linear_step_kernel[grid](
        q, k, v, state, g_arg, gk_arg, o, q.shape[2], k.shape[-1], v.shape[-1],
        HAS_G=g is not None, HAS_GK=gk is not None, **sizes,
    )
    return o


@torch.no_grad()
def fused_delta_step(
    q: Tensor, k: Tensor, v: Tensor, state: Tensor, log_alpha: Tensor, beta: Tensor, erase: Tensor
) -> Tensor:
    """One token of the delta rule: S <- exp(log_alpha) S - erase k (k^T S) + beta k v^T in place, o = S^T q.

    q [B, H, G, K] (G query heads read one state), k [B, H, K], v [B, H, V], ``state`` [B, H, K, V] float32
    contiguous (updated in place), ``log_alpha`` / ``beta`` / ``erase`` [B, H]. Returns o [B, H, G, V] in q's
    dtype. Decode only: no autograd.
    """
    gates = {"log_alpha": (log_alpha, False), "beta": (beta, False), "erase": (erase, False)}
    for name, (x, _) in gates.items():
        if x is None:
            raise ValueError(f"fused_delta_step: {name} is required")
    _check("fused_delta_step", q, k, v, state, gates)
    grid, sizes, o = _layout(q, state)
    q, k, v, log_alpha, beta, erase = (x.contiguous() for x in (q, k, v, log_alpha, beta, erase))
    _delta_step_kernel[grid](
        q, k, v, state, log_alpha, beta, erase, o, q.shape[2], k.shape[-1], v.shape[-1], **sizes
    )
    return o
