"""The YAML of ``hf-recattn pretrain`` / ``finetune``: read, its sections checked, its ``data`` and ``lora``
sections parsed, its ``training`` section turned into TrainingArguments.

Every unknown key is refused before anything is loaded, naming the file and the key and suggesting close
matches. The ``training`` section is passed to ``TrainingArguments`` as is, after a few defaults
(``arguments.py``); the ``model`` section of a pretrain YAML is read by ``model_presets.py``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from .arguments import build_training_arguments
from .checks import as_mapping, build_settings, check_keys
from .fused_loss import check_loss_kernel
from .sharding import check_arguments
from .trainable import LoraSettings

PRETRAIN_KEYS = {"model", "tokenizer", "data", "block_size", "loss_chunk_size", "loss_kernel", "training"}
FINETUNE_KEYS = {"model", "data", "block_size", "loss_chunk_size", "loss_kernel", "method", "lora", "training"}
_DATA_KEYS = {
    "source", "eval_source", "text_column", "messages_column", "eval_fraction", "eval_documents",
    "streaming", "num_proc", "max_documents", "split", "config_name", "cache_dir",
}
_LORA_KEYS = {"r", "alpha", "dropout", "target_modules", "train_mixers"}


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
        values = as_mapping(value, f"{where}: data")
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


# ----- the file -----------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    """A parsed pretrain or finetune YAML: ``values`` are the raw sections, ``where`` names the file."""

    values: dict[str, Any]
    where: str
    base: Path | None = None
    data: DataSettings = field(default_factory=DataSettings)


def read_training_yaml(config_or_path: str | Path | dict[str, Any] | None, known: set[str]) -> RunConfig:
    """Read a pretrain / finetune YAML file (or take a dict) and refuse unknown top-level keys."""
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
    values = as_mapping(values, where)
    check_keys(values, known, where, "a known section")
    return RunConfig(values, where, base, DataSettings.parse(values.get("data"), where, base))


def length_limit(config: Any) -> tuple[int | None, str | None]:
    """The longest sequence a model of ``config`` supports and why: an hf_recattn config's ``length_limit()`` and
    ``position_need()`` (None, None for a student that needs no positions), any other's
    ``max_position_embeddings``."""
    if callable(getattr(config, "length_limit", None)):
        return config.length_limit(), config.position_need()
    return getattr(config, "max_position_embeddings", None), None


def tokenizer_max_length(limit: int | None) -> int:
    """The ``model_max_length`` a model's tokenizer is saved with: its length limit, or transformers' "unbounded"
    (``VERY_LARGE_INTEGER``) for a model that needs no positions."""
    return VERY_LARGE_INTEGER if limit is None else limit


def block_size(value: Any, where: str, config: Any, default: int) -> int:
    """The ``block_size`` (``default`` when unset, cut to the model's length limit): an integer >= 2, at most the
    model's ``max_position_embeddings`` where the model needs positions (``length_limit``)."""
    limit, need = length_limit(config)
    size = (default if limit is None else min(default, limit)) if value is None else value
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ValueError(f"{where}: block_size must be an integer >= 2, got {size!r}")
    if limit is not None and size > limit:
        why = f" ({need})" if need else ""
        raise ValueError(f"{where}: block_size {size} is above the model's max_position_embeddings {limit}{why}")
    return size


def loss_chunk_size(value: Any, where: str) -> int | None:
    """The ``loss_chunk_size``: tokens per chunk of the loss taken from the final hidden states (``runner.py``), a
    positive integer; None (unset): the model's own loss over the whole logits."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{where}: loss_chunk_size must be a positive integer (tokens per chunk), got {value!r}")
    return value


def loss_kernel(value: Any, where: str) -> str:
    """The ``loss_kernel`` (``fused_loss.py``): ``auto`` (unset), ``torch`` or ``liger``, refused where it cannot
    run at all (liger-kernel not installed, no CUDA device)."""
    choice = "auto" if value is None else value
    check_loss_kernel(choice, f"{where}: loss_kernel")
    return choice


def lora_section(value: Any, where: str) -> tuple[LoraSettings, bool]:
    """A finetune YAML's ``lora`` section: the adapters' settings and its ``train_mixers``."""
    values = as_mapping(value, f"{where}: lora")
    check_keys(values, _LORA_KEYS, f"{where}: lora", "a LoRA option")
    train_mixers = bool(values.pop("train_mixers", False))
    targets = values.pop("target_modules", None)
    if targets is not None and not isinstance(targets, str):
        values["targets"] = targets
    settings = build_settings(LoraSettings, values, f"{where}: lora")
    if isinstance(targets, str):  # a regular expression: passed to peft as it is
        settings = dataclasses.replace(settings, targets=targets)
    settings.check(where, "lora")
    return settings, train_mixers


def run_arguments(run: RunConfig, where: str, output_dir: str | None, **defaults: Any) -> Any:
    """TrainingArguments for a pretrain / finetune YAML: its ``training`` section over ``defaults``, with
    evaluation when the data has a held-out part; streaming data needs ``training.max_steps``; FSDP
    (``training.fsdp`` or accelerate's FSDP config) needs several processes (``sharding.check_arguments``)."""
    training = {**defaults, **(run.values.get("training") or {})}
    streaming = run.data.streaming
    if streaming and int(training.get("max_steps", -1)) <= 0:
        raise ValueError(f"{where}: training.max_steps: streaming data has no length; set max_steps")
    has_eval = run.data.eval_source is not None or run.data.eval_documents is not None or (
        run.data.eval_fraction > 0 and not streaming)
    args = build_training_arguments(training, where, has_eval, output_dir=output_dir)
    check_arguments(args, f"{where}: training.fsdp")
    return args
