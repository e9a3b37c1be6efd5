"""Make ``transformers serve`` find a RecAttn checkpoint's model class, installed or shipped as remote code.

transformers 5.24's server builds a text model as ``getattr(transformers, config.architectures[0])
.from_pretrained(...)``, which finds transformers' own classes only: "module transformers has no attribute
RecAttnForCausalLM". ``expose_architecture`` names a loader there that hands the call to
``AutoModelForCausalLM``, which picks the class the same way any other load does: the installed hf_recattn's
(registered), or the checkpoint's own runtime files with ``trust_remote_code``. configuration.py calls it, so
that it happens whenever transformers reads a RecAttn config, before the server looks the class up.

transformers has more than one module object named ``transformers``: importing ``transformers.processing_utils``
re-executes its ``__init__`` and replaces ``sys.modules["transformers"]``, while modules imported before keep the
old object. So the loader goes on the current one and on the one the server's model manager holds.
"""

from __future__ import annotations

import sys
from typing import Any

import transformers


class _AutoCausalLMLoader:
    """Stands under the architecture's name on the transformers module; builds models with AutoModelForCausalLM."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        return transformers.AutoModelForCausalLM.from_pretrained(*args, **kwargs)

    @classmethod
    def from_config(cls, *args: Any, **kwargs: Any) -> Any:
        return transformers.AutoModelForCausalLM.from_config(*args, **kwargs)


def expose_architecture(name: str) -> None:
    """Name a loader for ``name`` on the transformers module objects (above) where nothing answers to it yet."""
    manager = sys.modules.get("transformers.cli.serving.model_manager")
    targets = {id(m): m for m in (sys.modules.get("transformers"), getattr(manager, "transformers", None)) if m}
    loader = type(name, (_AutoCausalLMLoader,), {"__doc__": _AutoCausalLMLoader.__doc__})
    for module in targets.values():
        if not hasattr(module, name):
            setattr(module, name, loader)


CONTINUOUS_BATCHING_REFUSED = (
    "continuous batching is not supported by hf_recattn models: transformers' paged cache stores keys and values in "
    "blocks for its own attention kernels, and cannot hold a recurrent mixer's per-sequence state or the model's "
    "RecAttnCache; generate() (without cache_implementation='paged') serves one request after another"
)


class RefuseContinuousBatching:
    """Mixed in before GenerationMixin: continuous batching's entry points refuse with the reason. The
    ``init_continuous_batching`` attribute is absent (``hasattr`` is False), which is how ``transformers serve
    --continuous-batching`` learns that a model cannot, and it then generates request by request."""

    @property
    def init_continuous_batching(self) -> Any:
        raise AttributeError(CONTINUOUS_BATCHING_REFUSED)

    def continuous_batching_context_manager(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(CONTINUOUS_BATCHING_REFUSED)

    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(CONTINUOUS_BATCHING_REFUSED)
