"""A model's hybrid layers with changed options and the same weights (e.g. the exact cache, ``cache_slots``, added
to a hybrid trained without it): options that add no parameters, so the trained state dict loads as it is.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from .configuration import RecAttnConfig, override_layers, override_order
from .mixer_hybrid import HybridMixer
from .modeling import RecAttnForCausalLM

#: the hybrid's ``cache_score`` when a spec does not set it
DEFAULT_CACHE_SCORE: str = HybridMixer.options["cache_score"].default
#: how the hybrid's exact cache holds its pairs when a spec does not say (``cache_dtype``)
DEFAULT_CACHE_DTYPE: str = HybridMixer.options["cache_dtype"].default


def parse_layers(items: list[str] | None) -> list[int] | None:
    """``--hybrid-layers`` items, ``["0-10", "14"]`` -> ``[0, 1, ..., 10, 14]`` (each a layer index or an inclusive
    range); None stays None. ValueError naming the item when it is neither."""
    if items is None:
        return None
    layers: list[int] = []
    for item in items:
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"--hybrid-layers: {item!r} is not a layer index or a range such as 0-10")
        layers.extend(range(int(first), int(last or first) + 1))
    return sorted(set(layers))


def layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 7]`` -> ``0-2, 7``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


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


def _hybrids(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The hybrid specs in ``spec``: itself when it is one, then those nested in it (retrieval heads' ``others``)."""
    if spec.get("mixer") == HybridMixer.name:
        yield spec
    for value in spec.values():
        if isinstance(value, dict) and "mixer" in value:
            yield from _hybrids(value)


def _cached(config: RecAttnConfig) -> Iterator[dict[str, Any]]:
    """The model's hybrid specs with an exact cache, in layer order."""
    return (h for spec in config.layer_specs() for h in _hybrids(spec) if int(h.get("cache_slots", 0)))


def hybrid_cache_choices(config: RecAttnConfig) -> list[tuple[str, int]]:
    """The ``cache_score`` and ``cache_recent`` (newest pairs reserved) of the model's hybrid layers with an exact
    cache, each pair once, in layer order."""
    return list(dict.fromkeys((h.get("cache_score", DEFAULT_CACHE_SCORE), int(h.get("cache_recent", 0)))
                              for h in _cached(config)))


def hybrid_cache_dtypes(config: RecAttnConfig) -> list[str]:
    """How the model's hybrid layers with an exact cache hold its pairs (``cache_dtype``), each once, in layer order."""
    return list(dict.fromkeys(h.get("cache_dtype", DEFAULT_CACHE_DTYPE) for h in _cached(config)))


def hybrid_cache_slots(config: RecAttnConfig) -> int:
    """The largest exact cache (``cache_slots``) of the model's hybrid layers; 0 when none has one."""
    return max((int(h["cache_slots"]) for h in _cached(config)), default=0)


def config_with_hybrid_options(config: RecAttnConfig, options: dict[str, Any],
                               layers: Collection[int] | None = None) -> RecAttnConfig:
    """A copy of ``config`` whose hybrid layers (only those among ``layers``, layer indices, when given) take
    ``options``; ValueError when an option is unknown or bad (named with its layer), a layer index is out of range
    or no chosen layer is a hybrid."""
    unknown = sorted(set(options) - set(HybridMixer.options))
    if unknown:
        raise ValueError(f"hybrid options {unknown}: unknown; the hybrid's options are {sorted(HybridMixer.options)}")
    current = config.layer_specs()
    outside = sorted(i for i in (layers or ()) if not 0 <= i < len(current))
    if outside:
        raise ValueError(f"hybrid options: layers {outside} out of range; the model has layers 0-{len(current) - 1}")
    specs, found = [], False
    for i, spec in enumerate(current):
        new, hit = _respec(spec, options) if layers is None or i in layers else (spec, False)
        specs.append(new)
        found = found or hit
    if not found:
        among = "" if layers is None else f" among layers {sorted(layers)}"
        raise ValueError(f"hybrid options {options}: the model has no hybrid layer{among} to set them on")
    changed = copy.deepcopy(config)
    changed.attention, changed.attention_overrides = specs, None
    changed.layer_specs()  # validate now
    return changed


def config_with_layer_options(config: RecAttnConfig, overrides: dict[str, dict[str, Any]],
                              section: str = "serve_overrides") -> RecAttnConfig:
    """A copy of ``config`` in which each entry of ``overrides`` (a layer key as in ``attention_overrides``: "3",
    "every:6"; patterns first, indices last) sets its hybrid options on the layers it selects. ValueError naming
    ``section[key]`` when a key is bad or its options do not fit its layers."""
    changed = config
    for key in override_order(overrides):
        layers = override_layers(str(key), config.num_hidden_layers, section)
        try:
            changed = config_with_hybrid_options(changed, overrides[key], layers)
        except ValueError as err:
            raise ValueError(f"{section}[{str(key)!r}]: {err}") from None
    return changed


def _changed_parameters(what: str, missing: list[str], unexpected: list[str]) -> ValueError:
    return ValueError(f"{what} change the parameters (missing {missing[:4]}, unexpected {unexpected[:4]}); only "
                      "options without weights of their own can be changed")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside are put on the meta device (no storage, their initialisation a no-op); buffers
    are made as usual, from the config being built."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def with_config(model: RecAttnForCausalLM, config: RecAttnConfig, what: str) -> RecAttnForCausalLM:
    """A model (in eval mode) built from ``config`` that holds ``model``'s weights, the same tensors (no copy: a
    7B student stays one 7B student in memory); ValueError naming ``what`` when ``config`` adds or drops
    parameters, since the trained weights would then not be the whole model."""
    with _parameters_on_meta():
        changed = RecAttnForCausalLM(config)
    result = changed.load_state_dict(model.state_dict(), strict=False, assign=True)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise _changed_parameters(what, missing, result.unexpected_keys)
    if config.tie_word_embeddings:
        changed.tie_weights()
    on_meta = [name for name, p in changed.named_parameters() if p.device.type == "meta"]
    if on_meta:
        raise ValueError(f"{what}: parameters {on_meta[:4]} have no trained weights to take")
    return changed.to(next(model.parameters()).dtype).eval()


def same_parameters(config: RecAttnConfig, changed: RecAttnConfig, what: str) -> None:
    """ValueError naming ``what`` when a model cannot be built from ``changed`` (a cache that does not fit its
    layer) or would not hold the parameters one built from ``config`` holds (checked on the meta device, without
    allocating weights)."""
    with torch.device("meta"):
        before = set(RecAttnForCausalLM(copy.deepcopy(config)).state_dict())
        try:
            after = set(RecAttnForCausalLM(copy.deepcopy(changed)).state_dict())
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
    if before != after:
        raise _changed_parameters(what, sorted(before - after), sorted(after - before))


def with_hybrid_options(model: RecAttnForCausalLM, options: dict[str, Any],
                        layers: Collection[int] | None = None) -> RecAttnForCausalLM:
    """``model`` as a model (in eval mode) whose hybrid layers (those among ``layers`` when given) take ``options``
    (``{"cache_slots": 64}``), holding the same weight tensors (``with_config``). ValueError as
    ``config_with_hybrid_options`` says, or when the change adds or drops parameters (named), since the trained
    weights would then not be the whole model."""
    return with_config(model, config_with_hybrid_options(model.config, options, layers), f"hybrid options {options}")
