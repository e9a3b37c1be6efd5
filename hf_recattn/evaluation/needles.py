"""Needles in natural text: the recall probe in the style of RULER (Hsieh et al., "RULER: What's the Real Context
Size of Your Long-Context Language Models?", arXiv:2404.06654), on documents instead of repeated filler.

Facts about made-up names are planted in natural text, then asked for after it; the model answers greedily through
its cache and a query passes when its value (every value, for ``multi_value``) appears in the decoded answer. The
haystack is whole documents laid end to end from a seeded start (the corpus's held-out split, or its
out-of-distribution license texts), so nothing in it repeats: a cache that keeps "whatever does not repeat" gains
nothing, unlike in the passkey probe's repeated filler. Tasks (the wording is the held-out ``needles`` templates'):

* ``single_number``, ``single_word``, ``single_phrase``: one fact whose value is a 7-digit number, a held-out word,
  or three held-out words;
* ``multi_key``: the asked fact among 3 distractors of the same form with other keys, one of them after it (the
  most recent number is never the answer);
* ``multi_value``: one key stated with 3 or 4 values at spread places, all asked for at once;
* ``multi_query``: 4 keys, each asked in turn (every query scored; the model's answers stay in the context);
* ``paraphrase``: a fact stated in plain prose, asked with a question in other words (its value: 4 digits).

A prompt depends only on the texts, the tokenizer and the seed, so a teacher and its students see the same tokens;
it is built in ``hf_recattn.prompting.needles`` (``needle_prompt``), which also writes the same tasks teacher-forced
in the training templates' words for the training data. This module scores the answers and runs the probe.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..prompting.haystack import Haystack
from ..prompting.needles import (
    ANSWER_SLACK,
    MULTI_KEYS,
    NEEDLE_TASKS,
    PHRASE_WORDS,
    TASK_FORMS,
    Needle,
    NeedlePrompt,
    NeedleQuery,
    lay_documents,
    needle_prompt,
    needle_template,
    needle_values,
)
from .generation import eval_mode, greedy_continuation, max_positions
from .progress import progress_bar
from .store import ProbeStore, cached

__all__ = [
    "ANSWER_SLACK",
    "MULTI_KEYS",
    "NEEDLE_HAYSTACKS",
    "NEEDLE_HAYSTACK_NAMES",
    "NEEDLE_LENGTHS",
    "NEEDLE_PROMPTS",
    "NEEDLE_TASKS",
    "PHRASE_WORDS",
    "TASK_FORMS",
    "Needle",
    "NeedlePrompt",
    "NeedleQuery",
    "cell_summary",
    "check_needle_args",
    "lay_documents",
    "natural_haystacks",
    "needle_answered",
    "needle_answers",
    "needle_probe",
    "needle_prompt",
    "needle_template",
    "needle_values",
    "score_needle_prompt",
    "wilson_interval",
]

NEEDLE_LENGTHS = (1024, 2048, 4096, 8192)
#: the haystacks: the corpus's held-out documents (in distribution) and its license texts (out of distribution)
NEEDLE_HAYSTACKS = ("heldout", "ood")
#: what each haystack is, as reports and cards name it
NEEDLE_HAYSTACK_NAMES = {"heldout": "held-out documents", "ood": "the embedded corpus's license texts"}
NEEDLE_PROMPTS = 20


# ----- scoring ------------------------------------------------------------------------------------
def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def needle_answered(answer: str, values: Sequence[str]) -> bool:
    """The verdict on one query: every value appears in the answer as a whole (not inside a longer number or
    word), whitespace runs read as one space, case ignored."""
    text = _normalized(answer)
    return all(re.search(rf"(?<![0-9a-z]){re.escape(_normalized(v))}(?![0-9a-z])", text) for v in values)


def needle_answers(model: Any, tokenizer: Any, prompt: NeedlePrompt) -> list[str]:
    """The decoded greedy answers through the cache: each query, then up to its room of new tokens; the model's
    answers stay in the context of the later queries, whose decoding continues the cache."""
    sequence, cache, answers = list(prompt.context), None, []
    for query in prompt.queries:
        sequence += query.ids
        out = greedy_continuation(model, tokenizer, torch.tensor([sequence]), query.max_new_tokens, cache)
        tokens = out.tokens.tolist()
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
        sequence += tokens
        cache = out.cache
    return answers


def score_needle_prompt(model: Any, tokenizer: Any, prompt: NeedlePrompt) -> dict[str, Any]:
    """One trial: its needles (key, value, depth, asked), documents, and each query's answer and verdict."""
    answers = needle_answers(model, tokenizer, prompt)
    needles = [{"key": n.key, "value": n.value, "depth": round(d, 3), "asked": n.asked}
               for n, d in zip(prompt.needles, prompt.depths(), strict=True)]
    queries = [{"key": q.key, "values": list(q.values), "answer": a.strip(), "correct": needle_answered(a, q.values)}
               for q, a in zip(prompt.queries, answers, strict=True)]
    return {"tokens": prompt.length, "start": prompt.start, "documents": prompt.documents,
            "repeated": prompt.repeated, "needles": needles, "queries": queries}


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (z = 1.96: 95%)."""
    if n < 1 or not 0 <= correct <= n:
        raise ValueError(f"wilson_interval needs 0 <= correct <= n and n >= 1, got {correct}, {n}")
    p = correct / n
    scale = 1 + z * z / n
    center = (p + z * z / (2 * n)) / scale
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    return max(0.0, center - half), min(1.0, center + half)


def cell_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A cell's accuracy over its queries, their number ``n``, the Wilson 95% interval, the prompts and how many of
    them had to repeat text."""
    verdicts = [query["correct"] for row in rows for query in row["queries"]]
    correct, n = sum(verdicts), len(verdicts)
    low, high = wilson_interval(correct, n)
    return {"accuracy": correct / n, "correct": correct, "n": n, "interval": [round(low, 4), round(high, 4)],
            "prompts": len(rows), "repeated": sum(bool(row["repeated"]) for row in rows)}


