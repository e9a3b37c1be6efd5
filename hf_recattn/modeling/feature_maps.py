"""Feature maps phi for linear attention, applied to grouped queries and to keys.

Queries arrive as ``[B, Hkv, G, T, D]`` and keys as ``[B, Hkv, T, D]``; learnable maps keep one set of
parameters per query head and one per key head.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import MixerShape

FEATURE_MAPS = ("identity", "elu", "relu", "cosine", "exp", "hedgehog", "taylor2")

#: rows of x from which taylor2's features are built from slices rather than gathers (a decode step has 1-3)
_SLICES_FROM = 16

#: keys are clamped here before exp so that sums over long contexts stay finite in fp32
EXP_KEY_CLAMP = 40.0


def _taylor2_indices(d: int, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where taylor2's features [1, x, x_i^2 / sqrt(2), x_i x_j (i < j)] take their two factors from
    [1, x, x / sqrt(2)] (length 1 + 2d): two gathers and one product build them (fewer ops than slicing)."""
    one = torch.zeros(1, dtype=torch.long, device=device)
    plain = torch.arange(1, d + 1, device=device)
    rows, cols = torch.triu_indices(d, d, offset=1, device=device)
    left = torch.cat([one, one.expand(d), plain, rows + 1])
    right = torch.cat([one, plain, plain + d, cols + 1])
    return left, right


@lru_cache(maxsize=8)
def _taylor2_rows(d: int) -> torch.Tensor:
    i, j = torch.triu_indices(d, d)  # order-2 Taylor's packing: (i, j), i <= j, row by row
    squares, pairs = i == j, i != j
    position = torch.empty(len(i), dtype=torch.long)
    position[squares] = 1 + d + i[squares]  # taylor2 keeps the squares first ...
    position[pairs] = 1 + 2 * d + torch.arange(d * (d - 1) // 2)  # ... then the products in the same row order
    return torch.cat([torch.arange(1 + d), position])


def taylor2_rows_in_taylor_order(d: int, device: torch.device) -> torch.Tensor:
    """Indices into taylor2's features [1, x, squares, products] that give order-2 Taylor's packed order
    [1, x, (i, j) for i <= j row by row] (the same monomials and weights)."""
    return _taylor2_rows(d).to(device)


def _per_head(param: torch.Tensor, x: torch.Tensor, is_query: bool) -> torch.Tensor:
    """Broadcast a [H or Hkv, ...] parameter against grouped q or k."""
    if is_query:
        hk, g = x.shape[1], x.shape[2]
        return param.view(hk, g, *param.shape[1:])
    return param


class FeatureMap(nn.Module):
    """phi(x); ``is_query`` selects the query or key side (they may differ)."""

    def __init__(self, kind: str, shape: MixerShape) -> None:
        super().__init__()
        if kind not in FEATURE_MAPS:
            raise ValueError(
                f"layer {shape.layer_idx}: unknown feature_map {kind!r}; known: {list(FEATURE_MAPS)}"
            )
        self.kind = kind
        self.shape = shape
        d = shape.head_dim
        if kind == "cosine":
            self.log_temperature = nn.Parameter(torch.zeros(shape.num_heads))
        elif kind == "hedgehog":
            eye = torch.eye(d)
            self.q_weight = nn.Parameter(eye.repeat(shape.num_heads, 1, 1))
            self.k_weight = nn.Parameter(eye.repeat(shape.num_kv_heads, 1, 1))
        if kind == "taylor2":
            left, right = _taylor2_indices(d, None)
            self.register_buffer("_left", left, persistent=False)
            self.register_buffer("_right", right, persistent=False)

    @property
    def out_dim(self) -> int:
        d = self.shape.head_dim
        return {"hedgehog": 2 * d, "taylor2": 1 + d + d * (d + 1) // 2}.get(self.kind, d)

    def init_parameters(self, init: Any) -> None:
        """Start as the plain map: temperature 1, hedgehog projections the identity (``init`` skips loaded
        ones).

        Also (re)fills taylor2's gather indices, which are not saved and so are never loaded.
        """
        if self.kind == "taylor2":  # non-persistent buffers: from_pretrained leaves them uninitialized (meta)
            left, right = _taylor2_indices(self.shape.head_dim, self._left.device)
            init.copy_(self._left, left)
            init.copy_(self._right, right)
        if self.kind == "cosine":
            init.zeros_(self.log_temperature)
        elif self.kind == "hedgehog":
            eye = torch.eye(self.shape.head_dim, device=self.q_weight.device, dtype=self.q_weight.dtype)
            init.copy_(self.q_weight, eye.expand_as(self.q_weight))
            init.copy_(self.k_weight, eye.expand_as(self.k_weight))

    def forward(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        kind = self.kind
        if kind == "identity":
            return x
        if kind == "elu":
            return F.elu(x) + 1.0
        if kind == "relu":
            return F.relu(x)
        if kind == "cosine":
            x = F.normalize(x, dim=-1)
            if not is_query:
                return x
            tau = _per_head(self.log_temperature.exp(), x, True)
            return x * tau[..., None, None]
        if kind == "exp":
            if is_query:  # a per-query constant factor cancels in every normalization
                return torch.exp(x - x.amax(-1, keepdim=True).detach())
            return torch.exp(x.clamp(max=EXP_KEY_CLAMP))
        if kind == "hedgehog":
            weight = _per_head(self.q_weight if is_query else self.k_weight, x, is_query)
            proj = torch.matmul(x, weight)  # [..., T, D] @ [..., D, D]
            # [softmax(proj), softmax(-proj)]: one softmax over both halves, viewed as two rows of D
            both = torch.cat([proj, -proj], dim=-1).view(*proj.shape[:-1], 2, proj.shape[-1])
            return both.softmax(-1).flatten(-2)
        # taylor2: phi(q).phi(k) = 1 + s + s^2/2 with s = q.k / sqrt(d), squares packed symmetrically:
        # [1, x, x_i^2 / sqrt(2), x_i x_j (i < j)], every entry one product of two entries of [1, x, x / sqrt(2)]
        x = x * self.shape.head_dim**-0.25
        if x.numel() >= _SLICES_FROM * x.shape[-1]:  # many rows: contiguous slices beat the gathers
            d = x.shape[-1]
            pairs = [x[..., a : a + 1] * x[..., a + 1 :] for a in range(d - 1)]
            return torch.cat([torch.ones_like(x[..., :1]), x, x * x * 2.0**-0.5, *pairs], dim=-1)
        factors = torch.cat([torch.ones_like(x[..., :1]), x, x * 2.0**-0.5], dim=-1)
        shape = (*x.shape[:-1], self._left.numel())
        return factors.gather(-1, self._left.expand(shape)) * factors.gather(-1, self._right.expand(shape))
