"""Independent float64 per-token references for DeltaFormer and PaTH (seed 002, "Feeding Back in Progress").

Nothing here imports hf_recattn. One batch row, one key head, one token at a time, written from the definitions:

* DeltaFormer: u_t = v_t - b_t sum_{j < t} [exp(s k_t . k_j) / sum_{l < t} exp(s k_t . k_l)] u_j over the real
  earlier keys (u_t = v_t when there is none), b_t = 1 or sigmoid(w_b . x_t + c); then
  o_t = sum_{j <= t} softmax_j(scale q_t . k_j) u_j over the real keys.
* PaTH: the logit of query i and key j <= i is scale * q_i^T (H_i @ H_{i-1} @ ... @ H_{j+1}) @ k_j with every
  H_t = I - b_t w_t w_t^T built as an explicit [D, D] matrix and multiplied pair by pair;
  w_t = W_w x_t / sqrt(|W_w x_t|^2 + eps) per key head, b_t = 2 sigmoid(w_b . x_t + c), and a padded token's
  H_t is the identity.

Both accept a cache from earlier tokens (``initial``: DeltaFormer's keys and u's; PaTH's keys already carried to
the last cached token, and values) and return it extended. Padded keys are invisible; padded query rows are zero.
Everything is built with out-of-place ops, so gradients flow to every input and parameter.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _real(mask: Tensor | None, b: int, t: int) -> bool:
    return mask is None or bool(mask[b, t])


def _softmax_sum(logits: list[Tensor], vectors: list[Tensor]) -> Tensor | None:
    """sum_j softmax(logits)_j vectors_j, or None for an empty list."""
    if not logits:
        return None
    top = max(float(x.detach()) for x in logits)
    weights = [torch.exp(x - top) for x in logits]
    total = sum(weights)
    return sum(w * vec for w, vec in zip(weights, vectors, strict=True)) / total


def deltaformer_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    mask: Tensor | None,
    scale: float,
    key_scale: float,
    beta_weight: Tensor | None = None,
    beta_bias: Tensor | None = None,
    initial: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Outputs [B, T, H, E] and the cache {"k": [B, Hk, P + T, D], "u": [B, Hk, P + T, E]} (P cached, all real)."""
    q, k, v, x = q.double(), k.double(), v.double(), x.double()
    bsz, heads, seq_len, _ = q.shape
    kv_heads, e = k.shape[1], v.shape[-1]
    group = heads // kv_heads
    zero = torch.zeros(e, dtype=torch.float64)
    rows, cache_k, cache_u = [], [], []
    for b in range(bsz):
        head_rows = [[zero] * heads for _ in range(seq_len)]
        keys_b, us_b = [], []
        for hk in range(kv_heads):
            keys = [] if initial is None else list(initial["k"][b, hk].double())
            us = [] if initial is None else list(initial["u"][b, hk].double())
            real = [True] * len(keys)
            for t in range(seq_len):
                kt = k[b, hk, t]
                earlier = [i for i, r in enumerate(real) if r]
                fed = _softmax_sum([key_scale * (kt @ keys[i]) for i in earlier], [us[i] for i in earlier])
                strength = 1.0
                if beta_weight is not None:
                    strength = torch.sigmoid(beta_weight[hk].double() @ x[b, t] + beta_bias[hk].double())
                u = v[b, hk, t] if fed is None else v[b, hk, t] - strength * fed
                keys.append(kt)
                us.append(u)
                real.append(_real(mask, b, t))
                if not real[-1]:
                    continue
                seen = [i for i, r in enumerate(real) if r]
                for h in range(hk * group, (hk + 1) * group):
                    qt = q[b, h, t]
                    head_rows[t][h] = _softmax_sum([scale * (qt @ keys[i]) for i in seen], [us[i] for i in seen])
            keys_b.append(torch.stack(keys))
            us_b.append(torch.stack(us))
        rows.append(torch.stack([torch.stack(r) for r in head_rows]))
        cache_k.append(torch.stack(keys_b))
        cache_u.append(torch.stack(us_b))
    return torch.stack(rows), {"k": torch.stack(cache_k), "u": torch.stack(cache_u)}


