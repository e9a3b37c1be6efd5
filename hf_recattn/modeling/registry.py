"""The stores of mixer families and presets, and the functions that read them.

A spec names a family (``"linear"``: the family with its defaults) or a preset (``"gdn"``); a dict whose
``mixer`` is a preset, ``{"mixer": "gdn", "conv_size": 0}``, is that preset with the given options overridden.
Family names and preset names share one namespace: registering either refuses a name the other holds.

This module knows no family: ``mixers.py`` registers the built-in families and the built-in presets (the data of
``presets.py``), so a mixer module may import it (a composite validates and builds its parts through it) without
a circle.
"""

from __future__ import annotations

import copy
from typing import Any

from .mixer_base import Mixer, MixerShape

#: family name -> class (``register_mixer`` adds to it)
MIXERS: dict[str, type[Mixer]] = {}
#: preset name -> spec (its ``mixer`` is always a family; ``register_preset`` adds to it)
PRESETS: dict[str, dict[str, Any]] = {}
#: preset name -> one line on where its defaults come from
PRESET_DOCS: dict[str, str] = {}


def register_mixer(cls: type[Mixer]) -> type[Mixer]:
    """Add a mixer family (usable as a class decorator). Names must be unique and not a preset's."""
    if cls.name in PRESETS:
        raise ValueError(f"a preset named {cls.name!r} exists; a mixer family cannot take its name")
    if cls.name in MIXERS and MIXERS[cls.name] is not cls:
        raise ValueError(f"a mixer named {cls.name!r} is already registered ({MIXERS[cls.name].__name__})")
    MIXERS[cls.name] = cls
    return cls


def mixer_class(name: Any, where: str) -> type[Mixer]:
    """The family registered under ``name``; an error naming ``where`` and the known names otherwise."""
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(
            f"{where}: unknown mixer {name!r}; known mixers: {sorted(MIXERS)}; presets: {sorted(PRESETS)}"
        )
    return MIXERS[name]


def expand_preset(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with a preset name in ``mixer`` replaced by the preset's options (``spec``'s own win)."""
    name = spec.get("mixer")
    if not isinstance(name, str) or name not in PRESETS:
        return spec
    return {**copy.deepcopy(PRESETS[name]), **{k: v for k, v in spec.items() if k != "mixer"}}


def validate_spec(spec: Any, where: str) -> dict[str, Any]:
    """Check one spec (a dict, a family name or a preset name) and return it with every default filled in.

    A preset in ``mixer`` is expanded first (the dict's other options override the preset's).
    """
    if isinstance(spec, str):
        spec = {"mixer": spec}
    if not isinstance(spec, dict) or "mixer" not in spec:
        raise ValueError(f"{where}: a spec must be a dict with a 'mixer' key, got {spec!r}")
    spec = expand_preset(spec)
    return mixer_class(spec["mixer"], where).validate(spec, where)


def position_need(spec: dict[str, Any], where: str) -> str | None:
    """Why a layer with this validated spec needs positions (``Mixer.position_need``), asking each part of a
    composite too (an option whose value is a spec, run on the layer's own rotated q and k: a hybrid's ``far``,
    ``retrieval_heads``' ``others``), or None when it runs at any length."""
    family = mixer_class(spec["mixer"], where)
    need = family.position_need(spec)
    if need is not None:
        return need
    rope = spec.get("rope", True)
    for name, part in spec.items():
        if isinstance(part, dict) and "mixer" in part:
            need = position_need({**part, "rope": rope}, f"{where}: option {name!r}")
            if need is not None:
                return f"its {name} part ({part['mixer']}): {need}"
    return None


def build_mixer(spec: dict[str, Any], shape: MixerShape, config: Any = None) -> Mixer:
    """The mixer of a validated ``spec`` for one layer of ``shape``."""
    return mixer_class(spec["mixer"], f"layer {shape.layer_idx}")(spec, shape, config)


def register_preset(name: str, spec: dict[str, Any] | str, doc: str = "") -> dict[str, Any]:
    """Add a preset; its spec is validated now (it may build on another preset). Returns the stored spec.

    Refuses a name that is a mixer family or another preset with a different spec.
    """
    where = f"preset {name!r}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a preset name must be a non-empty string")
    if name in MIXERS:
        raise ValueError(f"{where}: the name is a mixer family ({MIXERS[name].__name__}); pick another name")
    stored = expand_preset({"mixer": spec} if isinstance(spec, str) else dict(spec))
    if not isinstance(stored.get("mixer"), str):
        raise ValueError(f"{where}: a spec must be a dict with a 'mixer' key, got {spec!r}")
    validate_spec(stored, where)
    if name in PRESETS and PRESETS[name] != stored:
        raise ValueError(f"{where}: a different preset of this name is already registered")
    PRESETS[name] = stored
    PRESET_DOCS[name] = doc or PRESET_DOCS.get(name, "")
    return copy.deepcopy(stored)
