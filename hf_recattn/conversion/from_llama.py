"""Build a hf_recattn model from a Llama-shaped causal LM: copy every weight, add only the new mixer parameters."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..modeling.configuration import RecAttnConfig
from ..modeling.modeling import RecAttnForCausalLM

#: architectures whose weights map one to one onto ours (qwen2: q/k/v biases, no o_proj bias)
LLAMA_SHAPED = ("llama", "mistral", "qwen2")

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
}


def recattn_config_from(
    teacher_config: Any, attention: Any, attention_overrides: dict | None = None
) -> RecAttnConfig:
    """A RecAttnConfig with the teacher's architecture and the given attention specs."""
    model_type = getattr(teacher_config, "model_type", None)
    if model_type not in LLAMA_SHAPED:
        raise ValueError(
            f"teacher model_type {model_type!r} is not Llama-shaped; supported: {list(LLAMA_SHAPED)}"
        )
    if model_type == "mistral" and getattr(teacher_config, "sliding_window", None):
        raise ValueError(
            "teacher is a Mistral model with sliding_window set; give its layers "
            "{'mixer': 'sliding_window', 'window': N} explicitly after converting a copy with sliding_window=None"
        )
    if model_type == "qwen2" and getattr(teacher_config, "use_sliding_window", False):
        raise ValueError(
            "teacher is a Qwen2 model with use_sliding_window=True; only full attention converts"
        )
    values = {k: v for k, v in teacher_config.to_dict().items() if k not in _DROP_KEYS}
    if model_type == "qwen2":  # Qwen2's attention: biases on q/k/v, none on o_proj (not in its config)
        values.update(attention_bias=True, o_proj_bias=False)
    known = (
        set(RecAttnConfig.__dataclass_fields__) if hasattr(RecAttnConfig, "__dataclass_fields__") else None
    )
    if known is not None:
        values = {k: v for k, v in values.items() if k in known or k.startswith("rope")}
    config = RecAttnConfig(**values, attention=attention, attention_overrides=attention_overrides)
    config._attn_implementation = getattr(teacher_config, "_attn_implementation", None) or "sdpa"
    return config


def from_llama(
    model_or_path: PreTrainedModel | str | os.PathLike,
    attention: Any = "softmax",
    attention_overrides: dict | None = None,
    **load_kwargs: Any,
) -> RecAttnForCausalLM:
    """Convert a ``LlamaForCausalLM`` (object or local path / Hub id) into a ``RecAttnForCausalLM``.

    Every teacher weight is copied; only parameters that the chosen mixers add (feature maps, gains, gates)
    keep their fresh initialization. ``attention`` takes one spec, a mixer name, or a list with one per layer.
    """
    teacher = model_or_path
    if not isinstance(teacher, PreTrainedModel):
        teacher = AutoModelForCausalLM.from_pretrained(model_or_path, **load_kwargs)
    config = recattn_config_from(teacher.config, attention, attention_overrides)
    teacher_dtype = next(teacher.parameters()).dtype
    student = RecAttnForCausalLM(config).to(teacher_dtype)
    state = teacher.state_dict()
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