# ----- the probe ----------------------------------------------------------------------------------
def natural_haystacks(names: Sequence[str] = NEEDLE_HAYSTACKS,
                      heldout: Sequence[str] | None = None) -> dict[str, Sequence[str] | Callable[[], list[str]]]:
    """The probe's haystacks by name: ``heldout`` (the given held-out documents, else the embedded corpus's) and
    ``ood`` (the embedded corpus's license texts), each read once, when a probe first needs it (the needle probe and
    the report's perplexities on the license texts share one read)."""
    from ..data.corpus import embedded_texts

    unknown = [n for n in names if n not in NEEDLE_HAYSTACKS]
    if unknown or not names:
        raise ValueError(f"needles: haystacks must be some of {list(NEEDLE_HAYSTACKS)}, got {list(names)}")
    sources: dict[str, Sequence[str] | Callable[[], list[str]]] = {}
    for name in names:
        sources[name] = heldout if name == "heldout" and heldout is not None else (
            functools.cache(functools.partial(embedded_texts, name)))
    return sources


def check_needle_args(tasks: Sequence[str], lengths: Sequence[int], prompts: int) -> None:
    """ValueError naming the bad task, length or prompt count."""
    unknown = [t for t in tasks if t not in TASK_FORMS]
    if unknown or not tasks:
        raise ValueError(f"needles: tasks must be some of {list(NEEDLE_TASKS)}, got {list(tasks)}")
    if not lengths or any(int(n) != n or n < 1 for n in lengths):
        raise ValueError(f"needles: lengths must be positive integers, got {list(lengths)}")
    if prompts < 1:
        raise ValueError(f"needles: prompts per cell must be >= 1, got {prompts}")


