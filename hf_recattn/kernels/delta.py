"""Triton kernels for the chunked delta rule (DeltaNet, Gated DeltaNet and the general form), forward and backward.

Per batch row and head, with a state S of shape [K, V] (keys x values)::

    S_t = exp(a_t) S_{t-1} - e_t k_t (k_t^T S_{t-1}) + b_t k_t v_t^T,        o_t = S_t^T q_t

with a = ``log_alpha``, b = ``beta`` and e = ``erase`` (Gated DeltaNet: e = b exp(a); DeltaNet: a = 0, e = b).
No scale, normalization or masking happens here: the caller does those.

Chunked form. In a chunk of C tokens with start state S, let G_t be the cumulative log decay from the chunk's
start through token t, P_t = G_t - a_t the one before it, and G_C its value at the chunk's end. The new values
u_t = b_t v_t - e_t S_{t-1}^T k_t solve a unit lower-triangular system (the UT transform)::

    (I + L) U = diag(b) V - diag(e exp(P)) K S,        L_ts = e_t exp(P_t - G_s) k_t . k_s  (s < t)

so that with A = (I + L)^-1, W = A diag(e exp(P)) K and U~ = A diag(b) V (neither depends on S): U = U~ - W S, and

    O  = diag(exp(G)) Q S + (Q K^T * D) U,              D_ts = exp(G_t - G_s) for s <= t, else 0
    S' = exp(G_C) S + (diag(exp(G_C - G)) K)^T U

Backward, with g the gradient of the state after the chunk (from the later chunks and the final state)::

    dU = (Q K^T * D)^T dO + diag(exp(G_C - G)) K g,     r = A^T dU
    dS = (diag(exp(G)) Q)^T dO + exp(G_C) g - W^T dU      (the gradient of the chunk's start state)
    dV = diag(b) r,   db = rowsum(r * V),   d(diag(e exp(P)) K) = -r S^T,   dL = -strictly_lower(r U^T)

and the rest by the chain rule through Q K^T * D, L, the decayed keys and the cumulative sums (see
``_query_grad_kernel`` and ``_chunk_grad_kernel``).

Everything runs in Triton (torch only allocates and casts), in seven kernels:

* ``_prepare_kernel`` (chunks x heads): the inverse A (forward substitution, row by row), W and U~;
* ``_state_forward_kernel`` (heads x value blocks): the chunk-to-chunk recurrence, writing every chunk's start
  state and its new values U;
* ``_output_kernel`` (chunks x heads x value blocks): the outputs;
* ``_local_value_grad_kernel`` (chunks x heads x value blocks): the in-chunk part (Q K^T * D)^T dO of dU;
* ``_state_backward_kernel`` (heads x value blocks): the adjoint recurrence, writing dU and the gradient of every
  chunk's end state (and of the initial state);
* ``_query_grad_kernel`` (chunks x heads): dq, and the parts of dk and d log_alpha that flow through the in-chunk
  scores Q K^T * D;
* ``_chunk_grad_kernel`` (chunks x heads): dv, d beta, d erase, and the rest of dk and d log_alpha.

The recurrence is independent per column of S, so the sequential kernels own one [K, BV] block of it; every
kernel holds whole key vectors (K <= ``MAX_KEY_DIM``). Accumulation is float32. On CUDA, products of float32
inputs use three TF32 products (about float32 accuracy), of half inputs one; under Triton's interpreter (CPU)
they are IEEE float32 products. The decays are recomputed from ``log_alpha`` wherever needed; the backward keeps
A, W, U (float32, [T, C], [T, K], [T, V] per head) and every chunk's start state ([T / C, K, V]).

The per-chunk gradients take two kernels, one pass over the value blocks each, the first handing the second its
part of dk and of dG (float32, [T, K] and [T] per head). As one kernel, with all five [C, K] and [C, C]
accumulators live at once, the float32 build for Hopper GPUs (triton 3.6) spilled registers heavily and read
shared memory out of bounds in a tensor-core product (an illegal memory access). Split, it spills far less, but
the second kernel still faults that way in float32 at chunks of 64 on an H100 (docs/speed.md): the backward is
registered as not verified on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from triton.runtime.interpreter import InterpretedFunction

from .tiles import load_state_block, load_tile, store_tile

Tensor = torch.Tensor

__all__ = ["chunk_delta_rule", "set_gradient_variant"]

#: the largest key head dimension (a program holds whole key vectors; the gradient kernels' shared memory use
#: grows with it); values are split in blocks and have no limit
MAX_KEY_DIM = 128
#: value columns per program: the in-chunk kernels (also the padding of the internal buffers), the sequential
#: kernels (narrow, so that more programs walk the chunks side by side) and the per-chunk gradient kernels
BLOCK_V, BLOCK_V_STATE, BLOCK_V_GRAD = 32, 16, 16
#: warps per program of the per-chunk gradient kernels: 4 or 8 take Hopper's warp-group products (wgmma), 2 the
#: older per-warp ones (mma.sync)
GRAD_WARPS = 8
#: the values BLOCK_V_GRAD and GRAD_WARPS may take
GRAD_BLOCKS, GRAD_WARP_COUNTS = (16, 32), (2, 4, 8)
#: tensor-core products of float32 inputs on CUDA: the forward and sequential kernels, and the two per-chunk
#: gradient kernels (where three TF32 passes fault on Hopper); half inputs always take one TF32 pass
FLOAT32_PRECISION, GRAD_FLOAT32_PRECISION = "tf32x3", "tf32x3"
#: Triton's own ``input_precision`` values, and ``split``: three one-pass TF32 products of operands split in the
#: kernel into a TF32 high part and a float32 remainder (the arithmetic of ``tf32x3``, written out)
PRECISIONS = ("tf32x3", "tf32", "ieee", "split")
#: clears the 13 low mantissa bits of a float32 (as int32 bits): what a TF32 product reads of it
TF32_MASK = tl.constexpr(-8192)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----- device helpers -----------------------------------------------------------------------------------------
@triton.jit
def _split_tf32(x):
    """x as its TF32 high part (low mantissa bits cleared) and the float32 remainder, which sum to x exactly."""
    high = (x.to(tl.int32, bitcast=True) & TF32_MASK).to(tl.float32, bitcast=True)
    return high, x - high


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b in float32 at ``PRECISION``; ``split``: hi·hi + hi·lo + lo·hi, each one TF32 pass."""
    if PRECISION == "split":
        a_high, a_low = _split_tf32(a)
        b_high, b_low = _split_tf32(b)
        out = tl.dot(a_low, b_high, input_precision="tf32")
        out = tl.dot(a_high, b_low, out, input_precision="tf32")
        out = tl.dot(a_high, b_high, out, input_precision="tf32")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _load_row(ptr, rows, n):
    """float32 entries ``rows`` of a vector of length n, zero past its end (padded tokens: no decay, no write)."""
    return tl.load(ptr + rows, mask=rows < n, other=0.0).to(tl.float32)


