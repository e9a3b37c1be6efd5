"""Stage 2's memory options chosen where a recipe leaves them unset (``conversion/memory.py``): off for small
teachers on any machine with 16 GiB free (a tiny conversion then equals one with both options off, bit for bit),
on for a Qwen3-0.6B-shaped teacher at block 2048, explicit settings kept, the choice logged and recorded. The large
shapes are built on the meta device: their bytes are counted, never allocated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_teacher, tiny_teacher_folder, write_recipe
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_recattn.conversion import memory
from hf_recattn.conversion.memory import GIB, choose_memory_options, stage2_memory, stage2_shape
from hf_recattn.conversion.pipeline import convert
from hf_recattn.conversion.recipe import Recipe, available_recipes, check_against_teacher, load_recipe
from hf_recattn.modeling.modeling import RecAttnForCausalLM

#: Qwen3-0.6B's published shape
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)
#: Gemma 3 270M's
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   tie_word_embeddings=True)
#: SmolLM2-135M's, the embedded teacher's
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


def _block(recipe: Recipe, block: int, **stage2: object) -> Recipe:
    """``recipe`` with both stages at ``block`` tokens, batch 1, and ``stage2`` settings over its own."""
    one = {"block_size": block, "batch_size": 1}
    return dataclasses.replace(recipe, stage1=dataclasses.replace(recipe.stage1, **one),
                               stage2=dataclasses.replace(recipe.stage2, **one, **stage2))


def _meta_models(config: object, teacher_class: type, recipe: Recipe,
                 teacher_dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The teacher (in ``teacher_dtype``) and its float32 student as ``hf-recattn convert`` builds them, on meta."""
    with torch.device("meta"):
        teacher = teacher_class(config).to(teacher_dtype)
        student = RecAttnForCausalLM(check_against_teacher(recipe, config)).float()
    return teacher, student


def _qwen3_case(**stage2: object) -> tuple[Recipe, memory.Stage2Shape]:
    """The reported case: a Qwen3-0.6B-shaped bf16 teacher, the gdn recipe with both stages at block 2048."""
    recipe = _block(load_recipe("gdn", "quick"), 2048, **stage2)
    teacher, student = _meta_models(Qwen3Config(**QWEN3_06B), Qwen3ForCausalLM, recipe, torch.bfloat16)
    return recipe, stage2_shape(teacher, student, recipe.stage2, fused_loss=False)


def test_qwen3_06b_at_block_2048_gets_both_options_on_any_machine() -> None:
    recipe, shape = _qwen3_case()
    unset = shape.terms(None, False)
    assert unset["logits"] == 10 * 151936 * 4 * 2048 == 12_446_597_120  # ten fp32 copies of the block's logits
    assert unset["activations"] == 28 * (6 * 1024 + 2 * 24 * 128 + 4 * 3072) * 4 * 2048 == 5_637_144_576
    parameters = 596_049_920  # Qwen3-0.6B's, q / k norms included
    assert unset["weights"] >= parameters * (2 + 4)  # a bf16 teacher and its float32 student (plus its mixers)
    assert shape.total(None, False) > 20 * GIB
    for free in (8, 16, 24, 64, 139):
        choice = choose_memory_options(recipe.stage2, shape, free * GIB)
        assert choice.chosen == ("loss_chunk_size", "gradient_checkpointing"), free
        assert (choice.loss_chunk_size, choice.gradient_checkpointing) == (256, True)
        assert choice.budget == min(free, 16) * GIB // 2
        assert choice.estimate < 5.5 * GIB and choice.given == {}
    run = choice.apply(recipe.stage2)
    assert (run.loss_chunk_size, run.gradient_checkpointing) == (256, True)
    assert recipe.stage2.loss_chunk_size is None  # the recipe itself is unchanged: so is its fingerprint


