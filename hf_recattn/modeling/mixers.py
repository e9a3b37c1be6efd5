"""The registry of mixer families by spec name."""

from __future__ import annotations

from typing import Any

from .mixer_base import Mixer, MixerShape
from .mixer_delta import DeltaMixer
from .mixer_deltaformer import DeltaFormerMixer
from .mixer_gla import GLAMixer
from .mixer_heinsen import HeinsenMixer
from .mixer_hybrid import HybridMixer
from .mixer_linear import LinearMixer
from .mixer_mesanet import MesaMixer
from .mixer_path import PathMixer
from .mixer_retrieval import RetrievalHeadsMixer
from .mixer_softmax import SlidingWindowMixer, SoftmaxMixer
from .mixer_taylor import TaylorMixer
from .presets import PRESETS, expand_preset

MIXERS: dict[str, type[Mixer]] = {
    cls.name: cls
    for cls in (
        SoftmaxMixer, SlidingWindowMixer, LinearMixer, TaylorMixer, HeinsenMixer, HybridMixer, DeltaMixer
    )
}
MIXERS.update({cls.name: cls for cls in (DeltaFormerMixer, PathMixer)})  # seed 002's feedback families
MIXERS[GLAMixer.name] = GLAMixer  # gated linear attention (a gate per key dimension)
MIXERS[MesaMixer.name] = MesaMixer  # MesaNet (preset "mesanet")
MIXERS[RetrievalHeadsMixer.name] = RetrievalHeadsMixer  # exact softmax on a few KV heads, another mixer on the rest


def register_mixer(cls: type[Mixer]) -> type[Mixer]:
    """Add a mixer family (usable as a class decorator). Names must be unique and not a preset's."""
    if cls.name in PRESETS:
        raise ValueError(f"a preset named {cls.name!r} exists; a mixer family cannot take its name")
    if cls.name in MIXERS and MIXERS[cls.name] is not cls:
        raise ValueError(f"a mixer named {cls.name!r} is already registered ({MIXERS[cls.name].__name__})")
    MIXERS[cls.name] = cls
    return cls


def mixer_class(name: Any, where: str) -> type[Mixer]:
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(
            f"{where}: unknown mixer {name!r}; known mixers: {sorted(MIXERS)}; presets: {sorted(PRESETS)}"
        )
    return MIXERS[name]


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


def build_mixer(spec: dict[str, Any], shape: MixerShape, config: Any = None) -> Mixer:
    return mixer_class(spec["mixer"], f"layer {shape.layer_idx}")(spec, shape, config)