@triton.jit
def _unit_lower_inverse(lower, C: tl.constexpr):
    """(I + strictly_lower(lower))^-1 of a [C, C] tile by forward substitution, one row at a time."""
    rc = tl.arange(0, C)
    row, col = rc[:, None], rc[None, :]
    lower = tl.where(row > col, lower, 0.0)
    inverse = tl.where(row == col, 1.0, 0.0)
    for i in range(1, C):
        lower_i = tl.sum(tl.where(row == i, lower, 0.0), 0)  # row i of L (non-zero left of the diagonal)
        new = -tl.sum(lower_i[:, None] * inverse, 0)  # -L[i, :i] @ inverse[:i, :]
        inverse = tl.where(row == i, new[None, :] + tl.where(col == i, 1.0, 0.0), inverse)
    return inverse


@triton.jit
def _decays(la_ptr, rows, T, C: tl.constexpr):
    """Log decays of one chunk (tokens past T: none): cumulative G_t, P_t = G_{t-1}, G_C, and the causal
    pairwise factors exp(G_t - G_s) for s <= t ([C, C], zero above the diagonal)."""
    rc = tl.arange(0, C)
    la = _load_row(la_ptr, rows, T)
    cum = tl.cumsum(la, 0)
    last = tl.sum(la, 0)
    pair = tl.exp(tl.where(rc[:, None] >= rc[None, :], cum[:, None] - cum[None, :], float("-inf")))
    return cum, cum - la, last, pair


