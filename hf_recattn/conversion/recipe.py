"""Conversion recipes: YAML files validated into frozen dataclasses, with errors naming the file and the key.

A recipe file holds the attention spec, base settings for each stage and named budgets that override them::

    attention: {mixer: linear, feature_map: hedgehog}
    stage1: {lr: 1.0e-2, block_size: 256, batch_size: 4}
    stage2: {lr: 1.0e-4, loss: ce+kl, lora: {r: 8, alpha: 16}}
    budgets:
      quick: {stage1: {tokens: 32768}, stage2: {tokens: 8192}}
      full: {stage1: {tokens: 1000000}, stage2: {tokens: 2000000}}

``load_recipe(name_or_path, budget)`` merges the chosen budget over the base settings and validates the
result. Packaged recipes live in ``hf_recattn/recipes/*.yaml``; list them with ``available_recipes()``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..modeling.mixers import validate_spec
from .layer_selection import check_layers

LOSSES = ("ce", "kl", "ce+kl")
#: what stage 2 trains: LoRA adapters merged at the end, or every weight of the student
STAGE2_METHODS = ("lora", "full")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_LORA_TARGETS = ATTENTION_PROJECTIONS
#: teacher config fields a recipe may pin in ``expects``
EXPECTABLE = (
    "head_dim",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters of stage 2 (merged into the weights at the end)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS


@dataclass(frozen=True)
class Stage1Settings:
    """Attention transfer: train only the new mixer parameters to match each layer's softmax output (MSE)."""

    tokens: int = 0  # training tokens in total; 0 skips the stage
    lr: float = 1e-2
    block_size: int = 512
    batch_size: int = 4
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1  # cosine decay ends at lr * min_lr_fraction
    max_grad_norm: float = 1.0  # per layer
    save_every: int = 25  # optimizer steps between resumable checkpoints
    #: attention projections also trained in stage 1 (for mixers without parameters of their own, e.g.
    #: heinsen); the teacher stays frozen, only the student's copies move
    projections: tuple[str, ...] = ()
    projection_lr: float = 1e-4
    #: weight of a second term, the KL divergence (nats) from each query's softmax attention weights in the
    #: teacher to the student's (Hedgehog's objective; for mixers whose output is a weighted mean of the values,
    #: see ``Mixer.attention_weights``), against the output MSE relative to the mean square of the teacher's
    #: output (so one weight suits every layer): loss = MSE + attention_kl * mean(target^2) * KL; None or 0:
    #: outputs only
    attention_kl: float | None = None


@dataclass(frozen=True)
class Stage2Settings:
    """Finetuning with transformers' Trainer (LoRA adapters or every weight), cross-entropy and/or KL to the
    teacher."""

    tokens: int = 0  # training tokens in total; 0 skips the stage
    lr: float = 1e-4
    block_size: int = 512
    batch_size: int = 4
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


@dataclass(frozen=True)
class RetrievalHeadSettings:
    """After stage 1, keep exact softmax on the KV heads recall needs (``conversion/retrieval_heads.py``)."""

    max_heads: int = 0  # at most this many KV heads in the whole model; 0 turns the step off
    context_length: int = 1024  # tokens of each recall prompt the heads are chosen on
    prompts: int = 2  # prompts of each kind: a secret number, an associative-recall fact (in training text)
    per_round: int = 2  # heads switched to exact softmax per round of the greedy search


@dataclass(frozen=True)
class EvalSettings:
    """The built-in evaluation after conversion."""

    quick: bool = True
    heldout_fraction: float = 0.05
    heldout_tokens: int = 8192  # held-out tokens scored by perplexity (teacher and student see the same)
    block_size: int = 512
    sample_prompt: str = "The key idea of attention is"
    sample_tokens: int = 32