def test_explicit_settings_are_kept() -> None:
    _, shape = _qwen3_case()
    recipe, _ = _qwen3_case(loss_chunk_size=0, gradient_checkpointing=False)  # both off, as written
    choice = choose_memory_options(recipe.stage2, shape, 16 * GIB)
    assert choice.chosen == () and choice.given == {"loss_chunk_size": 0, "gradient_checkpointing": False}
    assert (choice.loss_chunk_size, choice.gradient_checkpointing) == (None, False)
    assert choice.estimate == shape.total(None, False)
    assert "loss_chunk_size: 0 as the recipe sets it" in choice.line()
    recipe, _ = _qwen3_case(loss_chunk_size=1024)  # one given, the other still chosen
    choice = choose_memory_options(recipe.stage2, shape, 16 * GIB)
    assert (choice.loss_chunk_size, choice.gradient_checkpointing, choice.chosen) == (
        1024, True, ("gradient_checkpointing",))
    assert recipe.fingerprint() != load_recipe("gdn", "quick").fingerprint()


def test_liger_loss_leaves_the_chunks_unset() -> None:
    """Where Liger's fused ops take the loss (a GPU, ``loss_kernel`` auto), no logits are kept: only checkpointing
    is chosen, and the line says why."""
    recipe, shape = _qwen3_case()
    fused = dataclasses.replace(shape, fused_loss=True)
    choice = choose_memory_options(recipe.stage2, fused, 139 * GIB, "free on cuda:0")
    assert choice.chosen == ("gradient_checkpointing",) and choice.loss_chunk_size is None
    assert fused.terms(None, False)["logits"] < 0.1 * GIB
    assert "Liger's fused ops" in choice.line() and "free on cuda:0" in choice.line()


def test_small_teachers_keep_both_options_off() -> None:
    """The embedded teacher's shape with every packaged recipe's quick and full budget, Gemma 3 270M's with its
    recipes' quick budget, and the tiny test teacher: nothing chosen on a machine with 16 GiB free (SmolLM2's quick
    budgets: down to 9 GiB), except where the exact cache's attention keeps gigabytes for the backward
    (``Mixer.backward_numbers``: the budgets that train the cached hybrids, 2,048 tokens a step): checkpointing
    then, chosen or given, and the estimate within the budget."""
    config = LlamaConfig(**SMOLLM2)
    heavy = []
    for name in (name for name in available_recipes() if not name.startswith("gemma")):
        teacher, student = _meta_models(config, LlamaForCausalLM, load_recipe(name), torch.float32)
        for budget, free in (("quick", 9), ("full", 16)):  # the budgets change stage 2's settings, not the models
            recipe = load_recipe(name, budget)
            if not recipe.stage2.tokens:  # nothing to train
                continue
            shape = stage2_shape(teacher, student, recipe.stage2, fused_loss=False)
            choice = choose_memory_options(recipe.stage2, shape, free * GIB)
            if sum(shape.mixer_numbers) * 4 > GIB:
                heavy.append(name)
                assert choice.gradient_checkpointing, (name, budget, choice.line())
                assert set(choice.chosen) <= {"gradient_checkpointing"}, choice.line()
                assert choice.estimate < 7.5 * GIB < shape.total(choice.loss_chunk_size, False), choice.line()
                continue
            assert choice.chosen == () and choice.estimate < 7.5 * GIB, (name, budget, choice.line())
    assert "retrieval9-int8keydiff" in heavy and "hybrid-w64-sink4-gdn-cache64" in heavy
    gemma = Gemma3TextConfig(**GEMMA3_270M)  # the other embedded teacher, with its recipes' quick budget
    recipe = load_recipe("gemma3-270m-full-hybrid-gdn", "quick")
    teacher, student = _meta_models(gemma, Gemma3ForCausalLM, recipe, torch.float32)
    choice = choose_memory_options(recipe.stage2, stage2_shape(teacher, student, recipe.stage2, False), 16 * GIB)
    assert choice.chosen == () and choice.estimate < 7.6 * GIB, choice.line()
    full = load_recipe("gemma3-270m-full-hybrid-gdn", "full")  # four blocks of a 262k vocabulary's logits
    choice = choose_memory_options(full.stage2, stage2_shape(teacher, student, full.stage2, False), 64 * GIB)
    assert choice.chosen == ("loss_chunk_size",) and choice.unset_terms["logits"] == 10 * 262144 * 4 * 2048
    tiny = tiny_teacher(96)
    recipe = Recipe("tiny", {"mixer": "linear"}, "quick", load_recipe("gdn").stage1, load_recipe("gdn").stage2,
                    load_recipe("gdn").eval)
    student = RecAttnForCausalLM(check_against_teacher(recipe, tiny.config))
    shape = stage2_shape(tiny, student, recipe.stage2, fused_loss=False)
    assert shape.total(None, False) < 0.01 * GIB
    assert choose_memory_options(recipe.stage2, shape, GIB).chosen == ()  # even with 1 GiB free
    assert set(choose_memory_options(recipe.stage2, shape, 2**20).chosen) == {"loss_chunk_size",
                                                                              "gradient_checkpointing"}  # 1 MiB


