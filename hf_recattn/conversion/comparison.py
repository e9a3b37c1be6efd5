"""The conversion's evaluation: the teacher, the untrained baselines (``eval.baselines``: the window of 512 + 4
sinks), the student's declared variants (window-only, far-only) and the student compared on the same held-out
blocks and probes; and the report's sample through the student's cache."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import evaluation
from ..data.corpus import long_documents, token_blocks
from ..modeling.variants import variant_models
from ..training.forms import fastest_forms
from .baselines import baseline_models
from .job import Job, Teacher

EVALUATION_FOLDER = "evaluation"


def compare_models(label: str, job: Job, teacher: Teacher, student: nn.Module,
                   heldout_texts: list[str]) -> dict[str, Any]:
    """Every model evaluated on the same held-out blocks and probes (a progress bar per pass and model, when
    asked); the comparison table is logged. Returns the report's student row, comparison, ratios and table."""
    ev, tokenizer = job.recipe.eval, teacher.tokenizer
    blocks = token_blocks(tokenizer, heldout_texts, ev.block_size, max_tokens=ev.heldout_tokens, seed=0)
    long_texts = long_documents(job.data, heldout_texts)
    job.log(f"{label} evaluating on {blocks.numel()} held-out tokens ({'quick' if ev.quick else 'full'} probes)")

    def evaluate(model: nn.Module, name: str) -> dict[str, Any]:
        return evaluation.evaluate(model, tokenizer, blocks, quick=ev.quick, recall_texts=heldout_texts,
                                   sizes=ev.recall_sizes(), progress=name if job.progress else None,
                                   long_texts=long_texts, store=evaluation_store(job, name))

    rows: dict[str, dict[str, Any]] = {}
    rows["teacher"] = evaluate(teacher.model, "teacher")
    for name, baseline in baseline_models(teacher.model, ev.baseline_names()):
        with fastest_forms(baseline, ev.block_size):
            rows[name] = evaluate(baseline, name)
        del baseline
    models = {**variant_models(student), job.recipe.name: student}
    for name, model in models.items():
        with fastest_forms(model, ev.block_size):  # the perplexity pass; decoding always uses the cache
            rows[name] = evaluate(model, name)
    del models
    table = evaluation.comparison_table(rows)
    job.log(table)
    teacher_ppl = rows["teacher"]["perplexity"]
    ratios = {name: row["perplexity"] / teacher_ppl for name, row in rows.items()}
    return {"student": rows[job.recipe.name], "comparison": rows, "perplexity_ratio": ratios, "table": table}


def evaluation_store(job: Job, name: str) -> evaluation.ProbeStore:
    """Where the evaluation of model ``name`` keeps its finished probes: ``OUTPUT/evaluation/NAME`` (the folder's
    ``run.json`` binds it to this run, whose recipe fixes the probes)."""
    return evaluation.ProbeStore(job.output / EVALUATION_FOLDER / evaluation.ProbeStore.file_name(name))


def report_sample(job: Job, student: nn.Module, tokenizer: Any) -> dict[str, Any]:
    """The report's sample: a greedy continuation of the recipe's prompt through the student's cache, logged."""
    ev = job.recipe.eval
    sample = evaluation.cache_sample(student, tokenizer, ev.sample_prompt, ev.sample_tokens)
    if sample:
        job.log(
            f"sample (greedy, through the {'/'.join(sample['cache_kinds'])} cache, {sample['cache_bytes'] / 2**20:.2f} "
            f"MiB after {sample['tokens']} tokens):\n  {sample['prompt']!r} -> {sample['output']!r}"
        )
    return sample
