"""Multi-query associative recall on natural text.

N facts (by default the held-out ``codes`` template: ``The code of NAME is NNNN.``, made-up names, distinct
4-digit codes) are planted at spread positions in held-out documents; at the end some of the names are asked
again in a random order (``The code of NAME is``) and a query passes when the model reproduces the value. The
passkey probe asks where in a context one fact is lost; this probe asks how many facts a model holds at once.
The prompt builder (``recall_prompt``, ``RecallPrompt``, ``Haystack``) lives in ``hf_recattn.prompting``, where it also
writes training prompts from the training templates (``conversion/retrieval_data.py``); this module scores and runs.

A prompt depends only on the texts, the tokenizer, the template and the seed, so a teacher and its students see the
same tokens. Both scorings run through the model's cache: the context is prefilled once, then the queries follow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from ..modeling.cache import CACHE_NAME, cache_of
from ..prompting.facts import Fact, fact_ids, make_facts
from ..prompting.haystack import Haystack, texts_from_blocks
from ..prompting.recall import RecallPrompt, recall_prompt
from .generation import eval_mode, greedy_continuation, max_positions, model_device
from .progress import progress_bar

__all__ = [
    "RECALL_LENGTHS",
    "RECALL_PAIRS",
    "SCORINGS",
    "Fact",
    "Haystack",
    "RecallPrompt",
    "associative_recall_probe",
    "fact_ids",
    "greedy_answers",
    "make_facts",
    "recall_answered",
    "recall_prompt",
    "score_prompt",
    "teacher_forced_answers",
    "texts_from_blocks",
]

RECALL_LENGTHS = (1024, 4096)
RECALL_PAIRS = (1, 4, 16)
SCORINGS = ("teacher_forced", "greedy")


# ----- scoring ------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_answers(model: Any, prompt: RecallPrompt) -> list[list[int]]:
    """The argmax prediction of each answer token of each query, every earlier token given: the context is
    prefilled into the cache, then all the queries (with their answers) go through it in one forward."""
    ids = prompt.ids().to(model_device(model))
    split = len(prompt.context)
    first = model(input_ids=ids[:, :split], use_cache=True, logits_to_keep=1)
    rest = model(input_ids=ids[:, split:], use_cache=True, **{CACHE_NAME: cache_of(first)})
    predicted = torch.cat([first.logits[0, -1:], rest.logits[0, :-1]]).argmax(-1).tolist()
    return [[predicted[p - split] for p in span] for span in prompt.answer_spans()]


def greedy_answers(model: Any, tokenizer: Any, prompt: RecallPrompt) -> list[list[int]]:
    """Greedy answers through the cache: each query, then as many decoded tokens as its value has; the model's
    own answers (and a full stop) stay in the context of the later queries, whose decoding continues the cache."""
    sequence, cache, answers = list(prompt.context), None, []
    for q in prompt.queries:
        fact = prompt.facts[q]
        sequence += fact.prefix
        out = greedy_continuation(model, tokenizer, torch.tensor([sequence]), len(fact.answer), cache,
                                  stop_at_eos=False)
        answers.append(out.tokens.tolist())
        sequence += [*answers[-1], *fact.suffix]
        cache = out.cache
    return answers


def score_prompt(model: Any, tokenizer: Any, prompt: RecallPrompt, scoring: str = "teacher_forced") -> dict[str, Any]:
    """One trial: its facts (name, value, depth) and each query's answer and verdict. Teacher-forced, a query
    passes when the argmax reproduces every token of the value; greedy, when the decoded answer starts with
    the value's digits (whitespace ignored)."""
    if scoring not in SCORINGS:
        raise ValueError(f"associative recall: scoring must be one of {list(SCORINGS)}, got {scoring!r}")
    if scoring == "teacher_forced":
        predicted = teacher_forced_answers(model, prompt)
    else:
        predicted = greedy_answers(model, tokenizer, prompt)
    depths = [round(d, 3) for d in prompt.depths()]
    facts = [{"name": f.name, "value": f.value, "depth": d} for f, d in zip(prompt.facts, depths, strict=True)]
    queries = []
    for q, tokens in zip(prompt.queries, predicted, strict=True):
        fact = prompt.facts[q]
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        if scoring == "teacher_forced":
            correct = tuple(tokens) == fact.answer
        else:
            correct = recall_answered(answer, fact.value)
        queries.append({**facts[q], "answer": answer.strip(), "correct": correct})
    return {"tokens": prompt.length, "facts": facts, "queries": queries}


