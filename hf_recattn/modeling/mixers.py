"""The built-in mixer families and presets, registered in ``registry.py``.

``MIXERS``, ``validate_spec``, ``build_mixer``, ``mixer_class`` and ``register_mixer`` stay importable from here
(saved checkpoints' runtime files and user code import them from this module).
"""

from __future__ import annotations

from .mixer_base import Mixer
from .mixer_delta import DeltaMixer
from .mixer_gated_linear import GatedLinearMixer
from .mixer_generalized_delta import GeneralizedDeltaMixer
from .mixer_heinsen import HeinsenMixer
from .mixer_hybrid import HybridMixer
from .mixer_kda import KdaMixer
from .mixer_linear import LinearMixer
from .mixer_mesa import MesaMixer
from .mixer_retrieval_heads import RetrievalHeadsMixer
from .mixer_softmax import SlidingWindowMixer, SoftmaxMixer
from .mixer_softmax_delta import SoftmaxDeltaMixer
from .mixer_softmax_householder import SoftmaxHouseholderMixer
from .mixer_taylor import TaylorMixer
from .presets import BUILTIN_PRESET_DOCS, BUILTIN_PRESETS
from .registry import MIXERS, PRESETS, build_mixer, mixer_class, register_mixer, register_preset, validate_spec

__all__ = ["MIXERS", "PRESETS", "build_mixer", "mixer_class", "register_mixer", "validate_spec"]

#: every built-in family, in the order ``hf-recattn mixers`` lists them
BUILTIN_MIXERS: tuple[type[Mixer], ...] = (
    SoftmaxMixer,
    SlidingWindowMixer,
    LinearMixer,
    TaylorMixer,
    HeinsenMixer,
    HybridMixer,  # softmax over a window + a far part (a family that declares far_part.py's protocol)
    DeltaMixer,
    SoftmaxDeltaMixer,  # DeltaFormer (preset "deltaformer")
    SoftmaxHouseholderMixer,  # PaTH (preset "path")
    GatedLinearMixer,  # gated linear attention, a gate per key dimension (preset "gla")
    MesaMixer,  # MesaNet (preset "mesanet")
    GeneralizedDeltaMixer,  # RWKV-7's generalized delta rule (preset "rwkv7")
    KdaMixer,  # Kimi Delta Attention, a gated delta rule with a decay per key channel (preset "kimi_linear")
    RetrievalHeadsMixer,  # exact softmax on a few KV heads, another mixer on the rest
)

for _family in BUILTIN_MIXERS:
    register_mixer(_family)
for _name, _spec in BUILTIN_PRESETS.items():
    register_preset(_name, _spec, BUILTIN_PRESET_DOCS[_name])