@triton.jit
def _system(k, prev, cum, er, C: tl.constexpr, PRECISION: tl.constexpr):
    """Returns (L, K K^T, exp(P_t - G_s) for s < t): the strictly lower system matrix of one chunk and its factors."""
    rc = tl.arange(0, C)
    strictly = rc[:, None] > rc[None, :]
    decay = tl.exp(tl.where(strictly, prev[:, None] - cum[None, :], float("-inf")))
    gram = _dot(k, tl.trans(k), PRECISION)
    return gram * decay * er[:, None], gram, decay


@triton.jit
def _chunk_scores(q_ptr, k_ptr, la_ptr, T, K, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  PRECISION: tl.constexpr):
    """This program's chunk i_c, head i_bh (int64), the chunk count n, its token / key / value ranges, and the
    chunk's Q, cumulative log decays G and masked scores Q K^T * D (grid: chunks x heads x value blocks)."""
    i_c, i_bh, i_v = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    n = tl.cdiv(T, C)
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    rt = i_c * C + rc
    q = load_tile(q_ptr + i_bh * T * K, rt, rk, T, K)
    k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K)
    cum, prev, last, pair = _decays(la_ptr + i_bh * T, rt, T, C)
    scores = _dot(q, tl.trans(k), PRECISION) * pair
    return i_c, i_bh, n, rt, rk, rv, q, cum, scores


