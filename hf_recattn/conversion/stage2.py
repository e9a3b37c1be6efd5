"""Stage 2 as a step of the conversion: its token blocks (``stage2.retrieval_share`` of them retrieval prompts),
the training package's distillation finetune (resumable from ``stage2/trainer``) and its summary
(``stage2/summary.json``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..atomic import write_json
from ..data.corpus import token_blocks
from ..training import parallel
from ..training.distill import finetune
from .job import Job, Log, Teacher
from .recipe import Recipe
from .retrieval_data import mix_blocks, recipe_window, retrieval_blocks
from .stage1 import tokens_per_second


def stage2(label: str, job: Job, teacher: Teacher, student: nn.Module,
           train_texts: list[str]) -> tuple[nn.Module, dict[str, Any]]:
    """Finetune ``student`` (LoRA merged at the end, or every weight) against the teacher on ``stage2.tokens``
    tokens of the training texts; returns the finetuned student and the stage's summary."""
    recipe, s2 = job.recipe, job.recipe.stage2
    job.log(
        f"{label} stage 2: {'finetuning every weight' if s2.method == 'full' else 'LoRA finetuning'}, "
        f"{s2.tokens} tokens, loss {s2.loss} "
        f"(batch {s2.batch_size} x accumulation {s2.grad_accum} x {s2.block_size} tokens)"
    )
    skip = s2.skip_tokens or 0  # a whole number of blocks (recipe check)
    blocks = token_blocks(
        teacher.tokenizer, train_texts, s2.block_size, max_tokens=s2.tokens + skip, seed=recipe.seed + 1
    )[skip // s2.block_size :]
    if skip:
        job.log(f"stage 2: {skip} tokens of the corpus order skipped (stage2.skip_tokens)")
    blocks, weights = _with_retrieval_data(recipe, blocks, teacher.tokenizer, train_texts, job.log)
    student, result = finetune(
        teacher.model,
        student,
        blocks,
        s2,
        job.output / "stage2" / "trainer",
        seed=recipe.seed,
        progress=job.progress,
        weights=weights,
        fsdp=job.fsdp,
    )
    summary = result.as_dict()
    summary["tokens_per_second"] = tokens_per_second(result)
    if parallel.is_main():
        write_json(job.output / "stage2" / "summary.json", summary)
    return student, summary


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
        extra, weights = retrieval_blocks(tokenizer, train_texts, count, s2.block_size, answer_weight, seed=recipe.seed,
                                          min_distance=recipe_window(recipe))
    except ValueError as err:
        raise ValueError(f"{recipe.source}: stage2.retrieval_share: {err}") from None
    return mix_blocks(blocks[: blocks.shape[0] - count], extra, weights)
