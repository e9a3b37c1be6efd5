"""The whole conversion: teacher -> student (new attention, or the converted checkpoint a recipe's ``init``
names, to train it further) -> stage 1 -> [retrieval heads] -> stage 2 -> evaluation -> checkpoint.

``convert(...)`` is what ``hf-recattn convert`` runs. Its output folder::

    run.json            what this run is (teacher, recipe + fingerprint, budget, seed, data): a rerun with
                        the same identity resumes, anything else is refused unless overwrite=True
    recipe.json         the resolved recipe
    stage1/progress/    resumable stage-1 checkpoints (step-N, written atomically)
    stage1/result/      the trained mixer parameters and a summary (written once, atomically)
    retrieval_heads.json  the KV heads that keep exact softmax (recipes with retrieval_heads.max_heads)
    stage2/trainer/     Trainer checkpoints (resume point of stage 2)
    model/              the converted checkpoint (safetensors + tokenizer + model card), written atomically
    report.json         evaluation of teacher and student (and window-only / far-only for hybrids)

Every stage that finished is skipped on a rerun; an interrupted stage continues from its last checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed

from ..modeling.cache import CACHE_NAME
from ..modeling.mixers import mixer_class
from .attention_transfer import (
    TransferResult,
    attention_transfer,
    fastest_forms,
    load_mixer_state,
    mixer_parameters,
    mixer_state_dict,
)
from .checkpoints import (
    atomic_dir,
    atomic_write_json,
    check_output_folder,
    claim_output_folder,
    load_tensors,
    save_tensors,
)
from .recipe import EXPECTABLE, Recipe, check_against_teacher, load_recipe, report_training_tokens

Log = Callable[[str], None]
#: where a layer's mixer parameters start in a state-dict key
MIXER_KEY = ".mixer."


# ----- identity ---------------------------------------------------------------------------------------------
def _teacher_identity(spec: str) -> str:
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def run_identity(teacher: str, recipe: Recipe, data: str | None) -> dict[str, Any]:
    return {
        "teacher": _teacher_identity(teacher),
        "recipe": recipe.name,
        "recipe_fingerprint": recipe.fingerprint(),
        "budget": recipe.budget,
        "seed": recipe.seed,
        "data": _teacher_identity(data) if data else "embedded",
    }


# ----- composites: their declared variants, as models of their own -----------------------------------------
def variant_models(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """For a model with composite layers (a hybrid, also beside retrieval heads): the same weights as each named
    variant its layers declare (``Mixer.variants``: window-only, far-only, ...).

    Each declared layer takes the variant's spec and maps its mixer's parameter keys by the variant's key map
    (e.g. ``mixer.far.*`` -> ``mixer.*``; the hybrid's mixing weights have no place in a far-only model); other
    layers stay as they are.
    """
    from ..modeling.modeling import RecAttnForCausalLM

    specs = model.config.layer_specs()
    declared = [mixer_class(spec["mixer"], f"layer {i}").variants(spec) for i, spec in enumerate(specs)]
    names = list(dict.fromkeys(name for variants in declared for name in variants))
    state = model.state_dict()
    out: dict[str, torch.nn.Module] = {}
    for name in names:
        config = copy.deepcopy(model.config)
        config.attention = [layer[name][0] if name in layer else s for s, layer in zip(specs, declared, strict=True)]
        config.attention_overrides = None
        variant = RecAttnForCausalLM(config).to(next(model.parameters()).dtype)
        mapped = {}
        for key, value in state.items():
            layer, mixer, inner = key.partition(MIXER_KEY)
            variants = declared[_layer_of(key)] if mixer else {}
            renamed = variants[name][1](inner) if name in variants else inner
            if renamed is not None:
                mapped[layer + mixer + renamed] = value
        result = variant.load_state_dict(mapped, strict=False)
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
        if missing:
            raise ValueError(f"{name}: the variant has parameters the model does not provide: {missing[:4]}")
        if config.tie_word_embeddings:
            variant.tie_weights()
        out[name] = variant.eval()
    return out


def _layer_of(key: str) -> int:
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1])


# ----- the pipeline -----------------------------------------------------------------------------------------
def tokens_per_second(result: Any) -> float:
    """Throughput of a stage's result (``tokens``, ``steps``, ``resumed_from``, ``seconds``) in this sitting:
    after a resume, ``seconds`` covers only the steps after ``resumed_from``."""
    trained = result.tokens * (result.steps - result.resumed_from) / max(result.steps, 1)
    return trained / max(result.seconds, 1e-9)


def convert(
    teacher: str = "embedded",
    recipe: str | Recipe = "hybrid-w64-taylor2",
    output: str | os.PathLike = "runs/convert",
    budget: str = "quick",
    seed: int | None = None,
    overwrite: bool = False,
    data: str | None = None,
    progress: bool = True,
    evaluate_models: bool = True,
    log: Log = print,
) -> dict[str, Any]:
    """Convert ``teacher`` with ``recipe`` into ``output`` (resuming an earlier run there) and evaluate it.

    Returns the report (also written to ``output/report.json``).
    """
    from ..data.corpus import is_embedded, load_splits, token_blocks
    from ..provenance import provenance
    from .finetune import finetune
    from .from_llama import from_llama
    from .teacher import load_teacher, teacher_license, teacher_name

    began = time.perf_counter()
    recipe = recipe.with_seed(seed) if isinstance(recipe, Recipe) else load_recipe(recipe, budget, seed)
    output = Path(output)
    identity = run_identity(teacher, recipe, data)
    decision = check_output_folder(output, identity, overwrite)  # refuse early; write nothing yet
    log(
        f"{'resuming' if decision == 'resume' else 'starting'} conversion in {output}: recipe {recipe.name} "
        f"(budget {recipe.budget}, seed {recipe.seed})"
    )
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    log(f"[1/5] loading teacher {teacher!r}")
    teacher_model, tokenizer = load_teacher(teacher)
    teacher_model.eval().requires_grad_(False)
    config = check_against_teacher(recipe, teacher_model.config, tokenizer)
    if recipe.init is not None:
        _check_init(recipe, config)
    timings["load_teacher"] = time.perf_counter() - t0
    claim_output_folder(output, identity, decision)  # teacher and recipe are fine: now take the folder
    atomic_write_json(output / "recipe.json", recipe.as_dict())

    t0 = time.perf_counter()
    log(f"[2/5] preparing data ({data or 'embedded corpus'})")
    train_texts, heldout_texts = load_splits(data, recipe.eval.heldout_fraction)
    timings["load_data"] = time.perf_counter() - t0

    model_dir = output / "model"
    stage1_summary: dict[str, Any] = {}
    stage2_summary: dict[str, Any] = {}
    if (model_dir / "config.json").is_file():
        log("[3/5] stage 1: done earlier (the converted model exists)")
        log("[4/5] stage 2: done earlier")
        student = _load_student(model_dir)
        stage1_summary = _read_json(output / "stage1" / "result" / "summary.json")
        stage2_summary = _read_json(output / "stage2" / "summary.json")
    else:
        set_seed(recipe.seed)
        if recipe.init is not None:
            student = _load_student(Path(recipe.init).expanduser())
            log(f"student: starting from the converted checkpoint {recipe.init!r} (init)")
        else:
            student = from_llama(teacher_model, recipe.attention, recipe.attention_overrides, recipe.layers)
        if student.config.layer_specs() != config.layer_specs():
            raise RuntimeError("the student's layer specs differ from the recipe check (a bug)")
        stage1_summary = _stage1(
            recipe, teacher_model, student, tokenizer, train_texts, output, progress, log, token_blocks
        )
        timings["stage1"] = stage1_summary.get("seconds", 0.0)
        if recipe.retrieval_heads.max_heads:
            t0 = time.perf_counter()
            student = _keep_retrieval_heads(recipe, student, tokenizer, train_texts, output, log)
            timings["retrieval_heads"] = time.perf_counter() - t0
        s2 = recipe.stage2
        if s2.tokens > 0:
            log(
                f"[4/5] stage 2: {'finetuning every weight' if s2.method == 'full' else 'LoRA finetuning'}, "
                f"{s2.tokens} tokens, loss {s2.loss} "
                f"(batch {s2.batch_size} x accumulation {s2.grad_accum} x {s2.block_size} tokens)"
            )
            skip = s2.skip_tokens or 0  # a whole number of blocks (recipe check)
            blocks = token_blocks(
                tokenizer, train_texts, s2.block_size, max_tokens=s2.tokens + skip, seed=recipe.seed + 1
            )[skip // s2.block_size :]
            if skip:
                log(f"stage 2: {skip} tokens of the corpus order skipped (stage2.skip_tokens)")
            blocks, weights = _with_retrieval_data(recipe, blocks, tokenizer, train_texts, log)
            student, result = finetune(
                teacher_model,
                student,
                blocks,
                s2,
                output / "stage2" / "trainer",
                seed=recipe.seed,
                progress=progress,
                weights=weights,
            )
            stage2_summary = result.as_dict()
            stage2_summary["tokens_per_second"] = tokens_per_second(result)
            atomic_write_json(output / "stage2" / "summary.json", stage2_summary)
            timings["stage2"] = result.seconds
        else:
            log("[4/5] stage 2: skipped (stage2.tokens is 0)")
        with atomic_dir(model_dir) as tmp:
            student.save_pretrained(tmp)
            tokenizer.model_max_length = student.config.max_position_embeddings  # not the "unbounded" 1e30
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(output / "stage2" / "trainer", ignore_errors=True)  # resume points are spent now
        log(f"saved the converted model to {model_dir}")

    report: dict[str, Any] = {
        "teacher": teacher_name(teacher),
        "teacher_license": teacher_license(teacher),
        "data": _teacher_identity(data) if data else "embedded",
        "recipe": recipe.as_dict(),
        "stage1": stage1_summary,
        "stage2": stage2_summary,
    }
    report["training_tokens"] = recipe.stage1.tokens + recipe.stage2.tokens
    if recipe.init is not None:
        report["init"] = _init_facts(recipe.init)
        report["training_tokens"] += report["init"]["training_tokens"]
    chosen = _read_json(output / "retrieval_heads.json")
    if "heads" in chosen:
        report["retrieval_heads"] = {key: chosen[key] for key in ("heads", "count", "answered", "prompts")}
    if evaluate_models:
        t0 = time.perf_counter()
        report.update(
            _evaluate_all(recipe, teacher_model, student, tokenizer, heldout_texts, log, token_blocks)
        )
        timings["evaluate"] = time.perf_counter() - t0
    report["provenance"] = provenance(corpus=is_embedded(data))
    report["sample"] = sample_through_cache(
        student, tokenizer, recipe.eval.sample_prompt, recipe.eval.sample_tokens, log
    )
    timings["total"] = time.perf_counter() - began
    report["timings_s"] = timings
    from ..evaluation import write_report

    write_report(output, report)
    write_report(model_dir, report)
    from ..model_card import write_model_card

    write_model_card(model_dir, output.resolve().name, report=report)
    log(
        f"report: {output / 'report.json'}; model card: {model_dir / 'README.md'}; "
        f"total {timings['total']:.0f} s"
    )
    return report


def _stage1(
    recipe: Recipe,
    teacher: torch.nn.Module,
    student: torch.nn.Module,
    tokenizer: Any,
    train_texts: list[str],
    output: Path,
    progress: bool,
    log: Log,
    token_blocks: Callable,
) -> dict:
    s1 = recipe.stage1
    result_dir = output / "stage1" / "result"
    if (result_dir / "summary.json").is_file():
        load_mixer_state(student, load_tensors(result_dir / "mixer.safetensors"), s1.projections)
        log("[3/5] stage 1: done earlier (loaded the trained mixer parameters)")
        return _read_json(result_dir / "summary.json")
    if s1.tokens <= 0:
        log("[3/5] stage 1: skipped (stage1.tokens is 0)")
        return {}
    if not mixer_parameters(student, s1.projections):
        log("[3/5] stage 1: skipped (the mixers have no parameters and stage1.projections is empty)")
        return {}
    log(f"[3/5] stage 1: attention transfer, {s1.tokens} tokens (batch {s1.batch_size} x {s1.block_size})")
    blocks = token_blocks(tokenizer, train_texts, s1.block_size, max_tokens=s1.tokens, seed=recipe.seed)
    result: TransferResult = attention_transfer(
        teacher,
        student,
        blocks,
        s1,
        seed=recipe.seed,
        checkpoint_dir=output / "stage1" / "progress",
        progress=progress,
    )
    summary = result.as_dict()
    summary["tokens_per_second"] = tokens_per_second(result)
    summary["distinct_tokens"] = int(blocks.numel())
    if result.relative_last:
        rel = list(result.relative_last.values())
        kls = list(result.attention_kl_last.values())
        kl = f", attention-weight KL mean {sum(kls) / len(kls):.3f} nats" if kls else ""
        log(
            f"stage 1: {result.steps} steps, {result.trainable_parameters} trained parameters, relative MSE "
            f"mean {sum(rel) / len(rel):.3f} (worst {max(rel):.3f}){kl}, "
            f"{summary['tokens_per_second']:.0f} tokens/s"
        )
    with atomic_dir(result_dir) as tmp:
        save_tensors(tmp / "mixer.safetensors", mixer_state_dict(student, s1.projections))
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
    shutil.rmtree(output / "stage1" / "progress", ignore_errors=True)
    return summary


def _keep_retrieval_heads(recipe: Recipe, student: torch.nn.Module, tokenizer: Any, train_texts: list[str],
                          output: Path, log: Log) -> torch.nn.Module:
    """Choose the KV heads that keep exact softmax on the stage-1 student (or read the choice of an earlier run
    from ``retrieval_heads.json``) and return the student that keeps them."""
    from .retrieval_heads import recall_objective, select_retrieval_heads, with_retrieval_heads

    settings = recipe.retrieval_heads
    path = output / "retrieval_heads.json"
    chosen = _read_json(path)
    if "heads" in chosen:
        heads = {int(layer): list(kv) for layer, kv in chosen["heads"].items()}
        log(f"[3/5] retrieval heads: chosen earlier, {sum(map(len, heads.values()))} KV heads")
    else:
        log(f"[3/5] retrieval heads: choosing at most {settings.max_heads} KV heads on {2 * settings.prompts} recall "
            f"prompts of {settings.context_length} tokens")
        try:
            prompts = recall_objective(tokenizer, train_texts, settings.context_length, settings.prompts,
                                       seed=recipe.seed)
        except ValueError as err:
            raise ValueError(f"{recipe.source}: retrieval_heads.context_length: {err}") from None
        selection = select_retrieval_heads(student, prompts, settings.max_heads, settings.per_round,
                                           log=lambda line: log("  " + line))
        heads = selection.heads
        atomic_write_json(path, {"heads": {str(k): v for k, v in heads.items()}, "count": selection.count,
                                 "answered": selection.answered, "prompts": selection.prompts,
                                 "rounds": selection.rounds})
    log("  exact softmax on: " + (", ".join(f"layer {k} KV {v}" for k, v in sorted(heads.items())) or "none"))
    return with_retrieval_heads(student, heads)


def _with_retrieval_data(recipe: Recipe, blocks: torch.Tensor, tokenizer: Any, train_texts: list[str],
                         log: Log) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 2's blocks with ``stage2.retrieval_share`` of them replaced by retrieval prompts built from the
    training texts (same count and length), and the loss weights; the blocks unchanged without the option."""
    from .retrieval_data import mix_blocks, retrieval_blocks

    s2 = recipe.stage2
    count = round((s2.retrieval_share or 0.0) * blocks.shape[0])
    if count == 0:
        return blocks, None
    answer_weight = s2.answer_weight or 1.0
    log(f"      {count} of {blocks.shape[0]} blocks hide facts in training text and ask for them "
        f"(answer weight {answer_weight:g})")
    try:
        extra, weights = retrieval_blocks(tokenizer, train_texts, count, s2.block_size, answer_weight, seed=recipe.seed)
    except ValueError as err:
        raise ValueError(f"{recipe.source}: stage2.retrieval_share: {err}") from None
    return mix_blocks(blocks[: blocks.shape[0] - count], extra, weights)


def _evaluate_all(
    recipe: Recipe,
    teacher: torch.nn.Module,
    student: torch.nn.Module,
    tokenizer: Any,
    heldout_texts: list[str],
    log: Log,
    token_blocks: Callable,
) -> dict[str, Any]:
    from ..evaluation import comparison_table, evaluate

    ev = recipe.eval
    blocks = token_blocks(tokenizer, heldout_texts, ev.block_size, max_tokens=ev.heldout_tokens, seed=0)
    log(f"[5/5] evaluating on {blocks.numel()} held-out tokens ({'quick' if ev.quick else 'full'} probes)")
    rows: dict[str, dict[str, Any]] = {}
    rows["teacher"] = evaluate(teacher, tokenizer, blocks, quick=ev.quick, recall_texts=heldout_texts)
    models = {**variant_models(student), recipe.name: student}
    for name, model in models.items():
        with fastest_forms(model, ev.block_size):  # the perplexity pass; decoding always uses the cache
            rows[name] = evaluate(model, tokenizer, blocks, quick=ev.quick, recall_texts=heldout_texts)
    del models
    table = comparison_table(rows)
    log(table)
    teacher_ppl = rows["teacher"]["perplexity"]
    ratios = {name: row["perplexity"] / teacher_ppl for name, row in rows.items()}
    return {"student": rows[recipe.name], "comparison": rows, "perplexity_ratio": ratios, "table": table}


@torch.no_grad()
def sample_through_cache(
    model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int, log: Log = print
) -> dict[str, Any]:
    """Greedy-generate from ``prompt`` with an explicit recurrent cache; report the text and cache size."""
    if max_new_tokens <= 0:
        return {}
    from ..evaluation import cache_nbytes, prompt_ids

    ids = prompt_ids(tokenizer, prompt)
    cache = model.new_cache()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **{CACHE_NAME: cache},
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad if (pad := tokenizer.pad_token_id) is not None else tokenizer.eos_token_id,
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    kinds = sorted({layer.kind for layer in cache.layers})
    sample = {
        "prompt": prompt,
        "output": text,
        "cache_bytes": cache_nbytes(cache),
        "cache_kinds": kinds,
        "tokens": int(out.shape[1]),
    }
    log(
        f"sample (greedy, through the {'/'.join(kinds)} cache, {sample['cache_bytes'] / 2**20:.2f} MiB after "
        f"{sample['tokens']} tokens):\n  {prompt!r} -> {text!r}"
    )
    return sample


def _check_init(recipe: Recipe, config: Any) -> None:
    """``recipe.init`` must be a converted checkpoint with the recipe's attention (layer by layer) and the
    teacher's shape: checked from its config before the run takes its output folder."""
    from ..modeling.configuration import RecAttnConfig

    where = f"{recipe.source}: init {recipe.init!r}"
    folder = Path(str(recipe.init)).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{where} is not a converted checkpoint folder (no config.json)")
    init = RecAttnConfig.from_pretrained(folder)
    for key in EXPECTABLE:  # the teacher's shape, as a recipe's ``expects`` may pin it
        have, want = getattr(init, key), getattr(config, key)
        if have != want:
            raise ValueError(f"{where} has {key} {have}, the teacher {want}")
    for layer, (have, want) in enumerate(zip(init.layer_specs(), config.layer_specs(), strict=True)):
        if have != want:
            raise ValueError(f"{where} layer {layer} has attention {have}, the recipe {want}")


def _init_facts(init: str) -> dict[str, Any]:
    """The checkpoint a continuing run starts from and the training tokens behind it (its saved report)."""
    earlier = _read_json(Path(init).expanduser() / "report.json")
    return {"checkpoint": init, "recipe": (earlier.get("recipe") or {}).get("name"),
            "training_tokens": report_training_tokens(earlier)}


def _load_student(folder: Path) -> torch.nn.Module:
    from ..modeling.modeling import RecAttnForCausalLM

    return RecAttnForCausalLM.from_pretrained(folder).eval()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
