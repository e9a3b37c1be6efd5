"""Triton kernels for chunked causal linear attention: plain, with a scalar decay, or with a decay per key.

Per batch row and head, with a state S of shape [K, V]::

    S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T      (per-key gate ``gk``, GLA)
    S_t = exp(g_t) S_{t-1} + k_t v_t^T              (scalar gate ``g``)
    S_t = S_{t-1} + k_t v_t^T                       (no gate)
    o_t = S_t^T q_t                                 (token t sees itself)

No scale, feature map or normalisation is applied: the caller does those.

Chunked form. Split the tokens into chunks of C; inside a chunk let b_t = sum of the log gates from the chunk's
first token to t (inclusive, per key dimension for ``gk``) and b_C its value at the chunk's end. With S the state
before the chunk::

    o_t  = (q_t * exp(b_t))^T S + sum_{s <= t} A_ts v_s,   A_ts = sum_d q_td k_sd exp(b_td - b_sd)
    S'   = diag(exp(b_C)) S + sum_s (k_s * exp(b_C - b_s)) v_s^T

Every exponent is b_t (<= 0), b_C - b_s or b_t - b_s with s <= t (<= 0; the pairs s > t are masked to -inf
before the exponential), so nothing overflows however strong the gates.

Backward, with dO and dS' the gradient of the state after the chunk, D_ts = dO_t . v_s::

    dq_t = exp(b_t) * (S dO_t) + sum_{s <= t} D_ts k_s * exp(b_t - b_s)
    dk_s = exp(b_C - b_s) * (dS' v_s) + sum_{t >= s} D_ts q_t * exp(b_t - b_s)
    dv_s = dS'^T (k_s * exp(b_C - b_s)) + sum_{t >= s} A_ts dO_t
    dS   = diag(exp(b_C)) dS' + sum_t (q_t * exp(b_t)) dO_t^T           (the gradient of the state before)

Gate gradient: with L_t the cumulative log gate over the whole sequence, the loss depends on L_t through the
factors exp(L_t - L_s) (L_t positive in o_t, negative in every later read of k_t and in the final state) and
exp(L_T) in the final state, which gives dL_t = q_t * dq_t - k_t * dk_t, plus rowsum(S_T * dS_T) at t = T.
Since g_r enters every L_t with t >= r, dg_r = sum_{t >= r} (q_t * dq_t - k_t * dk_t) + rowsum(S_T * dS_T),
summed over the key dimension for a scalar gate (the initial state enters through dq, which reads it). The
s = t terms (decay 1) of dq_t and dk_t cancel in that difference, so the kernels can also write dq and dk
without them and the gate gradient is formed from those: with strong gates the true gradient is tiny and the
rounding of those large terms would swamp it. The final-state term still cancels against k_T * dk_T, so with a
gradient on the final state the gate gradient's error is float32 rounding of k_T * (dS_T v_T), not of itself.

Kernels. The recurrence is independent per key row of S, so a program owns one [BK, BV] block of the state:
the grid is (B * H, K / BK, V / BV). The forward walks the chunks in order, keeps its state block in float32
registers and writes its partial output (summed over the key blocks afterwards). The backward runs one pass
forward in time for dq (it needs the state) and one backward in time for dk, dv and the initial state's gradient
(it carries dS); partial sums over blocks are added in torch, and so is the reverse cumulative sum of the gate
gradient. In-chunk products are ``tl.dot`` except for the per-key gate, whose pairwise decays exp(b_td - b_sd) are
a [C, C, BK] broadcast product: that gate runs chunks of at most ``GK_CHUNK`` (16) tokens and key blocks of at
most ``GK_BLOCK_K`` to keep that product small.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .tiles import load_state_block, load_tile, store_tile

Tensor = torch.Tensor

__all__ = ["chunk_linear_attention"]

#: largest key / value block a program holds (state block [BK, BV] in registers)
BLOCK_K = 64
BLOCK_V = 64
#: chunk length and key block cap for the per-key gate (its in-chunk decays are a [C, C, BK] product)
GK_CHUNK = 16
GK_BLOCK_K = 32
#: tl.dot precision for float32 inputs ("tf32x3": three tf32 products, close to float32 on tensor cores; "ieee"
#: is exact but runs on plain FMAs) and for half inputs (exact in tf32; only the float32 state is rounded)
FP32_DOT_PRECISION = "tf32x3"
HALF_DOT_PRECISION = "tf32"
#: software pipelining depth: 1 keeps float32 blocks of 64 x 64 within 64 KiB of shared memory
NUM_STAGES = 1

NO_GATE, SCALAR_GATE, KEY_GATE = 0, 1, 2
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----- device helpers -----------------------------------------------------------------------------------------
@triton.jit
def _chunk_decays(g_ptr, rows, cols, T, K, C: tl.constexpr, GATE: tl.constexpr):
    """Decay factors of one chunk from its log gates (tokens past T count as no decay).

    Returns (to_token, to_end, whole, pair): exp(b_t) ([C, 1], or [C, BK] per key), exp(b_C - b_t) (same
    shape), exp(b_C) (a scalar, or [BK, 1] per key) and exp(b_t - b_s) for s <= t, zero above the diagonal
    ([C, C], or [C, C, BK] per key).
    """
    rc = tl.arange(0, C)
    causal = rc[:, None] >= rc[None, :]
    if GATE == 0:
        to_token = tl.full([C, 1], 1.0, tl.float32)
        to_end = to_token
        whole = tl.full([1, 1], 1.0, tl.float32)
        pair = tl.where(causal, 1.0, 0.0)
    elif GATE == 1:
        b = tl.cumsum(tl.load(g_ptr + rows, mask=rows < T, other=0.0).to(tl.float32), 0)
        last = tl.sum(tl.where(rc == C - 1, b, 0.0), 0)
        to_token = tl.exp(b)[:, None]
        to_end = tl.exp(last - b)[:, None]
        whole = tl.exp(last)
        pair = tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
    else:
        b = tl.cumsum(load_tile(g_ptr, rows, cols, T, K), 0)
        last = tl.sum(tl.where((rc == C - 1)[:, None], b, 0.0), 0)
        to_token = tl.exp(b)
        to_end = tl.exp(last[None, :] - b)
        whole = tl.exp(last)[:, None]
        pair = tl.exp(tl.where(causal[:, :, None], b[:, None, :] - b[None, :, :], float("-inf")))
    return to_token, to_end, whole, pair


@triton.jit
def _scores(q, k, pair, GATE: tl.constexpr, PRECISION: tl.constexpr):
    """A_ts = sum_d q_td k_sd pair_ts(d): the decayed causal scores [C, C] of one chunk (this key block)."""
    if GATE == 2:
        a = tl.sum(q[:, None, :] * k[None, :, :] * pair, 2)
    else:
        a = tl.dot(q, tl.trans(k), input_precision=PRECISION) * pair
    return a


@triton.jit
def _value_products(do, v, C: tl.constexpr, PRECISION: tl.constexpr):
    """(d_ts = dO_t . v_s for s < t, zero elsewhere [C, C]; the diagonal dO_t . v_t [C]) of one chunk.

    The s = t terms (decay 1) are added apart, so that the gradients can also be written without them.
    """
    rc = tl.arange(0, C)
    d = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    diag = tl.sum(tl.where(rc[:, None] == rc[None, :], d, 0.0), 1)
    return tl.where(rc[:, None] > rc[None, :], d, 0.0), diag


@triton.jit
def _mix_keys(w, x, pair, GATE: tl.constexpr, PRECISION: tl.constexpr):
    """sum_s w_ts pair_ts(d) x_sd -> [C, BK] (row t gathers the tokens s <= t)."""
    if GATE == 2:
        out = tl.sum(w[:, :, None] * x[None, :, :] * pair, 1)
    else:
        out = tl.dot(w * pair, x, input_precision=PRECISION)
    return out


@triton.jit
def _mix_queries(w, x, pair, GATE: tl.constexpr, PRECISION: tl.constexpr):
    """sum_t w_ts pair_ts(d) x_td -> [C, BK] (row s gathers the tokens t >= s)."""
    if GATE == 2:
        out = tl.sum(w[:, :, None] * x[:, None, :] * pair, 0)
    else:
        out = tl.dot(tl.trans(w * pair), x, input_precision=PRECISION)
    return out


@triton.jit
def _program_blocks(BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """This program's head (int64), key block and value block (grid: heads x key blocks x value blocks), the
    number of heads, and its key, value and in-chunk ranges."""
    i_bh, i_k, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    rk, rv, rc = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    return i_bh, i_k, i_v, tl.num_programs(0), rk, rv, rc


@triton.jit
def _store_key_grad(ptr, off_ptr, grad, diag, x, rows, cols, T, K, OFF_DIAG: tl.constexpr):
    """Store a dq / dk block: ``grad`` (without the s = t terms) at ``off_ptr`` when OFF_DIAG, and with them
    (``diag * x``) at ``ptr``."""
    if OFF_DIAG:
        store_tile(off_ptr, grad, rows, cols, T, K)
    store_tile(ptr, grad + diag[:, None] * x, rows, cols, T, K)


# ----- kernels ------------------------------------------------------------------------------------------------
@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One head, one [BK, BV] state block: walk the chunks in order, write this key block's share of o
    (o_ptr is [K / BK, B * H, T, V]) and the block of the final state."""
    i_bh, i_k, i_v, n_bh, rk, rv, rc = _program_blocks(BK, BV, C)
    q_ptr, k_ptr, v_ptr = q_ptr + i_bh * T * K, k_ptr + i_bh * T * K, v_ptr + i_bh * T * V
    g_ptr += i_bh * T * (K if GATE == 2 else 1)
    o_ptr += (i_k * n_bh + i_bh) * T * V
    state = load_state_block(h0_ptr + i_bh * K * V, rk, rv, K, V, BK, BV, HAS_H0)
    for i_c in range(0, tl.cdiv(T, C)):
        rt = i_c * C + rc
        q, k = load_tile(q_ptr, rt, rk, T, K), load_tile(k_ptr, rt, rk, T, K)
        v = load_tile(v_ptr, rt, rv, T, V)
        to_token, to_end, whole, pair = _chunk_decays(g_ptr, rt, rk, T, K, C, GATE)
        o = tl.dot(q * to_token, state, input_precision=PRECISION)
        o += tl.dot(_scores(q, k, pair, GATE, PRECISION), v, input_precision=PRECISION)
        store_tile(o_ptr, o, rt, rv, T, V)
        state = state * whole + tl.dot(tl.trans(k * to_end), v, input_precision=PRECISION)
    store_tile(ht_ptr + i_bh * K * V, state, rk, rv, K, V)


