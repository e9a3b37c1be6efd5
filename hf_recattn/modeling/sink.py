"""A learned attention sink for kernelized attention: one extra key/value pair every query sees.

Softmax heads park attention on the first token when nothing else is relevant (the "attention sink"); a
pretrained model loses much of its quality without it (SmolLM2-135M, 512-token blocks: window-64 attention
76 perplexity, window-64 plus the first token 31, full attention 25). Kernel feature maps bound
phi(q).phi(k_0), so the first key cannot take that role in linear attention. This module adds a learned key
k* and value v* per key head with a learned weight w, outside the recurrent state (never decayed):

    num_t += w phi(q_t).phi(k*) v*,    den_t += w phi(q_t).phi(k*).

It starts with k* = 0, v* = 0 and w = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .mixer_base import MixerShape


class AttentionSink(nn.Module):
    """Adds the sink's share to a kernel attention's numerator [B, Hkv, G, T, E] and denominator."""

    def __init__(self, shape: MixerShape) -> None:
        super().__init__()
        self.key = nn.Parameter(torch.zeros(shape.num_kv_heads, shape.head_dim))
        self.value = nn.Parameter(torch.zeros(shape.num_kv_heads, shape.head_dim))
        self.log_weight = nn.Parameter(torch.zeros(shape.num_kv_heads))

    def init_parameters(self, init: Any) -> None:
        """k* = v* = 0, w = 1 (``init`` skips loaded parameters)."""
        for param in (self.key, self.value, self.log_weight):
            init.zeros_(param)

    def forward(
        self,
        q_features: torch.Tensor,
        key_map: Callable[[torch.Tensor], torch.Tensor],
        num: torch.Tensor,
        den: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_features`` [B, Hkv, G, T, F]; ``key_map`` is the layer's key feature map on [1, Hkv, 1, D]."""
        weight = self.scores(q_features, key_map)
        value = self.value.to(q_features.dtype)[None, :, None, None, :]
        return torch.addcmul(num, weight, value), den + weight[..., 0]

    def scores(
        self, q_features: torch.Tensor, key_map: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """[B, Hkv, G, T, 1]: w phi(q_t) . phi(k*), the sink's share of each query's numerator and denominator."""
        dtype = q_features.dtype
        k_features = key_map(self.key.to(dtype)[None, :, None, :])[0, :, 0]  # [Hkv, F]
        scaled = k_features * self.log_weight.to(dtype).exp()[:, None]  # [Hkv, F]
        return torch.matmul(q_features, scaled[None, :, None, :, None])
