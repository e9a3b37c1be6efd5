"""The teacher families whose decoder block is a Llama variant: how each maps onto RecAttnConfig's architecture
options, its per-layer attention (full or sliding window, with or without RoPE) and its weight names.

Everything a family's config can say is either mapped exactly or refused here, naming the family and the feature,
before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

#: the attention kinds a teacher layer has (transformers' ``layer_types`` names)
FULL, SLIDING = "full_attention", "sliding_attention"
#: rope types the rotary embedding computes exactly as transformers does
ROPE_TYPES = ("default", *sorted(k for k in ROPE_INIT_FUNCTIONS if k != "proportional"))


@dataclass(frozen=True)
class Family:
    """One teacher family: its architecture options and the rules for its layers and weights."""

    model_type: str
    #: RecAttnConfig options fixed by the family (values may be read from the teacher's config)
    options: Callable[[Any], dict[str, Any]] = lambda config: {}
    #: how it decides which layers slide: "none", "all" (Mistral / Phi-3: every layer when sliding_window is set)
    #: or "layer_types"
    windows: str = "none"
    #: q/k/v biases without an o_proj bias (Qwen2)
    qkv_bias_only: bool = False
    #: fused projections split on load (rows in order): the teacher's module -> ours
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: config flags that must be off (False / None / 0), with what they would do that nothing here maps
    must_be_off: dict[str, str] = field(default_factory=dict)


def _granite(config: Any) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(config.embedding_multiplier),
        "residual_multiplier": float(config.residual_multiplier),
        "attention_multiplier": float(config.attention_multiplier),
        "logits_scaling": float(config.logits_scaling),
    }


def _gemma(config: Any) -> dict[str, Any]:
    return {"norm_unit_offset": True, "embedding_multiplier": config.hidden_size**0.5}


def _gemma2(config: Any) -> dict[str, Any]:
    return {
        **_gemma(config),
        "hidden_act": config.hidden_activation,  # Gemma 2 / 3 MLPs read this one (Gemma's reads hidden_act)
        "norm_layout": "sandwich",
        "attention_multiplier": float(config.query_pre_attn_scalar) ** -0.5,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }


def _gemma3(config: Any) -> dict[str, Any]:
    return {
        **_gemma2(config),
        "qk_norm": "head",
        "attn_logit_softcapping": None,  # in its config, but Gemma 3's attention never applies it
    }


BIDIRECTIONAL = {"use_bidirectional_attention": "every token attending to later ones (only causal decoders convert)"}
#: Phi-3's dropouts act in training only, where the student would have to apply them too
PHI3_DROPOUTS = {"resid_pdrop": "dropout on the residual branches", "embd_pdrop": "dropout on the embeddings"}


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("mistral", windows="all"),
        Family("qwen2", windows="layer_types", qkv_bias_only=True),
        Family("qwen3", options=lambda c: {"qk_norm": "head"}, windows="layer_types"),
        Family("smollm3", windows="layer_types"),
        Family("olmo2", options=lambda c: {"norm_layout": "post", "qk_norm": "projection"}),
        Family("granite", options=_granite),
        Family(
            "phi3",
            # Phi-3's generate() recomputes the cache once the sequence passes original_max_position_embeddings
            options=lambda c: {"recompute_cache_after": getattr(c, "original_max_position_embeddings", None)},
            windows="all",
            must_be_off=PHI3_DROPOUTS,
            fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                   "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
        ),
        Family("gemma", options=_gemma, must_be_off=BIDIRECTIONAL),
        Family("gemma2", options=_gemma2, windows="layer_types", must_be_off=BIDIRECTIONAL),
        Family("gemma3_text", options=_gemma3, windows="layer_types", must_be_off=BIDIRECTIONAL),
    )
}
SUPPORTED = tuple(FAMILIES)

#: our architecture options: never copied from a teacher's config by name, always set by its family
ARCHITECTURE_OPTIONS = (
    "norm_layout", "norm_unit_offset", "qk_norm", "attention_multiplier", "embedding_multiplier",
    "residual_multiplier", "logits_scaling", "attn_logit_softcapping", "final_logit_softcapping", "rope_layer_groups",
    "recompute_cache_after",
)


def family_of(config: Any) -> Family:
    """The family of a teacher config; ValueError naming the model type and the supported ones otherwise."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        hint = " (the text model of a Gemma 3 checkpoint is gemma3_text: load it with Gemma3ForCausalLM)" \
            if model_type == "gemma3" else ""
        raise ValueError(
            f"teacher model_type {model_type!r} is not a supported Llama-variant family{hint}; supported: "
            f"{list(SUPPORTED)}"
        )
    return family


def _nested_rope(config: Any) -> bool:
    """Whether ``rope_parameters`` holds one set per layer type (Gemma 3) rather than one flat set."""
    params = getattr(config, "rope_parameters", None) or {}
    return isinstance(params.get(FULL), dict) or isinstance(params.get(SLIDING), dict)