@triton.jit
def _backward_dq_kernel(
    k_ptr, v_ptr, g_ptr, h0_ptr, do_ptr, dq_ptr, dq_off_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr,
    OFF_DIAG: tl.constexpr, PRECISION: tl.constexpr,
):
    """One head, one [BK, BV] state block, forward in time: rebuild the state chunk by chunk and write this
    value block's share of dq (dq_ptr is [V / BV, B * H, T, K]) and, with OFF_DIAG, of dq less its s = t term."""
    i_bh, i_k, i_v, n_bh, rk, rv, rc = _program_blocks(BK, BV, C)
    k_ptr, v_ptr, do_ptr = k_ptr + i_bh * T * K, v_ptr + i_bh * T * V, do_ptr + i_bh * T * V
    g_ptr += i_bh * T * (K if GATE == 2 else 1)
    dq_ptr += (i_v * n_bh + i_bh) * T * K
    dq_off_ptr += (i_v * n_bh + i_bh) * T * K
    state = load_state_block(h0_ptr + i_bh * K * V, rk, rv, K, V, BK, BV, HAS_H0)
    for i_c in range(0, tl.cdiv(T, C)):
        rt = i_c * C + rc
        k, v, do = load_tile(k_ptr, rt, rk, T, K), load_tile(v_ptr, rt, rv, T, V), load_tile(do_ptr, rt, rv, T, V)
        to_token, to_end, whole, pair = _chunk_decays(g_ptr, rt, rk, T, K, C, GATE)
        d, diag = _value_products(do, v, C, PRECISION)
        dq = tl.dot(do, tl.trans(state), input_precision=PRECISION) * to_token
        dq += _mix_keys(d, k, pair, GATE, PRECISION)
        _store_key_grad(dq_ptr, dq_off_ptr, dq, diag, k, rt, rk, T, K, OFF_DIAG)
        state = state * whole + tl.dot(tl.trans(k * to_end), v, input_precision=PRECISION)