def recall_answered(answer: str, value: str) -> bool:
    """The greedy verdict on one query: the decoded answer starts with the value's digits (whitespace ignored)."""
    return re.sub(r"\s+", "", answer).startswith(value)


# ----- the probe ----------------------------------------------------------------------------------
def _check_probe_args(context_lengths: Sequence[int], pairs: Sequence[int], trials: int, max_queries: int,
                      scoring: str) -> None:
    if not context_lengths or not pairs or trials < 1 or max_queries < 1:
        raise ValueError("associative_recall_probe needs context lengths, pair counts, trials >= 1 and "
                         "max_queries >= 1")
    if any(n < 1 for n in pairs):
        raise ValueError(f"associative_recall_probe: pair counts must be >= 1, got {list(pairs)}")
    if scoring not in SCORINGS:
        raise ValueError(f"associative recall: scoring must be one of {list(SCORINGS)}, got {scoring!r}")


def associative_recall_probe(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | torch.Tensor,
    context_lengths: Sequence[int] = RECALL_LENGTHS,
    pairs: Sequence[int] = RECALL_PAIRS,
    trials: int = 3,
    seed: int = 0,
    max_queries: int = 8,
    scoring: str = "teacher_forced",
    progress: str | None = None,
) -> dict[str, Any]:
    """Accuracy of the queries per context length and number of planted pairs, in ``texts`` (held-out
    documents, or ``[N, T]`` token blocks with EOS between documents).

    Each (length, pairs) cell runs ``trials`` prompts seeded by ``(seed, length, pairs, trial)``; its accuracy
    is the share of its queries answered. Returns ``accuracy`` ``{length: {pairs: share}}``, its mean over the
    cells, ``accuracy_by_pairs`` (the mean over lengths) and every trial under ``answers``. Lengths beyond the
    model's ``max_position_embeddings`` are listed under ``skipped``. ``progress``: the label of a progress bar
    over the prompts (None: no bar)."""
    _check_probe_args(context_lengths, pairs, trials, max_queries, scoring)
    limit = max_positions(model)
    haystack: Haystack | None = None
    accuracy: dict[str, dict[str, float]] = {}
    answers: dict[str, dict[str, list[dict[str, Any]]]] = {}
    skipped: list[int] = []
    runs = sum(limit is None or length <= limit for length in context_lengths)
    with eval_mode(model), progress_bar(runs * len(pairs) * trials, progress, "prompt") as bar:
        for length in context_lengths:
            if limit is not None and length > limit:
                skipped.append(length)
                continue
            if haystack is None:
                sources = texts_from_blocks(tokenizer, texts) if isinstance(texts, torch.Tensor) else texts
                haystack = Haystack(tokenizer, sources)
            accuracy[str(length)], answers[str(length)] = {}, {}
            for n in pairs:
                rows = []
                for t in range(trials):
                    prompt = recall_prompt(tokenizer, haystack, length, n, f"{seed}:{length}:{n}:{t}", max_queries)
                    rows.append(score_prompt(model, tokenizer, prompt, scoring))
                    bar.update()
                asked = [query["correct"] for row in rows for query in row["queries"]]
                answers[str(length)][str(n)] = rows
                accuracy[str(length)][str(n)] = sum(asked) / len(asked)
    cells = [share for per_length in accuracy.values() for share in per_length.values()]
    by_pairs = {str(n): _mean([per[str(n)] for per in accuracy.values()]) for n in pairs} if accuracy else {}
    return {"accuracy": accuracy, "mean_accuracy": _mean(cells), "accuracy_by_pairs": by_pairs,
            "pairs": list(pairs), "trials": trials, "max_queries": max_queries, "scoring": scoring,
            "skipped": skipped, "answers": answers}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
