"""The whole conversion: teacher -> student (new attention, or the converted checkpoint a recipe's ``init``
names, to train it further) -> stage 1 -> [retrieval heads] -> stage 2 -> [serve_overrides] -> evaluation ->
checkpoint.

``convert(...)`` is what ``hf-recattn convert`` runs. Its output folder::

    run.json            what this run is (teacher, recipe + fingerprint, budget, seed, data): a rerun with
                        the same identity resumes, anything else is refused unless overwrite=True
    recipe.json         the resolved recipe
    stage1/progress/    resumable stage-1 Trainer checkpoints (checkpoint-N)
    stage1/result/      the trained mixer parameters and a summary (written once, atomically)
    retrieval_heads.json  the KV heads that keep exact softmax (recipes with retrieval_heads.max_heads)
    stage2/trainer/     Trainer checkpoints (resume point of stage 2)
    model/              the converted checkpoint (safetensors + tokenizer + model card), written atomically
    evaluation/NAME/    each evaluated model's finished probes (and needle cells), read back on a rerun
    sittings.json       when each call on the folder began and ended (an interrupted one: at its last file)
    report.json         evaluation of teacher and student (and window-only / far-only for hybrids)

The stages (``STAGES``), each a function of explicit inputs (the ``Job``, what earlier stages made) that returns
what it made: the teacher, the data, the student with stage 1 and the retrieval heads (``stage1.py``), stage 2 and
the saved model (``stage2.py``), the evaluation (``comparison.py``); then the report. Every stage that finished is
skipped on a rerun; an interrupted stage continues from its last checkpoint (the evaluation from its last
finished probe).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn
from transformers import set_seed

from .. import evaluation
from ..atomic import atomic_folder, write_json
from ..data.corpus import is_embedded, load_splits
from ..model_card import write_model_card
from ..modeling.hybrid_options import config_with_layer_options, with_config
from ..provenance import provenance
from ..training import parallel, sharding
from ..training.run_config import tokenizer_max_length
from .checkpoints import check_output_folder, claim_output_folder
from .comparison import compare_models, report_sample
from .from_teacher import student_from_teacher
from .init_checkpoint import check_init, init_facts, load_converted
from .job import Job, Log, Teacher, read_json
from .recipe import Recipe, check_against_teacher, load_recipe
from .sittings import begin_sitting, end_sitting
from .stage1 import keep_retrieval_heads, stage1
from .stage2 import stage2
from .teacher import load_teacher, teacher_license, teacher_name

P = ParamSpec("P")
T = TypeVar("T")

#: the dtypes a teacher may be loaded in (``convert(teacher_dtype=...)``, ``--teacher-dtype``)
TEACHER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: the stages of a conversion, in order (their "[n/N]" labels follow from this list); the report comes after them
STAGES = ("teacher", "data", "stage 1", "stage 2", "evaluation")


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


# ----- what the stages make ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Texts:
    """The corpus split: training texts (both stages, the retrieval prompts) and held-out texts (evaluation)."""

    train: list[str]
    heldout: list[str]
    timings: dict[str, float]


@dataclass(frozen=True)
class Trained:
    """The student after a training stage, the stage's summary and timings; ``earlier``: the converted model
    existed already (a rerun), so both training stages were done earlier."""

    student: nn.Module
    summary: dict[str, Any]
    timings: dict[str, float]
    earlier: bool = False


@dataclass(frozen=True)
class Report:
    """The report (what the stages did and, on rank 0, the evaluation) and the evaluation's timings."""

    values: dict[str, Any]
    timings: dict[str, float]


