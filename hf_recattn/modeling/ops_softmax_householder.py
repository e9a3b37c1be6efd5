"""PaTH attention (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eqs. 25-29) on plain tensors:
softmax over Householder-transported keys.

The logit of query i and key j <= i is ``q_i^T R_{i,j} k_j * scale`` with ``R_{i,j} = H_i H_{i-1} ... H_{j+1}``
(``R_{i,i} = I``) and ``H_t = I - b_t w_t w_t^T``. Keys are carried forward in time: the cache holds every key
transported to the latest token, ``k~_j = R_{t,j} k_j``, so that a new token t + 1 applies H_{t+1} to the cache
and its query reads ``q^T H_{t+1} k~_j``.

Blocks of C tokens do this C Householders at a time through the UT transform (the delta rule's, with values
zero): for a block with unit lower triangular ``L = I + diag(b) (W W^T o M^-)`` and ``J = L^{-1}``,

* ``H_e ... H_a = I - W^T X`` with ``X = J diag(b) W`` (the block's whole transform),
* ``q_i^T H_i ... H_a = q_i^T - [(Q W^T o M) X]_i`` (queries read the keys cached before the block),
* in the block, ``q_i^T R_{i,j} k_j = q_i . k_j - [(Q W^T o M) Y]_ij`` with ``Y = J diag(b) (W K^T o M^-)``,
* the block's keys leave it as ``K - Y^T W`` and the cached keys as ``K~ - K~ X^T W``.

Per block O(C (P + C) D): the whole sequence costs O(T^2 D) like softmax attention, with [C, C] solves.
Shapes: q [B, Hk, G, T, D], k [B, Hk, T, D], v [B, Hk, T, E], w [B, Hk, T, D] (unit rows), b [B, Hk, T] (zero
on padded tokens: no Householder), cached keys [B, Hk, P, D] and values [B, Hk, P, E]; ``key_real`` [B, P + T].
"""

from __future__ import annotations

import torch

from .ops_softmax_delta import key_visibility, masked_softmax
from .triangular import unit_lower_solve


def _block_transforms(
    w: torch.Tensor, b: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """X = J diag(b) W [.., C, D] and Y = J diag(b) (W K^T o M^-) [.., C, C] of one block (see module doc)."""
    c = w.shape[-2]
    if c == 1:  # one Householder: J = I and nothing of the block lies before its only token
        return b[..., None] * w, torch.zeros(*w.shape[:-1], 1, dtype=w.dtype, device=w.device)
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=w.device).tril(-1)
    lower = ((w @ w.transpose(-1, -2)) * b[..., :, None]).masked_fill(~strictly_lower, 0.0)
    rhs = b[..., None] * torch.cat([w, (w @ k.transpose(-1, -2)).masked_fill(~strictly_lower, 0.0)], dim=-1)
    solved = unit_lower_solve(lower, rhs)
    return solved[..., : w.shape[-1]], solved[..., w.shape[-1] :]


