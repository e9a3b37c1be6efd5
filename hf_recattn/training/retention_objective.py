"""The objective of the learned retention score (``cache_score: learned``, modeling/retention_head.py): teach each
hybrid layer's retention head which pairs the teacher's later queries will need.

Locret's causal importance (Huang et al., arXiv:2410.01805), taken from the teacher during attention transfer: for
key j of a KV head, the largest attention weight any of the group's query heads puts on it from a query at least
``window`` tokens later, i >= j + W (the queries that no longer see it in the window, which only the cache can
serve). The target is its log, floored at ``IMPORTANCE_FLOOR``; the loss is the mean squared error of the head's
prediction over the keys that count: not one of the first ``sink_tokens`` (always kept as sinks) and with some query
that late in the block. The head reads the student's keys and values as given (no gradient flows into them), so the
loss trains the head alone and the other terms of attention transfer are unchanged.

``answer_retention_targets`` is the other target (``stage1.retention_target: answers``), for blocks that hide facts
and ask for them: how much more weight the queries that produce the answers put on a key than later queries put on
it on average. The largest weight of any later query ranks first the delimiters and common words that every query
rests on; the answering queries single out the facts, and dividing by the average weight demotes the resting
places.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: the smallest importance the target tells apart (weights below count as this)
IMPORTANCE_FLOOR = 1e-6


def _check_weights(log_weights: torch.Tensor, groups: int) -> None:
    """ValueError unless ``log_weights`` is [B, H, T, T] with H a multiple of ``groups``."""
    if log_weights.dim() != 4 or log_weights.shape[1] % groups:
        raise ValueError(f"retention targets need [B, H, T, T] weights with H a multiple of {groups} query heads "
                         f"per KV head, got {tuple(log_weights.shape)}")


def retention_targets(
    log_weights: torch.Tensor, window: int, sink_tokens: int, groups: int, floor: float = IMPORTANCE_FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the teacher's log attention weights [B, H, T, T]: the log importance [B, Hkv, T] of every key (H = Hkv x
    ``groups`` query heads, grouped as in ``group_queries``) and which keys count [B, Hkv, T] (see the module)."""
    _check_weights(log_weights, groups)
    b, h, t, _ = log_weights.shape
    query = torch.arange(t, device=log_weights.device)[:, None]
    key = torch.arange(t, device=log_weights.device)[None, :]
    late = (query - key) >= window  # [T, T]: queries past the window of each key
    weights = log_weights.float().exp().masked_fill(~late, 0.0)
    importance = weights.view(b, h // groups, groups, t, t).amax(dim=(2, 3))  # [B, Hkv, T]
    target = importance.clamp_min(floor).log()
    position = torch.arange(t, device=log_weights.device)
    counted = (position >= sink_tokens) & (position + window < t)
    return target, counted.expand_as(target)


def retention_loss(head: nn.Module, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor,
                   counted: torch.Tensor) -> torch.Tensor:
    """The head's mean squared error on the keys that count (keys / values [B, Hkv, T, D], detached here); 0 when
    none counts (a block no longer than the window)."""
    predicted = head(keys.detach(), values.detach())
    if not bool(counted.any()):
        return predicted.sum() * 0.0
    return F.mse_loss(predicted[counted], target[counted])


def ranking_agreement(predicted: torch.Tensor, target: torch.Tensor, counted: torch.Tensor, slots: int) -> float:
    """The share of the ``slots`` most important counted keys per (row, KV head) that are also among the head's
    ``slots`` highest predictions: how well it would fill a cache of that size (1.0 = as the teacher would)."""
    shares = []
    for pred_row, target_row, mask_row in zip(predicted.flatten(0, 1), target.flatten(0, 1),
                                              counted.flatten(0, 1), strict=True):
        n = min(slots, int(mask_row.sum()))
        if n == 0:
            continue
        best = set(torch.topk(target_row[mask_row], n).indices.tolist())
        chosen = set(torch.topk(pred_row[mask_row], n).indices.tolist())
        shares.append(len(best & chosen) / n)
    return math.fsum(shares) / len(shares) if shares else float("nan")


def answer_retention_targets(
    log_weights: torch.Tensor, answers: torch.Tensor, window: int, sink_tokens: int, groups: int,
    floor: float = IMPORTANCE_FLOOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the teacher's log attention weights [B, H, T, T] and the answer tokens ``answers`` [B, T] (bool, True
    where token i answers a question): per key [B, Hkv, T] the log of the largest weight a query predicting an answer
    token puts on it (the KV head's group of query heads), less the log of the mean weight over the group's queries
    at least ``window`` tokens later (each floored at ``floor``), and which keys count: not one of the first
    ``sink_tokens``, at least ``window`` tokens before the block's first answering query; none in a block without
    answers."""
    _check_weights(log_weights, groups)
    b, h, t, _ = log_weights.shape
    if answers.shape != (b, t):
        raise ValueError(f"answer retention targets: answers {tuple(answers.shape)} do not match blocks {(b, t)}")
    device = log_weights.device
    asking = torch.zeros(b, t, dtype=torch.bool, device=device)
    asking[:, :-1] = answers[:, 1:].to(device=device, dtype=torch.bool)  # query i predicts token i + 1
    weights = log_weights.float().exp().view(b, h // groups, groups, t, t)
    answer_weight = weights.masked_fill(~asking[:, None, None, :, None], 0.0).amax(dim=(2, 3))  # [B, Hkv, T]
    position = torch.arange(t, device=device)
    late = (position[:, None] - position[None, :]) >= window  # [T(query), T(key)]
    mean_late = (weights * late).sum(dim=(2, 3)) / (groups * late.sum(0)).clamp_min(1)
    target = answer_weight.clamp_min(floor).log() - mean_late.clamp_min(floor).log()
    first = torch.where(asking.any(1), asking.float().argmax(1), torch.zeros(b, dtype=torch.long, device=device))
    counted = (position[None] >= sink_tokens) & (position[None] + window <= first[:, None]) & asking.any(1)[:, None]
    return target, counted[:, None].expand_as(target)