def _rope_sets(config: Any) -> dict[str, dict[str, Any]]:
    params = getattr(config, "rope_parameters", None) or {}
    if _nested_rope(config):
        return {f"rope_parameters[{key!r}]": value for key, value in params.items() if isinstance(value, dict)}
    return {"rope_parameters": params}


def check_teacher(config: Any) -> Family:
    """The teacher's family, once every feature its config uses is known to map exactly (ValueError otherwise)."""
    family = family_of(config)
    where = f"teacher family {family.model_type!r}"
    for flag, meaning in family.must_be_off.items():
        if getattr(config, flag, None):
            raise ValueError(f"{where}: {flag}={getattr(config, flag)!r} has no mapping ({meaning})")
    for name, params in _rope_sets(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{where}: {name} rope_type {rope_type!r} has no mapping; supported: {list(ROPE_TYPES)}")
    if family.windows == "layer_types":
        types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"{where}: layer_types {unknown} have no mapping (only {FULL} and {SLIDING})")
        if types and len(types) != config.num_hidden_layers:
            raise ValueError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is "
                             f"{config.num_hidden_layers}")
    if _nested_rope(config):
        types = list(getattr(config, "layer_types", None) or [])
        missing = sorted(set(types) - {k for k, v in config.rope_parameters.items() if isinstance(v, dict)})
        if not types or missing:
            raise ValueError(f"{where}: rope_parameters holds one set per layer type but none for the layer types "
                             f"{missing or ['(no layer_types)']}")
    return family


def teacher_layer_types(config: Any) -> list[str]:
    """Each teacher layer's attention: ``full_attention`` or ``sliding_attention`` (as the teacher's mask has it)."""
    family = family_of(config)
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family.windows == "all":
        return [SLIDING if window else FULL] * n
    if family.windows == "layer_types" and window:
        return [SLIDING if t == SLIDING else FULL for t in (getattr(config, "layer_types", None) or [FULL] * n)]
    return [FULL] * n


def teacher_layer_specs(config: Any) -> list[dict[str, Any]]:
    """The mixer spec that reproduces each teacher layer exactly: softmax, or sliding_window with the teacher's
    window (transformers' sliding mask shows a query its last ``sliding_window`` keys, itself included: our
    ``window``); ``rope: False`` on NoPE layers (SmolLM3's ``no_rope_layers``)."""
    specs = []
    for i, kind in enumerate(teacher_layer_types(config)):
        spec: dict[str, Any] = {"mixer": "softmax"}
        if kind == SLIDING:
            spec = {"mixer": "sliding_window", "window": int(config.sliding_window)}
        if not uses_rope(config, i):
            spec["rope"] = False
        specs.append(spec)
    return specs


def uses_rope(config: Any, layer_idx: int) -> bool:
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = this layer rotates, 0 = NoPE
    return bool(no_rope[layer_idx]) if no_rope is not None else True


def architecture_options(config: Any) -> dict[str, Any]:
    """RecAttnConfig options that reproduce the teacher's block."""
    family = check_teacher(config)
    options: dict[str, Any] = {name: None for name in ("attention_multiplier", "attn_logit_softcapping",
                                                       "final_logit_softcapping", "rope_layer_groups", "qk_norm")}
    if family.qkv_bias_only:
        options.update(attention_bias=True, o_proj_bias=False)
    options.update(family.options(config))
    if _nested_rope(config):  # each layer rotates with the set of its teacher layer type
        options["rope_layer_groups"] = list(config.layer_types)
    head_dim = _head_dim(config)
    if options["attention_multiplier"] == head_dim**-0.5:  # the mixers' own scale: nothing to apply
        options["attention_multiplier"] = None
    return options


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def split_fused(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The teacher's weights under our names: fused q/k/v and gate/up projections (Phi-3) split into parts."""
    family = family_of(config)
    if not family.fused:
        return state
    head_dim = _head_dim(config)
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    sizes = {3: [q, kv, kv], 2: [config.intermediate_size] * 2}
    out = {}
    for name, tensor in state.items():
        stem, _, leaf = name.rpartition(".")
        fused = next((key for key in family.fused if stem.endswith(key)), None)
        if fused is None:
            out[name] = tensor
            continue
        parts = family.fused[fused]
        if tensor.shape[0] != sum(sizes[len(parts)]):
            raise ValueError(f"teacher family {family.model_type!r}: {name} has {tensor.shape[0]} rows, its config "
                             f"implies {sum(sizes[len(parts)])}")
        prefix = stem[: -len(fused)]
        for part, piece in zip(parts, tensor.split(sizes[len(parts)], dim=0), strict=True):
            out[f"{prefix}{part}.{leaf}"] = piece
    return out
