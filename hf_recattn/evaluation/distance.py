"""Recall at fixed distances: one fact, then exactly d tokens of held-out text, then the question.

The fact is the held-out ``words`` template's (``The capital of NAME is WORD.``: a made-up name, a word of the
held-out word list) at a sentence start after ``lead`` tokens of text; after it come the first ``d`` tokens of
other held-out text (from a sentence start), then the template's lead-in and the question. The trial passes when
the argmax reproduces every token of the word (teacher-forced through the cache, as in the associative recall
probe). Where the associative recall probe spreads facts over a context, this one says how far back a fact
still comes through.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .facts import make_facts
from .generation import eval_mode, max_positions
from .progress import progress_bar
from .prompts import fill_tokens
from .recall import Haystack, RecallPrompt, score_prompt, texts_from_blocks
from .templates import Template, probe_template

#: tokens of text between the fact and the question, by default
DISTANCES = (100, 1000, 4000, 16000)
LEAD = 64  # tokens of text before the fact


def first_tokens(pieces: Iterable[Sequence[int]], n_tokens: int) -> list[int]:
    """The first ``n_tokens`` ids of the pieces laid end to end (fewer only when they run out)."""
    ids: list[int] = []
    for piece in pieces:
        if len(ids) >= n_tokens:
            break
        ids.extend(piece)
    return ids[:n_tokens]


def distance_prompt(tokenizer: Any, texts: Haystack | Sequence[str], distance: int, seed: int | str = 0,
                    lead: int = LEAD, template: Template | None = None) -> RecallPrompt:
    """One trial: the head, ``lead`` tokens of text, the fact, exactly ``distance`` tokens of text, the lead-in;
    the query follows (``.ids()``). ``template``: a ``words`` or ``codes`` template (default: the probe's)."""
    if distance < 0 or lead < 0:
        raise ValueError(f"recall at distance: distance and lead must be >= 0, got {distance}, {lead}")
    template = template or probe_template("words")
    haystack = texts if isinstance(texts, Haystack) else Haystack(tokenizer, texts)
    rng = random.Random(seed)
    (fact,) = make_facts(tokenizer, 1, rng, template)
    head = tokenizer(template.parts["head"])["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    intro = tokenizer(template.parts["intro"], add_special_tokens=False)["input_ids"]
    before, _ = fill_tokens(haystack.pieces(rng.randrange(len(haystack.texts))), lead)
    after = first_tokens(haystack.pieces(rng.randrange(len(haystack.texts))), distance)
    context = head + before + list(fact.planted) + after + intro
    return RecallPrompt(tuple(context), (fact,), (len(head) + len(before),), (0,))


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