def needle_probe(
    model: Any,
    tokenizer: Any,
    haystacks: Mapping[str, Sequence[str] | Callable[[], Sequence[str]]],
    tasks: Sequence[str] = NEEDLE_TASKS,
    lengths: Sequence[int] = NEEDLE_LENGTHS,
    prompts: int = NEEDLE_PROMPTS,
    seed: int = 0,
    progress: str | None = None,
    depths: Sequence[float] | None = None,
    store: ProbeStore | None = None,
    cells: Sequence[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """Recall of needles in natural text per task, haystack and length.

    ``haystacks``: documents by name (or a function reading them, called only when a prompt needs them; see
    ``natural_haystacks``). Each (task, haystack, length) cell runs ``prompts`` prompts, prompt t with its asked
    needle at depth (t + 0.5) / prompts (with ``depths``: ``depths[t % len(depths)]``, e.g. 0.95 for a fact in the
    last 5% of the context), seeded by ``(seed, haystack, task, length, t)``. Returns ``cells``
    ``{task: {haystack: {length: cell_summary}}}``, the depth of each prompt t (``depths``), ``accuracy``
    ``{haystack: mean over its cells}`` and every trial under ``answers``; lengths beyond the model's
    ``max_position_embeddings`` are listed under ``skipped``. ``progress``: the label of a progress bar over the
    prompts (None: no bar). ``store``: where each finished cell is kept and read back from on a rerun. ``cells``:
    only these (task, length) pairs of the grid (None: all of them)."""
    check_needle_args(tasks, lengths, prompts)
    if depths is not None and (not depths or any(not 0.0 <= d <= 1.0 for d in depths)):
        raise ValueError(f"needles: depths must be a non-empty list in [0, 1], got {list(depths)}")
    placed = [(t + 0.5) / prompts if depths is None else float(depths[t % len(depths)]) for t in range(prompts)]
    placement = "" if depths is None else "-depths" + "_".join(f"{d:g}" for d in depths)  # a stored cell's key
    limit = max_positions(model)
    runs = [n for n in lengths if limit is None or n <= limit]
    wanted = None if cells is None else set(cells)
    if wanted is not None and (outside := [c for c in cells if c[0] not in tasks or c[1] not in lengths]):
        raise ValueError(f"needles: cells {outside} lie outside the tasks {list(tasks)} x lengths {list(lengths)}")
    chosen = [(task, n) for task in tasks for n in runs if wanted is None or (task, n) in wanted]
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    answers: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    documents: dict[str, int] = {}
    with eval_mode(model), progress_bar(len(haystacks) * len(chosen) * prompts, progress, "prompt") as bar:
        for name, source in haystacks.items():
            if not chosen:
                break
            texts = source() if callable(source) else source
            if not any(t.strip() for t in texts):
                raise ValueError(f"needles: haystack {name!r} holds no text")
            haystack = Haystack(tokenizer, texts)
            documents[name] = len(haystack.texts)
            for task, length in chosen:
                run_cell = functools.partial(_needle_cell, model, tokenizer, haystack, name, task, length, placed,
                                             seed, bar)
                rows = cached(store, f"needles-{name}-{task}-{length}-{prompts}x-seed{seed}{placement}", run_cell)
                summaries.setdefault(task, {}).setdefault(name, {})[str(length)] = cell_summary(rows)
                answers.setdefault(task, {}).setdefault(name, {})[str(length)] = rows
    return {"accuracy": _haystack_means(summaries), "cells": summaries, "tasks": list(tasks), "haystacks": documents,
            "lengths": list(lengths), "prompts": prompts, "seed": seed, "depths": placed,
            "skipped": [n for n in lengths if n not in runs], "answers": answers}


def _needle_cell(model: Any, tokenizer: Any, haystack: Haystack, name: str, task: str, length: int,
                 placed: Sequence[float], seed: int, bar: Any) -> list[dict[str, Any]]:
    """The scored prompts of one (haystack, task, length) cell, prompt t at depth ``placed[t]``."""
    rows = []
    for t, depth in enumerate(placed):
        prompt = needle_prompt(tokenizer, haystack, task, length, f"{seed}:{name}:{task}:{length}:{t}", depth=depth)
        rows.append(score_needle_prompt(model, tokenizer, prompt))
        bar.update()
    return rows


def _haystack_means(cells: Mapping[str, Mapping[str, Mapping[str, dict[str, Any]]]]) -> dict[str, float]:
    """The mean accuracy of each haystack's cells (every task and length weighs the same)."""
    shares: dict[str, list[float]] = {}
    for per_haystack in cells.values():
        for name, per_length in per_haystack.items():
            shares.setdefault(name, []).extend(cell["accuracy"] for cell in per_length.values())
    return {name: sum(values) / len(values) for name, values in shares.items()}