def test_a_resumed_stage_keeps_the_options_it_began_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    recipe, _ = _qwen3_case()
    teacher, student = _meta_models(Qwen3Config(**QWEN3_06B), Qwen3ForCausalLM, recipe, torch.bfloat16)
    lines: list[str] = []
    monkeypatch.setattr(memory, "machine_memory", lambda device: (16 * GIB, "available RAM"))
    settings, record = stage2_memory(teacher, student, recipe.stage2, False, tmp_path, lines.append)
    assert settings.loss_chunk_size == 256 and record["chosen"] == ["loss_chunk_size", "gradient_checkpointing"]
    assert json.loads((tmp_path / "memory.json").read_text())["gradient_checkpointing"] is True
    earlier = {**record, "loss_chunk_size": 512, "gradient_checkpointing": False, "chosen": ["loss_chunk_size"]}
    (tmp_path / "memory.json").write_text(json.dumps(earlier))  # what a first sitting chose elsewhere
    settings, record = stage2_memory(teacher, student, recipe.stage2, False, tmp_path, lines.append)
    assert (settings.loss_chunk_size, settings.gradient_checkpointing) == (512, False)
    assert "resuming with the options chosen" in lines[-2] and "loss_chunk_size 512" in lines[-1]


def test_tiny_conversion_with_unset_options_equals_both_off(tmp_path: Path) -> None:
    """The defaults of a tiny teacher are today's: the model equals, bit for bit, the one converted with
    ``loss_chunk_size: 0`` and ``gradient_checkpointing: false``; the log says what ran and why."""
    teacher, corpus = tiny_teacher_folder(tmp_path / "teacher"), tiny_corpus_file(tmp_path / "corpus.jsonl")
    models, logs = {}, {}
    for name, stage2 in (("unset", {}), ("off", {"loss_chunk_size": 0, "gradient_checkpointing": False})):
        recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_recipe_dict(stage1={"tokens": 0}, stage2=stage2))
        logs[name] = []
        convert(str(teacher), str(recipe), tmp_path / name, data=str(corpus), progress=False, evaluate_models=False,
                log=logs[name].append)
        models[name] = (tmp_path / name / "model" / "model.safetensors").read_bytes()
    assert models["unset"] == models["off"]
    line = next(line for line in logs["unset"] if line.startswith("stage 2 memory:"))
    assert "loss_chunk_size off, gradient_checkpointing off (nothing chosen)" in line and "GiB" in line
    off = next(line for line in logs["off"] if line.startswith("stage 2 memory:"))
    assert "gradient_checkpointing: False as the recipe sets it" in off
    summary = json.loads((tmp_path / "unset" / "stage2" / "summary.json").read_text())
    assert summary["memory"]["chosen"] == [] and summary["memory"]["unset_terms"]["logits"] > 0