def path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    key_real: torch.Tensor | None,
    scale: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New tokens after ``P`` cached ones (``cache``: their keys and values), in blocks of ``chunk_size``.

    Args:
        q: ``[B, Hk, G, T, D]`` queries, G query heads per key head.
        k: ``[B, Hk, T, D]`` keys of the new tokens.
        v: ``[B, Hk, T, E]`` their values.
        w: ``[B, Hk, T, D]`` Householder directions (unit rows).
        b: ``[B, Hk, T]`` Householder strengths in [0, 2] (0 on padded tokens: no Householder).
        cache: (keys ``[B, Hk, P, D]`` carried to the latest cached token, values ``[B, Hk, P, E]``); P may be 0.
        key_real: ``[B, P + T]`` (True = real token), or None.
        scale: query-key scale.
        chunk_size: tokens per block.

    Returns:
        ``(o, keys, values)``: o ``[B, Hk, G, T, E]``, every key carried to the last token ``[B, Hk, P + T, D]``,
        every value ``[B, Hk, P + T, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
        >>> w, b = torch.randn(1, 2, 5, 4), torch.zeros(1, 2, 5)  # b = 0: no Householder, softmax attention
        >>> w = w / w.norm(dim=-1, keepdim=True)
        >>> o, keys, values = path_attention(q, k, v, w, b, (k[:, :, :0], v[:, :, :0]), None, 0.5, chunk_size=2)
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention
        >>> torch.allclose(o, sdpa(q, k[:, :, None], v[:, :, None], is_causal=True, scale=0.5), atol=1e-5)
        True
    """
    past_keys, past_values = cache
    num_past, num_new = past_keys.shape[2], k.shape[2]
    if num_new == 1 and num_past:
        return path_step(q, k, v, (w, b), cache, key_real, scale)
    keys, values = past_keys, past_values
    seen = key_visibility(num_past, num_new, key_real, False, k.device).unsqueeze(2)  # [B|1, 1, 1, T, P + T]
    outs = []
    for start in range(0, num_new, chunk_size):
        end = min(start + chunk_size, num_new)
        qc, kc, vc, wc = q[..., start:end, :], k[:, :, start:end], v[:, :, start:end], w[:, :, start:end]
        bc = b[:, :, start:end]
        transform, in_block = _block_transforms(wc, bc, kc)
        reach = (qc @ wc.unsqueeze(2).transpose(-1, -2)).tril()  # (Q W^T o M): [B, Hk, G, C, C]
        scores = [(qc - reach @ transform.unsqueeze(2)) @ keys.unsqueeze(2).transpose(-1, -2)]
        scores.append(qc @ kc.unsqueeze(2).transpose(-1, -2) - reach @ in_block.unsqueeze(2))
        allowed = seen[..., start:end, : num_past + end]
        probs = masked_softmax(torch.cat(scores, dim=-1) * scale, allowed)
        # carry the cached keys over the block, then append the block's keys carried to its end
        keys = torch.cat([keys - (keys @ transform.transpose(-1, -2)) @ wc,
                          kc - in_block.transpose(-1, -2) @ wc], dim=2)
        values = torch.cat([values, vc], dim=2)
        outs.append(probs @ values.unsqueeze(2))
    return torch.cat(outs, dim=3) if len(outs) > 1 else outs[0], keys, values


def path_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, householder: tuple[torch.Tensor, torch.Tensor],
    cache: tuple[torch.Tensor, torch.Tensor], key_real: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One new token after ``P >= 1`` cached ones: one product of [w; queries] with the cached keys gives both
    ``K~ w`` (for carrying the keys over H_t) and the queries' scores, ``q . H_t k~_j = q . k~_j - b (q . w)
    (k~_j . w)``; the carried keys are written straight into the grown cache. Same result as the block form.

    Args:
        q: ``[B, Hk, G, 1, D]`` the token's queries.
        k: ``[B, Hk, 1, D]`` its key.
        v: ``[B, Hk, 1, E]`` its value.
        householder: (w ``[B, Hk, 1, D]``, b ``[B, Hk, 1]``) of the token.
        cache: (keys ``[B, Hk, P, D]`` carried to the previous token, values ``[B, Hk, P, E]``).
        key_real: ``[B, P + 1]`` (True = real token), or None.
        scale: query-key scale.

    Returns:
        ``(o, keys, values)``: o ``[B, Hk, G, 1, E]``, keys ``[B, Hk, P + 1, D]`` carried to this token, values
        ``[B, Hk, P + 1, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
        >>> w, b = torch.randn(1, 1, 4, 8), torch.rand(1, 1, 4) * 2
        >>> w = w / w.norm(dim=-1, keepdim=True)
        >>> empty = (k[:, :, :0], v[:, :, :0])
        >>> _, keys, values = path_attention(q[..., :3, :], k[:, :, :3], v[:, :, :3], w[:, :, :3], b[..., :3], empty,
        ...                                  None, 0.3, chunk_size=2)
        >>> o, _, _ = path_step(q[..., 3:, :], k[:, :, 3:], v[:, :, 3:], (w[:, :, 3:], b[..., 3:]), (keys, values),
        ...                     None, 0.3)
        >>> torch.allclose(o, path_attention(q, k, v, w, b, empty, None, 0.3, chunk_size=2)[0][..., 3:, :], atol=1e-5)
        True
    """
    (w, b), (past_keys, past_values) = householder, cache
    bsz, hk, num_past, d = past_keys.shape
    wt, qt = w[:, :, 0], q[:, :, :, 0]  # [B, Hk, D], [B, Hk, G, D]
    bt = b[:, :, :1]  # [B, Hk, 1]
    prod = torch.cat([wt[:, :, None], qt], dim=2) @ past_keys.transpose(-1, -2)  # [B, Hk, 1 + G, P]
    keys_w = prod[:, :, :1] * bt[..., None]  # b (k~_j . w): [B, Hk, 1, P]
    query_w = (qt * wt[:, :, None]).sum(-1, keepdim=True)  # [B, Hk, G, 1]
    scores = (prod[:, :, 1:] - query_w * keys_w) * scale
    if key_real is not None:
        scores = scores.masked_fill(~key_real[:, None, None, :-1].bool(), float("-inf"))
    own = (qt * k).sum(-1, keepdim=True) * scale  # [B, Hk, G, 1]: the new key, not transported
    probs = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
    o = probs[..., :num_past] @ past_values + probs[..., num_past:] * v
    carried_w = keys_w.transpose(-1, -2)  # [B, Hk, P, 1]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (past_keys, w, b, k)):
        keys = torch.cat([past_keys - carried_w * wt[:, :, None], k], dim=2)
    else:  # decoding: write the carried keys into the grown cache without an intermediate copy
        keys = past_keys.new_empty(bsz, hk, num_past + 1, d)
        torch.addcmul(past_keys, carried_w, wt[:, :, None], value=-1.0, out=keys[:, :, :num_past])
        keys[:, :, num_past:] = k
    return o[:, :, :, None], keys, torch.cat([past_values, v], dim=2)
