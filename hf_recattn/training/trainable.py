"""What a finetune trains: LoRA adapters through peft (merged at the end), every weight, or the mixers alone; and
the LoRA adapters' settings."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .checks import positive

#: what a finetune trains: LoRA adapters merged at the end, every weight, or only the mixers' own parameters
METHODS = ("lora", "full", "mixers")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_LORA_TARGETS = ATTENTION_PROJECTIONS


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft's LoraConfig), merged into the weights at the end. ``targets``: module-name suffixes
    (a finetune YAML's ``target_modules``; there a string is peft's regular expression)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def check(self, source: str, section: str) -> None:
        at = f"{source}: {section}"
        if not self.targets:
            raise ValueError(f"{at}.targets must name at least one module")
        positive(self.r, f"{at}.r")
        positive(self.alpha, f"{at}.alpha")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{at}.dropout must be in [0, 1)")


def is_mixer_parameter(name: str) -> bool:
    """A mixer's own parameter (a feature map, a gate), not a LoRA factor: its name passes through ``mixer``."""
    return ".mixer." in f".{name}." and "lora_" not in name


def wrap_lora(model: nn.Module, lora: LoraSettings, train_mixers: bool = False, where: str = "lora") -> nn.Module:
    """``model`` frozen and wrapped with LoRA adapters on ``lora.targets`` (``train_mixers``: the mixers train
    too, as peft's ``modules_to_save``)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("LoRA needs peft: pip install 'hf-recattn[train]'") from err
    targets = lora.targets if isinstance(lora.targets, str) else list(lora.targets)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        bias="none", modules_to_save=["mixer"] if train_mixers else None)
    model.requires_grad_(False)
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def set_trainable(model: nn.Module, method: str, lora: LoraSettings, train_mixers: bool = False,
                  where: str = "finetune") -> nn.Module:
    """Freeze / wrap ``model`` for ``method`` (lora, full or mixers); returns the model Trainer trains (a
    PeftModel for LoRA). ``where`` names the setting in errors."""
    if method == "full":
        return model.requires_grad_(True)
    if method == "mixers":
        names = []
        for name, param in model.named_parameters():
            param.requires_grad_(is_mixer_parameter(name))
            names += [name] if param.requires_grad else []
        if not names:
            raise ValueError(f"{where}: method: mixers: this model's mixers have no parameters of their own "
                             "(softmax layers only); use lora or full")
        return model
    return wrap_lora(model, lora, train_mixers, f"{where}: lora.target_modules")


def merge_lora(peft_model: nn.Module) -> nn.Module:
    """Fold the adapters into the weights and return the plain model, frozen and in eval mode."""
    return peft_model.merge_and_unload().eval().requires_grad_(False)


def finished_model(trained: nn.Module, method: str) -> nn.Module:
    """The plain model after training: adapters merged (LoRA), frozen and in eval mode."""
    if method == "lora":
        return merge_lora(trained)
    return trained.eval().requires_grad_(False)
