"""Feature maps phi for linear attention, applied to grouped queries and to keys.

Queries arrive as ``[B, Hkv, G, T, D]`` and keys as ``[B, Hkv, T, D]``; learnable maps keep one set of
parameters per query head and one per key head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import MixerShape
from .ops_taylor import packed_powers
from .options import check_kind

FEATURE_MAPS = ("identity", "elu", "relu", "cosine", "exp", "hedgehog", "taylor2")

#: keys are clamped here before exp so that sums over long contexts stay finite in fp32
EXP_KEY_CLAMP = 40.0


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
        check_kind(kind, FEATURE_MAPS, "feature_map", f"layer {shape.layer_idx}")
        self.kind = kind
        self.shape = shape
        d = shape.head_dim
        if kind == "cosine":
            self.log_temperature = nn.Parameter(torch.zeros(shape.num_heads))
        elif kind == "hedgehog":
            eye = torch.eye(d)
            self.q_weight = nn.Parameter(eye.repeat(shape.num_heads, 1, 1))
            self.k_weight = nn.Parameter(eye.repeat(shape.num_kv_heads, 1, 1))

    @property
    def out_dim(self) -> int:
        d = self.shape.head_dim
        return {"hedgehog": 2 * d, "taylor2": 1 + d + d * (d + 1) // 2}.get(self.kind, d)

    def init_parameters(self, init: Any) -> None:
        """Start as the plain map: temperature 1, hedgehog projections the identity (``init`` skips loaded
        ones)."""
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
        # taylor2: phi(q).phi(k) = 1 + s + s^2/2 with s = q.k / sqrt(d): order-2 Taylor's packed features of
        # x / d^(1/4) (squares packed symmetrically), so its chunked form can run through ``taylor_chunked``
        return packed_powers(x * self.shape.head_dim**-0.25, 2)
