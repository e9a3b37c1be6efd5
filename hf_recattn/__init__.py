"""hf_recattn: recurrent forms of attention as Hugging Face Transformers models."""

from .modeling.cache import RecAttnCache, cache_of
from .modeling.configuration import RecAttnConfig
from .modeling.mixer_base import Mixer, MixerInputs, MixerShape
from .modeling.mixers import MIXERS, register_mixer
from .modeling.modeling import RecAttnForCausalLM, RecAttnModel, RecAttnPreTrainedModel
from .registration import register_auto_classes

register_auto_classes()

from .conversion.from_teacher import from_teacher  # noqa: E402

#: the earlier name of ``from_teacher`` (it converts every teacher family, not only Llama); kept for existing code
from_llama = from_teacher
from .state_size import state_size_report  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "MIXERS",
    "Mixer",
    "MixerInputs",
    "MixerShape",
    "RecAttnCache",
    "RecAttnConfig",
    "RecAttnForCausalLM",
    "RecAttnModel",
    "RecAttnPreTrainedModel",
    "cache_of",
    "from_llama",
    "from_teacher",
    "register_mixer",
    "state_size_report",
]
