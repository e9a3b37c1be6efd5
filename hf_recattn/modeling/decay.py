"""Forget factors for linear attention states: S_t = g_t S_{t-1} + phi(k_t) v_t^T, one g per key head.

* ``learned``: g = sigmoid(b_h), a learnable constant per key head (decayed linear attention, as RetNet's
  fixed decays but trained);
* ``gated``: g_t = sigmoid(w_h . x_t / sqrt(C) + b_h), read from the layer input x (C channels; a scalar
  data-dependent gate, as in Mamba-2 or scalar GLA). ``w`` starts at zero, so a gated layer starts as the
  learned one; the 1/sqrt(C) keeps one optimizer step on ``w`` from swinging the gate across its range.

The biases start at half-lives spread log-uniformly over the key heads between ``half_life_min`` and
``half_life_max`` tokens (g^h = 1/2). Everything downstream works with log g <= 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import MixerShape

DECAYS = ("none", "learned", "gated")


def half_life_logits(num_heads: int, shortest: float, longest: float) -> torch.Tensor:
    """sigmoid^-1 of the per-token factors whose half-lives spread log-uniformly over ``num_heads`` heads."""
    if num_heads == 1:
        lives = torch.tensor([math.sqrt(shortest * longest)], dtype=torch.float64)
    else:
        lives = torch.logspace(math.log10(shortest), math.log10(longest), num_heads, dtype=torch.float64)
    g = 0.5 ** (1.0 / lives)
    return torch.log(g / (1.0 - g)).float()


class Decay(nn.Module):
    """log g of shape [B, Hkv, T] for the layer input ``x`` [B, T, C]."""

    def __init__(self, kind: str, shape: MixerShape, half_life_min: float, half_life_max: float) -> None:
        super().__init__()
        if kind not in DECAYS[1:]:
            raise ValueError(f"layer {shape.layer_idx}: unknown decay {kind!r}; known: {list(DECAYS)}")
        self.kind = kind
        self.half_lives = (float(half_life_min), float(half_life_max))
        self.bias = nn.Parameter(half_life_logits(shape.num_kv_heads, *self.half_lives))
        if kind == "gated":  # a plain parameter, not nn.Linear: the model's generic Linear init must not touch it
            self.weight = nn.Parameter(torch.zeros(shape.num_kv_heads, shape.hidden_size))

    def init_parameters(self, init: Any) -> None:
        """Biases at the configured half-lives, gate weights at zero (``init`` skips loaded ones)."""
        init.copy_(self.bias, half_life_logits(self.bias.numel(), *self.half_lives).to(self.bias))
        if self.kind == "gated":
            init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "learned":
            logits = self.bias[None, :, None].expand(x.shape[0], -1, x.shape[1])
        else:
            scale = x.shape[-1] ** -0.5
            logits = F.linear(x, self.weight.to(x.dtype) * scale, self.bias.to(x.dtype)).transpose(1, 2)
        return F.logsigmoid(logits.to(x.dtype))
