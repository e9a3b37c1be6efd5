"""Recipes: packaged ones load for every budget and fit SmolLM2; bad ones fail naming the file and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from distill_fixtures import tiny_recipe_dict, write_recipe
from transformers import Gemma3TextConfig, LlamaConfig

from hf_recattn.conversion.recipe import (
    available_recipes,
    budgets_of,
    check_against_teacher,
    load_recipe,
    recipe_from_dict,
    served_config,
)
from hf_recattn.conversion.retrieval_heads import config_with_retrieval_heads
from hf_recattn.conversion.settings import RETRIEVAL_KINDS, Stage2Settings
from hf_recattn.evaluation import RecallSizes
from hf_recattn.modeling.configuration import RecAttnConfig
from hf_recattn.state_size import state_bytes, state_size_report
from hf_recattn.training.checks import build_settings
from hf_recattn.training.distill_settings import DistillSettings

#: the stage-2 settings only conversion has: where its blocks start, the blocks that hide facts
CONVERSION_ONLY = ["skip_tokens", "retrieval_share", "answer_weight", "retrieval_kinds"]
REQUIRED = {"taylor2-norm", "hybrid-w64-taylor2", "hybrid-w64-hedgehog", "linear-hedgehog", "heinsen", "gdn", "kda",
            "hybrid-w64-sink4-gdn", "fox", "gemma3-270m-full-delta", "gemma3-270m-full-hybrid-gdn",
            "hybrid-w64-sink4-hedgehog-cache64", "hybrid-w64-sink4-gdn-cache64", "gemma3-270m-full-hybrid-gdn-cache64",
            "hybrid-w64-sink4-gdn-novelty64", "gemma3-270m-full-hybrid-gdn-novelty64"}
#: the recipes with the hybrid's exact cache, and the most of SmolLM2's bf16 KV cache at 8k their state may take
CACHED = {"hybrid-w64-sink4-hedgehog-cache64": 0.033, "hybrid-w64-sink4-gdn-cache64": 0.03,
          "gemma3-270m-full-hybrid-gdn-cache64": 0.03, "hybrid-w64-sink4-gdn-novelty64": 0.03,
          "gemma3-270m-full-hybrid-gdn-novelty64": 0.03}


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's shape (no weights needed: the check builds the student on the meta device)."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def test_required_recipes_are_packaged() -> None:
    assert REQUIRED <= set(available_recipes())


@pytest.mark.parametrize("name", sorted(available_recipes()))
def test_packaged_recipe_loads_and_fits_smollm2(name: str) -> None:
    assert {"quick", "full"} <= set(budgets_of(name))
    quick, full = load_recipe(name, "quick"), load_recipe(name, "full")
    for recipe in (quick, full):
        config = check_against_teacher(recipe, smollm2_config())
        assert len(config.layer_specs()) == 30
    total = full.stage1.tokens + full.stage2.tokens
    assert quick.stage1.tokens + quick.stage2.tokens < total <= 3_000_000  # the budget cap
    assert quick.eval.quick and not full.eval.quick
    assert quick.fingerprint() != full.fingerprint()


def _error(tmp_path: Path, recipe: dict, budget: str | None = None) -> str:
    path = write_recipe(tmp_path / "bad.yaml", recipe)
    with pytest.raises(ValueError) as info:
        load_recipe(path, budget)
    message = str(info.value)
    assert "bad.yaml" in message, message  # every error names the file
    return message


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "benchmarks" / "recipes").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_benchmark_recipes_load_and_fit_smollm2(path: Path) -> None:
    """The recipes the docs measure (outside the package) stay valid as the recipe schema moves."""
    for budget in budgets_of(path) or ["default"]:
        config = check_against_teacher(load_recipe(path, budget), smollm2_config())
        assert len(config.layer_specs()) == 30


def test_unknown_top_level_key(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict()
    recipe["stage3"] = {}
    assert "stage3" in _error(tmp_path, recipe)


def test_a_budget_for_a_recipe_without_budgets_is_refused(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict()
    assert "budgets" not in recipe
    assert "no budgets" in _error(tmp_path, recipe, "full")  # not ignored: its one set of settings would run
    path = tmp_path / "bad.yaml"
    assert load_recipe(path).budget == load_recipe(path, "default").budget == "default"


def test_unknown_nested_key_names_its_path(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict()
    recipe["stage2"]["lora"]["rank"] = 4
    message = _error(tmp_path, recipe)
    assert "stage2.lora" in message and "'rank'" in message


def test_unknown_mixer_option(tmp_path: Path) -> None:
    message = _error(tmp_path, tiny_recipe_dict({"mixer": "linear", "feature_map": "hedgehog", "depth": 3}))
    assert "attention" in message and "depth" in message


def test_bad_mixer_option_value(tmp_path: Path) -> None:
    message = _error(tmp_path, tiny_recipe_dict({"mixer": "linear", "feature_map": "gaussian"}))
    assert "feature_map" in message and "gaussian" in message


def test_unknown_mixer_and_bad_override(tmp_path: Path) -> None:
    assert "nonesuch" in _error(tmp_path, tiny_recipe_dict({"mixer": "nonesuch"}))
    recipe = tiny_recipe_dict(attention_overrides={"0": {"mixer": "sliding_window", "width": 8}})
    message = _error(tmp_path, recipe)
    assert "attention_overrides" in message and "width" in message


def test_wrong_types_and_values(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict()
    recipe["stage1"]["batch_size"] = "four"
    assert "stage1.batch_size" in _error(tmp_path, recipe)
    recipe = tiny_recipe_dict()
    recipe["stage2"]["loss"] = "mse"
    assert "stage2.loss" in _error(tmp_path, recipe)
    recipe = tiny_recipe_dict()
    recipe["stage1"]["projections"] = ["gate_proj"]
    assert "stage1.projections" in _error(tmp_path, recipe)
    recipe = tiny_recipe_dict()
    recipe["stage1"]["attention_kl"] = -1.0
    assert "stage1.attention_kl must be >= 0" in _error(tmp_path, recipe)
    recipe = tiny_recipe_dict()
    recipe["stage2"]["tokens"] = 10  # less than one optimizer step
    assert "stage2.tokens" in _error(tmp_path, recipe)
    for key, value in (("max_heads", -1), ("per_round", 0), ("context_length", "long")):
        recipe = tiny_recipe_dict(retrieval_heads={"max_heads": 2, key: value})
        assert f"retrieval_heads.{key}" in _error(tmp_path, recipe)
    unknown = tiny_recipe_dict(retrieval_heads={"heads": 3})
    assert "retrieval_heads: unknown key(s) ['heads']" in _error(tmp_path, unknown)
    method = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "method": "attention"})
    assert "retrieval_heads.method must be one of ['gradient', 'teacher'], got 'attention'" in _error(tmp_path, method)
    spec = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "retrieval": {"mixer": "hybrid", "windw": 8}})
    assert "retrieval_heads.retrieval: unknown option(s) ['windw']" in _error(tmp_path, spec)


def test_later_retrieval_head_settings_leave_fingerprints_alone(tmp_path: Path) -> None:
    """``method``, ``retrieval`` and ``kinds`` unset: the fingerprint of a recipe written before they existed; set:
    another."""
    plain = tiny_recipe_dict(retrieval_heads={"max_heads": 2})
    def fingerprint(folder: str, recipe: dict) -> str:  # one file name: the name is part of the fingerprint
        (tmp_path / folder).mkdir()
        return load_recipe(write_recipe(tmp_path / folder / "r.yaml", recipe)).fingerprint()

    before = fingerprint("a", plain)
    spelled = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "method": None, "retrieval": None, "kinds": None})
    assert fingerprint("b", spelled) == before
    teacher = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "method": "teacher"})
    assert fingerprint("c", teacher) != before
    kinds = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "kinds": ["words"]})
    assert fingerprint("d", kinds) != before


@pytest.mark.parametrize(("kinds", "message"), [(["word"], "unknown kind(s) ['word']"), ([], "an empty list")])
def test_retrieval_head_kinds_are_checked(tmp_path: Path, kinds: list, message: str) -> None:
    spec = tiny_recipe_dict(retrieval_heads={"max_heads": 2, "kinds": kinds})
    assert f"retrieval_heads.kinds: {message}" in _error(tmp_path, spec)


def test_missing_budget_lists_the_available_ones(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict(budgets={"quick": {"stage1": {"tokens": 1024}}})
    write_recipe(tmp_path / "r.yaml", recipe)
    assert load_recipe(tmp_path / "r.yaml", "quick").stage1.tokens == 1024
    message = _error(tmp_path, recipe, budget="huge")
    assert "huge" in message and "quick" in message


def test_budget_merges_over_base_and_yaml_floats(tmp_path: Path) -> None:
    recipe = tiny_recipe_dict(budgets={"full": {"stage2": {"lr": "3e-4", "lora": {"r": 16}}}})
    path = write_recipe(tmp_path / "r.yaml", recipe)
    full = load_recipe(path, "full")
    assert full.stage2.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string; we accept it
    assert full.stage2.lora.r == 16 and full.stage2.lora.alpha == 8.0  # merged, not replaced
    assert full.stage2.temperature == 2.0
    assert load_recipe(path, "full", seed=7).seed == 7


def test_unknown_recipe_name() -> None:
    with pytest.raises(ValueError, match="packaged recipes"):
        load_recipe("no-such-recipe")


def test_fingerprint_ignores_description_only() -> None:
    a = recipe_from_dict(tiny_recipe_dict())
    b = recipe_from_dict(tiny_recipe_dict(description="other words"))
    c = recipe_from_dict(tiny_recipe_dict(seed=1))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


#: fingerprints taken before stage2.mixer_lr / mixer_eps existed: output folders resume by them
OLD_FINGERPRINTS = {("hybrid-w64-sink4-hedgehog", "quick"): "73ca136c94fe2dc9",
                    ("hybrid-w64-sink4-hedgehog", "full"): "e535648cefb2a21b",
                    ("gdn", "quick"): "507c310bb6b2bec6", ("gdn", "full"): "2913adf1de87c218"}


@pytest.mark.parametrize(("name", "budget"), sorted(OLD_FINGERPRINTS))
def test_settings_added_later_keep_old_fingerprints(name: str, budget: str) -> None:
    assert load_recipe(name, budget).fingerprint() == OLD_FINGERPRINTS[name, budget]


def test_mixer_group_settings(tmp_path: Path) -> None:
    base = recipe_from_dict(tiny_recipe_dict(stage2={"train_mixer": True}))
    assert (base.stage2.mixer_lr, base.stage2.mixer_eps) == (None, None)
    set_ = recipe_from_dict(tiny_recipe_dict(stage2={"train_mixer": True, "mixer_lr": 1, "mixer_eps": "1e-16"}))
    assert (set_.stage2.mixer_lr, set_.stage2.mixer_eps) == (1.0, 1e-16)  # ints and YAML's 1e-16 strings read
    assert set_.fingerprint() != base.fingerprint()
    for key, value, says in (("mixer_lr", 0, "> 0"), ("mixer_eps", -1e-8, "> 0"), ("mixer_lr", "fast", "float"),
                             ("mixer_lr", True, "float"), ("mixer_eps", float("inf"), "finite")):
        message = _error(tmp_path, tiny_recipe_dict(stage2={"train_mixer": True, key: value}))
        assert f"stage2.{key}" in message and says in message, message
    message = _error(tmp_path, tiny_recipe_dict(stage2={"mixer_lr": 0.1}))
    assert "stage2.mixer_lr needs stage2.train_mixer" in message


def test_eval_baselines_setting(tmp_path: Path) -> None:
    """``eval.baselines``: unset is the window of 512 + 4 sinks and leaves the fingerprint alone; [] is none (another
    report, another fingerprint); an unknown name is refused naming the option."""
    settings = tiny_recipe_dict()
    del settings["eval"]["baselines"]
    unset = recipe_from_dict(settings)
    assert unset.eval.baselines is None and unset.eval.baseline_names() == ("window",)
    assert unset.fingerprint() == recipe_from_dict(tiny_recipe_dict(eval={"baselines": None})).fingerprint()
    none = recipe_from_dict(tiny_recipe_dict())  # the fixture's []
    assert none.eval.baseline_names() == () and none.fingerprint() != unset.fingerprint()
    message = _error(tmp_path, tiny_recipe_dict(eval={"baselines": ["window", "sinks"]}))
    assert "eval.baselines: unknown baseline(s) ['sinks']" in message, message


def test_attention_kl_setting(tmp_path: Path) -> None:
    base = recipe_from_dict(tiny_recipe_dict())
    assert base.stage1.attention_kl is None
    set_ = recipe_from_dict(tiny_recipe_dict(stage1={"attention_kl": 1}))
    assert set_.stage1.attention_kl == 1.0 and set_.fingerprint() != base.fingerprint()
    message = _error(tmp_path, tiny_recipe_dict(stage1={"attention_kl": "much"}))
    assert "stage1.attention_kl" in message and "float" in message, message


def test_retrieval_data_settings(tmp_path: Path) -> None:
    base = recipe_from_dict(tiny_recipe_dict())
    assert (base.stage2.retrieval_share, base.stage2.answer_weight) == (None, None)
    set_ = recipe_from_dict(tiny_recipe_dict(stage2={"retrieval_share": 0.5, "answer_weight": 50}))
    assert (set_.stage2.retrieval_share, set_.stage2.answer_weight) == (0.5, 50.0)
    assert set_.fingerprint() != base.fingerprint()
    for settings, says in (({"retrieval_share": 1.0}, "stage2.retrieval_share must be in [0, 1)"),
                           ({"retrieval_share": -0.1}, "stage2.retrieval_share must be in [0, 1)"),
                           ({"answer_weight": 10}, "stage2.answer_weight needs stage2.retrieval_share"),
                           ({"retrieval_share": 0.5, "answer_weight": 0}, "stage2.answer_weight must be"),
                           ({"retrieval_share": 0.5, "answer_weight": float("nan")}, "stage2.answer_weight must be")):
        message = _error(tmp_path, tiny_recipe_dict(stage2=settings))
        assert says in message, message
    stage1 = recipe_from_dict(tiny_recipe_dict(stage1={"retrieval_share": 0.25}))
    assert stage1.stage1.retrieval_share == 0.25 and stage1.fingerprint() != base.fingerprint()
    message = _error(tmp_path, tiny_recipe_dict(stage1={"retrieval_share": 1.0}))
    assert "stage1.retrieval_share must be in [0, 1)" in message, message


@pytest.mark.parametrize("section", ["stage1", "stage2"])
def test_retrieval_kinds_setting(tmp_path: Path, section: str) -> None:
    """{section}.retrieval_kinds: the kinds of retrieval block in turn; out of the fingerprint while unset or the
    default spelled out (the same blocks); a bad kind refused, naming the option and listing the kinds."""
    base = recipe_from_dict(tiny_recipe_dict(**{section: {"retrieval_share": 0.25}}))
    assert getattr(base, section).retrieval_kinds is None
    needles = recipe_from_dict(tiny_recipe_dict(**{section: {"retrieval_share": 0.25, "retrieval_kinds": ["needles"]}}))
    assert getattr(needles, section).retrieval_kinds == ("needles",) and needles.fingerprint() != base.fingerprint()
    one = recipe_from_dict(tiny_recipe_dict(**{section: {"retrieval_share": 0.25, "retrieval_kinds": "needles"}}))
    assert getattr(one, section).retrieval_kinds == ("needles",) and one.fingerprint() == needles.fingerprint()
    spelled = recipe_from_dict(tiny_recipe_dict(**{section: {"retrieval_share": 0.25,
                                                             "retrieval_kinds": ["passkey", "codes", "words"]}}))
    assert spelled.fingerprint() == base.fingerprint()
    listed = str(list(RETRIEVAL_KINDS))
    assert listed.startswith("['passkey', 'codes', 'words', 'needles', 'single_number'") and "'multi_key'" in listed
    for kinds, says in ((["needle"], f"{section}.retrieval_kinds: unknown kind(s) ['needle']; name some of {listed}"),
                        ([], f"{section}.retrieval_kinds: an empty list; name some of {listed}"),
                        ([3], f"{section}.retrieval_kinds must be a list of strings")):
        message = _error(tmp_path, tiny_recipe_dict(**{section: {"retrieval_share": 0.25, "retrieval_kinds": kinds}}))
        assert says in message, message
    message = _error(tmp_path, tiny_recipe_dict(**{section: {"retrieval_kinds": ["needles"]}}))
    assert f"{section}.retrieval_kinds needs {section}.retrieval_share > 0" in message, message


def test_continuation_settings(tmp_path: Path) -> None:
    base = recipe_from_dict(tiny_recipe_dict())
    assert (base.init, base.stage2.skip_tokens) == (None, None)
    more = recipe_from_dict(tiny_recipe_dict(init="runs/first/model", stage2={"skip_tokens": 256}))
    assert (more.init, more.stage2.skip_tokens) == ("runs/first/model", 256)
    assert more.fingerprint() != base.fingerprint()
    assert recipe_from_dict(tiny_recipe_dict(init="runs/other/model")).fingerprint() != base.fingerprint()
    for recipe, says in ((tiny_recipe_dict(stage2={"skip_tokens": -32}), "stage2.skip_tokens must be >= 0"),
                         (tiny_recipe_dict(stage2={"skip_tokens": 40}), "must be a multiple of stage2.block_size"),
                         (tiny_recipe_dict(init=3), "init must be str"),
                         (tiny_recipe_dict(init="runs/first/model", retrieval_heads={"max_heads": 2}),
                          "init and retrieval_heads.max_heads do not combine")):
        message = _error(tmp_path, recipe)
        assert says in message, message


def test_memory_settings(tmp_path: Path) -> None:
    """stage2.loss_chunk_size and gradient_checkpointing: unset by default (stage 2 chooses them) and out of the
    fingerprint until set; 0 and false set them off."""
    base = recipe_from_dict(tiny_recipe_dict())
    assert (base.stage2.loss_chunk_size, base.stage2.gradient_checkpointing) == (None, None)
    for settings in ({"loss_chunk_size": 1024}, {"gradient_checkpointing": True}, {"loss_chunk_size": 0},
                     {"gradient_checkpointing": False}):
        set_ = recipe_from_dict(tiny_recipe_dict(stage2=settings))
        assert getattr(set_.stage2, next(iter(settings))) == next(iter(settings.values()))
        assert set_.fingerprint() != base.fingerprint()
    for settings, says in (({"loss_chunk_size": -8}, "stage2.loss_chunk_size must be >= 0, got -8"),
                           ({"loss_chunk_size": 2.5}, "stage2.loss_chunk_size must be int"),
                           ({"gradient_checkpointing": "yes"}, "stage2.gradient_checkpointing must be bool")):
        message = _error(tmp_path, tiny_recipe_dict(stage2=settings))
        assert says in message, message


def test_stage2_method(tmp_path: Path) -> None:
    base = recipe_from_dict(tiny_recipe_dict())
    assert base.stage2.method is None
    full = tiny_recipe_dict(stage2={"method": "full", "mixer_lr": 1e-3})
    del full["stage2"]["lora"]
    recipe = recipe_from_dict(full)
    assert (recipe.stage2.method, recipe.stage2.mixer_lr) == ("full", 1e-3)  # mixer_lr without train_mixer
    assert recipe.fingerprint() != base.fingerprint()
    assert recipe_from_dict(tiny_recipe_dict(stage2={"method": "lora"})).fingerprint() == base.fingerprint()
    check_against_teacher(recipe, smollm2_config())  # passes: no LoRA targets to check
    for bad, says in (
        (tiny_recipe_dict(stage2={"method": "full"}), "stage2.lora: only used with stage2.method: lora"),
        (tiny_recipe_dict(stage2={"method": "adapters"}), "stage2.method must be one of ['lora', 'full']"),
        (tiny_recipe_dict(stage2={"mixer_lr": 1e-3}), "needs stage2.train_mixer: true or stage2.method"),
    ):
        message = _error(tmp_path, bad)
        assert says in message, message


def test_stage2_is_the_distillation_finetune_plus_conversion_data() -> None:
    """Training owns the finetune's settings; stage 2 adds only what conversion feeds it, after them (recipe.json
    keeps its key order), and checks them between the optimizer's checks and the loss's as it always did."""
    names = [f.name for f in dataclasses.fields(Stage2Settings)]
    assert names == [f.name for f in dataclasses.fields(DistillSettings)] + CONVERSION_ONLY
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['skip_tokens'\]"):
        build_settings(DistillSettings, {"skip_tokens": 0}, "x: finetune")
    with pytest.raises(ValueError, match=r"x: finetune.loss must be one of"):
        DistillSettings(loss="mse").check("x", "finetune")
    both = Stage2Settings(skip_tokens=7, loss="mse")
    with pytest.raises(ValueError, match=r"bad.yaml: stage2.skip_tokens \(7\) must be a multiple"):
        both.check("bad.yaml")


def test_teacher_mismatches() -> None:
    teacher = smollm2_config()
    with pytest.raises(ValueError, match="expects head_dim=128 but the teacher has head_dim=64"):
        check_against_teacher(recipe_from_dict(tiny_recipe_dict(expects={"head_dim": 128})), teacher)
    with pytest.raises(ValueError, match="vocab_size"):
        check_against_teacher(recipe_from_dict(tiny_recipe_dict(expects={"vocab_size": 32000})), teacher)
    out_of_range = tiny_recipe_dict(attention_overrides={"40": {"mixer": "softmax"}})
    with pytest.raises(ValueError, match="out of range"):
        check_against_teacher(recipe_from_dict(out_of_range), teacher)
    recipe = tiny_recipe_dict()
    recipe["stage2"]["lora"]["targets"] = ["c_attn"]
    with pytest.raises(ValueError, match="c_attn"):
        check_against_teacher(recipe_from_dict(recipe), teacher)
    recipe = tiny_recipe_dict()
    recipe["eval"]["block_size"] = 10_000
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_against_teacher(recipe_from_dict(recipe), teacher)
    too_many = tiny_recipe_dict(retrieval_heads={"max_heads": 91})
    with pytest.raises(ValueError, match=r"retrieval_heads.max_heads 91 exceeds the teacher's 90 KV heads"):
        check_against_teacher(recipe_from_dict(too_many), teacher)
    too_long = tiny_recipe_dict(retrieval_heads={"max_heads": 4, "context_length": 10_000})
    with pytest.raises(ValueError, match=r"retrieval_heads.context_length 10000 exceeds"):
        check_against_teacher(recipe_from_dict(too_long), teacher)


def test_eval_probe_sizes(tmp_path: Path) -> None:
    """eval.probes sets the recall probes over the quick / full defaults; out of the fingerprint until set."""
    unset = tiny_recipe_dict()
    del unset["eval"]["probes"]  # the tiny recipes' own (fewer needle prompts)
    base = recipe_from_dict(unset)
    assert base.eval.probes is None
    assert base.eval.recall_sizes() == RecallSizes.for_mode(base.eval.quick)
    set_ = recipe_from_dict(tiny_recipe_dict(eval={"quick": True, "probes": {"passkey_lengths": [1024, 4096],
                                                                             "distances": [100, 1000, 4000]}}))
    sizes = set_.eval.recall_sizes()
    assert (sizes.passkey_lengths, sizes.distances) == ((1024, 4096), (100, 1000, 4000))
    assert sizes.passkey_trials == RecallSizes.for_mode(True).passkey_trials  # the rest stays quick's
    assert set_.fingerprint() != base.fingerprint()
    for probes, says in (({"passkey_length": [1024]}, "eval.probes: unknown key(s) ['passkey_length']"),
                         ({"passkey_lengths": [0]}, "eval.probes: passkey_lengths must be positive integers"),
                         ({"passkey_trials": 0}, "eval.probes: passkey_trials must be >= 1"),
                         ([1024], "eval.probes must be dict")):
        message = _error(tmp_path, tiny_recipe_dict(eval={"probes": probes}))
        assert says in message, message


def _states_and_kv_cache(config: RecAttnConfig) -> tuple[dict[int, int], int]:
    """The model's state elements at 1k, 8k and 32k tokens, and its teacher's KV-cache elements at 8k."""
    reports = {n: state_size_report(config, n) for n in (1024, 8192, 32768)}
    states = {n: sum(r.state_elements for r in rows) for n, rows in reports.items()}
    return states, sum(r.kv_cache_elements for r in reports[8192])


@pytest.mark.parametrize("name", sorted(CACHED))
def test_cache_recipes_keep_a_constant_state(name: str) -> None:
    """The recipes with the exact cache: every converted layer has it, and the whole state is the same at 1k, 8k
    and 32k tokens, a small share of the teacher's KV cache at 8k."""
    recipe = load_recipe(name, "quick")
    config = check_against_teacher(recipe, smollm2_config())
    assert all(spec["cache_slots"] == 64 for spec in config.layer_specs())
    states, kv = _states_and_kv_cache(config)
    assert len(set(states.values())) == 1, states
    assert states[8192] / kv <= CACHED[name]


