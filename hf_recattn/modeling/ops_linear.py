"""Functional forms of (causal) linear attention: numerator and denominator of phi(q) . sum phi(k) v.

Shapes: ``q`` is ``[B, Hkv, G, T, F]`` (G query heads share a key head), ``k`` is ``[B, Hkv, T, F]``, ``v`` is
``[B, Hkv, T, E]``. States: ``S`` is ``[B, Hkv, F, E]`` (sum of k v^T), ``z`` is ``[B, Hkv, F]`` (sum of k).
Padding is the caller's business: zero the feature-mapped keys of padded tokens before calling.
"""

from __future__ import annotations

import torch


def _causal(scores: torch.Tensor) -> torch.Tensor:
    t, s = scores.shape[-2:]
    keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
    return scores.masked_fill(~keep, 0.0)


def linear_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quadratic form: returns (numerator [B,Hkv,G,T,E], denominator [B,Hkv,G,T])."""
    scores = torch.einsum("bhgtf,bhsf->bhgts", q, k)
    if causal:
        scores = _causal(scores)
    return torch.einsum("bhgts,bhse->bhgte", scores, v), scores.sum(-1)


def linear_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunkwise causal form, O(T * chunk): exact inside a chunk, state across chunks.

    Returns (numerator, denominator, final S, final z).
    """
    nums, dens = [], []
    for start in range(0, q.shape[3], chunk_size):
        qc = q[:, :, :, start : start + chunk_size]
        kc = k[:, :, start : start + chunk_size]
        vc = v[:, :, start : start + chunk_size]
        intra = _causal(torch.einsum("bhgtf,bhsf->bhgts", qc, kc))
        nums.append(torch.einsum("bhgtf,bhfe->bhgte", qc, S) + torch.einsum("bhgts,bhse->bhgte", intra, vc))
        dens.append(torch.einsum("bhgtf,bhf->bhgt", qc, z) + intra.sum(-1))
        S = S + torch.einsum("bhsf,bhse->bhfe", kc, vc)
        z = z + kc.sum(2)
    return torch.cat(nums, dim=3), torch.cat(dens, dim=3), S, z


def linear_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token (T == 1): fold k v^T into the state, then read it with q.

    Written with addcmul / matmul rather than einsum: a decode step runs this once per layer per token, and
    einsum's reshapes cost more than the arithmetic at these sizes.
    """
    S = torch.addcmul(S, k.transpose(-1, -2), v)
    z = z + k[:, :, 0]
    q1 = q[:, :, :, 0]  # [B, Hkv, G, F]
    return torch.matmul(q1, S).unsqueeze(3), torch.matmul(q1, z.unsqueeze(-1)), S, z


def noncausal_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bidirectional form in O(T): every query reads the state of the whole sequence."""
    S = torch.einsum("bhsf,bhse->bhfe", k, v)
    z = k.sum(2)
    return torch.einsum("bhgtf,bhfe->bhgte", q, S), torch.einsum("bhgtf,bhf->bhgt", q, z)
