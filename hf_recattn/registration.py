"""Register hf_recattn with the transformers Auto classes and the trust_remote_code auto_map."""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling import modeling as _modeling
from .modeling.configuration import RecAttnConfig
from .modeling.modeling import RecAttnForCausalLM, RecAttnModel, runtime_auto_map

#: what config.json's auto_map holds after save_pretrained (RecAttnPreTrainedModel.save_pretrained writes it)
AUTO_MAP = runtime_auto_map()


def register_auto_classes() -> None:
    """Idempotent: adds model_type "recattn" without touching any built-in type."""
    AutoConfig.register(RecAttnConfig.model_type, RecAttnConfig, exist_ok=True)
    AutoModel.register(RecAttnConfig, RecAttnModel, exist_ok=True)
    AutoModelForCausalLM.register(RecAttnConfig, RecAttnForCausalLM, exist_ok=True)
    # save_pretrained copies the runtime files next to the weights and writes this auto_map, so that a
    # checkpoint also loads with trust_remote_code=True where hf_recattn is not installed
    RecAttnConfig.register_for_auto_class("AutoConfig")
    RecAttnModel.register_for_auto_class("AutoModel")
    RecAttnForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    # model.push_to_hub writes the project's model card instead of transformers' generic one
    _modeling.MODEL_CARD_WRITER = _write_card


def _write_card(folder: str, repo_id: str, tags: list[str] | None) -> None:
    from .hub import write_card_for_push

    write_card_for_push(folder, repo_id, tags)