BENCHMARK_RECIPES = Path(__file__).parents[1] / "benchmarks/recipes"
#: the benchmark recipe the packaged Gemma 3 recipe's recall figures were measured on (docs/recall.md)
MEASURED_GEMMA3 = BENCHMARK_RECIPES / "gemma3-270m-w4-recent120-k8v4g16keydiffspan2313.yaml"
#: what a packaged recipe may change from the file it was measured as: nothing that trains or serves
ONLY_NAMES_AND_PROSE = {"name", "budget", "eval", "description", "source"}


def _settings_apart(packaged: dict, measured: dict) -> set[str]:
    """The top-level settings in which two recipes (``Recipe.as_dict()``) differ."""
    return {key for key in packaged if packaged[key] != measured[key]}


def test_packaged_gemma3_recipe_trains_and_serves_as_the_measured_one() -> None:
    """gemma3-270m-exact-cache-k8v4g16's full budget is the measured recipe in every setting that changes the
    weights or the caches: only its name, budget, evaluation and prose differ."""
    packaged = load_recipe("gemma3-270m-exact-cache-k8v4g16", "full").as_dict()
    measured = load_recipe(MEASURED_GEMMA3).as_dict()
    differ = _settings_apart(packaged, measured)
    assert differ == ONLY_NAMES_AND_PROSE, differ
    assert packaged["serve_overrides"] and packaged["stage2"]["tokens"] == 65536


