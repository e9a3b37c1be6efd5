"""DeltaFormer (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eq. 23) on plain tensors:
softmax attention over values fed back through the keys.

With ``A = softmax(Q K^T * scale + log M)`` (each query i sees keys j <= i) and
``B = softmax(K K^T * key_scale + log M^-)`` (each key i weighs the keys j < i; a row with no such key is zero),
the output is ``O = A (I + diag(b) B)^{-1} V``: the new values U solve, token by token,

    u_i = v_i - b_i * sum_{j < i} B_ij u_j,

(b = 1 is the equation as Su writes it; a per-token write strength b in (0, 1) is DeltaFormer's optional beta). The same
function runs a whole sequence, a prefill after a cache and a single decode step: the cache holds every past key
and its u (values are not needed once their u is known).

Shapes: q [B, Hk, G, T, D] (G query heads share a key head), k [B, Hk, T, D], v [B, Hk, T, E], b [B, Hk, T] or
None, cached keys [B, Hk, P, D] and u [B, Hk, P, E]; ``key_real`` [B, P + T] bool (True = real token) or None.
"""

from __future__ import annotations

import torch

from .triangular import unit_lower_solve


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the allowed entries of the last dim; a row with no allowed entry is all zeros.

    Args:
        logits: ``[..., S]`` scores.
        allowed: bool, broadcastable to ``logits``: True where an entry takes part.

    Returns:
        ``[..., S]`` probabilities, zero where not allowed.

    Example:
        >>> masked_softmax(torch.zeros(2, 3), torch.tensor([[True, True, False], [False, False, False]]))
        tensor([[0.5000, 0.5000, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    filled = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return torch.softmax(filled, dim=-1) * allowed.to(logits.dtype)


def key_visibility(
    num_past: int, num_new: int, key_real: torch.Tensor | None, strict: bool, device: torch.device
) -> torch.Tensor:
    """[B or 1, 1, T, P + T] bool: the keys each new token sees (j < i if ``strict`` else j <= i; real keys).

    Args:
        num_past: P, the cached tokens before the new ones.
        num_new: T, the new tokens.
        key_real: ``[B, P + T]`` (True / 1 = real token), or None when every token is real.
        strict: only earlier keys (j < i) rather than j <= i.
        device: where the mask is built.

    Returns:
        ``[B or 1, 1, T, P + T]`` bool, True where new token i sees key j.

    Example:
        >>> key_visibility(1, 2, None, False, torch.device("cpu"))[0, 0]
        tensor([[ True,  True, False],
                [ True,  True,  True]])
    """
    query_pos = torch.arange(num_past, num_past + num_new, device=device)[:, None]
    key_pos = torch.arange(num_past + num_new, device=device)[None, :]
    seen = (key_pos < query_pos) if strict else (key_pos <= query_pos)
    seen = seen[None, None]
    if key_real is not None:
        seen = seen & key_real[:, None, None, :].bool()
    return seen


def deltaformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    write: torch.Tensor | None,
    cache: tuple[torch.Tensor, torch.Tensor],
    key_real: torch.Tensor | None,
    scale: float,
    key_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New tokens after ``P`` cached ones (``cache``: their keys and u's): returns (o [B, Hk, G, T, E], every key
    [B, Hk, P + T, D], every u).

    O((P + T) T D) for the scores plus one [T, T] unit lower triangular solve per key head.

    Args:
        q: ``[B, Hk, G, T, D]`` queries, G query heads per key head.
        k: ``[B, Hk, T, D]`` keys of the new tokens.
        v: ``[B, Hk, T, E]`` their values.
        write: ``[B, Hk, T]`` write strength b of the new tokens, or None for b = 1 (Su's form).
        cache: (keys ``[B, Hk, P, D]``, u ``[B, Hk, P, E]``) of the P cached tokens (P may be 0).
        key_real: ``[B, P + T]`` (True = real token), or None.
        scale: query-key scale of the output softmax.
        key_scale: key-key scale of the feedback softmax.

    Returns:
        ``(o, keys, u)``: o ``[B, Hk, G, T, E]``, and the grown cache: keys ``[B, Hk, P + T, D]``, u
        ``[B, Hk, P + T, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        >>> empty = (torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
        >>> o, keys, u = deltaformer_attention(q, k, v, None, empty, None, 8**-0.5, 8**-0.5)
        >>> o.shape, keys.shape, u.shape
        (torch.Size([1, 2, 1, 4, 8]), torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4, 8]))
    """
    past_keys, past_u = cache
    num_past, num_new = past_keys.shape[2], k.shape[2]
    if num_new == 1 and num_past:
        return deltaformer_step(q, k, v, write, cache, key_real, (scale, key_scale))
    keys = torch.cat([past_keys, k], dim=2) if num_past else k
    before = key_visibility(num_past, num_new, key_real, True, k.device)
    feedback = masked_softmax((k @ keys.transpose(-1, -2)) * key_scale, before)  # B rows: [B, Hk, T, P + T]
    if write is not None:
        feedback = feedback * write[..., None]
    rhs = v - feedback[..., :num_past] @ past_u if num_past else v
    if num_new == 1:  # a decode step: nothing new to solve against
        u = rhs
    else:  # (I + B_new) U = rhs; only B_new's strictly lower triangle is read (it is zero elsewhere)
        u = unit_lower_solve(feedback[..., num_past:], rhs)
    values = torch.cat([past_u, u], dim=2) if num_past else u
    seen = key_visibility(num_past, num_new, key_real, False, k.device)
    probs = masked_softmax((q @ keys.unsqueeze(2).transpose(-1, -2)) * scale, seen.unsqueeze(2))
    return probs @ values.unsqueeze(2), keys, values


def deltaformer_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, write: torch.Tensor | None,
    cache: tuple[torch.Tensor, torch.Tensor], key_real: torch.Tensor | None, scales: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One new token after ``P >= 1`` cached ones, with one pass over the cached keys and one over the u's.

    The new key's feedback row (keys j < t) and the G query rows (keys j <= t) share the score product with the
    cached keys and the read of the cached u's; the query rows then add the new token's own term, whose u is
    only known after the feedback row is read. Same result as :func:`deltaformer_attention` up to rounding.

    Args:
        q: ``[B, Hk, G, 1, D]`` the token's queries.
        k: ``[B, Hk, 1, D]`` its key.
        v: ``[B, Hk, 1, E]`` its value.
        write: ``[B, Hk, 1]`` its write strength b, or None for b = 1.
        cache: (keys ``[B, Hk, P, D]``, u ``[B, Hk, P, E]``) of the cached tokens.
        key_real: ``[B, P + 1]`` (True = real token), or None.
        scales: (scale, key_scale), as in :func:`deltaformer_attention`.

    Returns:
        ``(o, keys, u)``: o ``[B, Hk, G, 1, E]``, keys ``[B, Hk, P + 1, D]``, u ``[B, Hk, P + 1, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
        >>> empty = (torch.zeros(1, 1, 0, 8), torch.zeros(1, 1, 0, 8))
        >>> _, keys, u = deltaformer_attention(q[..., :3, :], k[:, :, :3], v[:, :, :3], None, empty, None, 0.3, 0.3)
        >>> o, keys, u = deltaformer_step(q[..., 3:, :], k[:, :, 3:], v[:, :, 3:], None, (keys, u), None, (0.3, 0.3))
        >>> whole, _, _ = deltaformer_attention(q, k, v, None, empty, None, 0.3, 0.3)
        >>> torch.allclose(o, whole[..., 3:, :], atol=1e-5)
        True
    """
    (past_keys, past_u), (scale, key_scale) = cache, scales
    rows = torch.cat([k * key_scale, q[:, :, :, 0] * scale], dim=2)  # [B, Hk, 1 + G, D]
    scores = rows @ past_keys.transpose(-1, -2)  # [B, Hk, 1 + G, P]
    if key_real is not None:
        past_real = key_real[:, None, None, :-1].bool()
        scores = scores.masked_fill(~past_real, float("-inf"))
    self_score = (q[:, :, :, 0] * k).sum(-1, keepdim=True) * scale  # [B, Hk, G, 1]: each query on the new key
    top = scores.amax(-1, keepdim=True)
    top = torch.cat([top[:, :, :1], torch.maximum(top[:, :, 1:], self_score)], dim=2)
    top = torch.nan_to_num(top, neginf=0.0)  # a row with no visible cached key
    weights = torch.exp(scores - top)  # masked keys: exp(-inf) = 0
    read = weights @ past_u  # [B, Hk, 1 + G, E]
    total = weights.sum(-1, keepdim=True)
    feedback = read[:, :, :1] / total[:, :, :1].clamp_min(torch.finfo(total.dtype).tiny)  # 0 without a key
    if write is not None:
        feedback = feedback * write[..., None]
    u = v - feedback  # [B, Hk, 1, E]
    own = torch.exp(self_score - top[:, :, 1:])  # [B, Hk, G, 1]
    o = (read[:, :, 1:] + own * u) / (total[:, :, 1:] + own)
    return o[:, :, :, None], torch.cat([past_keys, k], dim=2), torch.cat([past_u, u], dim=2)