# ----- the pipeline -----------------------------------------------------------------------------------------
def convert(
    teacher: str = "embedded",
    recipe: str | Recipe = "hybrid-w64-taylor2",
    output: str | os.PathLike = "runs/convert",
    budget: str | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    data: str | None = None,
    progress: bool = True,
    evaluate_models: bool = True,
    log: Log = print,
    teacher_dtype: str = "float32",
    fsdp: bool = False,
) -> dict[str, Any]:
    """Convert ``teacher`` with ``recipe`` into ``output`` (resuming an earlier run there) and evaluate it.

    Returns the report (also written to ``output/report.json``). ``teacher_dtype``: ``bfloat16`` loads the
    teacher in bfloat16 (the student still trains in float32). Under ``torchrun`` / ``accelerate launch`` both
    training stages run data parallel; rank 0 writes the files and evaluates (the other ranks return ``{}``).
    ``fsdp`` (or accelerate launch's FSDP config): both stages shard what they train over the processes (FSDP2).
    """
    began, began_wall = time.perf_counter(), time.time()
    if teacher_dtype not in TEACHER_DTYPES:
        raise ValueError(f"teacher dtype {teacher_dtype!r}: use one of {sorted(TEACHER_DTYPES)}")
    sharding.check_flag(fsdp, "fsdp")
    recipe = recipe.with_seed(seed) if isinstance(recipe, Recipe) else load_recipe(recipe, budget, seed)
    parallel.init_process_group()
    log = log if parallel.is_main() else _quiet
    job = Job(teacher, recipe, Path(output), data, teacher_dtype, progress, evaluate_models, log, fsdp)
    identity = run_identity(teacher, recipe, data)
    if teacher_dtype != "float32":  # added later: float32 runs keep the identity they had
        identity["teacher_dtype"] = teacher_dtype
    decision = check_output_folder(job.output, identity, overwrite)  # refuse early; write nothing yet
    parallel.barrier()  # every process has looked at the folder before rank 0 takes it
    log(
        f"{'resuming' if decision == 'resume' else 'starting'} conversion in {job.output}: recipe {recipe.name} "
        f"(budget {recipe.budget}, seed {recipe.seed})"
    )
    record = provenance(corpus=is_embedded(job.data))  # the code and machine this sitting starts with
    loaded = _stage("teacher", _load_teacher, job, identity, decision)
    if parallel.is_main():  # the folder is the run's now
        begin_sitting(job.output, began_wall, record.get("commit"))
    texts = _stage("data", _prepare_data, job)
    first = _stage("stage 1", _student_and_stage1, job, loaded, texts.train)
    second = _stage("stage 2", _stage2_and_save, job, loaded, first, texts.train)
    report = _stage("evaluation", _evaluate, job, loaded, first, second, texts.heldout, record)
    if not parallel.is_main():
        return {}
    timings = {**loaded.timings, **texts.timings, **first.timings, **second.timings, **report.timings}
    timings["total"] = time.perf_counter() - began
    report.values["sittings"] = end_sitting(job.output, time.time())
    _write_report(job, report.values, timings)
    return report.values


