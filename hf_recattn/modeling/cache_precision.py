"""How the hybrid's exact cache holds its pairs (option ``cache_dtype``): as the model computes them (``model``), or
each key and each value as 8-bit integers with one scale (``int8``: symmetric, the vector's largest magnitude maps
to 127; the scale in float32, float64 in a float64 model), about four times as many pairs per byte as float32.

A pair is quantized once, when a decision first keeps it; the forms carry it dequantized beside its scales, so a
pair that stays cached is never rounded twice and every form reads the same numbers. The state holds the integers
and the scales. Training passes gradients straight through the rounding (the straight-through estimator).
"""

from __future__ import annotations

import torch

MODEL = "model"
INT8 = "int8"
CACHE_DTYPES = (MODEL, INT8)
#: the integer range of a symmetric int8 code (-127..127: zero stays exact and the range is symmetric)
INT8_LEVELS = 127
#: bytes of one stored scale (float32)
SCALE_BYTES = 4


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The scales' dtype for vectors of ``dtype``: float32, or float64 for float64 vectors."""
    return torch.promote_types(dtype, torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> its int8 codes [..., D] and scales [..., 1] (``scale_dtype``; a zero vector: scale 0, codes
    0)."""
    x32 = x.detach().to(scale_dtype(x.dtype))
    scale = x32.abs().amax(-1, keepdim=True) / INT8_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x32 / safe).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors [..., D] in ``dtype`` that int8 ``codes`` [..., D] and their ``scale`` [..., 1] stand for."""
    return (codes.to(scale.dtype) * scale).to(dtype)


def round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as int8 would hold it (dequantized, in x's dtype; the gradient passes straight through) and its scales."""
    codes, scale = quantize(x)
    held = dequantize(codes, scale, x.dtype)
    return x + (held - x).detach(), scale


def codes_of(held: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 codes of vectors ``held`` [..., D] that ``round_trip`` produced with ``scale`` [..., 1]: exactly those
    it rounded to (the product of a code and its scale divides back to within far less than a half)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(held.detach().to(scale.dtype) / safe).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)


def int8_slot_bytes(num_kv_heads: int, head_dim: int, slots: int) -> int:
    """The bytes of an int8 cache's keys and values: one per code, plus a float32 scale per key and per value."""
    return 2 * num_kv_heads * slots * (head_dim + SCALE_BYTES)


def slot_elements(num_kv_heads: int, head_dim: int, slots: int, cache_dtype: str) -> int:
    """The cache's keys and values (not its mask) in float32 elements: 2 G Hkv D as computed; for int8 their bytes
    (``int8_slot_bytes``) over four, rounded up."""
    if cache_dtype == MODEL:
        return 2 * num_kv_heads * head_dim * slots
    return -(-int8_slot_bytes(num_kv_heads, head_dim, slots) // 4)