@triton.jit
def _backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, do_ptr, dht_ptr, dk_ptr, dk_off_ptr, dv_ptr, dh0_ptr, T, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr, OFF_DIAG: tl.constexpr, PRECISION: tl.constexpr,
):
    """One head, one [BK, BV] block of dS, backward in time: write this value block's share of dk
    (dk_ptr is [V / BV, B * H, T, K]; with OFF_DIAG also dk less its s = t term), this key block's share of dv
    (dv_ptr is [K / BK, B * H, T, V]) and the block of the initial state's gradient."""
    i_bh, i_k, i_v, n_bh, rk, rv, rc = _program_blocks(BK, BV, C)
    q_ptr, k_ptr = q_ptr + i_bh * T * K, k_ptr + i_bh * T * K
    v_ptr, do_ptr = v_ptr + i_bh * T * V, do_ptr + i_bh * T * V
    g_ptr += i_bh * T * (K if GATE == 2 else 1)
    dk_ptr += (i_v * n_bh + i_bh) * T * K
    dk_off_ptr += (i_v * n_bh + i_bh) * T * K
    dv_ptr += (i_k * n_bh + i_bh) * T * V
    dstate = load_state_block(dht_ptr + i_bh * K * V, rk, rv, K, V, BK, BV, HAS_DHT)
    n_chunks = tl.cdiv(T, C)
    for i in range(0, n_chunks):
        rt = (n_chunks - 1 - i) * C + rc
        q, k = load_tile(q_ptr, rt, rk, T, K), load_tile(k_ptr, rt, rk, T, K)
        v, do = load_tile(v_ptr, rt, rv, T, V), load_tile(do_ptr, rt, rv, T, V)
        to_token, to_end, whole, pair = _chunk_decays(g_ptr, rt, rk, T, K, C, GATE)
        d, diag = _value_products(do, v, C, PRECISION)
        dk = tl.dot(v, tl.trans(dstate), input_precision=PRECISION) * to_end
        dk += _mix_queries(d, q, pair, GATE, PRECISION)
        _store_key_grad(dk_ptr, dk_off_ptr, dk, diag, q, rt, rk, T, K, OFF_DIAG)
        dv = tl.dot(k * to_end, dstate, input_precision=PRECISION)
        dv += tl.dot(tl.trans(_scores(q, k, pair, GATE, PRECISION)), do, input_precision=PRECISION)
        store_tile(dv_ptr, dv, rt, rv, T, V)
        dstate = dstate * whole + tl.dot(tl.trans(q * to_token), do, input_precision=PRECISION)
    if STORE_DH0:
        store_tile(dh0_ptr + i_bh * K * V, dstate, rk, rv, K, V)


