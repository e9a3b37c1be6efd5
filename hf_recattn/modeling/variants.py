"""A composite model's declared variants as models of their own (window-only, far-only, ...), with its weights.

A family declares its variants per layer (``Mixer.variants(spec)``: the variant's spec and the map of the layer's
mixer keys to the variant's); ``variant_models`` applies them to a whole model. Conversion evaluates each variant
beside the trained hybrid to show what each part contributes.
"""

from __future__ import annotations

import copy

from torch import Tensor

from .mixer_base import KeyMap
from .mixers import mixer_class
from .modeling import RecAttnForCausalLM

#: where a layer's mixer parameters start in a state-dict key
MIXER_KEY = ".mixer."

Declared = dict[str, tuple[dict, KeyMap]]


def variant_models(model: RecAttnForCausalLM) -> dict[str, RecAttnForCausalLM]:
    """For a model with composite layers (a hybrid, also beside retrieval heads): the same weights as each named
    variant its layers declare (``Mixer.variants``: window-only, far-only, ...), in eval mode; {} without any.

    Each declared layer takes the variant's spec and maps its mixer's parameter keys by the variant's key map
    (e.g. ``mixer.far.*`` -> ``mixer.*``; the hybrid's mixing weights have no place in a far-only model); other
    layers stay as they are.
    """
    specs = model.config.layer_specs()
    declared = [mixer_class(spec["mixer"], f"layer {i}").variants(spec) for i, spec in enumerate(specs)]
    names = list(dict.fromkeys(name for variants in declared for name in variants))
    state = model.state_dict()
    return {name: _variant(model, name, specs, declared, state) for name in names}


def _variant(model: RecAttnForCausalLM, name: str, specs: list[dict], declared: list[Declared],
             state: dict[str, Tensor]) -> RecAttnForCausalLM:
    """The variant ``name`` of ``model``: its config with each declaring layer's variant spec, ``state`` mapped."""
    config = copy.deepcopy(model.config)
    config.attention = [layer[name][0] if name in layer else s for s, layer in zip(specs, declared, strict=True)]
    config.attention_overrides = None
    variant = RecAttnForCausalLM(config).to(next(model.parameters()).dtype)
    mapped = {}
    for key, value in state.items():
        layer, mixer, inner = key.partition(MIXER_KEY)
        variants = declared[_layer_of(key)] if mixer else {}
        renamed = variants[name][1](inner) if name in variants else inner
        if renamed is not None:
            mapped[layer + mixer + renamed] = value
    result = variant.load_state_dict(mapped, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing:
        raise ValueError(f"{name}: the variant has parameters the model does not provide: {missing[:4]}")
    if config.tie_word_embeddings:
        variant.tie_weights()
    return variant.eval()


def _layer_of(key: str) -> int:
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1])