#: the benchmark recipe the packaged SmolLM2 recall recipe's figures were measured on (docs/recall.md)
MEASURED_SMOLLM2 = BENCHMARK_RECIPES / "retrieval9-int8-int4keydiff-lora32-multikey.yaml"


def test_packaged_smollm2_recall_recipe_trains_as_the_measured_one() -> None:
    """retrieval9-int8-int4keydiff-multikey's full budget is the measured recipe in every setting that changes the
    weights or the caches (gradient checkpointing recomputes the same activations: on here, off in the measured
    file); its quick budget runs the same path for two steps."""
    packaged = load_recipe("retrieval9-int8-int4keydiff-multikey", "full").as_dict()
    measured = load_recipe(MEASURED_SMOLLM2).as_dict()
    assert packaged["stage2"]["gradient_checkpointing"] and not measured["stage2"]["gradient_checkpointing"]
    for recipe in (packaged, measured):
        recipe["stage2"].pop("gradient_checkpointing")
    differ = _settings_apart(packaged, measured)
    assert differ == ONLY_NAMES_AND_PROSE, differ
    assert packaged["stage2"]["tokens"] == 65536 and "multi_key" in packaged["stage2"]["retrieval_kinds"]
    quick = load_recipe("retrieval9-int8-int4keydiff-multikey", "quick").as_dict()
    assert quick["stage2"] == packaged["stage2"] | {"tokens": 4096, "gradient_checkpointing": True}


