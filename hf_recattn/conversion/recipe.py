"""Conversion recipes: YAML files validated into frozen dataclasses, with errors naming the file and the key.

A recipe file holds the attention spec, base settings for each stage and named budgets that override them::

    attention: {mixer: linear, feature_map: hedgehog}
    stage1: {lr: 1.0e-2, block_size: 256, batch_size: 4}
    stage2: {lr: 1.0e-4, loss: ce+kl, lora: {r: 8, alpha: 16}}
    budgets:
      quick: {stage1: {tokens: 32768}, stage2: {tokens: 8192}}
      full: {stage1: {tokens: 1000000}, stage2: {tokens: 2000000}}

``load_recipe(name_or_path, budget)`` merges the chosen budget over the base settings (by the rules of
``extends:``, recipe_extends.py: mappings key by key, ``null`` drops a key, a spec naming another mixer replaces the
base's) and validates the result (each section is a settings class of ``settings.py``). Packaged recipes live in
``hf_recattn/recipes/*.yaml``; list them with ``available_recipes()``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..modeling.mixers import validate_spec
from ..training.checks import build_settings, typed
from ..training.fused_loss import config_misfit, refusal
from .layer_selection import check_layers
from .recipe_extends import merge_recipe, resolve_extends
from .settings import DEFAULT_RETRIEVAL_KINDS, EvalSettings, RetrievalHeadSettings, Stage1Settings, Stage2Settings

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
    #: hybrid options (without weights of their own) set on the trained student before it is saved, by layer key
    #: as in ``attention_overrides``: the model trains with ``attention`` and serves with these (e.g. another
    #: ``cache_dtype``)
    serve_overrides: dict[str, dict[str, Any]] | None = None
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
        else:  # its later settings, as below
            if values["retrieval_heads"]["method"] == "gradient":  # the default spelled out
                values["retrieval_heads"]["method"] = None
            for key in ("method", "retrieval", "kinds"):
                if values["retrieval_heads"][key] is None:
                    values["retrieval_heads"].pop(key)
        if self.init is None:  # added later, as above
            values.pop("init")
        if self.layers is None:  # added later, as above
            values.pop("layers")
        if self.serve_overrides is None:  # added later, as above
            values.pop("serve_overrides")
        if values["stage2"]["method"] == "lora":  # the default spelled out: the same run as leaving it unset
            values["stage2"]["method"] = None
        if values["stage2"]["loss_kernel"] == "auto":  # the default spelled out, as above
            values["stage2"]["loss_kernel"] = None
        for section in ("stage1", "stage2"):  # the default kinds spelled out: the same blocks as leaving it unset
            if values[section]["retrieval_kinds"] == list(DEFAULT_RETRIEVAL_KINDS):
                values[section]["retrieval_kinds"] = None
        for section, keys in _LATER_SETTINGS.items():
            for key in keys:
                if values[section][key] is None:
                    values[section].pop(key)
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

    def check(self) -> None:
        """Every section checks its own values; then the checks across sections."""
        for section in SECTIONS:
            getattr(self, section).check(self.source, section)
        if self.init is not None and self.retrieval_heads.max_heads:
            raise ValueError(
                f"{self.source}: init and retrieval_heads.max_heads do not combine (the heads are chosen on a fresh "
                "stage-1 student; an init checkpoint keeps the heads it has)"
            )

    def with_seed(self, seed: int | None) -> Recipe:
        return self if seed is None else dataclasses.replace(self, seed=int(seed))


#: the settings sections of a recipe (each a dataclass that checks itself), by key
SECTIONS: dict[str, type] = {
    "stage1": Stage1Settings,
    "stage2": Stage2Settings,
    "eval": EvalSettings,
    "retrieval_heads": RetrievalHeadSettings,
}

#: settings added after recipes were in use, default None: not in the fingerprint while they are None
_LATER_SETTINGS = {
    "stage1": ("attention_kl", "retrieval_share", "retrieval_kinds", "retention_target"),
    "stage2": ("mixer_lr", "mixer_eps", "retrieval_share", "answer_weight", "retrieval_kinds", "skip_tokens", "method",
               "loss_chunk_size", "gradient_checkpointing", "loss_kernel"),
    "eval": ("probes", "baselines"),
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
    "serve_overrides",
    "budgets",
    "extends",
}
_BUDGET_KEYS = {"stage1", "stage2", "eval", "seed", "retrieval_heads"}
# the budget a run of a recipe without budgets records (its one set of settings, whatever --budget said)
NO_BUDGETS = "default"
QUICK = "quick"  # the budget a recipe with budgets runs when none is named


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


def read_recipe_yaml(path: Path) -> dict[str, Any]:
    """The parsed recipe file with the recipe it ``extends`` merged in (recipe_extends.py), its ``name``
    defaulting to the file's stem; ValueError naming the file."""
    data = _parse_recipe_yaml(path)
    return resolve_extends(data, path, recipe_source(path), _read_base)