# ----- launchers ----------------------------------------------------------------------------------------------
def _block(n: int, cap: int) -> int:
    """Power-of-two block (>= 16, for tl.dot) covering n, at most cap."""
    return min(max(16, triton.next_power_of_2(n)), cap)


def _plan(q: Tensor, v: Tensor, mode: int, chunk_size: int) -> tuple[int, int, int, str]:
    """(chunk, BK, BV, dot precision) for these shapes and this gate."""
    if mode == KEY_GATE:
        chunk, block_k = min(chunk_size, GK_CHUNK), _block(q.shape[-1], GK_BLOCK_K)
    else:
        chunk, block_k = chunk_size, _block(q.shape[-1], BLOCK_K)
    precision = FP32_DOT_PRECISION if q.dtype == torch.float32 else HALF_DOT_PRECISION
    return chunk, block_k, _block(v.shape[-1], BLOCK_V), precision


def _forward(
    q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, mode: int, h0: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: (o in q's dtype, final state in float32)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    chunk, bk, bv, precision = _plan(q, v, mode, chunk_size)
    nk, nv = triton.cdiv(K, bk), triton.cdiv(V, bv)
    o = q.new_empty(nk, B, H, T, V, dtype=torch.float32)
    ht = q.new_empty(B, H, K, V, dtype=torch.float32)
    _forward_kernel[(B * H, nk, nv)](
        q, k, v, q if gate is None else gate, ht if h0 is None else h0, o, ht, T, K, V,
        C=chunk, BK=bk, BV=bv, GATE=mode, HAS_H0=h0 is not None, PRECISION=precision, num_stages=NUM_STAGES,
    )
    return o.sum(0).to(q.dtype), ht


class _Grads(NamedTuple):
    """float32 gradients from the backward kernels; ``dq_off`` / ``dk_off`` leave out the s = t terms."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dh0: Tensor | None
    dq_off: Tensor | None
    dk_off: Tensor | None


def _backward(
    q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, mode: int, h0: Tensor | None, do: Tensor,
    dht: Tensor | None, chunk_size: int, off_diag: bool, want_dh0: bool,
) -> _Grads:
    """Launch the two backward kernels (``off_diag``: also write dq and dk without their s = t terms;
    ``want_dh0``: write the initial state's gradient)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    chunk, bk, bv, precision = _plan(q, v, mode, chunk_size)
    nk, nv = triton.cdiv(K, bk), triton.cdiv(V, bv)
    g = q if gate is None else gate
    dq, dk = (q.new_empty(nv, B, H, T, K, dtype=torch.float32) for _ in range(2))
    dq_off, dk_off = (q.new_empty(nv, B, H, T, K, dtype=torch.float32) if off_diag else None for _ in range(2))
    dv = q.new_empty(nk, B, H, T, V, dtype=torch.float32)
    dh0 = q.new_empty(B, H, K, V, dtype=torch.float32) if want_dh0 else None
    grid = (B * H, nk, nv)
    shapes = dict(C=chunk, BK=bk, BV=bv, GATE=mode, OFF_DIAG=off_diag, PRECISION=precision, num_stages=NUM_STAGES)
    _backward_dq_kernel[grid](
        k, v, g, q if h0 is None else h0, do, dq, dq if dq_off is None else dq_off, T, K, V,
        HAS_H0=h0 is not None, **shapes,
    )
    _backward_dkdv_kernel[grid](
        q, k, v, g, do, q if dht is None else dht, dk, dk if dk_off is None else dk_off, dv,
        q if dh0 is None else dh0, T, K, V, HAS_DHT=dht is not None, STORE_DH0=want_dh0, **shapes,
    )
    return _Grads(dq.sum(0), dk.sum(0), dv.sum(0), dh0, *(None if x is None else x.sum(0) for x in (dq_off, dk_off)))


def _gate_grad(
    q: Tensor, k: Tensor, dq_off: Tensor, dk_off: Tensor, mode: int, ht: Tensor, dht: Tensor | None
) -> Tensor:
    """dg_r = sum_{t >= r} (q_t dq_t - k_t dk_t) + rowsum(S_T dS_T), per key ([B, H, T, K]) or summed ([B, H, T]).

    dq and dk without their s = t terms give the same sum (those cancel exactly) without their rounding.
    """
    dlog = q.float() * dq_off - k.float() * dk_off
    end = None if dht is None else (ht * dht).sum(-1)  # [B, H, K]
    if mode == SCALAR_GATE:
        dlog, end = dlog.sum(-1), None if end is None else end.sum(-1)
    time = -1 if mode == SCALAR_GATE else -2  # the token axis of the gate
    dgate = dlog.flip(time).cumsum(time).flip(time)
    return dgate if end is None else dgate + end.unsqueeze(time)


class _ChunkLinearAttention(torch.autograd.Function):
    """Autograd wrapper: Triton forward and backward; inputs are checked and contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, gate, mode, h0, chunk_size):  # type: ignore[override]
        o, ht = _forward(q, k, v, gate, mode, h0, chunk_size)
        ctx.save_for_backward(q, k, v, gate, h0, ht)
        ctx.mode, ctx.chunk_size = mode, chunk_size
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        q, k, v, gate, h0, ht = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.float().contiguous()
        gate_grad = gate is not None and ctx.needs_input_grad[3]
        want_dh0 = h0 is not None and ctx.needs_input_grad[5]
        grads = _backward(q, k, v, gate, ctx.mode, h0, do, dht, ctx.chunk_size, gate_grad, want_dh0)
        dgate = None
        if gate_grad:
            dgate = _gate_grad(q, k, grads.dq_off, grads.dk_off, ctx.mode, ht, dht).to(gate.dtype)
        dh0 = None if grads.dh0 is None else grads.dh0.to(h0.dtype)
        return grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype), dgate, None, dh0, None


# ----- validation ---------------------------------------------------------------------------------------------
def _check_dtype(name: str, x: Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"chunk_linear_attention: {name} has dtype {x.dtype}; the kernel takes float32, bfloat16 "
                         "or float16 (use the torch forms for other dtypes)")


def _check_shape(name: str, x: Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"chunk_linear_attention: {name} must be {layout} = {shape}, got {tuple(x.shape)}")


def _check_types(tensors: dict[str, Tensor | None]) -> None:
    """q, k, v are tensors, the optional ones tensors or None; one kernel dtype for q, k, v; one device."""
    for name, x in tensors.items():
        if not isinstance(x, Tensor) and (x is not None or name in ("q", "k", "v")):
            raise ValueError(f"chunk_linear_attention: {name} must be a tensor, got {type(x).__name__}")
    q = tensors["q"]
    for name, x in tensors.items():
        if x is not None:
            _check_dtype(name, x)
            if x.device != q.device:
                raise ValueError(f"chunk_linear_attention: {name} is on {x.device}, q on {q.device}")
    if tensors["k"].dtype != q.dtype or tensors["v"].dtype != q.dtype:
        raise ValueError(f"chunk_linear_attention: q, k and v must share a dtype, got {q.dtype}, "
                         f"{tensors['k'].dtype}, {tensors['v'].dtype}")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gk: Tensor | None, h0: Tensor | None) -> None:
    """The layouts of the docstring, with B, H, T, K from q and V from v."""
    if q.dim() != 4:
        raise ValueError(f"chunk_linear_attention: q must be [B, H, T, K], got shape {tuple(q.shape)}")
    B, H, T, K = q.shape
    _check_shape("k", k, tuple(q.shape), "[B, H, T, K]")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"chunk_linear_attention: v must be [B, H, T, V] with B, H, T = {(B, H, T)}, "
                         f"got {tuple(v.shape)}")
    V = v.shape[-1]
    if min(T, K, V) == 0:
        raise ValueError(f"chunk_linear_attention: T, K and V must be positive, got {(T, K, V)}")
    if g is not None and gk is not None:
        raise ValueError("chunk_linear_attention: pass at most one of g (scalar decay) and gk (per-key decay)")
    if g is not None:
        _check_shape("g", g, (B, H, T), "[B, H, T]")
    if gk is not None:
        _check_shape("gk", gk, (B, H, T, K), "[B, H, T, K]")
    if h0 is not None:
        _check_shape("initial_state", h0, (B, H, K, V), "[B, H, K, V]")


def _checked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gk: Tensor | None, initial_state: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, int, Tensor | None]:
    """Validate the arguments; return contiguous (q, k, v, gate, gate mode, initial state)."""
    _check_types({"q": q, "k": k, "v": v, "g": g, "gk": gk, "initial_state": initial_state})
    _check_shapes(q, k, v, g, gk, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_linear_attention: chunk_size must be a power of two >= 16, got {chunk_size}")
    gate = g if g is not None else gk
    mode = NO_GATE if gate is None else SCALAR_GATE if g is not None else KEY_GATE
    h0 = None if initial_state is None else initial_state.contiguous()
    return q.contiguous(), k.contiguous(), v.contiguous(), None if gate is None else gate.contiguous(), mode, h0


def chunk_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Causal linear attention o_t = S_t^T q_t with S_t = decay_t S_{t-1} + k_t v_t^T, chunked, in Triton.

    q, k: [B, H, T, K]; v: [B, H, T, V]; ``g`` [B, H, T] a scalar log decay per head and token, or ``gk``
    [B, H, T, K] a log decay per key dimension (both <= 0, at most one); ``initial_state`` [B, H, K, V].
    Inputs are float32, bfloat16 or float16 (accumulated in float32). Returns o [B, H, T, V] in q's dtype and,
    if ``output_final_state``, the final state [B, H, K, V] in float32. Differentiable in q, k, v, the gate and
    the initial state. ``chunk_size`` is a power of two >= 16 (capped at 16 with ``gk``).
    """
    q, k, v, gate, mode, h0 = _checked(q, k, v, g, gk, initial_state, chunk_size)
    o, ht = _ChunkLinearAttention.apply(q, k, v, gate, mode, h0, chunk_size)
    return o, (ht if output_final_state else None)
