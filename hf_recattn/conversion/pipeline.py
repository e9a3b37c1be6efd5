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

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed

from .. import evaluation
from ..data.corpus import is_embedded, load_splits, token_blocks
from ..model_card import write_model_card
from ..modeling.configuration import RecAttnConfig
from ..modeling.modeling import RecAttnForCausalLM
from ..modeling.variants import variant_models
from ..provenance import provenance
from ..training import parallel
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
from .families import teacher_layer_types
from .finetune import finetune
from .from_llama import from_llama
from .layer_selection import selected_layers
from .recipe import EXPECTABLE, Recipe, check_against_teacher, load_recipe, report_training_tokens
from .retrieval_data import mix_blocks, retrieval_blocks
from .retrieval_heads import recall_objective, select_retrieval_heads, with_retrieval_heads
from .teacher import load_teacher, teacher_license, teacher_name

Log = Callable[[str], None]


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


# ----- the pipeline -----------------------------------------------------------------------------------------
def tokens_per_second(result: Any) -> float:
    """Throughput of a stage's result (``tokens``, ``steps``, ``resumed_from``, ``seconds``) in this sitting:
    after a resume, ``seconds`` covers only the steps after ``resumed_from``."""
    trained = result.tokens * (result.steps - result.resumed_from) / max(result.steps, 1)
    return trained / max(result.seconds, 1e-9)


#: the dtypes a teacher may be loaded in (``convert(teacher_dtype=...)``, ``--teacher-dtype``)
TEACHER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    """What the stages of one conversion share: the inputs, then what each stage makes."""

    teacher: str
    recipe: Recipe
    output: Path
    data: str | None
    progress: bool
    evaluate_models: bool
    log: Log
    identity: dict[str, Any]
    teacher_dtype: str = "float32"
    decision: str = "new"
    teacher_model: Any = None
    tokenizer: Any = None
    config: Any = None
    train_texts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    student: Any = None
    done_earlier: bool = False  # the converted model exists: both training stages are skipped
    stage1: dict[str, Any] = field(default_factory=dict)
    stage2: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.output / "model"


@dataclass(frozen=True)
class Stage:
    """One stage of the conversion: its name and what it does (``run(state, label)``; ``label`` is "[n/N]")."""

    name: str
    run: Callable[[Run, str], None]


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
    teacher_dtype: str = "float32",
) -> dict[str, Any]:
    """Convert ``teacher`` with ``recipe`` into ``output`` (resuming an earlier run there) and evaluate it.

    Returns the report (also written to ``output/report.json``). ``teacher_dtype``: ``bfloat16`` loads the
    teacher in bfloat16 (the student still trains in float32). Under ``torchrun`` / ``accelerate launch`` both
    training stages run data parallel; rank 0 writes the files and evaluates (the other ranks return ``{}``).
    """
    began = time.perf_counter()
    if teacher_dtype not in TEACHER_DTYPES:
        raise ValueError(f"teacher dtype {teacher_dtype!r}: use one of {sorted(TEACHER_DTYPES)}")
    parallel.init_process_group()
    log = log if parallel.is_main() else _quiet
    recipe = recipe.with_seed(seed) if isinstance(recipe, Recipe) else load_recipe(recipe, budget, seed)
    identity = run_identity(teacher, recipe, data)
    if teacher_dtype != "float32":  # added later: float32 runs keep the identity they had
        identity["teacher_dtype"] = teacher_dtype
    run = Run(teacher, recipe, Path(output), data, progress, evaluate_models, log, identity, teacher_dtype)
    run.decision = check_output_folder(run.output, identity, overwrite)  # refuse early; write nothing yet
    parallel.barrier()  # every process has looked at the folder before rank 0 takes it
    log(
        f"{'resuming' if run.decision == 'resume' else 'starting'} conversion in {run.output}: recipe {recipe.name} "
        f"(budget {recipe.budget}, seed {recipe.seed})"
    )
    for number, stage in enumerate(STAGES, 1):
        stage.run(run, f"[{number}/{len(STAGES)}]")
        parallel.barrier()
    if not parallel.is_main():
        return {}
    run.timings["total"] = time.perf_counter() - began
    _write_report(run)
    return run.report


def _quiet(line: str) -> None:
    """The log of the processes other than rank 0."""


