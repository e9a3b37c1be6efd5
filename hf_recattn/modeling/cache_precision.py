"""How the hybrid's exact cache holds its pairs (option ``cache_dtype``): as the model computes them (``model``), or
each key and each value as symmetric integer codes with float32 scales (float64 in a float64 model):

- ``int8``: one scale per vector (its largest magnitude maps to 127), a byte per code: about four times as many
  pairs per byte as float32.
- ``int4``: one scale per group of 32 dimensions (per vector when it has fewer; its largest magnitude maps to 7), two
  codes per byte: about 6.4 times as many pairs per byte as float32 for 64 dimensions, 1.7 times int8's.
- ``int4g16``: int4 codes with one float16 scale per 16 dimensions, the same bytes as ``int4`` (twice the scales at
  half their bytes): a large coordinate spoils the step of 15 others instead of 31. Each scale is the float16 at or
  above the group's largest magnitude / 7 (so no code clips), at most float16's largest (65,504: a group beyond
  about 458,000 clips).
- ``k8v4g16``: each key as ``int8`` codes, each value as ``int4g16`` codes: the keys set the attention weights, and
  int4 keys cost a teacher's attention far more than int4 values cost its output (benchmarks/cache_code_error.py).

A pair is quantized once, when a decision first keeps it; the forms carry it dequantized beside its scales, so a
pair that stays cached is never rounded twice and every form reads the same numbers. The state holds the codes and
the scales. Training passes gradients straight through the rounding (the straight-through estimator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODEL = "model"
INT8 = "int8"
INT4 = "int4"
#: bytes of one stored scale (float32, unless a format says otherwise)
SCALE_BYTES = 4
#: the dtype a format whose scales take 2 bytes stores them in
HALF_SCALE = torch.float16


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The scales' dtype for vectors of ``dtype``: float32, or float64 for float64 vectors."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class CodeFormat:
    """Symmetric integer codes of ``bits`` bits, 8 or 4 (-levels..levels), with one scale per ``group`` dimensions
    (None: per vector; a vector of fewer dimensions has one); 4-bit codes are packed two per byte. ``scale_bytes``:
    4 (float32 scales, float64 in a float64 model) or 2 (each rounded up to a float16 and stored as one).
    ``description`` is how cards and reports name the format."""

    bits: int
    group: int | None
    description: str
    scale_bytes: int = SCALE_BYTES

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def codes_dtype(self) -> torch.dtype:
        """How the state stores the codes: int8 as they are, narrower codes packed into bytes."""
        return torch.int8 if self.bits == 8 else torch.uint8

    def group_size(self, head_dim: int) -> int:
        return head_dim if self.group is None else min(self.group, head_dim)

    def groups(self, head_dim: int) -> int:
        """Scales per vector."""
        return head_dim // self.group_size(head_dim)

    def stored_dims(self, head_dim: int) -> int:
        """The last dimension of a vector's stored codes: its bytes."""
        return head_dim * self.bits // 8

    def vector_bytes(self, head_dim: int) -> int:
        """The bytes of one coded vector: its codes and its scales."""
        return self.stored_dims(head_dim) + self.scale_bytes * self.groups(head_dim)

    def stored_scales(self, scale: torch.Tensor) -> torch.Tensor:
        """The scales as the state stores them: float16 for 2-byte scales (exact: ``quantize`` rounded them)."""
        return scale.to(HALF_SCALE) if self.scale_bytes == 2 else scale

    def _rounded_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """2-byte scales: each the float16 at or above it (none below: no code clips), at most float16's largest."""
        if self.scale_bytes != 2:
            return scale
        half = scale.clamp(max=torch.finfo(HALF_SCALE).max).to(HALF_SCALE)
        up = torch.nextafter(half, torch.full_like(half, torch.inf)).clamp(max=torch.finfo(HALF_SCALE).max)
        return torch.where(half.to(scale.dtype) < scale, up, half).to(scale.dtype)

    def unfit(self, head_dim: int) -> str | None:
        """Why vectors of ``head_dim`` dimensions cannot take these codes, or None."""
        per_byte, size = 8 // self.bits, self.group_size(head_dim)
        if head_dim % per_byte or head_dim % size:
            return (f"packs {per_byte} codes per byte with a scale per {size} dimensions, which head_dim "
                    f"{head_dim} does not divide into")
        return None

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.groups(x.shape[-1]), -1))

    def _codes(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The stored codes of ``x`` [..., D] (in the scales' dtype) at its ``scale`` [..., groups]."""
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(self._grouped(x) / safe[..., None]).clamp(-self.levels, self.levels).flatten(-2)
        if self.bits == 8:
            return codes.to(torch.int8)
        biased = (codes + self.levels + 1).to(torch.uint8)  # 1..15: a code and its neighbour share a byte
        return biased[..., 0::2] | (biased[..., 1::2] << 4)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> its stored codes [..., ``stored_dims``] and scales [..., ``groups``] (``scale_dtype``; a zero
        group: scale 0, codes 0)."""
        x32 = x.detach().to(scale_dtype(x.dtype))
        scale = self._rounded_scale(self._grouped(x32).abs().amax(-1) / self.levels)
        return self._codes(x32, scale), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The vectors [..., D] in ``dtype`` that stored ``codes`` and their ``scale`` [..., groups] stand for."""
        if self.bits == 8:
            values = codes.to(scale.dtype)
        else:
            nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
            values = nibbles.to(scale.dtype) - (self.levels + 1)
        return (self._grouped(values) * scale[..., None]).flatten(-2).to(dtype)

    def round_trip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x as the codes would hold it (dequantized, in x's dtype; the gradient passes straight through) and its
        scales."""
        codes, scale = self.quantize(x)
        held = self.dequantize(codes, scale, x.dtype)
        return x + (held - x).detach(), scale

    def codes_of(self, held: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The stored codes of vectors ``held`` [..., D] that ``round_trip`` produced with ``scale``: exactly those it
        rounded to (the product of a code and its scale divides back to within far less than a half)."""
        return self._codes(held.detach().to(scale.dtype), scale)


#: the vector codes, by name
CODE_FORMATS = {
    INT8: CodeFormat(bits=8, group=None, description="int8 codes with a float32 scale per key and per value"),
    INT4: CodeFormat(bits=4, group=32, description="int4 codes (two per byte) with a float32 scale per 32 dimensions "
                                                   "of each key and value"),
    "int4g16": CodeFormat(bits=4, group=16, scale_bytes=2, description="int4 codes (two per byte) with a float16 "
                                                                       "scale per 16 dimensions of each key and value"),
}


@dataclass(frozen=True)
class PairCodes:
    """How a coded ``cache_dtype`` holds a pair: its key's codes and its value's."""

    keys: CodeFormat
    values: CodeFormat
    description: str

    def pair_bytes(self, head_dim: int) -> int:
        """The bytes of one coded key and its value."""
        return self.keys.vector_bytes(head_dim) + self.values.vector_bytes(head_dim)

    def unfit(self, head_dim: int) -> str | None:
        """Why heads of ``head_dim`` dimensions cannot take these codes, or None."""
        if self.keys == self.values:
            return self.keys.unfit(head_dim)
        for part, vectors in (("keys", self.keys), ("values", self.values)):
            why = vectors.unfit(head_dim)
            if why:
                return f"{why} (its {part}' codes)"
        return None


def _same_codes(name: str) -> PairCodes:
    return PairCodes(CODE_FORMATS[name], CODE_FORMATS[name], CODE_FORMATS[name].description)


#: the coded ``cache_dtype`` choices
PAIR_CODES = {
    **{name: _same_codes(name) for name in CODE_FORMATS},
    "k8v4g16": PairCodes(CODE_FORMATS[INT8], CODE_FORMATS["int4g16"], "int8 codes with a float32 scale per key, "
                         "int4 codes (two per byte) with a float16 scale per 16 dimensions of each value"),
}
CACHE_DTYPES = (MODEL, *PAIR_CODES)


def pair_codes(cache_dtype: str) -> PairCodes:
    """The keys' and values' codes of a coded ``cache_dtype``."""
    return PAIR_CODES[cache_dtype]


def coded_slot_bytes(num_kv_heads: int, head_dim: int, slots: int, cache_dtype: str) -> int:
    """The bytes of a coded cache's keys and values: their codes and scales (``PairCodes.pair_bytes``)."""
    return num_kv_heads * slots * pair_codes(cache_dtype).pair_bytes(head_dim)


def slot_elements(num_kv_heads: int, head_dim: int, slots: int, cache_dtype: str) -> int:
    """The cache's keys and values (not its mask) in float32 elements: 2 G Hkv D as computed; for coded ones their
    bytes (``coded_slot_bytes``) over four, rounded up."""
    if cache_dtype == MODEL:
        return 2 * num_kv_heads * head_dim * slots
    return -(-coded_slot_bytes(num_kv_heads, head_dim, slots, cache_dtype) // 4)
