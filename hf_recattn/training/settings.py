"""The YAML of ``hf-recattn pretrain`` / ``finetune``: reading, checking every key, building the objects.

Every unknown key is refused before anything is loaded, naming the file and the key and suggesting close
matches (``pretrain.yaml: training.learnig_rate: not a TrainingArguments field (did you mean
learning_rate?)``). The ``training`` section is passed to ``TrainingArguments`` as is, after a few defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: model sizes for ``model: NAME`` (or ``model: {preset: NAME, ...}``); vocabulary and special ids come
#: from the tokenizer
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True),
    "base": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True),
}
#: config arguments RecAttnConfig accepts that are not fields (LlamaConfig converts them)
_CONFIG_EXTRAS = {"rope_theta", "rope_scaling"}
_DATA_KEYS = {
    "source", "eval_source", "text_column", "messages_column", "eval_fraction", "eval_documents",
    "streaming", "num_proc", "max_documents", "split", "config_name", "cache_dir",
}
PRETRAIN_KEYS = {"model", "tokenizer", "data", "block_size", "training"}
FINETUNE_KEYS = {"model", "data", "block_size", "method", "lora", "training"}
_LORA_KEYS = {"r", "alpha", "dropout", "target_modules", "train_mixers"}
METHODS = ("lora", "full", "mixers")
#: TrainingArguments values we change from transformers' defaults (the YAML wins)
TRAINING_DEFAULTS: dict[str, Any] = {
    "logging_steps": 10,
    "save_strategy": "steps",
    "save_steps": 100,
    "save_total_limit": 2,
    "report_to": "none",
    "dataloader_num_workers": 0,
}


def _device_defaults() -> dict[str, Any]:
    """Without CUDA, train on the CPU explicitly: accelerate then runs several processes as MULTI_CPU (gloo)."""
    import torch

    cuda = torch.cuda.is_available()
    return {"use_cpu": not cuda, "dataloader_pin_memory": cuda}


def _suggest(key: str, known: set[str] | list[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def check_keys(values: dict[str, Any], known: set[str], where: str, what: str) -> None:
    """Raise ValueError naming the first key of ``values`` not in ``known``, with close matches."""
    for key in values:
        if key not in known:
            raise ValueError(f"{where}: {key}: not {what}{_suggest(str(key), known)}")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return dict(value)


# ----- data ---------------------------------------------------------------------------------------------
@dataclass
class DataSettings:
    """Where the documents come from and how they are split (the ``data`` section)."""

    source: Any = "embedded"
    eval_source: Any = None
    text_column: str = "text"
    messages_column: str = "messages"
    eval_fraction: float = 0.01
    eval_documents: int | None = None
    streaming: bool = False
    num_proc: int | None = None
    max_documents: int | None = None
    split: str = "train"
    config_name: str | None = None
    cache_dir: str | None = None

    @classmethod
    def parse(cls, value: Any, where: str, base: Path | None) -> DataSettings:
        """From ``data: SOURCE`` or ``data: {source: ..., ...}``; relative paths are taken from ``base``."""
        if isinstance(value, (str, list)):
            value = {"source": value}
        values = _mapping(value, f"{where}: data")
        check_keys(values, _DATA_KEYS, f"{where}: data", "a data option")
        settings = cls(**values)
        settings.source = _relative(settings.source, base)
        settings.eval_source = _relative(settings.eval_source, base)
        settings.check(where)
        return settings

    def check(self, where: str) -> None:
        if not 0.0 <= float(self.eval_fraction) < 1.0:
            raise ValueError(f"{where}: data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for key in ("eval_documents", "num_proc", "max_documents"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: data.{key} must be a positive integer, got {value!r}")
        if self.streaming and self.num_proc:
            raise ValueError(f"{where}: data.num_proc: streaming data is tokenized on the fly, one process")


def _relative(source: Any, base: Path | None) -> Any:
    """Resolve relative local paths against the YAML's folder when they exist there."""
    if base is None or source is None:
        return source
    if isinstance(source, list):
        return [_relative(s, base) for s in source]
    text = str(source)
    if Path(text).expanduser().is_absolute() or Path(text).exists() or not (base / text).exists():
        return text
    return str(base / text)


