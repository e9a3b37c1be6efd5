"""Recall at fixed distances: one fact, then exactly d tokens of held-out text, then the question.

The fact is the held-out ``words`` template's (``The capital of NAME is WORD.``: a made-up name, a word of the
held-out word list) at a sentence start after ``lead`` tokens of text; after it come the first ``d`` tokens of
other held-out text (from a sentence start), then the template's lead-in and the question. The trial passes when
the argmax reproduces every token of the word (teacher-forced through the cache, as in the associative recall
probe). Where the associative recall probe spreads facts over a context, this one says how far back a fact
still comes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..prompting.distance import LEAD, distance_prompt, first_tokens
from ..prompting.haystack import Haystack, texts_from_blocks
from .generation import eval_mode, max_positions
from .progress import progress_bar
from .recall import score_prompt

__all__ = ["DISTANCES", "LEAD", "distance_prompt", "distance_recall_probe", "first_tokens"]

#: tokens of text between the fact and the question, by default
DISTANCES = (100, 1000, 4000, 16000)


def distance_recall_probe(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | torch.Tensor,
    distances: Sequence[int] = DISTANCES,
    trials: int = 3,
    seed: int = 0,
    lead: int = LEAD,
    progress: str | None = None,
) -> dict[str, Any]:
    """The share of trials recalled at each distance, in ``texts`` (held-out documents, or ``[N, T]`` token
    blocks with EOS between documents).

    Trial t at distance d is seeded by ``(seed, d, t)``, so every model sees the same prompts. Returns
    ``accuracy`` ``{distance: share}``, its mean, and every trial under ``answers``; a distance whose prompts
    exceed the model's ``max_position_embeddings`` is left out with the reason under ``skipped``."""
    if not distances or trials < 1 or any(d < 0 for d in distances):
        raise ValueError(f"distance_recall_probe needs distances >= 0 and trials >= 1, got {list(distances)}, "
                         f"{trials}")
    sources = texts_from_blocks(tokenizer, texts) if isinstance(texts, torch.Tensor) else texts
    haystack = Haystack(tokenizer, sources)
    limit = max_positions(model)
    prompts = {d: [distance_prompt(tokenizer, haystack, d, f"{seed}:distance:{d}:{t}", lead) for t in range(trials)]
               for d in distances}
    skipped: dict[str, str] = {}
    for d, trial_prompts in prompts.items():
        longest = max(p.length for p in trial_prompts)
        if limit is not None and longest > limit:
            skipped[str(d)] = f"its prompts take up to {longest} tokens, beyond max_position_embeddings {limit}"
    accuracy: dict[str, float] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    runs = [d for d in distances if str(d) not in skipped]
    with eval_mode(model), progress_bar(len(runs) * trials, progress, "prompt") as bar:
        for d in runs:
            rows = []
            for prompt in prompts[d]:
                rows.append(score_prompt(model, tokenizer, prompt))
                bar.update()
            answers[str(d)] = rows
            accuracy[str(d)] = sum(row["queries"][0]["correct"] for row in rows) / trials
    mean = sum(accuracy.values()) / len(accuracy) if accuracy else None
    return {"accuracy": accuracy, "mean_accuracy": mean, "distances": list(distances), "trials": trials,
            "lead": lead, "skipped": skipped, "answers": answers}
