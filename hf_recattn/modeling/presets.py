"""Named presets: a spec written once under a name, usable wherever a spec is accepted.

A string spec names a mixer family (``"linear"``: the family with its defaults) or a preset (``"gdn"``). A dict
whose ``mixer`` is a preset, ``{"mixer": "gdn", "conv_size": 0}``, is that preset with the given options
overridden. Family names and preset names share one namespace: registering either refuses a name the other
holds. Every preset names a family and states each architectural option explicitly, so that a later change of a
family's defaults does not change what a preset means; the validated spec names the family, never the preset.
"""

from __future__ import annotations

import copy
from typing import Any

_GDN: dict[str, Any] = {
    "mixer": "delta",
    "rule": "gated",
    "householder_steps": 1,
    "conv_size": 4,
    "activation": "silu",
    "qk_norm": "l2",
    "negative_eigenvalues": False,
    "output_norm": True,
    "output_gate": True,
    "rope": False,
    "init": "scratch",
}

#: preset name -> spec (its ``mixer`` is always a family)
PRESETS: dict[str, dict[str, Any]] = {
    "deltanet": {**_GDN, "rule": "delta", "output_gate": False},
    "gdn": dict(_GDN),
    "comba": {**_GDN, "rule": "comba"},
    "deltaproduct": {**_GDN, "householder_steps": 2, "negative_eigenvalues": True},
}

#: preset name -> one line on where its defaults come from
PRESET_DOCS: dict[str, str] = {
    "deltanet": "DeltaNet (Yang et al. 2024), as fla's DeltaNet layer defaults: short convolution of 4 taps, "
    "SiLU on q/k/v, L2-normalized q and k, output RMSNorm, no output gate, no RoPE.",
    "gdn": "Gated DeltaNet (Yang et al. 2025): DeltaNet's convolution, SiLU and L2 norm plus Mamba-2's decay "
    "(A ~ U(0, 16), dt log-uniform in [1e-3, 0.1]) and a SiLU output gate after the RMSNorm, no RoPE.",
    "comba": "Comba (Hu et al. 2025): rule comba (see mixer_delta.py), otherwise Gated DeltaNet's convolution, "
    "norms, gates and initialization, no RoPE.",
    "deltaproduct": "Gated DeltaProduct (Siems et al. 2025): 2 Householder steps per token with b in (0, 2) "
    "(eigenvalues in [-1, 1]), otherwise Gated DeltaNet.",
}


def expand_preset(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with a preset name in ``mixer`` replaced by the preset's options (``spec``'s own win)."""
    name = spec.get("mixer")
    if not isinstance(name, str) or name not in PRESETS:
        return spec
    return {**copy.deepcopy(PRESETS[name]), **{k: v for k, v in spec.items() if k != "mixer"}}


def register_preset(name: str, spec: dict[str, Any] | str, doc: str = "") -> dict[str, Any]:
    """Add a preset; its spec is validated now (it may build on another preset). Returns the stored spec.

    Refuses a name that is a mixer family or another preset with a different spec.
    """
    from .mixers import MIXERS, validate_spec  # the registry imports this module

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