def _load_teacher(run: Run, label: str) -> None:
    t0 = time.perf_counter()
    run.log(f"{label} loading teacher {run.teacher!r}")
    run.teacher_model, run.tokenizer = load_teacher(run.teacher, dtype=TEACHER_DTYPES[run.teacher_dtype])
    run.teacher_model.eval().requires_grad_(False)
    run.config = check_against_teacher(run.recipe, run.teacher_model.config, run.tokenizer)
    if run.recipe.init is not None:
        _check_init(run.recipe, run.config)
    run.timings["load_teacher"] = time.perf_counter() - t0
    if parallel.is_main():  # teacher and recipe are fine: now take the folder
        claim_output_folder(run.output, run.identity, run.decision)
        atomic_write_json(run.output / "recipe.json", run.recipe.as_dict())


def _prepare_data(run: Run, label: str) -> None:
    t0 = time.perf_counter()
    run.log(f"{label} preparing data ({run.data or 'embedded corpus'})")
    run.train_texts, run.heldout_texts = load_splits(run.data, run.recipe.eval.heldout_fraction)
    run.timings["load_data"] = time.perf_counter() - t0


def _student_and_stage1(run: Run, label: str) -> None:
    """The student (the teacher's copy with the new attention, or ``init``), stage 1, the retrieval heads."""
    recipe = run.recipe
    if (run.model_dir / "config.json").is_file():
        run.log(f"{label} stage 1: done earlier (the converted model exists)")
        run.done_earlier = True
        run.student = _load_student(run.model_dir)
        run.stage1 = _read_json(run.output / "stage1" / "result" / "summary.json")
        return
    set_seed(recipe.seed)
    if recipe.init is not None:
        run.student = _load_student(Path(recipe.init).expanduser())
        run.log(f"student: starting from the converted checkpoint {recipe.init!r} (init)")
    else:  # trained in float32 whatever the teacher's dtype
        run.student = from_llama(run.teacher_model, recipe.attention, recipe.attention_overrides, recipe.layers).float()
    if run.student.config.layer_specs() != run.config.layer_specs():
        raise RuntimeError("the student's layer specs differ from the recipe check (a bug)")
    run.stage1 = _stage1(recipe, run.teacher_model, run.student, run.tokenizer, run.train_texts, run.output,
                         run.progress, run.log, label)
    run.timings["stage1"] = run.stage1.get("seconds", 0.0)
    if recipe.retrieval_heads.max_heads:
        t0 = time.perf_counter()
        run.student = _keep_retrieval_heads(recipe, run.student, run.tokenizer, run.train_texts, run.output,
                                            run.log, label)
        run.timings["retrieval_heads"] = time.perf_counter() - t0


