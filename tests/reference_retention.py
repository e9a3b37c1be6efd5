"""An independent float64 reference of the learned retention score (``cache_score: learned``) and of its training
target, one pair and one key at a time."""

from __future__ import annotations

import math

import torch


def _unit(x: list[float]) -> tuple[list[float], float]:
    rms = math.sqrt(sum(a * a for a in x) / len(x) + 1e-6)
    return [a / rms for a in x], math.log(rms)


def retention_score(head: torch.nn.Module, hk: int, key: torch.Tensor, value: torch.Tensor) -> float:
    """The head's predicted log importance of one pair of KV head ``hk``: the value and the norms of the key's
    rotary pairs (i, i + D/2), each scaled to unit RMS, with both log RMS, through the head's SiLU MLP."""
    k, v = key.detach().double().tolist(), value.detach().double().tolist()
    half = len(k) // 2
    pairs = [math.hypot(k[i], k[i + half]) for i in range(half)]
    v_unit, v_log = _unit(v)
    p_unit, p_log = _unit(pairs)
    x = v_unit + p_unit + [v_log, p_log]
    w_in, b_in = head.w_in[hk].detach().double(), head.b_in[hk].detach().double()
    w_out, b_out = head.w_out[hk].detach().double(), float(head.b_out[hk].detach())
    total = b_out
    for u in range(w_in.shape[1]):
        a = float(b_in[u]) + sum(x[f] * float(w_in[f, u]) for f in range(len(x)))
        total += float(w_out[u]) * a / (1.0 + math.exp(-a))
    return total


def importance_reference(weights: torch.Tensor, window: int, sinks: int, groups: int, floor: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key of attention ``weights`` [B, H, T, T]: the log of the largest weight any query of its KV head's group
    at least ``window`` tokens later puts on it (floored at ``floor``), and whether the key counts (not one of the
    first ``sinks``, some query that late exists)."""
    bsz, heads, seq, _ = weights.shape
    kv = heads // groups
    target = torch.zeros(bsz, kv, seq, dtype=torch.float64)
    counted = torch.zeros(bsz, kv, seq, dtype=torch.bool)
    for b in range(bsz):
        for hk in range(kv):
            for j in range(seq):
                later = [float(weights[b, h, i, j]) for h in range(hk * groups, (hk + 1) * groups)
                         for i in range(j + window, seq)]
                if later and j >= sinks:
                    counted[b, hk, j] = True
                    target[b, hk, j] = math.log(max(max(later), floor))
    return target, counted


def answer_importance_reference(weights: torch.Tensor, answers: torch.Tensor, window: int, sinks: int, groups: int,
                                floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key of attention ``weights`` [B, H, T, T] and answer tokens ``answers`` [B, T]: the log of the largest
    weight a query whose next token answers (query i, token i + 1) puts on it within its KV head's group, less the
    log of the group's mean weight on it over queries at least ``window`` tokens later (both floored at ``floor``);
    a key counts when it is not one of the first ``sinks`` and lies ``window`` tokens or more before the first
    answering query."""
    bsz, heads, seq, _ = weights.shape
    kv = heads // groups
    target = torch.zeros(bsz, kv, seq, dtype=torch.float64)
    counted = torch.zeros(bsz, kv, seq, dtype=torch.bool)
    for b in range(bsz):
        asking = [i for i in range(seq - 1) if bool(answers[b, i + 1])]
        for hk in range(kv):
            group = range(hk * groups, (hk + 1) * groups)
            for j in range(seq):
                late = [float(weights[b, h, i, j]) for h in group for i in range(j + window, seq)]
                if not asking or not late:
                    continue
                best = max(float(weights[b, h, i, j]) for h in group for i in asking)
                mean = sum(late) / len(late)
                target[b, hk, j] = math.log(max(best, floor)) - math.log(max(mean, floor))
                counted[b, hk, j] = j >= sinks and j + window <= asking[0]
    return target, counted
