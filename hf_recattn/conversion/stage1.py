"""Stage 1 as a step of the conversion: the attention transfer on the student's mixers (resumable from
``stage1/progress``, its result saved once to ``stage1/result``), then the KV heads that keep exact softmax, chosen
on the stage-1 student (``retrieval_heads.json``)."""

from __future__ import annotations

import json
import shutil
from typing import Any

from torch import nn

from ..atomic import atomic_folder, write_json
from ..data.corpus import token_blocks
from ..training import parallel
from ..training.attention_objective import load_mixer_state, mixer_parameters, mixer_state_dict
from ..training.attention_transfer import TransferResult
from .attention_transfer import attention_transfer
from .checkpoints import load_tensors, save_tensors
from .families import teacher_layer_types
from .job import Job, Log, Teacher, read_json
from .layer_selection import selected_layers
from .recipe import Recipe
from .retrieval_data import with_retrieval_blocks
from .retrieval_heads import DEFAULT_OBJECTIVE_KINDS, recall_objective, select_retrieval_heads, with_retrieval_heads
from .teacher_heads import copy_scores, describe, top_heads


def tokens_per_second(result: Any) -> float:
    """Throughput of a stage's result (``tokens``, ``steps``, ``resumed_from``, ``seconds``) in this sitting:
    after a resume, ``seconds`` covers only the steps after ``resumed_from``."""
    trained = result.tokens * (result.steps - result.resumed_from) / max(result.steps, 1)
    return trained / max(result.seconds, 1e-9)


def converted_layers(recipe: Recipe, teacher_config: Any) -> list[int] | None:
    """The teacher layers the recipe replaces (stage 1 trains only those), or None for every layer."""
    if recipe.layers is None:
        return None
    return selected_layers(recipe.layers, teacher_layer_types(teacher_config))


def stage1(label: str, job: Job, teacher: Teacher, student: nn.Module, train_texts: list[str]) -> dict[str, Any]:
    """Train ``student``'s mixers (in place) to match the teacher's attention, or load what an earlier run trained;
    returns the stage's summary ({} when there was nothing to train)."""
    recipe, s1 = job.recipe, job.recipe.stage1
    result_dir = job.output / "stage1" / "result"
    if (result_dir / "summary.json").is_file():
        load_mixer_state(student, load_tensors(result_dir / "mixer.safetensors"), s1.projections)
        job.log(f"{label} stage 1: done earlier (loaded the trained mixer parameters)")
        return read_json(result_dir / "summary.json")
    if s1.tokens <= 0:
        job.log(f"{label} stage 1: skipped (stage1.tokens is 0)")
        return {}
    if not mixer_parameters(student, s1.projections):
        job.log(f"{label} stage 1: skipped (the mixers have no parameters and stage1.projections is empty)")
        return {}
    job.log(f"{label} stage 1: attention transfer, {s1.tokens} tokens (batch {s1.batch_size} x {s1.block_size})")
    blocks = token_blocks(teacher.tokenizer, train_texts, s1.block_size, max_tokens=s1.tokens, seed=recipe.seed)
    blocks, _, answers = with_retrieval_blocks(blocks, recipe, "stage1", teacher.tokenizer, train_texts, job.log)
    result = attention_transfer(
        teacher.model,
        student,
        blocks,
        s1,
        seed=recipe.seed,
        checkpoint_dir=job.output / "stage1" / "progress",
        progress=job.progress,
        layers=converted_layers(recipe, teacher.model.config),
        fsdp=job.fsdp,
        answers=answers if s1.retention_target == "answers" else None,
    )
    summary = result.as_dict()
    summary["tokens_per_second"] = tokens_per_second(result)
    summary["distinct_tokens"] = int(blocks.numel())
    _log_result(result, summary["tokens_per_second"], job.log)
    if parallel.is_main():
        with atomic_folder(result_dir) as tmp:
            save_tensors(tmp / "mixer.safetensors", mixer_state_dict(student, s1.projections))
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
        shutil.rmtree(job.output / "stage1" / "progress", ignore_errors=True)
    return summary


def _log_result(result: TransferResult, per_second: float, log: Log) -> None:
    """One line: steps, trained parameters, the layers' relative MSE (and attention-weight KL) at the end."""
    if not result.relative_last:
        return
    rel = list(result.relative_last.values())
    kls = list(result.attention_kl_last.values())
    kl = f", attention-weight KL mean {sum(kls) / len(kls):.3f} nats" if kls else ""
    log(
        f"stage 1: {result.steps} steps, {result.trainable_parameters} trained parameters, relative MSE "
        f"mean {sum(rel) / len(rel):.3f} (worst {max(rel):.3f}){kl}, {per_second:.0f} tokens/s"
    )


def keep_retrieval_heads(label: str, job: Job, teacher: Teacher, student: nn.Module,
                         train_texts: list[str]) -> nn.Module:
    """Choose the KV heads that keep exact softmax (or the recipe's ``retrieval`` spec): on the stage-1 student by
    the gradient search, or on the teacher by ``method: teacher``; or read the choice of an earlier run from
    ``retrieval_heads.json``. Returns the student that keeps them."""
    settings, log = job.recipe.retrieval_heads, job.log
    path = job.output / "retrieval_heads.json"
    chosen = read_json(path)
    if "heads" in chosen:
        heads = {int(layer): list(kv) for layer, kv in chosen["heads"].items()}
        log(f"{label} retrieval heads: chosen earlier, {sum(map(len, heads.values()))} KV heads")
    else:
        by_teacher = settings.method == "teacher"
        try:
            prompts = recall_objective(teacher.tokenizer, train_texts, settings.context_length, settings.prompts,
                                       seed=job.recipe.seed, kinds=settings.kinds)
        except ValueError as err:
            raise ValueError(f"{job.recipe.source}: retrieval_heads.context_length: {err}") from None
        log(f"{label} retrieval heads: choosing {'the' if by_teacher else 'at most'} {settings.max_heads} KV heads "
            f"{'the teacher copies with ' if by_teacher else ''}on {len(prompts)} recall prompts of "
            f"{settings.context_length} tokens ({', '.join(settings.kinds or DEFAULT_OBJECTIVE_KINDS)})")
        if by_teacher:
            scores = copy_scores(teacher.model, prompts, log=lambda line: log("  " + line))
            heads = top_heads(scores, settings.max_heads)
            record = describe(scores, heads)
        else:
            selection = select_retrieval_heads(student, prompts, settings.max_heads, settings.per_round,
                                               log=lambda line: log("  " + line))
            heads = selection.heads
            record = {"count": selection.count, "answered": selection.answered, "prompts": selection.prompts,
                      "rounds": selection.rounds}
        if parallel.is_main():
            write_json(path, {"heads": {str(k): v for k, v in heads.items()}, **record})
    kept = "exact softmax" if settings.retrieval is None else f"a {settings.retrieval['mixer']} of their own"
    log(f"  {kept} on: " + (", ".join(f"layer {k} KV {v}" for k, v in sorted(heads.items())) or "none"))
    return with_retrieval_heads(student, heads, settings.retrieval)