# ----- training arguments -------------------------------------------------------------------------------
def training_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def build_training_arguments(values: dict[str, Any], where: str, has_eval: bool, **forced: Any) -> Any:
    """TrainingArguments from the ``training`` section over ``TRAINING_DEFAULTS``; ``forced`` wins over both.

    With evaluation data and no ``eval_strategy`` given, evaluation runs every ``eval_steps`` (default: the
    ``save_steps``)."""
    from transformers import TrainingArguments

    check_keys(values, training_fields(), f"{where}: training", "a TrainingArguments field")
    merged = {**TRAINING_DEFAULTS, **_device_defaults(), **values, **{k: v for k, v in forced.items() if v is not None}}
    if not merged.get("output_dir"):
        raise ValueError(f"{where}: training.output_dir: missing (or pass --output)")
    if has_eval and "eval_strategy" not in values:
        merged["eval_strategy"] = "steps"
        merged.setdefault("eval_steps", merged["save_steps"])
    if not has_eval and values.get("eval_strategy", "no") != "no":
        raise ValueError(f"{where}: training.eval_strategy: no evaluation data (set data.eval_fraction, "
                         "data.eval_documents or data.eval_source)")
    try:
        return TrainingArguments(**merged)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: training: {err}") from err


# ----- model --------------------------------------------------------------------------------------------
def config_fields() -> set[str]:
    from ..modeling.configuration import RecAttnConfig

    return {f.name for f in dataclasses.fields(RecAttnConfig)} | _CONFIG_EXTRAS


def model_values(value: Any, where: str) -> dict[str, Any]:
    """RecAttnConfig keyword arguments from ``model: PRESET`` or ``model: {preset: ..., FIELD: ...}``."""
    if isinstance(value, str):
        value = {"preset": value}
    values = _mapping(value, f"{where}: model")
    preset = values.pop("preset", None)
    if not preset and "hidden_size" not in values:
        preset = "tiny"
    if preset is not None and preset not in MODEL_PRESETS:
        raise ValueError(f"{where}: model.preset: unknown preset {preset!r}{_suggest(str(preset), MODEL_PRESETS)}"
                         f"; presets: {sorted(MODEL_PRESETS)}")
    check_keys(values, config_fields(), f"{where}: model", "a RecAttnConfig field")
    return {**copy.deepcopy(MODEL_PRESETS.get(preset, {})), **values}


# ----- the files ----------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    """A parsed pretrain or finetune YAML: ``values`` are the raw sections, ``where`` names the file."""

    values: dict[str, Any]
    where: str
    base: Path | None = None
    data: DataSettings = field(default_factory=DataSettings)


def read_config(config_or_path: str | Path | dict[str, Any] | None, known: set[str]) -> RunConfig:
    """Read a YAML file (or take a dict) and refuse unknown top-level keys."""
    if config_or_path is None:
        values: Any = {}
        where, base = "<config>", None
    elif isinstance(config_or_path, dict):
        values, where, base = copy.deepcopy(config_or_path), "<config>", None
    else:
        path = Path(config_or_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"config {config_or_path}: no such file")
        try:
            values = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({err})") from err
        where, base = str(path), path.parent
    values = _mapping(values, where)
    check_keys(values, known, where, "a known section")
    return RunConfig(values, where, base, DataSettings.parse(values.get("data"), where, base))


@dataclass
class LoraSettings:
    """``lora`` section of a finetune YAML (peft's LoraConfig names)."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    train_mixers: bool = False

    @classmethod
    def parse(cls, value: Any, where: str) -> LoraSettings:
        values = _mapping(value, f"{where}: lora")
        check_keys(values, _LORA_KEYS, f"{where}: lora", "a LoRA option")
        return cls(**values)


def block_size(value: Any, where: str, limit: int | None, default: int) -> int:
    """The ``block_size``: a positive integer at most the model's ``max_position_embeddings``."""
    size = default if value is None else value
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ValueError(f"{where}: block_size must be an integer >= 2, got {size!r}")
    if limit is not None and size > limit:
        raise ValueError(f"{where}: block_size {size} is above the model's max_position_embeddings {limit}")
    return size