def _stage(name: str, step: Callable[Concatenate[str, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``step(label, ...)``, its "[n/N]" label from ``STAGES``; then every process waits for the others."""
    done = step(f"[{STAGES.index(name) + 1}/{len(STAGES)}]", *args, **kwargs)
    parallel.barrier()
    return done


def _quiet(line: str) -> None:
    """The log of the processes other than rank 0."""


def _load_teacher(label: str, job: Job, identity: dict[str, Any], decision: str) -> Teacher:
    """The teacher and the student's config (the recipe checked against the teacher); then rank 0 takes the
    output folder (``decision``: new / resume / overwrite) and writes ``recipe.json``."""
    t0 = time.perf_counter()
    job.log(f"{label} loading teacher {job.teacher_spec!r}")
    model, tokenizer = load_teacher(job.teacher_spec, dtype=TEACHER_DTYPES[job.teacher_dtype])
    model.eval().requires_grad_(False)
    config = check_against_teacher(job.recipe, model.config, tokenizer)
    if job.recipe.init is not None:
        check_init(job.recipe, config)
    timings = {"load_teacher": time.perf_counter() - t0}
    if parallel.is_main():  # teacher and recipe are fine: now take the folder
        claim_output_folder(job.output, identity, decision)
        write_json(job.output / "recipe.json", job.recipe.as_dict())
    return Teacher(model, tokenizer, config, timings)


def _prepare_data(label: str, job: Job) -> Texts:
    t0 = time.perf_counter()
    job.log(f"{label} preparing data ({job.data or 'embedded corpus'})")
    train, heldout = load_splits(job.data, job.recipe.eval.heldout_fraction)
    return Texts(train, heldout, {"load_data": time.perf_counter() - t0})


def _student_and_stage1(label: str, job: Job, teacher: Teacher, train_texts: list[str]) -> Trained:
    """The student (the teacher's copy with the new attention, or ``init``), stage 1, the retrieval heads."""
    recipe = job.recipe
    if (job.model_dir / "config.json").is_file():
        job.log(f"{label} stage 1: done earlier (the converted model exists)")
        summary = read_json(job.output / "stage1" / "result" / "summary.json")
        return Trained(load_converted(job.model_dir), summary, {}, earlier=True)
    set_seed(recipe.seed)
    if recipe.init is not None:
        student = load_converted(Path(recipe.init).expanduser())
        job.log(f"student: starting from the converted checkpoint {recipe.init!r} (init)")
    else:  # trained in float32 whatever the teacher's dtype
        student = student_from_teacher(teacher.model, teacher.student_config, torch.float32)
    summary = stage1(label, job, teacher, student, train_texts)
    timings = {"stage1": summary.get("seconds", 0.0)}
    if recipe.retrieval_heads.max_heads:
        t0 = time.perf_counter()
        student = keep_retrieval_heads(label, job, teacher, student, train_texts)
        timings["retrieval_heads"] = time.perf_counter() - t0
    return Trained(student, summary, timings)


def _stage2_and_save(label: str, job: Job, teacher: Teacher, first: Trained, train_texts: list[str]) -> Trained:
    """Stage 2 (the training package's distillation finetune), then the converted model saved."""
    if first.earlier:
        job.log(f"{label} stage 2: done earlier")
        return Trained(first.student, read_json(job.output / "stage2" / "summary.json"), {}, earlier=True)
    student, summary, timings = first.student, {}, {}
    if job.recipe.stage2.tokens > 0:
        student, summary = stage2(label, job, teacher, student, train_texts)
        timings["stage2"] = summary["seconds"]
    else:
        job.log(f"{label} stage 2: skipped (stage2.tokens is 0)")
    if job.recipe.serve_overrides:
        served = config_with_layer_options(student.config, job.recipe.serve_overrides)  # checked with the teacher
        student = with_config(student, served, "serve_overrides")
        job.log(f"{label} serving with {job.recipe.serve_overrides} (serve_overrides; the same weights)")
    if parallel.is_main():
        with atomic_folder(job.model_dir) as tmp:
            student.save_pretrained(tmp)
            # the student's own limit: the teacher's context where a layer needs positions, else "unbounded"
            teacher.tokenizer.model_max_length = tokenizer_max_length(student.config.length_limit())
            teacher.tokenizer.save_pretrained(tmp)
        shutil.rmtree(job.output / "stage2" / "trainer", ignore_errors=True)  # resume points are spent now
        job.log(f"saved the converted model to {job.model_dir}")
    return Trained(student, summary, timings)


def _evaluate(label: str, job: Job, teacher: Teacher, first: Trained, second: Trained,
              heldout_texts: list[str], record: dict[str, Any]) -> Report:
    """The report: what the stages did, and (rank 0, unless turned off) the evaluation against the teacher;
    ``record``: the provenance taken when this sitting began (a commit made while it runs is not the code it ran)."""
    if not parallel.is_main():
        return Report({}, {})
    report = _records(job, first.summary, second.summary)
    timings: dict[str, float] = {}
    if job.evaluate_models:
        t0 = time.perf_counter()
        report.update(compare_models(label, job, teacher, second.student, heldout_texts))
        timings["evaluate"] = time.perf_counter() - t0
    report["provenance"] = record
    report["sample"] = report_sample(job, second.student, teacher.tokenizer)
    return Report(report, timings)


def _records(job: Job, stage1_summary: dict[str, Any], stage2_summary: dict[str, Any]) -> dict[str, Any]:
    """The report's first part: teacher, data, recipe, the stages' summaries, the training tokens behind the
    model (``init``'s included) and the retrieval heads kept."""
    recipe = job.recipe
    report = {
        "teacher": teacher_name(job.teacher_spec),
        "teacher_license": teacher_license(job.teacher_spec),
        "data": _teacher_identity(job.data) if job.data else "embedded",
        "recipe": recipe.as_dict(),
        "stage1": stage1_summary,
        "stage2": stage2_summary,
    }
    if job.teacher_dtype != "float32":
        report["teacher_dtype"] = job.teacher_dtype
    report["training_tokens"] = recipe.stage1.tokens + recipe.stage2.tokens
    if recipe.init is not None:
        report["init"] = init_facts(recipe.init)
        report["training_tokens"] += report["init"]["training_tokens"]
    chosen = read_json(job.output / "retrieval_heads.json")
    if "heads" in chosen:
        keys = ("heads", "count", "answered", "prompts", "method", "chosen_scores")
        report["retrieval_heads"] = {key: chosen[key] for key in keys if key in chosen}
    return report


def _write_report(job: Job, report: dict[str, Any], timings: dict[str, float]) -> None:
    """``report.json`` (with the timings) beside the run and the model, and the model card."""
    report["timings_s"] = timings
    evaluation.write_report(job.output, report)
    evaluation.write_report(job.model_dir, report)
    write_model_card(job.model_dir, job.output.resolve().name, report=report)
    count, total = len(report["sittings"]["sittings"]), report["sittings"]["total_s"]
    over = f" ({count} sittings: {total:.0f} s)" if count > 1 else ""
    job.log(f"report: {job.output / 'report.json'}; model card: {job.model_dir / 'README.md'}; "
            f"total {timings['total']:.0f} s{over}")