def _parse_recipe_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return data


def _read_base(reference: str, folder: Path | None) -> tuple[dict[str, Any], Path, str]:
    """The recipe an ``extends`` names: a .yaml path (relative to the extending file's folder) or a packaged
    recipe's name."""
    if Path(reference).suffix in (".yaml", ".yml") and folder is not None and not Path(reference).is_absolute():
        reference = str(folder / reference)
    path = find_recipe(reference)
    return _parse_recipe_yaml(path), path, recipe_source(path)


def recipe_source(path: Path) -> str:
    """How a recipe's file is named in messages and reports: a packaged one as ``hf_recattn/recipes/NAME.yaml``
    (where it sits in the package, not on this machine), any other by the path given."""
    if path.resolve().parent == recipes_folder().resolve():
        return f"hf_recattn/recipes/{path.name}"
    return str(path)


def is_packaged_source(source: str | None) -> bool:
    """Whether a report's recipe ``source`` names a packaged recipe (``recipe_source``'s form), or nothing that a
    path could reproduce (older reports, recipes built from a dict): either way the recipe goes by its name."""
    return not source or source == "<dict>" or source.startswith("hf_recattn/recipes/")



def load_recipe(name_or_path: str | Path, budget: str | None = None, seed: int | None = None) -> Recipe:
    """Read, merge (base settings + ``budgets[budget]``) and validate a recipe (``budget``: see
    ``recipe_from_dict``)."""
    path = find_recipe(name_or_path)
    return recipe_from_dict(read_recipe_yaml(path), budget, source=recipe_source(path)).with_seed(seed)


def budgets_of(name_or_path: str | Path) -> list[str]:
    """The budget names of a recipe (packaged or a file)."""
    return sorted((read_recipe_yaml(find_recipe(name_or_path)).get("budgets") or {}).keys())


def recipe_from_dict(data: dict[str, Any], budget: str | None = None, source: str = "<dict>") -> Recipe:
    """Validate a recipe given as a dict (the parsed YAML; an ``extends`` path there is relative to the working
    folder). ``budget``: one of its ``budgets`` (none: ``quick``); a recipe without budgets takes none (or
    ``NO_BUDGETS``, the name its runs record), and any other is an error rather than ignored."""
    data = resolve_extends(data, None, source, _read_base)
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    if "attention" not in data:
        raise ValueError(f"{source}: missing key 'attention' (the mixer spec, e.g. {{mixer: linear}})")
    budgets = data.get("budgets") or {}
    if not isinstance(budgets, dict):
        raise ValueError(f"{source}: 'budgets' must map a budget name to settings")
    merged = {k: copy.deepcopy(v) for k, v in data.items() if k != "budgets"}
    if not budgets and budget not in (None, NO_BUDGETS):
        raise ValueError(f"{source}: no budget {budget!r}; this recipe has no budgets (one set of settings): "
                         "convert it without --budget")
    budget = (budget or QUICK) if budgets else NO_BUDGETS
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
        merged = merge_recipe(merged, chosen)
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
        name=typed(merged.get("name", "recipe"), str, f"{source}: name"),
        description=typed(merged.get("description", ""), str, f"{source}: description"),
        attention=attention,
        attention_overrides=overrides,
        budget=budget,
        seed=typed(merged.get("seed", 0), int, f"{source}: seed"),
        expects=dict(expects),
        init=typed(merged["init"], str, f"{source}: init") if merged.get("init") is not None else None,
        layers=check_layers(merged.get("layers"), f"{source}: layers"),
        serve_overrides=_check_serve_overrides(merged.get("serve_overrides"), source),
        source=source,
        **{key: build_settings(cls, merged.get(key), f"{source}: {key}") for key, cls in SECTIONS.items()},
    )
    recipe.check()
    return recipe


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


