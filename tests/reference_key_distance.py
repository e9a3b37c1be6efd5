"""Independent float64 per-token reference for softmax attention whose distant keys are scored at a bounded RoPE
distance (the hybrid's ``distant_positions: clamp``), written from the rotation's definition.

Nothing here imports hf_recattn. RoPE pairs dimension i with i + F (F = rotated dimensions / 2) and turns the pair
by the angle position * theta_i. For un-rotated q0 and k0, the logit of a query at position t and a key at p is

    q0 . R(-d theta) k0 = sum_i [(qa ka + qb kb) cos(d theta_i) + (qa kb - qb ka) sin(d theta_i)] + q0_rest . k0_rest

with d = min(t - p, D): the rotation appears only through the distance, which the clamp caps at D.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor
#: visible(row, query index, key index) -> whether the query sees the key
Visibility = Callable[[int, int, int], bool]


def frequencies(head_dim: int, base: float, partial: float = 1.0, factor: float = 1.0) -> list[float]:
    """theta_i of RoPE on the first ``partial`` of each head, its positions divided by ``factor`` (linear scaling)."""
    dims = int(head_dim * partial)
    return [base ** (-2 * i / dims) / factor for i in range(dims // 2)]


def rotate(x: Tensor, positions: Tensor, theta: list[float]) -> Tensor:
    """x [B, H, T, D] turned per token by its position [B, T] (float64, pair by pair)."""
    out = x.detach().double().clone()
    f = len(theta)
    for b in range(x.shape[0]):
        for t in range(x.shape[2]):
            for i, th in enumerate(theta):
                angle = float(positions[b, t]) * th
                c, s = math.cos(angle), math.sin(angle)
                a, bb = x[b, :, t, i].double(), x[b, :, t, i + f].double()
                out[b, :, t, i] = a * c - bb * s
                out[b, :, t, i + f] = a * s + bb * c
    return out


def clamped_logit(q: Tensor, k: Tensor, distance: int, theta: list[float]) -> float:
    """The logit of un-rotated q [D] and k [D] at ``distance`` (already capped)."""
    f = len(theta)
    total = float(q[2 * f :] @ k[2 * f :])
    for i, th in enumerate(theta):
        qa, qb, ka, kb = float(q[i]), float(q[i + f]), float(k[i]), float(k[i + f])
        angle = distance * th
        total += (qa * ka + qb * kb) * math.cos(angle) + (qa * kb - qb * ka) * math.sin(angle)
    return total


def clamped_attention(
    q0: Tensor, k0: Tensor, v: Tensor, positions: Tensor, theta: list[float], limit: int, visible: Visibility
) -> Tensor:
    """[B, T, H, E]: softmax over the keys each query sees (``visible``) of the logits scaled by 1/sqrt(D), each at
    distance min(t - p, ``limit``) from the un-rotated q0 [B, H, T, D], k0 [B, Hkv, T, D]; rows with no key: 0."""
    b_size, heads, t_size, d = q0.shape
    groups = heads // k0.shape[1]
    out = torch.zeros(b_size, t_size, heads, v.shape[-1], dtype=torch.float64)
    for b in range(b_size):
        for h in range(heads):
            kh = h // groups
            for t in range(t_size):
                keys = [s for s in range(t + 1) if visible(b, t, s)]
                if not keys:
                    continue
                logits = torch.tensor([
                    clamped_logit(q0[b, h, t].double(), k0[b, kh, s].double(),
                                  min(int(positions[b, t] - positions[b, s]), limit), theta) / math.sqrt(d)
                    for s in keys
                ], dtype=torch.float64)
                weights = torch.softmax(logits, dim=0)
                out[b, t, h] = sum(w * v[b, kh, s].double() for w, s in zip(weights, keys, strict=True))
    return out


def sinks_and_window(mask: Tensor, sinks: int, window: int) -> Visibility:
    """Key s is real and among the row's first ``sinks`` real tokens or one of the last ``window`` tokens up to the
    query (the window counts padded slots too)."""
    rank = mask.long().cumsum(1) - 1

    def visible(b: int, t: int, s: int) -> bool:
        return bool(mask[b, s]) and (int(rank[b, s]) < sinks or t - s < window)

    return visible


def every_real_key(mask: Tensor) -> Visibility:
    """Every real key up to the query (an exact cache that never evicts)."""
    return lambda b, t, s: bool(mask[b, s])