@dataclass(frozen=True)
class Recipe:
    """A validated conversion recipe with one budget applied."""

    name: str
    attention: Any
    budget: str
    stage1: Stage1Settings
    stage2: Stage2Settings
    eval: EvalSettings
    attention_overrides: dict[str, Any] | None = None
    retrieval_heads: RetrievalHeadSettings = field(default_factory=RetrievalHeadSettings)
    description: str = ""
    seed: int = 0
    expects: dict[str, int] = field(default_factory=dict)
    #: an earlier converted checkpoint (folder) the student starts from instead of the teacher's copy
    init: str | None = None
    #: which teacher layers convert (layer_selection.py); the others keep the teacher's attention. None: all
    layers: dict[str, Any] | None = None
    source: str = "<dict>"

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def fingerprint(self) -> str:
        """A short hash of every setting that changes the result (not the description or the file path).

        Settings added later are left out while they hold their defaults, so that the fingerprints of older
        recipes (and the output folders that resume by them) stay the same.
        """
        values = self.as_dict()
        for key in ("description", "source"):
            values.pop(key)
        if not self.retrieval_heads.max_heads:  # added later: off leaves older fingerprints as they were
            values.pop("retrieval_heads")
        if self.init is None:  # added later, as above
            values.pop("init")
        if self.layers is None:  # added later, as above
            values.pop("layers")
        if values["stage2"]["method"] == "lora":  # the default spelled out: the same run as leaving it unset
            values["stage2"]["method"] = None
        for section, keys in _LATER_SETTINGS.items():
            for key in keys:
                if values[section][key] is None:
                    values[section].pop(key)
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

    def with_seed(self, seed: int | None) -> Recipe:
        return self if seed is None else dataclasses.replace(self, seed=int(seed))


#: settings added after recipes were in use, default None: not in the fingerprint while they are None
_LATER_SETTINGS = {
    "stage1": ("attention_kl",),
    "stage2": ("mixer_lr", "mixer_eps", "retrieval_share", "answer_weight", "skip_tokens", "method"),
}


def report_training_tokens(report: dict[str, Any], recipe: dict[str, Any] | None = None) -> int:
    """The training tokens behind a converted checkpoint: its ``report.json`` count (which includes those of an
    ``init`` checkpoint), else the stages of ``recipe`` (default: the report's own recipe)."""
    if "training_tokens" in report:
        return int(report["training_tokens"])
    stages = (report.get("recipe") or {}) if recipe is None else recipe
    return sum(int((stages.get(stage) or {}).get("tokens", 0)) for stage in ("stage1", "stage2"))


# ----- loading ----------------------------------------------------------------------------------------------
_TOP_KEYS = {
    "name",
    "description",
    "attention",
    "attention_overrides",
    "seed",
    "expects",
    "stage1",
    "stage2",
    "eval",
    "retrieval_heads",
    "init",
    "layers",
    "budgets",
}
_BUDGET_KEYS = {"stage1", "stage2", "eval", "seed", "retrieval_heads"}


def recipes_folder() -> Path:
    return Path(str(resources.files("hf_recattn").joinpath("recipes")))


def available_recipes() -> list[str]:
    """Names of the packaged recipes."""
    return sorted(p.stem for p in recipes_folder().glob("*.yaml"))


