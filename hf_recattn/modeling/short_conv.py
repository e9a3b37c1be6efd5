"""A causal depthwise convolution over time with its own cached inputs (the short convolution of recurrent mixers).

y_t[c] = sum_{j < W} w[c, j] x_{t - W + 1 + j}[c]. The state holds the last ``W - 1`` inputs ``[B, channels, W - 1]``
(batch first, so the cache reorders and selects it like any other state), which makes a prefill in one call, in
chunks or token by token give the same outputs. A fresh state is zeros: a sequence starts as if preceded by zero
inputs, so left padding whose inputs are zeroed is invisible.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through the convolution: x [B, channels], state [B, channels, W - 1] (the last inputs), weight
    [channels, W] -> (y [B, channels], the new state). Callers may stack several convolutions along channels."""
    seq = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
    return (seq * weight.to(x.dtype)).sum(-1), seq[:, :, 1:]


def convolve_streams(
    streams: dict[str, torch.Tensor],
    convs: nn.ModuleDict,
    state: dict[str, torch.Tensor] | None,
    mask: torch.Tensor | None,
    activation: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each stream [B, T, channels] through the convolution of its name in ``convs`` (if any), then SiLU when
    ``activation`` is ``silu``. Padded tokens (``mask`` False, [B, T]) enter as zeros, and a padded one-token step
    keeps the old inputs. Returns the streams and the convolutions' new states, by name."""
    t = next(iter(streams.values())).shape[1]
    out: dict[str, torch.Tensor] = {}
    new_state: dict[str, torch.Tensor] = {}
    for name, stream in streams.items():
        if mask is not None:  # padded tokens enter the convolution as zeros
            stream = stream * mask[..., None].to(stream.dtype)
        if name in convs:
            old = None if state is None else state[name]
            stream, new_state[name] = convs[name](stream, old)
            if mask is not None and old is not None and t == 1:  # a padded step leaves the inputs kept
                new_state[name] = torch.where(mask[:, :, None], new_state[name], old)
        out[name] = F.silu(stream) if activation == "silu" else stream
    return out, new_state


class ShortConvolution(nn.Module):
    """Depthwise causal convolution of ``size`` taps over ``channels`` channels (``size`` >= 1)."""

    def __init__(self, channels: int, size: int, identity_init: bool) -> None:
        super().__init__()
        self.channels = channels
        self.size = size
        self.identity_init = identity_init
        self.weight = nn.Parameter(torch.zeros(channels, size))

    def init_parameters(self, init: Any) -> None:
        """``identity_init``: the last tap 1 and the others 0 (the layer starts as no convolution); otherwise
        torch's Conv1d default, uniform in +-1/sqrt(taps)."""
        if self.identity_init:
            eye = torch.zeros(self.channels, self.size, device=self.weight.device, dtype=self.weight.dtype)
            eye[:, -1] = 1.0
            init.copy_(self.weight, eye)
        else:
            bound = 1.0 / math.sqrt(self.size)
            init.uniform_(self.weight, -bound, bound)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch_size, self.channels, self.size - 1, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, channels] -> (y [B, T, channels], the last ``size - 1`` inputs)."""
        b, t, _ = x.shape
        if state is None:
            state = self.init_state(b, x.device, x.dtype)
        if t == 1:
            y, state = conv_step(x[:, 0], state, self.weight)
            return y[:, None], state
        seq = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, W - 1 + T]
        y = F.conv1d(seq, self.weight.to(x.dtype)[:, None, :], groups=self.channels)
        return y.transpose(1, 2), seq[:, :, seq.shape[2] - (self.size - 1) :]