def path_householders(
    x: Tensor, mask: Tensor | None, w_weight: Tensor, beta_weight: Tensor, beta_bias: Tensor, head_dim: int,
    eps: float,
) -> list[list[list[Tensor]]]:
    """H[b][hk][t]: the explicit [D, D] matrix I - b_t w_t w_t^T (the identity for a padded token)."""
    x = x.double()
    bsz, seq_len, _ = x.shape
    kv_heads = beta_weight.shape[0]
    eye = torch.eye(head_dim, dtype=torch.float64)
    out = []
    for b in range(bsz):
        per_head = []
        for hk in range(kv_heads):
            mats = []
            for t in range(seq_len):
                if not _real(mask, b, t):
                    mats.append(eye)
                    continue
                raw = w_weight[hk * head_dim : (hk + 1) * head_dim].double() @ x[b, t]
                w = raw / torch.sqrt(raw @ raw + eps)
                strength = 2.0 * torch.sigmoid(beta_weight[hk].double() @ x[b, t] + beta_bias[hk].double())
                mats.append(eye - strength * torch.outer(w, w))
            per_head.append(mats)
        out.append(per_head)
    return out


def path_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    x: Tensor,
    mask: Tensor | None,
    scale: float,
    w_weight: Tensor,
    beta_weight: Tensor,
    beta_bias: Tensor,
    eps: float,
    initial: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Outputs [B, T, H, E] and the cache {"k": every key carried to the last token, "v": every value}.

    Cached keys (``initial["k"]``, positions before the first new token) are already carried to the last cached
    token, so only the new tokens' Householders act on them.
    """
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq_len, d = q.shape
    kv_heads, e = k.shape[1], v.shape[-1]
    group = heads // kv_heads
    past = 0 if initial is None else initial["k"].shape[2]
    house = path_householders(x, mask, w_weight, beta_weight, beta_bias, d, eps)
    eye = torch.eye(d, dtype=torch.float64)
    zero = torch.zeros(e, dtype=torch.float64)

    def transport(b: int, hk: int, i: int, j: int) -> Tensor:
        """H_i @ ... @ H_{j+1} over new-token indices (j = -1: from the cache), an explicit product."""
        r = eye
        for t in range(j + 1, i + 1):
            r = house[b][hk][t] @ r
        return r

    rows, cache_k, cache_v = [], [], []
    for b in range(bsz):
        head_rows = [[zero] * heads for _ in range(seq_len)]
        keys_b, values_b = [], []
        for hk in range(kv_heads):
            old_k = [] if initial is None else list(initial["k"][b, hk].double())
            old_v = [] if initial is None else list(initial["v"][b, hk].double())
            for i in range(seq_len):
                if not _real(mask, b, i):
                    continue
                logits_keys = [transport(b, hk, i, -1) @ kj for kj in old_k]
                logits_keys += [transport(b, hk, i, j) @ k[b, hk, j] for j in range(i + 1) if _real(mask, b, j)]
                values = old_v + [v[b, hk, j] for j in range(i + 1) if _real(mask, b, j)]
                for h in range(hk * group, (hk + 1) * group):
                    head_rows[i][h] = _softmax_sum([scale * (q[b, h, i] @ kj) for kj in logits_keys], values)
            last = seq_len - 1
            carried = [transport(b, hk, last, -1) @ kj for kj in old_k]
            carried += [transport(b, hk, last, j) @ k[b, hk, j] for j in range(seq_len)]
            keys_b.append(torch.stack(carried))
            values_b.append(torch.stack(old_v + [v[b, hk, j] for j in range(seq_len)]))
        rows.append(torch.stack([torch.stack(r) for r in head_rows]))
        cache_k.append(torch.stack(keys_b))
        cache_v.append(torch.stack(values_b))
    assert past == 0 or cache_k[0].shape[1] == past + seq_len
    return torch.stack(rows), {"k": torch.stack(cache_k), "v": torch.stack(cache_v)}
