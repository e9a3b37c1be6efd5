"""Stage 2 as a step of the conversion: its token blocks (``stage2.retrieval_share`` of them retrieval prompts),
the training package's distillation finetune (resumable from ``stage2/trainer``) and its summary
(``stage2/summary.json``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..atomic import write_json
from ..data.corpus import token_blocks
from ..training import parallel
from ..training.distill import finetune
from .job import Job, Teacher
from .memory import stage2_memory
from .retrieval_data import with_retrieval_blocks
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
    blocks, weights, _ = with_retrieval_blocks(blocks, recipe, "stage2", teacher.tokenizer, train_texts, job.log)
    settings, memory = stage2_memory(teacher.model, student, s2, weights is not None, job.output / "stage2", job.log)
    student, result = finetune(
        teacher.model,
        student,
        blocks,
        settings,
        job.output / "stage2" / "trainer",
        seed=recipe.seed,
        progress=job.progress,
        weights=weights,
        fsdp=job.fsdp,
    )
    summary = result.as_dict()
    summary["tokens_per_second"] = tokens_per_second(result)
    summary["memory"] = memory
    if parallel.is_main():
        write_json(job.output / "stage2" / "summary.json", summary)
    return student, summary