def find_recipe(name_or_path: str | Path) -> Path:
    """A packaged recipe by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ValueError(f"recipe file {str(path)!r} does not exist")
        return path
    packaged = recipes_folder() / f"{name_or_path}.yaml"
    if not packaged.is_file():
        raise ValueError(
            f"unknown recipe {str(name_or_path)!r}; packaged recipes: {available_recipes()} "
            "(or give the path of a .yaml file)"
        )
    return packaged


def load_recipe(name_or_path: str | Path, budget: str = "quick", seed: int | None = None) -> Recipe:
    """Read, merge (base settings + ``budgets[budget]``) and validate a recipe."""
    path = find_recipe(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return recipe_from_dict(data, budget, source=str(path)).with_seed(seed)


def budgets_of(name_or_path: str | Path) -> list[str]:
    path = find_recipe(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    return sorted((data.get("budgets") or {}).keys())


def recipe_from_dict(data: dict[str, Any], budget: str = "quick", source: str = "<dict>") -> Recipe:
    """Validate a recipe given as a dict (the parsed YAML)."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    if "attention" not in data:
        raise ValueError(f"{source}: missing key 'attention' (the mixer spec, e.g. {{mixer: linear}})")
    budgets = data.get("budgets") or {}
    if not isinstance(budgets, dict):
        raise ValueError(f"{source}: 'budgets' must map a budget name to settings")
    merged = {k: copy.deepcopy(v) for k, v in data.items() if k != "budgets"}
    if budgets:
        if budget not in budgets:
            raise ValueError(f"{source}: no budget {budget!r}; this recipe has {sorted(budgets)}")
        chosen = budgets[budget] or {}
        if not isinstance(chosen, dict):
            raise ValueError(f"{source}: budgets.{budget} must be a mapping")
        bad = sorted(set(chosen) - _BUDGET_KEYS)
        if bad:
            raise ValueError(
                f"{source}: budgets.{budget}: unknown key(s) {bad}; known: {sorted(_BUDGET_KEYS)}"
            )
        merged = _deep_merge(merged, chosen)
    stage2 = merged.get("stage2")
    if isinstance(stage2, dict) and stage2.get("method") == "full" and "lora" in stage2:
        raise ValueError(f"{source}: stage2.lora: only used with stage2.method: lora (method is 'full')")
    attention = merged["attention"]
    overrides = merged.get("attention_overrides") or None
    _check_attention(attention, overrides, source)
    expects = merged.get("expects") or {}
    if not isinstance(expects, dict) or sorted(set(expects) - set(EXPECTABLE)):
        raise ValueError(f"{source}: expects: keys must be among {list(EXPECTABLE)}, got {expects!r}")
    for key, value in expects.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{source}: expects.{key} must be an integer, got {value!r}")
    recipe = Recipe(
        name=_typed(merged.get("name", "recipe"), str, f"{source}: name"),
        description=_typed(merged.get("description", ""), str, f"{source}: description"),
        attention=attention,
        attention_overrides=overrides,
        budget=budget if budgets else "default",
        seed=_typed(merged.get("seed", 0), int, f"{source}: seed"),
        expects=dict(expects),
        init=_typed(merged["init"], str, f"{source}: init") if merged.get("init") is not None else None,
        layers=check_layers(merged.get("layers"), f"{source}: layers"),
        stage1=_build(Stage1Settings, merged.get("stage1"), f"{source}: stage1"),
        stage2=_build(Stage2Settings, merged.get("stage2"), f"{source}: stage2"),
        eval=_build(EvalSettings, merged.get("eval"), f"{source}: eval"),
        retrieval_heads=_build(RetrievalHeadSettings, merged.get("retrieval_heads"), f"{source}: retrieval_heads"),
        source=source,
    )
    _check_settings(recipe)
    return recipe


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _check_attention(attention: Any, overrides: Any, source: str) -> None:
    """Every spec must be one the mixer registry accepts (unknown mixers / options fail here)."""
    if isinstance(attention, list):
        for i, spec in enumerate(attention):
            validate_spec(spec, f"{source}: attention[{i}]")
    else:
        validate_spec(attention, f"{source}: attention")
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ValueError(f"{source}: attention_overrides must map a layer key ('3', 'every:4') to a spec")
    for key, spec in overrides.items():
        validate_spec(spec, f"{source}: attention_overrides[{str(key)!r}]")


def _typed(value: Any, kind: type, where: str) -> Any:
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


def _build(cls: type, values: Any, where: str) -> Any:
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
            kwargs[name] = _build(hint, value, key)
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
                kwargs[name] = _typed(value, kinds[0], key)
        else:
            kwargs[name] = _typed(value, hint, key)
    return cls(**kwargs)


