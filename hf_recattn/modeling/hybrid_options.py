"""A model's hybrid layers with changed options and the same weights (e.g. the exact cache, ``cache_slots``, added
to a hybrid trained without it): options that add no parameters, so the trained state dict loads as it is.
"""

from __future__ import annotations

import copy
from typing import Any

from .configuration import RecAttnConfig
from .mixer_hybrid import HybridMixer
from .modeling import RecAttnForCausalLM


def _respec(spec: dict[str, Any], options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``spec`` with ``options`` set on every hybrid in it (itself, or nested, e.g. retrieval heads' ``others``),
    and whether there was one."""
    if spec.get("mixer") == HybridMixer.name:
        return {**spec, **options}, True
    found = False
    out = dict(spec)
    for key, value in spec.items():
        if isinstance(value, dict) and "mixer" in value:
            out[key], inner = _respec(value, options)
            found = found or inner
    return out, found


def _slots(spec: dict[str, Any]) -> int:
    """The largest ``cache_slots`` of a hybrid in ``spec`` (itself or nested); 0 without one."""
    own = int(spec.get("cache_slots", 0)) if spec.get("mixer") == HybridMixer.name else 0
    nested = [_slots(value) for value in spec.values() if isinstance(value, dict) and "mixer" in value]
    return max([own, *nested])


def _scores(spec: dict[str, Any]) -> list[str]:
    """The ``cache_score`` of each hybrid with an exact cache in ``spec`` (itself, then nested)."""
    own = []
    if spec.get("mixer") == HybridMixer.name and int(spec.get("cache_slots", 0)):
        own = [spec.get("cache_score", HybridMixer.options["cache_score"].default)]
    return own + [s for value in spec.values() if isinstance(value, dict) and "mixer" in value for s in _scores(value)]


def hybrid_cache_scores(config: RecAttnConfig) -> list[str]:
    """The ``cache_score`` of the model's hybrid layers with an exact cache, each once, in layer order."""
    return list(dict.fromkeys(s for spec in config.layer_specs() for s in _scores(spec)))


def hybrid_cache_slots(config: RecAttnConfig) -> int:
    """The largest exact cache (``cache_slots``) of the model's hybrid layers; 0 when none has one."""
    return max(_slots(spec) for spec in config.layer_specs())


def config_with_hybrid_options(config: RecAttnConfig, options: dict[str, Any]) -> RecAttnConfig:
    """A copy of ``config`` whose hybrid layers take ``options``; ValueError when an option is unknown or bad (named
    with its layer) or no layer is a hybrid."""
    unknown = sorted(set(options) - set(HybridMixer.options))
    if unknown:
        raise ValueError(f"hybrid options {unknown}: unknown; the hybrid's options are {sorted(HybridMixer.options)}")
    specs, found = [], False
    for spec in config.layer_specs():
        new, hit = _respec(spec, options)
        specs.append(new)
        found = found or hit
    if not found:
        raise ValueError(f"hybrid options {options}: the model has no hybrid layer to set them on")
    changed = copy.deepcopy(config)
    changed.attention, changed.attention_overrides = specs, None
    changed.layer_specs()  # validate now
    return changed


def with_hybrid_options(model: RecAttnForCausalLM, options: dict[str, Any]) -> RecAttnForCausalLM:
    """A copy of ``model`` (in eval mode) whose hybrid layers take ``options`` (``{"cache_slots": 64}``), with the
    same weights. ValueError as ``config_with_hybrid_options`` says, or when the change adds or drops parameters
    (named), since the trained weights would then not be the whole model."""
    config = config_with_hybrid_options(model.config, options)
    changed = RecAttnForCausalLM(config).to(next(model.parameters()).dtype)
    result = changed.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(f"hybrid options {options} change the parameters (missing {missing[:4]}, unexpected "
                         f"{result.unexpected_keys[:4]}); only options without weights of their own can be changed")
    if config.tie_word_embeddings:
        changed.tie_weights()
    return changed.eval()