#: the recall bar's needle cells (README): single needles at 1k and 4k, multi-key and multi-query at 2k
BAR_CELLS = [("single_number", 1024), ("single_number", 4096), ("multi_key", 2048), ("multi_query", 2048)]


@pytest.mark.parametrize("name", ["gemma3-270m-exact-cache-k8v4g16", "retrieval9-int8-int4keydiff-multikey"])
def test_packaged_bar_recipes_evaluate_the_bar_at_their_full_budget(name: str) -> None:
    """The full budget's report measures every cell of the recall bar on both haystacks with 20 prompts, and the
    perplexity on 512- and 4,096-token blocks, and nothing that takes hours beyond them."""
    sizes = load_recipe(name, "full").eval.recall_sizes()
    tasks, lengths, cells = sizes.needle_grid()
    assert cells == BAR_CELLS and sizes.needle_prompts == 20 and sizes.needle_haystacks == ("heldout", "ood")
    assert load_recipe(name, "full").eval.block_size == 512 and sizes.long_lengths == (4096,)
    assert max(sizes.passkey_lengths + sizes.recall_lengths + sizes.distances) <= 1024


@pytest.mark.parametrize("budget", ["quick", "full"])
def test_packaged_gemma3_recipe_fits_a_sixteenth_of_its_teachers_kv_cache(budget: str) -> None:
    """On Gemma 3 270M's shape, as trained and as served: the same bytes at 1k, 8k and 32k tokens, at most 1/16 of
    the teacher's float32 KV cache at 8k (its 15 sliding-window layers hold 512 tokens, its 3 global ones all)."""
    from test_conversion_memory import GEMMA3_270M

    teacher = Gemma3TextConfig(**GEMMA3_270M, sliding_window=512)
    recipe = load_recipe("gemma3-270m-exact-cache-k8v4g16", budget)
    trained = check_against_teacher(recipe, teacher)
    served = served_config(recipe, trained)
    assert [spec["cache_dtype"] for spec in served.layer_specs()] == ["int4g16"] * 5 + ["k8v4g16"] + (
        ["int4g16"] * 5 + ["k8v4g16"]) * 2
    tokens = [8192 if kind == "full_attention" else 511 for kind in teacher.layer_types]  # a window holds 511 pairs
    kv_bytes = sum(tokens) * teacher.num_key_value_heads * teacher.head_dim * 2 * 4
    for config in (trained, served):
        sizes = {n: state_bytes(state_size_report(config, n), 4) for n in (1024, 8192, 32768)}
        assert len(set(sizes.values())) == 1, sizes
        assert sizes[8192] * 16 <= kv_bytes, (sizes[8192] / 2**20, kv_bytes / 16 / 2**20)
        assert sum(r.kv_cache_elements for r in state_size_report(config, 8192)) * 4 == kv_bytes  # what cards show


