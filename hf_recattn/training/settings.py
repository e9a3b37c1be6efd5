"""The settings of every Trainer run: the YAML of ``hf-recattn pretrain`` / ``finetune`` and the distillation
finetune of conversion (``Stage2Settings``), read, checked and built in one place.

Every unknown key is refused before anything is loaded, naming the file and the key and suggesting close
matches (``pretrain.yaml: training.learnig_rate: not a TrainingArguments field (did you mean
learning_rate?)``). The ``training`` section is passed to ``TrainingArguments`` as is, after a few defaults.
Each settings class checks its own values (``check(source, section)``), the messages naming ``section.key``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
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
#: what a finetune trains: LoRA adapters merged at the end, every weight, or only the mixers' own parameters
METHODS = ("lora", "full", "mixers")
#: the methods of conversion's stage 2 (its stage 1 is what trains the mixers alone)
STAGE2_METHODS = tuple(m for m in METHODS if m != "mixers")
LOSSES = ("ce", "kl", "ce+kl")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_LORA_TARGETS = ATTENTION_PROJECTIONS
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


def read_training_yaml(config_or_path: str | Path | dict[str, Any] | None, known: set[str]) -> RunConfig:
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


def block_size(value: Any, where: str, limit: int | None, default: int) -> int:
    """The ``block_size``: a positive integer at most the model's ``max_position_embeddings``."""
    size = default if value is None else value
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ValueError(f"{where}: block_size must be an integer >= 2, got {size!r}")
    if limit is not None and size > limit:
        raise ValueError(f"{where}: block_size {size} is above the model's max_position_embeddings {limit}")
    return size


def run_arguments(run: RunConfig, where: str, output_dir: str | None, **defaults: Any) -> Any:
    """TrainingArguments for a pretrain / finetune YAML: its ``training`` section over ``defaults``, with
    evaluation when the data has a held-out part; streaming data needs ``training.max_steps``."""
    training = {**defaults, **(run.values.get("training") or {})}
    streaming = run.data.streaming
    if streaming and int(training.get("max_steps", -1)) <= 0:
        raise ValueError(f"{where}: training.max_steps: streaming data has no length; set max_steps")
    has_eval = run.data.eval_source is not None or run.data.eval_documents is not None or (
        run.data.eval_fraction > 0 and not streaming)
    return build_training_arguments(training, where, has_eval, output_dir=output_dir)


# ----- typed settings classes ---------------------------------------------------------------------------
def positive(value: float, where: str, allow_zero: bool = False) -> None:
    """Raise ValueError naming ``where`` unless ``value`` > 0 (or >= 0 with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def typed(value: Any, kind: type, where: str) -> Any:
    """``value`` as ``kind`` (ints and YAML strings such as ``1e-4`` taken as floats), else ValueError."""
    if kind is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def build_settings(cls: type, values: Any, where: str) -> Any:
    """A settings dataclass from a mapping: unknown keys and wrong types raise, naming ``where.key``."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {names}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        hint = hints[name]
        key = f"{where}.{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_settings(hint, value, key)
        elif typing.get_origin(hint) is tuple:
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{key} must be a list of strings, got {value!r}")
            kwargs[name] = tuple(value)
        elif isinstance(hint, types.UnionType):
            kinds = [k for k in typing.get_args(hint) if k is not type(None)]
            if value is None or len(kinds) != 1:
                kwargs[name] = value
            else:  # an optional scalar: checked like the plain type
                kwargs[name] = typed(value, kinds[0], key)
        else:
            kwargs[name] = typed(value, hint, key)
    return cls(**kwargs)


def check_schedule(settings: Any, at: str) -> None:
    """The values every training stage has: tokens, lr, block and batch size, clipping, warm-up."""
    positive(settings.tokens, f"{at}.tokens", allow_zero=True)
    for key in ("lr", "block_size", "batch_size", "max_grad_norm"):
        positive(getattr(settings, key), f"{at}.{key}")
    if not 0 <= settings.warmup_fraction < 1:
        raise ValueError(f"{at}.warmup_fraction must be in [0, 1)")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft's LoraConfig), merged into the weights at the end. ``targets``: module-name suffixes
    (a finetune YAML's ``target_modules``; there a string is peft's regular expression)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    @classmethod
    def parse(cls, value: Any, where: str) -> tuple[LoraSettings, bool]:
        """From a finetune YAML's ``lora`` section: the settings and its ``train_mixers``."""
        values = _mapping(value, f"{where}: lora")
        check_keys(values, _LORA_KEYS, f"{where}: lora", "a LoRA option")
        train_mixers = bool(values.pop("train_mixers", False))
        targets = values.pop("target_modules", None)
        if targets is not None and not isinstance(targets, str):
            values["targets"] = targets
        settings = build_settings(cls, values, f"{where}: lora")
        if isinstance(targets, str):  # a regular expression: passed to peft as it is
            settings = dataclasses.replace(settings, targets=targets)
        settings.check(where, "lora")
        return settings, train_mixers

    def check(self, source: str, section: str) -> None:
        at = f"{source}: {section}"
        if not self.targets:
            raise ValueError(f"{at}.targets must name at least one module")
        positive(self.r, f"{at}.r")
        positive(self.alpha, f"{at}.alpha")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{at}.dropout must be in [0, 1)")


