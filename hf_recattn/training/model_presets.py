"""The model sizes a pretrain YAML names (``model: small``), and the ``model`` section as RecAttnConfig keyword
arguments."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from .checks import as_mapping, check_keys, suggest

#: model sizes for ``model: NAME`` (or ``model: {preset: NAME, ...}``); vocabulary and special ids come
#: from the tokenizer
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True),
    "base": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True),
}
#: config arguments RecAttnConfig accepts that are not fields (LlamaConfig converts them)
_CONFIG_EXTRAS = {"rope_theta", "rope_scaling"}


def config_fields() -> set[str]:
    from ..modeling.configuration import RecAttnConfig

    return {f.name for f in dataclasses.fields(RecAttnConfig)} | _CONFIG_EXTRAS


def model_values(value: Any, where: str) -> dict[str, Any]:
    """RecAttnConfig keyword arguments from ``model: PRESET`` or ``model: {preset: ..., FIELD: ...}``."""
    if isinstance(value, str):
        value = {"preset": value}
    values = as_mapping(value, f"{where}: model")
    preset = values.pop("preset", None)
    if not preset and "hidden_size" not in values:
        preset = "tiny"
    if preset is not None and preset not in MODEL_PRESETS:
        raise ValueError(f"{where}: model.preset: unknown preset {preset!r}{suggest(str(preset), MODEL_PRESETS)}"
                         f"; presets: {sorted(MODEL_PRESETS)}")
    check_keys(values, config_fields(), f"{where}: model", "a RecAttnConfig field")
    return {**copy.deepcopy(MODEL_PRESETS.get(preset, {})), **values}
