"""Triton device helpers shared by the chunked kernels: masked float32 tiles of row-major matrices."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile(ptr, rows, cols, n_rows, n_cols):
    """[len(rows), len(cols)] float32 tile of a row-major [n_rows, n_cols] matrix, zero outside it."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, value, rows, cols, n_rows, n_cols):
    """Store a tile into a row-major [n_rows, n_cols] matrix, skipping what falls outside it."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * n_cols + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state_block(ptr, rows, cols, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr, PRESENT: tl.constexpr):
    """The float32 [BR, BC] block (``rows`` x ``cols``) of a row-major [n_rows, n_cols] state, zeros when the state
    is not ``PRESENT`` (no initial state, no gradient on the final one)."""
    block = tl.zeros([BR, BC], dtype=tl.float32)
    if PRESENT:
        block = load_tile(ptr, rows, cols, n_rows, n_cols)
    return block