def _stage2(run: Run, label: str) -> None:
    """Stage 2 (the training package's distillation finetune), then the converted model saved."""
    if run.done_earlier:
        run.log(f"{label} stage 2: done earlier")
        run.stage2 = _read_json(run.output / "stage2" / "summary.json")
        return
    recipe, s2 = run.recipe, run.recipe.stage2
    if s2.tokens > 0:
        run.log(
            f"{label} stage 2: {'finetuning every weight' if s2.method == 'full' else 'LoRA finetuning'}, "
            f"{s2.tokens} tokens, loss {s2.loss} "
            f"(batch {s2.batch_size} x accumulation {s2.grad_accum} x {s2.block_size} tokens)"
        )
        skip = s2.skip_tokens or 0  # a whole number of blocks (recipe check)
        blocks = token_blocks(
            run.tokenizer, run.train_texts, s2.block_size, max_tokens=s2.tokens + skip, seed=recipe.seed + 1
        )[skip // s2.block_size :]
        if skip:
            run.log(f"stage 2: {skip} tokens of the corpus order skipped (stage2.skip_tokens)")
        blocks, weights = _with_retrieval_data(recipe, blocks, run.tokenizer, run.train_texts, run.log)
        run.student, result = finetune(
            run.teacher_model,
            run.student,
            blocks,
            s2,
            run.output / "stage2" / "trainer",
            seed=recipe.seed,
            progress=run.progress,
            weights=weights,
        )
        run.stage2 = result.as_dict()
        run.stage2["tokens_per_second"] = tokens_per_second(result)
        if parallel.is_main():
            atomic_write_json(run.output / "stage2" / "summary.json", run.stage2)
        run.timings["stage2"] = result.seconds
    else:
        run.log(f"{label} stage 2: skipped (stage2.tokens is 0)")
    if parallel.is_main():
        with atomic_dir(run.model_dir) as tmp:
            run.student.save_pretrained(tmp)
            run.tokenizer.model_max_length = run.student.config.max_position_embeddings  # not "unbounded" 1e30
            run.tokenizer.save_pretrained(tmp)
        shutil.rmtree(run.output / "stage2" / "trainer", ignore_errors=True)  # resume points are spent now
        run.log(f"saved the converted model to {run.model_dir}")


def _evaluate(run: Run, label: str) -> None:
    """The report: what the stages did, and (rank 0, unless turned off) the evaluation against the teacher."""
    if not parallel.is_main():
        return
    recipe = run.recipe
    report = run.report
    report.update({
        "teacher": teacher_name(run.teacher),
        "teacher_license": teacher_license(run.teacher),
        "data": _teacher_identity(run.data) if run.data else "embedded",
        "recipe": recipe.as_dict(),
        "stage1": run.stage1,
        "stage2": run.stage2,
    })
    if run.teacher_dtype != "float32":
        report["teacher_dtype"] = run.teacher_dtype
    report["training_tokens"] = recipe.stage1.tokens + recipe.stage2.tokens
    if recipe.init is not None:
        report["init"] = _init_facts(recipe.init)
        report["training_tokens"] += report["init"]["training_tokens"]
    chosen = _read_json(run.output / "retrieval_heads.json")
    if "heads" in chosen:
        report["retrieval_heads"] = {key: chosen[key] for key in ("heads", "count", "answered", "prompts")}
    if run.evaluate_models:
        t0 = time.perf_counter()
        report.update(_evaluate_all(recipe, run.teacher_model, run.student, run.tokenizer, run.heldout_texts,
                                    run.log, label, run.progress))
        run.timings["evaluate"] = time.perf_counter() - t0
    report["provenance"] = provenance(corpus=is_embedded(run.data))
    report["sample"] = sample_through_cache(
        run.student, run.tokenizer, recipe.eval.sample_prompt, recipe.eval.sample_tokens, run.log
    )


def _write_report(run: Run) -> None:
    """``report.json`` beside the run and the model, and the model card."""
    run.report["timings_s"] = run.timings
    evaluation.write_report(run.output, run.report)
    evaluation.write_report(run.model_dir, run.report)
    write_model_card(run.model_dir, run.output.resolve().name, report=run.report)
    run.log(
        f"report: {run.output / 'report.json'}; model card: {run.model_dir / 'README.md'}; "
        f"total {run.timings['total']:.0f} s"
    )


#: the stages of a conversion, in order (their "[n/N]" labels follow from this list)
STAGES: tuple[Stage, ...] = (
    Stage("teacher", _load_teacher),
    Stage("data", _prepare_data),
    Stage("stage 1", _student_and_stage1),
    Stage("stage 2", _stage2),
    Stage("evaluation", _evaluate),
)


def converted_layers(recipe: Recipe, teacher_config: Any) -> list[int] | None:
    """The teacher layers the recipe replaces (stage 1 trains only those), or None for every layer."""
    if recipe.layers is None:
        return None
    return selected_layers(recipe.layers, teacher_layer_types(teacher_config))


def _stage1(
    recipe: Recipe,
    teacher: torch.nn.Module,
    student: torch.nn.Module,
    tokenizer: Any,
    train_texts: list[str],
    output: Path,
    progress: bool,
    log: Log,
    label: str,
) -> dict:
    s1 = recipe.stage1
    result_dir = output / "stage1" / "result"
    if (result_dir / "summary.json").is_file():
        load_mixer_state(student, load_tensors(result_dir / "mixer.safetensors"), s1.projections)
        log(f"{label} stage 1: done earlier (loaded the trained mixer parameters)")
        return _read_json(result_dir / "summary.json")
    if s1.tokens <= 0:
        log(f"{label} stage 1: skipped (stage1.tokens is 0)")
        return {}
    if not mixer_parameters(student, s1.projections):
        log(f"{label} stage 1: skipped (the mixers have no parameters and stage1.projections is empty)")
        return {}
    log(f"{label} stage 1: attention transfer, {s1.tokens} tokens (batch {s1.batch_size} x {s1.block_size})")
    blocks = token_blocks(tokenizer, train_texts, s1.block_size, max_tokens=s1.tokens, seed=recipe.seed)
    result: TransferResult = attention_transfer(
        teacher,
        student,
        blocks,
        s1,
        seed=recipe.seed,
        checkpoint_dir=output / "stage1" / "progress",
        progress=progress,
        layers=converted_layers(recipe, teacher.config),
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
    if parallel.is_main():
        with atomic_dir(result_dir) as tmp:
            save_tensors(tmp / "mixer.safetensors", mixer_state_dict(student, s1.projections))
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
        shutil.rmtree(output / "stage1" / "progress", ignore_errors=True)
    return summary


def _keep_retrieval_heads(recipe: Recipe, student: torch.nn.Module, tokenizer: Any, train_texts: list[str],
                          output: Path, log: Log, label: str) -> torch.nn.Module:
    """Choose the KV heads that keep exact softmax on the stage-1 student (or read the choice of an earlier run
    from ``retrieval_heads.json``) and return the student that keeps them."""
    settings = recipe.retrieval_heads
    path = output / "retrieval_heads.json"
    chosen = _read_json(path)
    if "heads" in chosen:
        heads = {int(layer): list(kv) for layer, kv in chosen["heads"].items()}
        log(f"{label} retrieval heads: chosen earlier, {sum(map(len, heads.values()))} KV heads")
    else:
        log(f"{label} retrieval heads: choosing at most {settings.max_heads} KV heads on {2 * settings.prompts} recall "
            f"prompts of {settings.context_length} tokens")
        try:
            prompts = recall_objective(tokenizer, train_texts, settings.context_length, settings.prompts,
                                       seed=recipe.seed)
        except ValueError as err:
            raise ValueError(f"{recipe.source}: retrieval_heads.context_length: {err}") from None
        selection = select_retrieval_heads(student, prompts, settings.max_heads, settings.per_round,
                                           log=lambda line: log("  " + line))
        heads = selection.heads
        if parallel.is_main():
            atomic_write_json(path, {"heads": {str(k): v for k, v in heads.items()}, "count": selection.count,
                                     "answered": selection.answered, "prompts": selection.prompts,
                                     "rounds": selection.rounds})
    log("  exact softmax on: " + (", ".join(f"layer {k} KV {v}" for k, v in sorted(heads.items())) or "none"))
    return with_retrieval_heads(student, heads)


def _with_retrieval_data(recipe: Recipe, blocks: torch.Tensor, tokenizer: Any, train_texts: list[str],
                         log: Log) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 2's blocks with ``stage2.retrieval_share`` of them replaced by retrieval prompts built from the
    training texts (same count and length), and the loss weights; the blocks unchanged without the option."""
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
    label: str,
    progress: bool,
) -> dict[str, Any]:
    ev = recipe.eval
    blocks = token_blocks(tokenizer, heldout_texts, ev.block_size, max_tokens=ev.heldout_tokens, seed=0)
    log(f"{label} evaluating on {blocks.numel()} held-out tokens ({'quick' if ev.quick else 'full'} probes)")
    rows: dict[str, dict[str, Any]] = {}
    rows["teacher"] = evaluation.evaluate(teacher, tokenizer, blocks, quick=ev.quick, recall_texts=heldout_texts,
                                          progress="teacher" if progress else None)
    models = {**variant_models(student), recipe.name: student}
    for name, model in models.items():
        with fastest_forms(model, ev.block_size):  # the perplexity pass; decoding always uses the cache
            rows[name] = evaluation.evaluate(model, tokenizer, blocks, quick=ev.quick, recall_texts=heldout_texts,
                                             progress=name if progress else None)
    del models
    table = evaluation.comparison_table(rows)
    log(table)
    teacher_ppl = rows["teacher"]["perplexity"]
    ratios = {name: row["perplexity"] / teacher_ppl for name, row in rows.items()}
    return {"student": rows[recipe.name], "comparison": rows, "perplexity_ratio": ratios, "table": table}


def sample_through_cache(
    model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int, log: Log = print
) -> dict[str, Any]:
    """Greedy-generate from ``prompt`` through the model's cache; report the text and cache size."""
    sample = evaluation.cache_sample(model, tokenizer, prompt, max_new_tokens)
    if sample:
        log(
            f"sample (greedy, through the {'/'.join(sample['cache_kinds'])} cache, {sample['cache_bytes'] / 2**20:.2f} "
            f"MiB after {sample['tokens']} tokens):\n  {prompt!r} -> {sample['output']!r}"
        )
    return sample


def _check_init(recipe: Recipe, config: Any) -> None:
    """``recipe.init`` must be a converted checkpoint with the recipe's attention (layer by layer) and the
    teacher's shape: checked from its config before the run takes its output folder."""
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
    return RecAttnForCausalLM.from_pretrained(folder).eval()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