def _positive(value: float, where: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_settings(recipe: Recipe) -> None:
    src = recipe.source
    s1, s2, ev = recipe.stage1, recipe.stage2, recipe.eval
    for stage, settings in (("stage1", s1), ("stage2", s2)):
        _positive(settings.tokens, f"{src}: {stage}.tokens", allow_zero=True)
        for key in ("lr", "block_size", "batch_size", "max_grad_norm"):
            _positive(getattr(settings, key), f"{src}: {stage}.{key}")
        if not 0 <= settings.warmup_fraction < 1:
            raise ValueError(f"{src}: {stage}.warmup_fraction must be in [0, 1)")
    _positive(s1.save_every, f"{src}: stage1.save_every")
    _positive(s1.projection_lr, f"{src}: stage1.projection_lr")
    if s1.attention_kl is not None:
        _positive(s1.attention_kl, f"{src}: stage1.attention_kl", allow_zero=True)
    bad = sorted(set(s1.projections) - set(ATTENTION_PROJECTIONS))
    if bad:
        raise ValueError(
            f"{src}: stage1.projections: unknown {bad}; choose from {list(ATTENTION_PROJECTIONS)}"
        )
    if not s2.lora.targets:
        raise ValueError(f"{src}: stage2.lora.targets must name at least one module")
    if not 0 <= s1.min_lr_fraction <= 1:
        raise ValueError(f"{src}: stage1.min_lr_fraction must be in [0, 1]")
    _positive(s2.grad_accum, f"{src}: stage2.grad_accum")
    _positive(s2.save_steps, f"{src}: stage2.save_steps")
    _positive(s2.temperature, f"{src}: stage2.temperature")
    _positive(s2.kl_weight, f"{src}: stage2.kl_weight", allow_zero=True)
    _positive(s2.weight_decay, f"{src}: stage2.weight_decay", allow_zero=True)
    for key in ("mixer_lr", "mixer_eps"):
        value = getattr(s2, key)
        if value is None:
            continue
        if not s2.trains_mixer:
            raise ValueError(f"{src}: stage2.{key} needs stage2.train_mixer: true or stage2.method: full "
                             "(it sets the mixer's group)")
        if not math.isfinite(value):
            raise ValueError(f"{src}: stage2.{key} must be finite, got {value!r}")
        _positive(value, f"{src}: stage2.{key}")
    if s2.method is not None and s2.method not in STAGE2_METHODS:
        raise ValueError(f"{src}: stage2.method must be one of {list(STAGE2_METHODS)}, got {s2.method!r}")
    if s2.skip_tokens is not None:
        _positive(s2.skip_tokens, f"{src}: stage2.skip_tokens", allow_zero=True)
        if s2.skip_tokens % s2.block_size:
            raise ValueError(f"{src}: stage2.skip_tokens ({s2.skip_tokens}) must be a multiple of stage2.block_size "
                             f"({s2.block_size}): whole blocks are skipped")
    if recipe.init is not None and recipe.retrieval_heads.max_heads:
        raise ValueError(
            f"{src}: init and retrieval_heads.max_heads do not combine (the heads are chosen on a fresh stage-1 "
            "student; an init checkpoint keeps the heads it has)"
        )
    if s2.retrieval_share is not None and not 0 <= s2.retrieval_share < 1:
        raise ValueError(f"{src}: stage2.retrieval_share must be in [0, 1), got {s2.retrieval_share!r}")
    if s2.answer_weight is not None:
        if not s2.retrieval_share:
            raise ValueError(f"{src}: stage2.answer_weight needs stage2.retrieval_share > 0 (it weights those blocks)")
        if not (math.isfinite(s2.answer_weight) and s2.answer_weight > 0):
            raise ValueError(f"{src}: stage2.answer_weight must be a finite number > 0, got {s2.answer_weight!r}")
    if s2.loss not in LOSSES:
        raise ValueError(f"{src}: stage2.loss must be one of {list(LOSSES)}, got {s2.loss!r}")
    _positive(s2.lora.r, f"{src}: stage2.lora.r")
    _positive(s2.lora.alpha, f"{src}: stage2.lora.alpha")
    if not 0 <= s2.lora.dropout < 1:
        raise ValueError(f"{src}: stage2.lora.dropout must be in [0, 1)")
    if not 0 < ev.heldout_fraction < 1:
        raise ValueError(f"{src}: eval.heldout_fraction must be in (0, 1)")
    for key in ("heldout_tokens", "block_size"):
        _positive(getattr(ev, key), f"{src}: eval.{key}")
    _positive(ev.sample_tokens, f"{src}: eval.sample_tokens", allow_zero=True)
    rh = recipe.retrieval_heads
    _positive(rh.max_heads, f"{src}: retrieval_heads.max_heads", allow_zero=True)
    for key in ("context_length", "prompts", "per_round"):
        _positive(getattr(rh, key), f"{src}: retrieval_heads.{key}")
    if s1.tokens and s1.tokens < s1.block_size * s1.batch_size:
        raise ValueError(
            f"{src}: stage1.tokens ({s1.tokens}) is less than one batch "
            f"(block_size * batch_size = {s1.block_size * s1.batch_size})"
        )
    per_step = s2.block_size * s2.batch_size * s2.grad_accum
    if s2.tokens and s2.tokens < per_step:
        raise ValueError(
            f"{src}: stage2.tokens ({s2.tokens}) is less than one optimizer step "
            f"(block_size * batch_size * grad_accum = {per_step})"
        )


# ----- the recipe against a teacher -------------------------------------------------------------------------
def check_against_teacher(recipe: Recipe, teacher_config: Any, tokenizer: Any = None) -> Any:
    """Check that ``recipe`` fits ``teacher_config`` and return the student's RecAttnConfig.

    Catches: a pinned ``expects`` value that differs (head dims, vocab...), override keys out of range,
    specs whose mixers cannot be built at the teacher's sizes, LoRA targets that match no module, block
    sizes beyond the teacher's positions, a tokenizer larger than the embedding.
    """
    import torch

    from ..modeling.modeling import RecAttnForCausalLM
    from .families import attention_kl_problem
    from .from_llama import recattn_config_from

    src = recipe.source
    for key, wanted in recipe.expects.items():
        have = getattr(teacher_config, key, None)
        if key == "head_dim" and have is None:
            have = teacher_config.hidden_size // teacher_config.num_attention_heads
        if have != wanted:
            raise ValueError(f"{src}: the recipe expects {key}={wanted} but the teacher has {key}={have}")
    try:
        config = recattn_config_from(teacher_config, recipe.attention, recipe.attention_overrides, recipe.layers)
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from None
    if recipe.stage1.attention_kl and (problem := attention_kl_problem(teacher_config, config)):
        raise ValueError(f"{src}: stage1.attention_kl recomputes the teacher's attention weights the Llama way, but "
                         f"{problem}; set stage1.attention_kl to 0 for this teacher")
    try:
        with torch.device("meta"):
            skeleton = RecAttnForCausalLM(copy.deepcopy(config))
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"{src}: the attention spec does not fit the teacher: {err}") from None
    if recipe.stage2.tokens and recipe.stage2.method != "full":
        names = [n for n, _ in skeleton.named_modules()]
        for target in recipe.stage2.lora.targets:
            if not any(n == target or n.endswith("." + target) for n in names):
                raise ValueError(
                    f"{src}: stage2.lora.targets: {target!r} matches no module of the student "
                    "(Llama names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)"
                )
    kv_heads = config.num_hidden_layers * config.num_key_value_heads
    if recipe.retrieval_heads.max_heads > kv_heads:
        raise ValueError(f"{src}: retrieval_heads.max_heads {recipe.retrieval_heads.max_heads} exceeds the teacher's "
                         f"{kv_heads} KV heads ({config.num_hidden_layers} layers x {config.num_key_value_heads})")
    limit = getattr(teacher_config, "max_position_embeddings", None)
    for key, size in (
        ("stage1.block_size", recipe.stage1.block_size),
        ("stage2.block_size", recipe.stage2.block_size),
        ("eval.block_size", recipe.eval.block_size),
        ("retrieval_heads.context_length", recipe.retrieval_heads.context_length),
    ):
        if limit and size > limit:
            raise ValueError(f"{src}: {key} {size} exceeds the teacher's max_position_embeddings {limit}")
    if tokenizer is not None and len(tokenizer) > teacher_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the teacher's vocab_size is "
            f"{teacher_config.vocab_size}"
        )
    return config
