"""Build a hf_recattn model from a causal LM of a Llama-variant family (families.py): copy every weight, add only
the new mixer parameters."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..modeling.configuration import RecAttnConfig, resolve_layer_specs
from ..modeling.modeling import RecAttnForCausalLM
from .families import (
    ARCHITECTURE_OPTIONS,
    architecture_options,
    split_fused,
    teacher_layer_specs,
    teacher_layer_types,
)
from .layer_selection import selected_layers

# config keys of the teacher that do not describe the architecture we copy
_DROP_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "sliding_window",
    "layer_types",
    "use_sliding_window",
    "max_window_layers",
    "quantization_config",
    *ARCHITECTURE_OPTIONS,
}


def recattn_config_from(
    teacher_config: Any, attention: Any, attention_overrides: dict | None = None, layers: dict | None = None
) -> RecAttnConfig:
    """A RecAttnConfig with the teacher's architecture and the given attention specs.

    ``layers`` (see layer_selection.py) picks the teacher layers that take ``attention``; the others keep the
    teacher's own attention (softmax, or sliding_window with its window). A ``softmax`` spec given to a layer the
    teacher runs with a sliding window keeps that window; NoPE layers stay without RoPE whatever the spec.
    """
    teacher_specs = teacher_layer_specs(teacher_config)  # checks the family and its features first
    values = {k: v for k, v in teacher_config.to_dict().items() if k not in _DROP_KEYS}
    values.update(architecture_options(teacher_config))
    known = set(getattr(RecAttnConfig, "__dataclass_fields__", ())) | set(ARCHITECTURE_OPTIONS) | {"o_proj_bias"}
    values = {k: v for k, v in values.items() if k in known or k.startswith("rope")}
    if layers is not None or any(spec != {"mixer": "softmax"} for spec in teacher_specs):
        n = teacher_config.num_hidden_layers
        requested = resolve_layer_specs(attention, attention_overrides, n)
        chosen = set(selected_layers(layers, teacher_layer_types(teacher_config)))
        attention = [_student_spec(requested[i], teacher_specs[i]) if i in chosen else teacher_specs[i]
                     for i in range(n)]
        attention_overrides = None
    windows = [spec.get("window") for spec in teacher_specs]
    config = RecAttnConfig(**values, attention=attention, attention_overrides=attention_overrides,
                           teacher_kv_windows=windows if any(w is not None for w in windows) else None)
    config._attn_implementation = getattr(teacher_config, "_attn_implementation", None) or "sdpa"
    return config


def _student_spec(requested: dict[str, Any], teacher: dict[str, Any]) -> dict[str, Any]:
    """The spec of a converted layer: softmax keeps the teacher's window; a NoPE layer stays NoPE."""
    spec = dict(requested)
    if spec["mixer"] == "softmax" and teacher["mixer"] == "sliding_window":
        spec.update(mixer="sliding_window", window=teacher["window"])
    if teacher.get("rope") is False:
        spec["rope"] = False
    return spec


def from_teacher(
    model_or_path: PreTrainedModel | str | os.PathLike,
    attention: Any = "softmax",
    attention_overrides: dict | None = None,
    layers: dict | None = None,
    **load_kwargs: Any,
) -> RecAttnForCausalLM:
    """Convert a causal LM of a Llama-variant family (Llama, Mistral, Qwen2 / 3, SmolLM3, OLMo 2, Granite,
    Phi-3, Gemma 1-3; object or local path / Hub id) into a ``RecAttnForCausalLM``.

    Every teacher weight is copied; only parameters that the chosen mixers add (feature maps, gains, gates)
    keep their fresh initialization. ``attention`` takes one spec, a mixer name, or a list with one per layer;
    ``layers`` (layer_selection.py) which teacher layers take it, the others keeping the teacher's attention.
    A teacher whose config uses a feature with no exact mapping is refused before any weight is copied.
    """
    teacher = model_or_path
    if not isinstance(teacher, PreTrainedModel):
        teacher = AutoModelForCausalLM.from_pretrained(model_or_path, **load_kwargs)
    return student_from_teacher(teacher, recattn_config_from(teacher.config, attention, attention_overrides, layers))


def student_from_teacher(
    teacher: PreTrainedModel, config: RecAttnConfig, dtype: torch.dtype | None = None
) -> RecAttnForCausalLM:
    """The student that ``config`` (``recattn_config_from`` the teacher's config) describes, in ``dtype`` (None: the
    teacher's), with every teacher weight copied: only the parameters the chosen mixers add keep their fresh
    initialization. In another dtype than the teacher's it is the teacher-dtype student cast to ``dtype``, bit for
    bit (its fresh tensors rounded through the teacher's dtype), built without a second copy of the weights."""
    teacher_dtype = next(teacher.parameters()).dtype
    state = split_fused(teacher.config, teacher.state_dict())
    student = RecAttnForCausalLM(config)
    if dtype is None or dtype == teacher_dtype:
        student = student.to(teacher_dtype)
    else:
        _round_fresh(student, teacher_dtype, set(state))
        student = student.to(dtype)
    _check_shapes(state, student.state_dict(), config)
    result = student.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"teacher weights with no place in the student: {result.unexpected_keys[:8]}")
    missing = [k for k in result.missing_keys if ".mixer." not in k and k != "lm_head.weight"]
    if missing:
        raise ValueError(f"student weights the teacher does not provide: {missing[:8]}")
    if "lm_head.weight" in result.missing_keys and not config.tie_word_embeddings:
        raise ValueError("the teacher has no lm_head.weight and does not tie its embeddings")
    if config.tie_word_embeddings:
        student.tie_weights()
    student.generation_config = teacher.generation_config
    student.eval()
    with torch.no_grad():
        _check_copied(student, teacher)
    return student


def _round_fresh(student: torch.nn.Module, dtype: torch.dtype, provided: set[str]) -> None:
    """Round every floating parameter and buffer of ``student`` that the teacher does not provide (``provided``:
    the state-dict names it does) to ``dtype`` and back, replacing it as ``Module.to`` does: the values the student
    built in ``dtype`` starts from."""
    kept = {id(t) for name, t in student.state_dict(keep_vars=True).items() if name in provided}
    student._apply(lambda t: t if id(t) in kept or not t.is_floating_point() else t.to(dtype).to(t.dtype))


def _check_shapes(
    teacher_state: dict[str, torch.Tensor], student_state: dict[str, torch.Tensor], config: Any
) -> None:
    """A teacher whose weights do not match its own config (e.g. head counts) is a ValueError, not a crash."""
    wrong = [
        f"{name}: teacher {tuple(t.shape)}, config implies {tuple(student_state[name].shape)}"
        for name, t in teacher_state.items()
        if name in student_state and t.shape != student_state[name].shape
    ]
    if wrong:
        raise ValueError(
            "teacher weights do not match its config (num_attention_heads="
            f"{config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}, "
            f"head_dim={config.head_dim}, hidden_size={config.hidden_size}): " + "; ".join(wrong[:4])
        )


def _check_copied(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """Cheap guard: the embedding really is the teacher's."""
    a = student.get_input_embeddings().weight
    b = teacher.get_input_embeddings().weight
    if a.shape != b.shape or not torch.equal(a[:8], b[:8].to(a.dtype)):
        raise RuntimeError("copying the teacher's embeddings failed")