@dataclass(frozen=True)
class Stage2Settings:
    """A distillation finetune with transformers' Trainer (conversion's stage 2: LoRA adapters or every
    weight), cross-entropy and/or KL to the teacher."""

    tokens: int = 0  # training tokens in total; 0 skips the stage
    lr: float = 1e-4
    block_size: int = 512
    batch_size: int = 4  # blocks per optimizer micro-step in all (shared by the processes of a parallel run)
    grad_accum: int = 1
    loss: str = "ce"
    temperature: float = 1.0  # softmax temperature of the KL term
    kl_weight: float = 1.0  # weight of the KL term in "ce+kl"
    train_mixer: bool = False  # also train the mixer parameters (feature maps, gains) in stage 2
    #: with train_mixer, the mixer parameters' own optimizer group: its peak learning rate (None: lr) and
    #: Adam's eps (None: Trainer's adam_epsilon, 1e-8); no weight decay. A small eps makes Adam's step ~lr
    #: even for gradients far below 1e-8 (the FoX gates at their lossless start)
    mixer_lr: float | None = None
    mixer_eps: float | None = None
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_steps: int = 25
    lora: LoraSettings = field(default_factory=LoraSettings)
    #: ``lora`` (None: the adapters above, merged at the end) or ``full`` (every weight trains, the mixers'
    #: own parameters included; ``lora`` is then refused)
    method: str | None = None
    #: training tokens of the corpus order passed over before stage 2's blocks begin (a run that continues from
    #: ``init`` skips the tokens the first run trained on, so that it sees fresh text)
    skip_tokens: int | None = None
    # share of the stage-2 blocks that hide facts in training text and ask for them (``retrieval_data.py``)
    retrieval_share: float | None = None
    answer_weight: float | None = None  # loss weight of those blocks' answer tokens (default 1)

    @property
    def trains_mixer(self) -> bool:
        """Whether the mixers' own parameters train in stage 2 (asked for, or with every weight)."""
        return self.train_mixer or self.method == "full"

    def check(self, source: str, section: str = "stage2") -> None:
        """Raise ValueError naming ``source: section.key`` for the first value out of range."""
        at = f"{source}: {section}"
        check_schedule(self, at)
        self.lora.check(source, f"{section}.lora")
        for key in ("grad_accum", "save_steps", "temperature"):
            positive(getattr(self, key), f"{at}.{key}")
        for key in ("kl_weight", "weight_decay"):
            positive(getattr(self, key), f"{at}.{key}", allow_zero=True)
        for key in ("mixer_lr", "mixer_eps"):
            value = getattr(self, key)
            if value is None:
                continue
            if not self.trains_mixer:
                raise ValueError(f"{at}.{key} needs {section}.train_mixer: true or {section}.method: full "
                                 "(it sets the mixer's group)")
            if not math.isfinite(value):
                raise ValueError(f"{at}.{key} must be finite, got {value!r}")
            positive(value, f"{at}.{key}")
        if self.method is not None and self.method not in STAGE2_METHODS:
            raise ValueError(f"{at}.method must be one of {list(STAGE2_METHODS)}, got {self.method!r}")
        if self.skip_tokens is not None:
            positive(self.skip_tokens, f"{at}.skip_tokens", allow_zero=True)
            if self.skip_tokens % self.block_size:
                raise ValueError(f"{at}.skip_tokens ({self.skip_tokens}) must be a multiple of {section}.block_size "
                                 f"({self.block_size}): whole blocks are skipped")
        self._check_retrieval(at, section)
        if self.loss not in LOSSES:
            raise ValueError(f"{at}.loss must be one of {list(LOSSES)}, got {self.loss!r}")
        per_step = self.block_size * self.batch_size * self.grad_accum
        if self.tokens and self.tokens < per_step:
            raise ValueError(
                f"{at}.tokens ({self.tokens}) is less than one optimizer step "
                f"(block_size * batch_size * grad_accum = {per_step})"
            )

    def _check_retrieval(self, at: str, section: str) -> None:
        share, weight = self.retrieval_share, self.answer_weight
        if share is not None and not 0 <= share < 1:
            raise ValueError(f"{at}.retrieval_share must be in [0, 1), got {share!r}")
        if weight is None:
            return
        if not share:
            raise ValueError(f"{at}.answer_weight needs {section}.retrieval_share > 0 (it weights those blocks)")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{at}.answer_weight must be a finite number > 0, got {weight!r}")
