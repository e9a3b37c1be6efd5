"""The decoder's architecture options beyond Llama (norm placement, q/k norms, multipliers, soft-caps, per-layer
rotary groups): their validation and the small modules that apply them. The defaults are Llama's."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

#: where each layout puts its RMSNorms: role -> weight name (the teacher's own names, so weights load as they are)
NORM_LAYOUTS: dict[str, dict[str, str]] = {
    "pre": {"attention_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "post": {"attention_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "sandwich": {
        "attention_in": "input_layernorm",
        "attention_out": "post_attention_layernorm",
        "mlp_in": "pre_feedforward_layernorm",
        "mlp_out": "post_feedforward_layernorm",
    },
}
QK_NORMS = ("head", "projection")

RopePair = tuple[torch.Tensor, torch.Tensor]
#: the rotary embedding of a forward: one (cos, sin), or one per group of layers (``rope_layer_groups``)
PositionEmbeddings = RopePair | dict[str, RopePair]


def _positive_number(config: Any, name: str, nullable: bool) -> None:
    value = getattr(config, name)
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0{' or None' if nullable else ''}, got {value!r}")


def check_architecture(config: Any) -> None:
    """Raise ValueError naming the option whose value is not one the decoder implements."""
    if config.norm_layout not in NORM_LAYOUTS:
        raise ValueError(f"norm_layout must be one of {list(NORM_LAYOUTS)}, got {config.norm_layout!r}")
    if config.qk_norm is not None and config.qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {list(QK_NORMS)} or None, got {config.qk_norm!r}")
    if not isinstance(config.norm_unit_offset, bool):
        raise ValueError(f"norm_unit_offset must be true or false, got {config.norm_unit_offset!r}")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        _positive_number(config, name, nullable=False)
    for name in ("attention_multiplier", "attn_logit_softcapping", "final_logit_softcapping"):
        _positive_number(config, name, nullable=True)
    after = config.recompute_cache_after
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 1):
        raise ValueError(f"recompute_cache_after must be a positive int or None, got {after!r}")
    groups = config.rope_layer_groups
    if groups is None:
        return
    if not isinstance(groups, list) or len(groups) != config.num_hidden_layers:
        raise ValueError(
            f"rope_layer_groups must list one group per layer ({config.num_hidden_layers}), got {groups!r}"
        )
    params = config.rope_parameters or {}
    missing = sorted({g for g in groups if not isinstance(params.get(g), dict)})
    if missing:
        raise ValueError(
            f"rope_layer_groups names {missing} but rope_parameters has no such nested entries (it has "
            f"{sorted(params)})"
        )


class RecAttnRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm (same weights and formula); in float32 one fused op (torch's ``rms_norm``, which sums the
    squares in another order: equal within float32 rounding). With ``unit_offset`` Gemma's: the weight is stored
    as an offset from 1 and applied as ``1 + weight`` in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__(hidden_size, eps=eps)
        self.unit_offset = unit_offset

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            x = hidden_states.float()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (normed * (1.0 + self.weight.float())).type_as(hidden_states)
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)
        return super().forward(hidden_states)

    def init_parameters(self, init: Any) -> None:
        """Unit-offset weights start at 0 (a scale of 1), like the plain ones start at 1."""
        if self.unit_offset:
            init.zeros_(self.weight)


def rms_norm(config: Any, size: int) -> RecAttnRMSNorm:
    return RecAttnRMSNorm(size, eps=config.rms_norm_eps, unit_offset=bool(config.norm_unit_offset))


def block_norms(config: Any) -> dict[str, RecAttnRMSNorm]:
    """The decoder block's norms by weight name, for ``config.norm_layout``."""
    return {name: rms_norm(config, config.hidden_size) for name in NORM_LAYOUTS[config.norm_layout].values()}


def qk_norms(config: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[nn.Module, nn.Module] | None:
    """The q and k norms of ``config.qk_norm`` (None without): per head, or over the whole projection."""
    if config.qk_norm is None:
        return None
    if config.qk_norm == "head":
        return rms_norm(config, head_dim), rms_norm(config, head_dim)
    return rms_norm(config, num_heads * head_dim), rms_norm(config, num_kv_heads * head_dim)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``; x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


class RecAttnRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's rotary embedding; its default rope also honours ``partial_rotary_factor`` (Phi-3: only the first
    fraction of each head rotates)."""

    @staticmethod
    def compute_default_rope_parameters(
        config: Any = None, device: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0


class GroupedRotaryEmbedding(nn.Module):
    """One rotary embedding per group of layers (``rope_layer_groups``), each from its nested ``rope_parameters``;
    the forward returns ``{group: (cos, sin)}``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        rotaries = {}
        for group in sorted(set(config.rope_layer_groups)):
            flat = copy.copy(config)
            flat.rope_parameters = config.rope_parameters[group]
            rotaries[group] = RecAttnRotaryEmbedding(config=flat)
        self.groups = nn.ModuleDict(rotaries)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, RopePair]:
        return {group: rotary(x, position_ids=position_ids) for group, rotary in self.groups.items()}


def rotary_embedding(config: Any) -> nn.Module:
    return GroupedRotaryEmbedding(config) if config.rope_layer_groups else RecAttnRotaryEmbedding(config=config)


def layer_rope(position_embeddings: PositionEmbeddings, group: str | None) -> RopePair:
    """The (cos, sin) a layer of ``group`` rotates with."""
    return position_embeddings[group] if isinstance(position_embeddings, dict) else position_embeddings


def slice_rope(position_embeddings: PositionEmbeddings, start: int, stop: int) -> PositionEmbeddings:
    """The rotary embedding of tokens ``start:stop``."""
    if isinstance(position_embeddings, dict):
        return {group: (cos[:, start:stop], sin[:, start:stop]) for group, (cos, sin) in position_embeddings.items()}
    cos, sin = position_embeddings
    return cos[:, start:stop], sin[:, start:stop]