def _costliest_heads(config: RecAttnConfig, count: int) -> dict[int, list[int]]:
    """``count`` KV heads placed where a retrieval head adds the most bytes: the layers whose own heads keep the
    smallest state, at most all but one KV head per layer."""
    rows = state_size_report(config, 8192)
    layers = sorted(range(len(rows)), key=lambda i: (rows[i].state_elements, i))
    heads: dict[int, list[int]] = {}
    for layer in layers:
        take = min(count - sum(map(len, heads.values())), config.num_key_value_heads - 1)
        if take <= 0:
            break
        heads[layer] = list(range(take))
    return heads


@pytest.mark.parametrize("name", sorted(name for name in available_recipes() if name.startswith("retrieval")))
def test_retrieval_head_recipes_fit_a_sixteenth_of_the_kv_cache(name: str) -> None:
    """The bounded retrieval-head recipes keep a state that is the same at 1k, 8k and 32k tokens and at most 1/16 of
    SmolLM2's KV cache at 8k, wherever their heads land (placed here where they cost the most)."""
    recipe = load_recipe(name, "full")
    settings = recipe.retrieval_heads
    assert settings.max_heads and settings.method == "teacher" and settings.retrieval is not None
    config = check_against_teacher(recipe, smollm2_config())
    config, _ = config_with_retrieval_heads(config, _costliest_heads(config, settings.max_heads), settings.retrieval)
    states, kv = _states_and_kv_cache(config)
    assert len(set(states.values())) == 1, states
    assert states[8192] * 16 <= kv, (states[8192] * 4 / 2**20, kv * 4 / 2**20 / 16)


def test_a_packaged_recipe_is_named_by_its_place_in_the_package(tmp_path: Path) -> None:
    """Reports and messages name a packaged recipe ``hf_recattn/recipes/NAME.yaml``, not this machine's path; a
    file given by path keeps that path."""
    assert load_recipe("gdn").source == "hf_recattn/recipes/gdn.yaml"
    own = write_recipe(tmp_path / "mine.yaml", tiny_recipe_dict())
    assert load_recipe(own).source == str(own)
