"""Independent float64 per-token references for DeltaFormer and PaTH (Su, "A Brief History of Linear Attention",
kexue.fm/archives/11033, "Feeding Back in Progress").

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

from collections.abc import Callable

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


def _by_key_head(
    q: Tensor, v: Tensor, kv_heads: int, initial: dict[str, Tensor] | None, names: tuple[str, str],
    run: Callable[[int, int, list[Tensor], list[Tensor], list[list[Tensor]]], tuple[list[Tensor], list[Tensor]]],
) -> tuple[Tensor, dict[str, Tensor]]:
    """For every batch row b and key head hk, ``run(b, hk, first, second, head_rows)`` gets the row's cached
    vectors under ``names`` (empty lists without ``initial``), writes the outputs of its query heads into
    ``head_rows[t][h]`` (zero elsewhere) and returns the two final cache lists. Returns the outputs [B, T, H, E] and
    the caches {name: [B, Hk, P + T, .]}."""
    bsz, heads, seq_len, _ = q.shape
    zero = torch.zeros(v.shape[-1], dtype=torch.float64)
    rows, caches = [], {name: [] for name in names}
    for b in range(bsz):
        head_rows = [[zero] * heads for _ in range(seq_len)]
        per_head = {name: [] for name in names}
        for hk in range(kv_heads):
            cached = [[] if initial is None else list(initial[name][b, hk].double()) for name in names]
            for name, final in zip(names, run(b, hk, *cached, head_rows), strict=True):
                per_head[name].append(torch.stack(final))
        rows.append(torch.stack([torch.stack(r) for r in head_rows]))
        for name in names:
            caches[name].append(torch.stack(per_head[name]))
    return torch.stack(rows), {name: torch.stack(c) for name, c in caches.items()}


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
    _, heads, seq_len, _ = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads

    def key_head(
        b: int, hk: int, keys: list[Tensor], us: list[Tensor], head_rows: list[list[Tensor]]
    ) -> tuple[list[Tensor], list[Tensor]]:
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
        return keys, us

    return _by_key_head(q, v, kv_heads, initial, ("k", "u"), key_head)


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
    _, heads, seq_len, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    past = 0 if initial is None else initial["k"].shape[2]
    house = path_householders(x, mask, w_weight, beta_weight, beta_bias, d, eps)
    eye = torch.eye(d, dtype=torch.float64)

    def transport(b: int, hk: int, i: int, j: int) -> Tensor:
        """H_i @ ... @ H_{j+1} over new-token indices (j = -1: from the cache), an explicit product."""
        r = eye
        for t in range(j + 1, i + 1):
            r = house[b][hk][t] @ r
        return r

    def key_head(
        b: int, hk: int, old_k: list[Tensor], old_v: list[Tensor], head_rows: list[list[Tensor]]
    ) -> tuple[list[Tensor], list[Tensor]]:
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
        return carried, old_v + [v[b, hk, j] for j in range(seq_len)]

    out, cache = _by_key_head(q, v, kv_heads, initial, ("k", "v"), key_head)
    assert past == 0 or cache["k"].shape[2] == past + seq_len
    return out, cache