# ----- forward kernels ----------------------------------------------------------------------------------------
@triton.jit
def _prepare_kernel(
    k_ptr, v_ptr, la_ptr, beta_ptr, erase_ptr, a_ptr, w_ptr, u_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk of one head: the inverse A [C, C], W = A diag(e exp(P)) K and U~ = A diag(b) V (all padded)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    tp = tl.cdiv(T, C) * C
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    rt = i_c * C + rc
    k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K)
    er = _load_row(erase_ptr + i_bh * T, rt, T)
    be = _load_row(beta_ptr + i_bh * T, rt, T)
    cum, prev, last, pair = _decays(la_ptr + i_bh * T, rt, T, C)
    lower, gram, decay = _system(k, prev, cum, er, C, PRECISION)
    inverse = _unit_lower_inverse(lower, C)
    row = i_bh * tp + rt
    tl.store(a_ptr + row[:, None] * C + rc[None, :], inverse)
    w = _dot(inverse, k * (er * tl.exp(prev))[:, None], PRECISION)
    tl.store(w_ptr + row[:, None] * BK + rk[None, :], w)
    for i_v in range(VP // BV):
        rv = i_v * BV + tl.arange(0, BV)
        v = load_tile(v_ptr + i_bh * T * V, rt, rv, T, V)
        u = _dot(inverse, v * be[:, None], PRECISION)
        tl.store(u_ptr + row[:, None] * VP + rv[None, :], u)


@triton.jit
def _state_forward_kernel(
    k_ptr, la_ptr, w_ptr, u_ptr, h_ptr, s0_ptr, sn_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, HAS_S0: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One head, one [BK, BV] block of the state, chunk after chunk: store the chunk's start state, turn U~ into
    the new values U = U~ - W S (in place), then S <- exp(G_C) S + K^T U; finally store the last state."""
    i_bh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = tl.cdiv(T, C)
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    state = load_state_block(s0_ptr + i_bh * K * V, rk, rv, K, V, BK, BV, HAS_S0)
    for i_c in range(n):
        rt = i_c * C + rc
        row = i_bh * n * C + rt
        tl.store(h_ptr + ((i_bh * n + i_c) * BK + rk[:, None]) * VP + rv[None, :], state)
        w = tl.load(w_ptr + row[:, None] * BK + rk[None, :])
        u_at = u_ptr + row[:, None] * VP + rv[None, :]
        u = tl.load(u_at) - _dot(w, state, PRECISION)
        tl.store(u_at, u)
        cum, prev, last, pair = _decays(la_ptr + i_bh * T, rt, T, C)
        k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K) * tl.exp(last - cum)[:, None]
        state = state * tl.exp(last) + _dot(tl.trans(k), u, PRECISION)
    store_tile(sn_ptr + i_bh * K * V, state, rk, rv, K, V)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, la_ptr, u_ptr, h_ptr, o_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk, one head, one value block: O = diag(exp(G)) Q S + (Q K^T * D) U."""
    i_c, i_bh, n, rt, rk, rv, q, cum, scores = _chunk_scores(q_ptr, k_ptr, la_ptr, T, K, C, BK, BV, PRECISION)
    state = tl.load(h_ptr + ((i_bh * n + i_c) * BK + rk[:, None]) * VP + rv[None, :])
    u = tl.load(u_ptr + (i_bh * n * C + rt)[:, None] * VP + rv[None, :])
    o = _dot(q * tl.exp(cum)[:, None], state, PRECISION)
    o += _dot(scores, u, PRECISION)
    store_tile(o_ptr + i_bh * T * V, o, rt, rv, T, V)


# ----- backward kernels ---------------------------------------------------------------------------------------
@triton.jit
def _local_value_grad_kernel(
    q_ptr, k_ptr, la_ptr, do_ptr, du_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk, one head, one value block: the in-chunk part of dU, (Q K^T * D)^T dO."""
    i_c, i_bh, n, rt, rk, rv, q, cum, scores = _chunk_scores(q_ptr, k_ptr, la_ptr, T, K, C, BK, BV, PRECISION)
    do = load_tile(do_ptr + i_bh * T * V, rt, rv, T, V)
    du = _dot(tl.trans(scores), do, PRECISION)
    tl.store(du_ptr + (i_bh * n * C + rt)[:, None] * VP + rv[None, :], du)


@triton.jit
def _state_backward_kernel(
    q_ptr, k_ptr, la_ptr, w_ptr, do_ptr, du_ptr, dh_ptr, dsn_ptr, ds0_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, HAS_DSN: tl.constexpr,
    HAS_S0: tl.constexpr, PRECISION: tl.constexpr,
):
    """One head, one [BK, BV] block of the state gradient g, chunk after chunk backwards: store g (the gradient
    of the chunk's end state), complete dU += diag(exp(G_C - G)) K g (in place), then
    g <- exp(G_C) g + (diag(exp(G)) Q)^T dO - W^T dU; finally store the initial state's gradient."""
    i_bh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = tl.cdiv(T, C)
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    grad = load_state_block(dsn_ptr + i_bh * K * V, rk, rv, K, V, BK, BV, HAS_DSN)
    for j in range(n):
        i_c = n - 1 - j
        rt = i_c * C + rc
        row = i_bh * n * C + rt
        tl.store(dh_ptr + ((i_bh * n + i_c) * BK + rk[:, None]) * VP + rv[None, :], grad)
        cum, prev, last, pair = _decays(la_ptr + i_bh * T, rt, T, C)
        k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K) * tl.exp(last - cum)[:, None]
        du_at = du_ptr + row[:, None] * VP + rv[None, :]
        du = tl.load(du_at) + _dot(k, grad, PRECISION)
        tl.store(du_at, du)
        q = load_tile(q_ptr + i_bh * T * K, rt, rk, T, K) * tl.exp(cum)[:, None]
        do = load_tile(do_ptr + i_bh * T * V, rt, rv, T, V)
        w = tl.load(w_ptr + row[:, None] * BK + rk[None, :])
        grad = grad * tl.exp(last) + _dot(tl.trans(q), do, PRECISION)
        grad -= _dot(tl.trans(w), du, PRECISION)
    if HAS_S0:
        store_tile(ds0_ptr + i_bh * K * V, grad, rk, rv, K, V)


@triton.jit
def _query_grad_kernel(
    q_ptr, k_ptr, la_ptr, u_ptr, h_ptr, do_ptr, dq_ptr, dkq_ptr, dcum_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk of one head, the outputs' part of the gradients: from dO S^T and dO U^T (over the value blocks),
    dq, and the parts of dk and of dG that flow through Q K^T * D (float32, padded, for ``_chunk_grad_kernel``)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n = tl.cdiv(T, C)
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    rt = i_c * C + rc
    row = i_bh * n * C + rt
    d_read = tl.zeros([C, BK], dtype=tl.float32)  # dO S^T
    d_scores = tl.zeros([C, C], dtype=tl.float32)  # dO U^T
    for i_v in range(VP // BV):
        rv = i_v * BV + tl.arange(0, BV)
        state = tl.load(h_ptr + ((i_bh * n + i_c) * BK + rk[:, None]) * VP + rv[None, :])
        u = tl.load(u_ptr + row[:, None] * VP + rv[None, :])
        do = load_tile(do_ptr + i_bh * T * V, rt, rv, T, V)
        d_read += _dot(do, tl.trans(state), PRECISION)
        d_scores += _dot(do, tl.trans(u), PRECISION)
    # outputs: O = diag(exp(G)) Q S + (Q K^T * D) U
    q = load_tile(q_ptr + i_bh * T * K, rt, rk, T, K)
    k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K)
    cum, prev, last, pair = _decays(la_ptr + i_bh * T, rt, T, C)
    d_read *= tl.exp(cum)[:, None]
    d_cum = tl.sum(q * d_read, 1)
    d_qk = d_scores * pair  # zero above the diagonal
    dq = d_read + _dot(d_qk, k, PRECISION)
    dk = _dot(tl.trans(d_qk), q, PRECISION)
    z = d_qk * _dot(q, tl.trans(k), PRECISION)  # dD * D: exp(G_t - G_s)
    d_cum += tl.sum(z, 1) - tl.sum(z, 0)
    store_tile(dq_ptr + i_bh * T * K, dq, rt, rk, T, K)
    tl.store(dkq_ptr + row[:, None] * BK + rk[None, :], dk)
    tl.store(dcum_ptr + row, d_cum)


@triton.jit
def _chunk_grad_kernel(
    k_ptr, v_ptr, la_ptr, beta_ptr, erase_ptr, a_ptr, u_ptr, h_ptr, du_ptr, dh_ptr, dkq_ptr, dcum_ptr,
    dk_ptr, dv_ptr, dla_ptr, dbeta_ptr, derase_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk of one head, the rest of the gradients: from the chunk's start state S, end-state gradient g, U,
    dU and what ``_query_grad_kernel`` left, dk, dv, d log_alpha, d beta and d erase.

    Over the value blocks: r = A^T dU (dV = diag(b) r, db = rowsum(r V)), the key-side products -r S^T and U g^T,
    the [C, C] product -r U^T, and <S, g>. Then the chain rule through the decayed keys, exp(G_C) and L, and
    d log_alpha from the gradients of G and P.
    """
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n = tl.cdiv(T, C)
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    rt = i_c * C + rc
    row = i_bh * n * C + rt
    be = _load_row(beta_ptr + i_bh * T, rt, T)
    inverse = tl.load(a_ptr + row[:, None] * C + rc[None, :])
    d_key_rhs = tl.zeros([C, BK], dtype=tl.float32)  # -r S^T
    d_key_state = tl.zeros([C, BK], dtype=tl.float32)  # U g^T
    d_lower = tl.zeros([C, C], dtype=tl.float32)  # -r U^T
    d_beta = tl.zeros([C], dtype=tl.float32)
    d_carry = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(VP // BV):
        rv = i_v * BV + tl.arange(0, BV)
        at_state = ((i_bh * n + i_c) * BK + rk[:, None]) * VP + rv[None, :]
        state, grad = tl.load(h_ptr + at_state), tl.load(dh_ptr + at_state)
        at_rows = row[:, None] * VP + rv[None, :]
        u, du = tl.load(u_ptr + at_rows), tl.load(du_ptr + at_rows)
        v = load_tile(v_ptr + i_bh * T * V, rt, rv, T, V)
        r = _dot(tl.trans(inverse), du, PRECISION)
        store_tile(dv_ptr + i_bh * T * V, r * be[:, None], rt, rv, T, V)
        d_beta += tl.sum(r * v, 1)
        d_key_rhs -= _dot(r, tl.trans(state), PRECISION)
        d_key_state += _dot(u, tl.trans(grad), PRECISION)
        d_lower -= _dot(r, tl.trans(u), PRECISION)
        d_carry += tl.sum(state * grad, 1)

    k = load_tile(k_ptr + i_bh * T * K, rt, rk, T, K)
    er = _load_row(erase_ptr + i_bh * T, rt, T)
    cum, prev, last, _ = _decays(la_ptr + i_bh * T, rt, T, C)
    dk = tl.load(dkq_ptr + row[:, None] * BK + rk[None, :])
    d_cum = tl.load(dcum_ptr + row)
    # next state: exp(G_C) S + (diag(exp(G_C - G)) K)^T U
    to_end = tl.exp(last - cum)
    dk += d_key_state * to_end[:, None]
    x = tl.sum(d_key_state * k, 1) * to_end
    d_last = tl.sum(x, 0) + tl.exp(last) * tl.sum(d_carry, 0)
    d_cum -= x
    # right-hand side: diag(e exp(P)) K
    scale = er * tl.exp(prev)
    dk += d_key_rhs * scale[:, None]
    y = tl.sum(d_key_rhs * k, 1)
    d_erase = y * tl.exp(prev)
    d_prev = y * scale
    # system: L = (K K^T) * exp(P_t - G_s) * e_t, strictly lower
    lower, gram, decay = _system(k, prev, cum, er, C, PRECISION)
    d_lower = d_lower * decay  # zero on and above the diagonal
    d_gram = d_lower * er[:, None]
    dk += _dot(d_gram, k, PRECISION) + _dot(tl.trans(d_gram), k, PRECISION)
    z = d_gram * gram  # dL * L
    d_prev += tl.sum(z, 1)
    d_cum -= tl.sum(z, 0)
    d_erase += tl.sum(d_lower * gram, 1)
    # G = cumsum(a), P = G - a, G_C = G at the chunk's last slot (padded tokens add no decay)
    d_cum += d_prev + tl.where(rc == C - 1, d_last, 0.0)
    d_la = tl.cumsum(d_cum, 0, reverse=True) - d_prev

    store_tile(dk_ptr + i_bh * T * K, dk, rt, rk, T, K)
    tl.store(dla_ptr + i_bh * T + rt, d_la.to(dla_ptr.dtype.element_ty), mask=rt < T)
    tl.store(dbeta_ptr + i_bh * T + rt, d_beta.to(dbeta_ptr.dtype.element_ty), mask=rt < T)
    tl.store(derase_ptr + i_bh * T + rt, d_erase.to(derase_ptr.dtype.element_ty), mask=rt < T)


# ----- launchers ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """Sizes of one call: heads (B * H), tokens, head dims, chunk, key block, padded value width, dot precision."""

    bh: int
    t: int
    k: int
    v: int
    chunk: int
    bk: int
    vp: int
    precision: str
    grad_precision: str

    @property
    def n(self) -> int:
        return triton.cdiv(self.t, self.chunk)

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.t, self.k, self.v

    @property
    def grad_block(self) -> int:
        """Value columns per program of the per-chunk gradient kernels (a divisor of the padded width)."""
        return min(self.vp, BLOCK_V_GRAD)

    def options(self, bv: int, warps: int, grad: bool = False) -> dict[str, object]:
        """Compile-time sizes and launch options of a kernel owning ``bv`` value columns (``grad``: one of the
        per-chunk gradient kernels, with their product precision)."""
        precision = self.grad_precision if grad else self.precision
        return dict(C=self.chunk, BK=self.bk, BV=bv, VP=self.vp, PRECISION=precision, num_warps=warps,
                    num_stages=1)


def set_gradient_variant(precision: str, block: int, warps: int) -> None:
    """Run the per-chunk gradient kernels with these settings from the next call on (``GRAD_FLOAT32_PRECISION``,
    ``BLOCK_V_GRAD``, ``GRAD_WARPS``: the hardware-check variants), checked when that call plans its launches."""
    global GRAD_FLOAT32_PRECISION, BLOCK_V_GRAD, GRAD_WARPS
    GRAD_FLOAT32_PRECISION, BLOCK_V_GRAD, GRAD_WARPS = precision, block, warps


def _plan(q: Tensor, v: Tensor, chunk_size: int) -> _Plan:
    b, h, t, k = q.shape
    block = min(max(16, triton.next_power_of_2(v.shape[-1])), BLOCK_V)
    if (BLOCK_V_GRAD not in GRAD_BLOCKS or GRAD_WARPS not in GRAD_WARP_COUNTS or FLOAT32_PRECISION not in PRECISIONS
            or GRAD_FLOAT32_PRECISION not in PRECISIONS):
        raise ValueError(f"delta kernels: BLOCK_V_GRAD must be 16 or 32, GRAD_WARPS 2, 4 or 8 and the float32 "
                         f"precisions one of {PRECISIONS}, got {BLOCK_V_GRAD}, {GRAD_WARPS}, "
                         f"{FLOAT32_PRECISION!r}, {GRAD_FLOAT32_PRECISION!r}")
    if isinstance(_prepare_kernel, InterpretedFunction):  # IEEE products; ``split`` still runs its algebra
        precision, grad_precision = (("split" if x == "split" else "ieee")
                                     for x in (FLOAT32_PRECISION, GRAD_FLOAT32_PRECISION))
    elif q.dtype == torch.float32:  # tensor cores: three TF32 products keep float32 inputs at float32 accuracy
        precision, grad_precision = FLOAT32_PRECISION, GRAD_FLOAT32_PRECISION
    else:
        precision = grad_precision = "tf32"
    vp = triton.cdiv(v.shape[-1], block) * block
    return _Plan(b * h, t, k, v.shape[-1], chunk_size, max(16, triton.next_power_of_2(k)), vp, precision,
                 grad_precision)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, la: Tensor, beta: Tensor, erase: Tensor, s0: Tensor | None, p: _Plan
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Launch the forward kernels: (o in q's dtype, final state in float32, what the backward needs)."""
    f32 = dict(device=q.device, dtype=torch.float32)
    tp, bv = p.n * p.chunk, min(p.vp, BLOCK_V)
    inverse = torch.empty(p.bh, tp, p.chunk, **f32)
    w = torch.empty(p.bh, tp, p.bk, **f32)
    u = torch.empty(p.bh, tp, p.vp, **f32)
    h = torch.empty(p.bh, p.n, p.bk, p.vp, **f32)
    o = torch.empty_like(v, dtype=q.dtype)
    final = torch.empty(*q.shape[:2], p.k, p.v, **f32)
    _prepare_kernel[(p.n, p.bh)](k, v, la, beta, erase, inverse, w, u, *p.dims, **p.options(bv, 8))
    _state_forward_kernel[(p.bh, p.vp // BLOCK_V_STATE)](
        k, la, w, u, h, final if s0 is None else s0, final, *p.dims, HAS_S0=s0 is not None,
        **p.options(BLOCK_V_STATE, 4),
    )
    _output_kernel[(p.n, p.bh, p.vp // bv)](q, k, la, u, h, o, *p.dims, **p.options(bv, 4))
    return o, final, (inverse, w, u, h)


def _backward(
    saved: tuple[Tensor, ...], do: Tensor, dsn: Tensor | None, has_s0: bool, p: _Plan
) -> tuple[Tensor, ...]:
    """Launch the backward kernels: (dq, dk, dv, d log_alpha, d beta, d erase) in the inputs' dtypes, then the
    initial state's gradient in float32 (or None)."""
    q, k, v, la, beta, erase, inverse, w, u, h = saved
    du, dh = torch.empty_like(u), torch.empty_like(h)
    ds0 = torch.empty(*q.shape[:2], p.k, p.v, device=q.device, dtype=torch.float32) if has_s0 else None
    grads = [torch.empty_like(x) for x in (q, k, v, la, beta, erase)]
    bv = min(p.vp, BLOCK_V)
    _local_value_grad_kernel[(p.n, p.bh, p.vp // bv)](q, k, la, do, du, *p.dims, **p.options(bv, 4))
    _state_backward_kernel[(p.bh, p.vp // BLOCK_V_STATE)](
        q, k, la, w, do, du, dh, do if dsn is None else dsn, du if ds0 is None else ds0, *p.dims,
        HAS_DSN=dsn is not None, HAS_S0=has_s0, **p.options(BLOCK_V_STATE, 8),
    )
    dq, dk, dv, dla, dbeta, derase = grads
    dk_q, d_cum = torch.empty_like(w), torch.empty(p.bh, p.n * p.chunk, device=q.device, dtype=torch.float32)
    grad = p.options(p.grad_block, GRAD_WARPS, grad=True)
    _query_grad_kernel[(p.n, p.bh)](q, k, la, u, h, do, dq, dk_q, d_cum, *p.dims, **grad)
    _chunk_grad_kernel[(p.n, p.bh)](
        k, v, la, beta, erase, inverse, u, h, du, dh, dk_q, d_cum, dk, dv, dla, dbeta, derase, *p.dims, **grad
    )
    return (*grads, ds0)


class _ChunkDeltaRule(torch.autograd.Function):
    """Autograd wrapper: Triton forward and backward; inputs are checked and contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, la, beta, erase, s0, chunk_size):  # type: ignore[override]
        plan = _plan(q, v, chunk_size)
        o, final, saved = _forward(q, k, v, la, beta, erase, s0, plan)
        ctx.save_for_backward(q, k, v, la, beta, erase, *saved)
        ctx.plan, ctx.s0_dtype = plan, None if s0 is None else s0.dtype
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dsn):  # type: ignore[override]
        saved = ctx.saved_tensors
        do = torch.zeros_like(saved[2]) if do is None else do.contiguous()
        dsn = None if dsn is None else dsn.float().contiguous()
        *grads, ds0 = _backward(saved, do, dsn, ctx.s0_dtype is not None, ctx.plan)
        return (*grads, None if ds0 is None else ds0.to(ctx.s0_dtype), None)


# ----- validation ---------------------------------------------------------------------------------------------
def runs_on(x: Tensor) -> bool:
    """Whether the kernels can run on x's device: CUDA, or anything under Triton's interpreter."""
    return x.device.type == "cuda" or isinstance(_prepare_kernel, InterpretedFunction)


def check_tensor(fn: str, name: str, x: Tensor, shape: tuple[int, ...], layout: str, ref: Tensor) -> None:
    """ValueError unless x is a float32 / bfloat16 / float16 tensor of this shape on ref's device."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{fn}: {name} has dtype {x.dtype}; the kernel takes float32, bfloat16 or float16 "
                         "(use the torch forms for other dtypes)")
    if tuple(x.shape) != shape:
        raise ValueError(f"{fn}: {name} must be {layout} = {shape}, got {tuple(x.shape)}")
    if x.device != ref.device:
        raise ValueError(f"{fn}: {name} is on {x.device}, q on {ref.device}")


def _check(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, erase: Tensor, s0: Tensor | None,
    chunk_size: int,
) -> None:
    fn = "chunk_delta_rule"
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"{fn}: q must be a [B, H, T, K] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    b, h, t, dk = q.shape
    if not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError(f"{fn}: v must be a [B, H, T, V] tensor, got {getattr(v, 'shape', type(v).__name__)}")
    dv = v.shape[-1]
    check_tensor(fn, "q", q, (b, h, t, dk), "[B, H, T, K]", q)
    check_tensor(fn, "k", k, (b, h, t, dk), "[B, H, T, K]", q)
    check_tensor(fn, "v", v, (b, h, t, dv), "[B, H, T, V]", q)
    for name, x in (("log_alpha", log_alpha), ("beta", beta), ("erase", erase)):
        check_tensor(fn, name, x, (b, h, t), "[B, H, T]", q)
    if s0 is not None:
        check_tensor(fn, "initial_state", s0, (b, h, dk, dv), "[B, H, K, V]", q)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{fn}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if min(t, dk, dv) == 0 or dk > MAX_KEY_DIM:
        raise ValueError(f"{fn}: T, K, V must be positive and K at most {MAX_KEY_DIM}, got {(t, dk, dv)}")
    if not isinstance(chunk_size, int) or not 16 <= chunk_size <= 128 or chunk_size & (chunk_size - 1):
        raise ValueError(f"{fn}: chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    if not runs_on(q):
        raise ValueError(f"{fn}: tensors on {q.device} need a CUDA device (or TRITON_INTERPRET=1 set before "
                         "triton is imported)")


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor,
    beta: Tensor,
    erase: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """The general delta rule S_t = exp(log_alpha_t) S_{t-1} - erase_t k_t (k_t^T S_{t-1}) + beta_t k_t v_t^T,
    o_t = S_t^T q_t, chunked, in Triton.

    q, k: [B, H, T, K]; v: [B, H, T, V]; log_alpha, beta, erase: [B, H, T]; ``initial_state`` [B, H, K, V].
    Inputs are float32, bfloat16 or float16 (q, k, v of one dtype; accumulated in float32). Returns o
    [B, H, T, V] in q's dtype and, if ``output_final_state``, the final state [B, H, K, V] in float32.
    Differentiable in every tensor argument. ``chunk_size`` is 16, 32, 64 or 128; any T works.
    """
    _check(q, k, v, log_alpha, beta, erase, initial_state, chunk_size)
    args = (q, k, v, log_alpha, beta, erase, initial_state)
    q, k, v, log_alpha, beta, erase, initial_state = (None if x is None else x.contiguous() for x in args)
    o, final = _ChunkDeltaRule.apply(q, k, v, log_alpha, beta, erase, initial_state, chunk_size)
    return o, (final if output_final_state else None)
