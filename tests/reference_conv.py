"""Per-token pieces shared by the float64 references of the families fed by short convolutions (the delta rule,
MesaNet), written from the papers' equations (see the README's references). Nothing here imports hf_recattn.

A short causal depthwise convolution keeps, per batch row, a buffer of the last W - 1 raw inputs of each of its
channels (``conv_q`` / ``conv_k`` / ``conv_v``); a padded token is never fed to it. The output of a query head is
RMS-normalized (gain g), then multiplied by silu(w_g . x).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def softplus(x: Tensor) -> Tensor:
    return torch.log1p(torch.exp(x))


def conv_buffers(conv: dict[str, Tensor], initial: dict[str, Tensor] | None, b: int) -> dict[str, list[Tensor]]:
    """Row ``b``'s buffers (W - 1 float64 inputs each): from the mixer-layout ``initial`` [B, channels, W - 1], or
    zeros."""
    buffers = {}
    for name, weight in conv.items():
        taps = weight.shape[1]
        if initial:
            buffers[name] = [initial[name][b, :, j].double() for j in range(taps - 1)]
        else:
            buffers[name] = [torch.zeros(weight.shape[0], dtype=torch.float64) for _ in range(taps - 1)]
    return buffers


def conv_token(conv: dict[str, Tensor], buffers: dict[str, list[Tensor]], raw: dict[str, Tensor],
               activation: bool) -> dict[str, Tensor]:
    """One token's raw channels through their convolutions (those in ``conv``; ``buffers`` move on by one), then
    SiLU when ``activation``."""
    mixed = {}
    for name, vec in raw.items():
        if name in conv:
            window = [*buffers[name], vec]
            vec = sum(conv[name][:, j] * window[j] for j in range(len(window)))
            buffers[name] = window[1:]
        mixed[name] = silu(vec) if activation else vec
    return mixed


def add_final_buffers(finals: dict[str, list[Tensor]], buffers: dict[str, list[Tensor]]) -> None:
    """Append a row's final buffers, in the mixer layout [channels, W - 1], to ``finals``."""
    for name, buffer in buffers.items():
        finals.setdefault(name, []).append(torch.stack(buffer, dim=1) if buffer else torch.zeros(0))


def norm_and_gate(o: Tensor, hq: int, xt: Tensor, norm_gain: Tensor | None, gate_weight: Tensor | None,
                  eps: float) -> Tensor:
    """Query head ``hq``'s output: RMS-normalized with gain ``norm_gain[hq]``, then times silu(w_g . x)."""
    e = o.shape[0]
    if norm_gain is not None:
        o = o / torch.sqrt((o * o).mean() + eps) * norm_gain[hq]
    if gate_weight is not None:
        o = o * silu(gate_weight[hq * e : (hq + 1) * e] @ xt)
    return o
