"""Denominator replacements: a vector norm of each head's output (Mongaras & Larson, arXiv:2507.23632, eq. 6), with
a learnable gain."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import MixerShape
from .options import check_kind

OUTPUT_NORMS = ("l2", "rms", "layernorm")


class OutputNorm(nn.Module):
    """Normalize each head's output vector over its last dim; gain per query head, initialized to 1."""

    def __init__(self, kind: str, shape: MixerShape, dim: int, eps: float) -> None:
        super().__init__()
        check_kind(kind, OUTPUT_NORMS, "output norm", f"layer {shape.layer_idx}")
        self.kind = kind
        self.eps = eps
        self.groups = (shape.num_kv_heads, shape.groups)
        self.weight = nn.Parameter(torch.ones(shape.num_heads, dim))

    def init_parameters(self, init: Any) -> None:
        init.ones_(self.weight)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, Hkv, G, T, E]."""
        if self.kind == "l2":
            o = o / (o.norm(dim=-1, keepdim=True) + self.eps)
        elif self.kind == "rms":
            o = F.rms_norm(o, (o.shape[-1],), eps=self.eps)
        else:
            o = o - o.mean(-1, keepdim=True)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return o * self.weight.view(*self.groups, 1, -1)
