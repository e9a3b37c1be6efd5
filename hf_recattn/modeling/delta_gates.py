"""The per-head coefficients of the delta rules, read from the layer input x (see ops_delta.py for the update).

* write strength b_t = sigmoid(W_b x_t / sqrt(C) + c_b), or 2 sigmoid(...) with ``negative_eigenvalues`` (b in
  (0, 2): the transition I - b k k^T may then have the eigenvalue 1 - b < 0), one per key head and Householder step;
* decay a_t = exp(-exp(A_log) softplus(W_a x_t / sqrt(C) + dt_bias)), one per key head (Mamba-2's
  parameterization, as Gated DeltaNet and Comba use it); ``delta`` has none.

The gates read x / sqrt(C) (C channels) so that one optimizer step on W cannot swing a gate across its range; the
``scratch`` initialization scales W up by sqrt(C) to give the published distribution of the gate logits.

The update coefficients per rule: ``delta`` alpha = 1, erase = beta = b; ``gated`` alpha = a, erase = a b,
beta = b; ``comba`` alpha = a, erase = beta = b (its e_t). With n Householder steps the decay acts once per token,
on its first step.

Initializations (``init``):

* ``scratch``, the published one: W_a, W_b ~ N(0, initializer_range) (as logits of x), c_b = 0, A ~ U(0, 16),
  dt log-uniform in [1e-3, 1e-1] with dt_bias = softplus^-1(dt);
* ``convert``, for distilling a softmax teacher: W_a = W_b = 0 (every gate starts input-independent), A = 1,
  dt_bias such that the decays' half-lives spread log-uniformly over the key heads between ``half_life_min`` and
  ``half_life_max`` tokens, and c_b such that b = ``beta_init``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decay import log_uniform_half_lives
from .gated_parts import head_gate_logits, logit
from .mixer_base import MixerShape

RULES = ("delta", "gated", "comba")


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def half_life_dt_bias(num_heads: int, shortest: float, longest: float) -> torch.Tensor:
    """dt_bias giving a = 2^(-1 / half-life) at A = 1 and W_a = 0, half-lives log-uniform over the heads."""
    return _inverse_softplus(math.log(2.0) / log_uniform_half_lives(num_heads, shortest, longest)).float()


class DeltaGates(nn.Module):
    """(log_alpha, beta, erase), each [B, Hk, T * n], from x [B, T, C]; zero updates on padded tokens."""

    def __init__(self, spec: dict[str, Any], shape: MixerShape, initializer_range: float) -> None:
        super().__init__()
        self.rule = spec["rule"]
        self.steps = int(spec["householder_steps"])
        self.negative_eigenvalues = bool(spec["negative_eigenvalues"])
        self.init_kind = spec["init"]
        self.half_lives = (float(spec["half_life_min"]), float(spec["half_life_max"]))
        self.beta_init = float(spec["beta_init"])
        self.initializer_range = initializer_range
        hk, c = shape.num_kv_heads, shape.hidden_size
        # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
        self.beta_weight = nn.Parameter(torch.zeros(self.steps * hk, c))
        self.beta_bias = nn.Parameter(torch.zeros(self.steps * hk))
        if self.rule != "delta":
            self.decay_weight = nn.Parameter(torch.zeros(hk, c))
            self.dt_bias = nn.Parameter(torch.zeros(hk))
            self.A_log = nn.Parameter(torch.zeros(hk))

    def init_parameters(self, init: Any) -> None:
        """See the module docstring (``init`` skips loaded parameters)."""
        hk = self.beta_bias.numel() // self.steps
        if self.init_kind == "convert":
            init.zeros_(self.beta_weight)
            target = self.beta_init / 2.0 if self.negative_eigenvalues else self.beta_init
            init.constant_(self.beta_bias, logit(target))
            if self.rule != "delta":
                init.zeros_(self.decay_weight)
                init.zeros_(self.A_log)
                init.copy_(self.dt_bias, half_life_dt_bias(hk, *self.half_lives).to(self.dt_bias))
            return
        std = self.initializer_range * math.sqrt(self.beta_weight.shape[1])  # logits of x / sqrt(C)
        init.normal_(self.beta_weight, 0.0, std)
        init.zeros_(self.beta_bias)
        if self.rule != "delta":
            init.normal_(self.decay_weight, 0.0, std)
            device = self.A_log.device
            init.copy_(self.A_log, torch.empty(hk, device=device).uniform_(0.0, 16.0).clamp_min(1e-4).log())
            dt = torch.empty(hk, device=device).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(self.dt_bias, _inverse_softplus(dt))

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        n = self.steps
        x = x * x.shape[-1] ** -0.5
        beta = torch.sigmoid(head_gate_logits(x, self.beta_weight, self.beta_bias))  # [B, T, n Hk]
        if self.negative_eigenvalues:
            beta = beta * 2.0
        if token_mask is not None:
            keep = token_mask[..., None].to(beta.dtype)  # [B, T, 1]
            beta = beta * keep
        beta = beta.view(b, t, n, -1).permute(0, 3, 1, 2)  # [B, Hk, T, n]
        if self.rule == "delta":
            log_alpha = torch.zeros_like(beta)
        else:
            dt = F.softplus(head_gate_logits(x, self.decay_weight, self.dt_bias))  # [B, T, Hk]
            if token_mask is not None:
                dt = dt * keep
            log_alpha = (dt * -self.A_log.to(x.dtype).exp()).transpose(1, 2)[..., None]  # [B, Hk, T, 1]
            if n > 1:  # the decay acts on the first step only
                log_alpha = F.pad(log_alpha, (0, n - 1))
        erase = beta * log_alpha.exp() if self.rule == "gated" else beta
        hk = beta.shape[1]
        return (
            log_alpha.reshape(b, hk, t * n),
            beta.reshape(b, hk, t * n),
            erase.reshape(b, hk, t * n),
        )
