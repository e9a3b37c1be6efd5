"""A learned retention score for the hybrid's exact cache (``cache_score: learned``): a small head per KV head that
predicts, from a key / value pair alone, how much attention later queries will put on it.

Locret (Huang et al., "Locret: Enhancing Eviction in Long-Context LLM Inference with Trained Retaining Heads",
arXiv:2410.01805) trains such heads to predict each key's causal importance and evicts the least important pairs
under a fixed budget; here the target comes from the teacher during conversion (training/retention_objective.py):
the largest attention weight any of the teacher's later queries beyond the window puts on the key, on a log scale.

The head reads what the cache holds, so the score needs no question and no layer input at write time:

* the value v (D numbers; values carry no position);
* the key's rotation-invariant part: the norm of each pair of dimensions (i, i + D/2) that the rotary embedding
  turns together (D/2 numbers), so that the same token scores the same at any position (with partial rotary the
  unrotated dimensions pair up the same way: still no position, a coarser view);

each part scaled to unit RMS, with the log of both RMS as two more features, then a two-layer MLP per KV head (SiLU,
``hidden`` units). It starts with its output layer at zero: every pair scores 0 and ties keep the older pair
(hybrid_cache.keep_slots), until training moves it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import MixerShape

#: hidden units of the head's MLP, per KV head
RETENTION_HIDDEN = 32
_EPS = 1e-6


def retention_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, N, 3D/2 + 2] float32 features of keys / values [B, Hkv, N, D]: the values and the keys' rotary
    pair norms, each scaled to unit RMS, then the log of both RMS."""
    k, v = keys.float(), values.float()
    half = k.shape[-1] // 2
    pairs = torch.sqrt(k[..., :half].square() + k[..., half : 2 * half].square())
    parts, scales = [], []
    for part in (v, pairs):
        rms = part.square().mean(-1, keepdim=True).add(_EPS).sqrt()
        parts.append(part / rms)
        scales.append(rms.log())
    return torch.cat([*parts, *scales], dim=-1)


def retention_feature_size(head_dim: int) -> int:
    """The number of features ``retention_features`` gives for keys and values of ``head_dim``."""
    return head_dim + head_dim // 2 + 2


class RetentionHead(nn.Module):
    """Per KV head, an MLP from a pair's ``retention_features`` to its predicted log importance."""

    def __init__(self, shape: MixerShape, hidden: int = RETENTION_HIDDEN) -> None:
        super().__init__()
        heads, features = shape.num_kv_heads, retention_feature_size(shape.head_dim)
        self.w_in = nn.Parameter(torch.empty(heads, features, hidden))
        self.b_in = nn.Parameter(torch.zeros(heads, hidden))
        self.w_out = nn.Parameter(torch.zeros(heads, hidden))
        self.b_out = nn.Parameter(torch.zeros(heads))
        self.init_parameters(nn.init)

    def init_parameters(self, init: Any) -> None:
        """Input layer random (std 1/sqrt(features)), the rest zero: every pair scores 0 at the start."""
        init.normal_(self.w_in, 0.0, self.w_in.shape[1] ** -0.5)
        for param in (self.b_in, self.w_out, self.b_out):
            init.zeros_(param)

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, N] float32: the predicted log importance of each pair (keys / values [B, Hkv, N, D])."""
        x = retention_features(keys, values)
        hidden = F.silu(torch.einsum("bhnf,hfu->bhnu", x, self.w_in.float()) + self.b_in.float()[:, None, :])
        return torch.einsum("bhnu,hu->bhn", hidden, self.w_out.float()) + self.b_out.float()[:, None]
