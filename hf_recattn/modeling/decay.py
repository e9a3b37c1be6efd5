"""Forget factors for linear attention states: S_t = g_t S_{t-1} + phi(k_t) v_t^T, one g per key head.

* ``learned``: g = sigmoid(b_h), a learnable constant per key head (decayed linear attention, as RetNet's
  fixed decays but trained);
* ``gated``: g_t = sigmoid(w_h . x_t / sqrt(C) + b_h), read from the layer input x (C channels; a scalar
  data-dependent gate, as in Mamba-2 or scalar GLA). ``w`` starts at zero, so a gated layer starts as the
  learned one; the 1/sqrt(C) keeps one optimizer step on ``w`` from swinging the gate across its range;
* ``retnet``: RetNet's fixed decay, no parameters: gamma_h for key head h = 0 .. Hkv-1 with 1 - gamma_h spread
  geometrically from 1 - ``gamma_min`` to 1 - ``gamma_max``:
  1 - gamma_h = (1 - gamma_min)^(1 - h/(Hkv-1)) (1 - gamma_max)^(h/(Hkv-1)) (gamma_min alone when Hkv = 1).
  The defaults, gamma_min = 1 - 2^-5 and gamma_max = None (meaning 1 - 2^-(5 + Hkv - 1)), give RetNet's
  gamma_h = 1 - 2^(-5 - h) (Sun et al. 2023; there over the query heads, here over the key heads, which RetNet
  does not distinguish). The factors are a non-persistent buffer: a function of the spec (saved in the config),
  so checkpoints carry no tensor for them and the model's weight init refills them (``from_pretrained`` leaves
  non-persistent buffers unset).

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

DECAYS = ("none", "learned", "gated", "retnet")
RETNET_GAMMA_MIN = 1.0 - 2.0**-5


def log_uniform_half_lives(count: int, shortest: float, longest: float) -> torch.Tensor:
    """float64 [count] half-lives (tokens) spread log-uniformly from ``shortest`` to ``longest`` (one: their
    geometric mean)."""
    if count == 1:
        return torch.tensor([math.sqrt(shortest * longest)], dtype=torch.float64)
    return torch.logspace(math.log10(shortest), math.log10(longest), count, dtype=torch.float64)


def half_life_logits(num_heads: int, shortest: float, longest: float) -> torch.Tensor:
    """sigmoid^-1 of the per-token factors whose half-lives spread log-uniformly over ``num_heads`` heads."""
    g = 0.5 ** (1.0 / log_uniform_half_lives(num_heads, shortest, longest))
    return torch.log(g / (1.0 - g)).float()


def retnet_log_gammas(num_heads: int, gamma_min: float, gamma_max: float | None) -> torch.Tensor:
    """float64 log gamma_h of the ``retnet`` schedule (see the module docstring)."""
    first = math.log1p(-gamma_min)  # log(1 - gamma)
    last = first - (num_heads - 1) * math.log(2.0) if gamma_max is None else math.log1p(-gamma_max)
    frac = torch.linspace(0.0, 1.0, num_heads, dtype=torch.float64) if num_heads > 1 else torch.zeros(1).double()
    return torch.log1p(-torch.exp(first + frac * (last - first)))


class Decay(nn.Module):
    """log g of shape [B, Hkv, T] for the layer input ``x`` [B, T, C]."""

    def __init__(
        self,
        kind: str,
        shape: MixerShape,
        half_life_min: float,
        half_life_max: float,
        gamma_min: float = RETNET_GAMMA_MIN,
        gamma_max: float | None = None,
    ) -> None:
        super().__init__()
        if kind not in DECAYS[1:]:
            raise ValueError(f"layer {shape.layer_idx}: unknown decay {kind!r}; known: {list(DECAYS)}")
        self.kind = kind
        self.half_lives = (float(half_life_min), float(half_life_max))
        self.gammas = (float(gamma_min), None if gamma_max is None else float(gamma_max))
        if kind == "retnet":
            log_gamma = retnet_log_gammas(shape.num_kv_heads, *self.gammas).to(torch.get_default_dtype())
            self.register_buffer("log_gamma", log_gamma, persistent=False)
            return
        self.bias = nn.Parameter(half_life_logits(shape.num_kv_heads, *self.half_lives))
        if kind == "gated":  # a plain parameter, not nn.Linear: the model's generic Linear init must not touch it
            self.weight = nn.Parameter(torch.zeros(shape.num_kv_heads, shape.hidden_size))

    def init_parameters(self, init: Any) -> None:
        """Biases at the configured half-lives, gate weights at zero (``init`` skips loaded ones); RetNet's
        factors recomputed (never saved, so never loaded)."""
        if self.kind == "retnet":
            init.copy_(self.log_gamma, retnet_log_gammas(self.log_gamma.numel(), *self.gammas).to(self.log_gamma))
            return
        init.copy_(self.bias, half_life_logits(self.bias.numel(), *self.half_lives).to(self.bias))
        if self.kind == "gated":
            init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "retnet":
            return self.log_gamma.to(x.dtype)[None, :, None].expand(x.shape[0], -1, x.shape[1])
        if self.kind == "learned":
            logits = self.bias[None, :, None].expand(x.shape[0], -1, x.shape[1])
        else:
            scale = x.shape[-1] ** -0.5
            logits = F.linear(x, self.weight.to(x.dtype) * scale, self.bias.to(x.dtype)).transpose(1, 2)
        return F.logsigmoid(logits.to(x.dtype))
