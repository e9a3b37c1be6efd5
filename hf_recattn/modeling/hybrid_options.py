"""A model's hybrid layers with changed options and the same weights (e.g. the exact cache, ``cache_slots``, added
to a hybrid trained without it): options that add no parameters, so the trained state dict loads as it is.
"""

from __future__ import annotations

import copy
from typing import Any

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


def with_hybrid_options(model: RecAttnForCausalLM, options: dict[str, Any]) -> RecAttnForCausalLM:
    """A copy of ``model`` (in eval mode) whose hybrid layers take ``options`` (``{"cache_slots": 64}``), with the
    same weights. ValueError when no layer is a hybrid, when an option is bad (named with its layer), or when the
    change adds or drops parameters (named), since the trained weights would then not be the whole model."""
    unknown = sorted(set(options) - set(HybridMixer.options))
    if unknown:
        raise ValueError(f"hybrid options {unknown}: unknown; the hybrid's options are {sorted(HybridMixer.options)}")
    specs, found = [], []
    for spec in model.config.layer_specs():
        new, hit = _respec(spec, options)
        specs.append(new)
        found.append(hit)
    if not any(found):
        raise ValueError(f"hybrid options {options}: the model has no hybrid layer to set them on")
    config = copy.deepcopy(model.config)
    config.attention, config.attention_overrides = specs, None
    changed = RecAttnForCausalLM(config).to(next(model.parameters()).dtype)
    result = changed.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(f"hybrid options {options} change the parameters (missing {missing[:4]}, unexpected "
                         f"{result.unexpected_keys[:4]}); only options without weights of their own can be changed")
    if config.tie_word_embeddings:
        changed.tie_weights()
    return changed.eval()