def _check_serve_overrides(overrides: Any, source: str) -> dict[str, dict[str, Any]] | None:
    """``serve_overrides``: a layer key ('3', 'every:6') to the hybrid options its layers serve with; unknown
    options fail here, the rest against the teacher's layers (``check_against_teacher``)."""
    from ..modeling.mixer_hybrid import HybridMixer

    if not overrides:
        return None
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) and v for v in overrides.values()):
        raise ValueError(f"{source}: serve_overrides must map a layer key ('3', 'every:6') to hybrid options "
                         "({cache_dtype: int8})")
    for key, options in overrides.items():
        unknown = sorted(set(options) - set(HybridMixer.options))
        if unknown:
            raise ValueError(f"{source}: serve_overrides[{str(key)!r}]: {unknown} unknown; the hybrid's options are "
                             f"{sorted(HybridMixer.options)}")
    return {str(key): dict(options) for key, options in overrides.items()}


def served_config(recipe: Recipe, config: Any) -> Any:
    """The student's config as it is saved: ``config`` with the recipe's ``serve_overrides`` set (itself when there
    are none); ValueError naming the recipe and the key when they do not fit or would change the parameters."""
    from ..modeling.hybrid_options import config_with_layer_options, same_parameters

    if not recipe.serve_overrides:
        return config
    try:
        served = config_with_layer_options(config, recipe.serve_overrides)
        same_parameters(config, served, f"serve_overrides {recipe.serve_overrides}")
    except ValueError as err:
        raise ValueError(f"{recipe.source}: {err}") from None
    return served


# ----- the recipe against a teacher -------------------------------------------------------------------------
def check_against_teacher(recipe: Recipe, teacher_config: Any, tokenizer: Any = None) -> Any:
    """Check that ``recipe`` fits ``teacher_config`` and return the student's RecAttnConfig.

    Catches: a pinned ``expects`` value that differs (head dims, vocab...), override keys out of range,
    specs whose mixers cannot be built at the teacher's sizes, LoRA targets that match no module, block
    sizes beyond the teacher's positions, a tokenizer larger than the embedding.
    """
    import torch

    from ..modeling.modeling import RecAttnForCausalLM
    from .from_teacher import recattn_config_from

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
    _check_loss_kernel(recipe, config, teacher_config)
    served_config(recipe, config)
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


def _check_loss_kernel(recipe: Recipe, config: Any, teacher_config: Any) -> None:
    """``stage2.loss_kernel: liger`` refused before any stage where the models' configs say that its ops cannot
    compute stage 2's loss (a soft-capped KL, LoRA on the LM head)."""
    s2 = recipe.stage2
    if not s2.tokens or s2.loss_kernel != "liger":
        return
    lora_on_head = s2.method != "full" and "lm_head" in s2.lora.targets
    reason = config_misfit(s2.loss, {"student": config, "teacher": teacher_config}, lora_on_head)
    if reason is not None:
        raise refusal(f"{recipe.source}: stage2.loss_kernel", reason)
