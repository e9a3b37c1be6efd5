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

A prompt depends only on the texts, the tokenizer and the seed, so a teacher and its students see the same tokens.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .facts import made_up_name
from .generation import eval_mode, greedy_continuation, max_positions
from .progress import progress_bar
from .prompts import plant
from .recall import Haystack
from .templates import Template, templates, word_list

NEEDLE_TASKS = ("single_number", "single_word", "single_phrase", "multi_key", "multi_value", "multi_query",
                "paraphrase")
NEEDLE_LENGTHS = (1024, 2048, 4096, 8192)
#: the haystacks: the corpus's held-out documents (in distribution) and its license texts (out of distribution)
NEEDLE_HAYSTACKS = ("heldout", "ood")
NEEDLE_PROMPTS = 20
#: the form of template (``templates.NEEDLE_FORMS``) each task asks in
TASK_FORMS = {"single_number": "number", "single_word": "word", "single_phrase": "phrase", "multi_key": "number",
              "multi_value": "number", "multi_query": "number", "paraphrase": "paraphrase"}
MULTI_KEYS = 4  # multi_key: the asked fact and 3 distractors; multi_query: 4 keys asked in turn
ANSWER_SLACK = 4  # answer tokens decoded beyond the values' own (and 2 per separator between values)
PHRASE_WORDS = 3


@dataclass(frozen=True)
class Needle:
    """One planted fact: its key, value, sentence ids and whether a query asks for it."""

    key: str
    value: str
    ids: tuple[int, ...]
    asked: bool


@dataclass(frozen=True)
class NeedleQuery:
    """One question: its ids (the question and the answer's lead-in), the values its answer must hold and the
    tokens decoded for it."""

    key: str
    values: tuple[str, ...]
    ids: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class NeedlePrompt:
    """One trial: ``context`` (the head and the text with the needles planted at ``positions``), the queries asked
    after it in turn, the first document laid (``start``), how many documents were laid and whether one of them
    had to repeat (the haystack ran out of text)."""

    task: str
    context: tuple[int, ...]
    needles: tuple[Needle, ...]
    positions: tuple[int, ...]
    queries: tuple[NeedleQuery, ...]
    start: int
    documents: int
    repeated: bool

    @property
    def length(self) -> int:
        """Tokens of the whole trial: the context, and each query with the room of its answer."""
        return len(self.context) + sum(len(q.ids) + q.max_new_tokens for q in self.queries)

    def depths(self) -> list[float]:
        """Where each needle begins, relative to the context's length."""
        return [p / len(self.context) for p in self.positions]


# ----- prompts ------------------------------------------------------------------------------------
def needle_template(task: str, split: str = "heldout") -> Template:
    """The template ``task`` asks in: the first ``split`` needles template of its form."""
    if task not in TASK_FORMS:
        raise ValueError(f"unknown needle task {task!r}; use one of {list(NEEDLE_TASKS)}")
    found = [t for t in templates("needles", split) if t.parts["form"] == TASK_FORMS[task]]
    if not found:
        raise ValueError(f"no {split} needles template of form {TASK_FORMS[task]!r} (task {task})")
    return found[0]


def needle_values(form: str, split: str, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct values of ``form``: 7-digit numbers, 4-digit numbers (``paraphrase``), words of the
    ``split`` word list, or phrases of three of them (no word in two phrases)."""
    if form == "number":
        return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), count)]
    if form == "paraphrase":
        return [str(v) for v in rng.sample(range(1000, 10_000), count)]
    words = list(word_list(split))
    per_value = PHRASE_WORDS if form == "phrase" else 1
    if count * per_value > len(words):
        raise ValueError(f"needles: {count} {form} values need more than the {len(words)} {split} words")
    drawn = rng.sample(words, count * per_value)
    return [" ".join(drawn[i * per_value : (i + 1) * per_value]) for i in range(count)]


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _keys(tokenizer: Any, count: int, rng: random.Random) -> list[str]:
    """``count`` made-up names, distinct as text and as tokens."""
    names: dict[tuple[int, ...], str] = {}
    for _ in range(100 * count):
        name = made_up_name(rng)
        names.setdefault(_encode(tokenizer, " " + name), name)
        if len(names) == count:
            return list(names.values())
    raise ValueError(f"needles: the tokenizer tells apart only {len(names)} of {count} names")


def _query(tokenizer: Any, template: Template, key: str, values: Sequence[str]) -> NeedleQuery:
    """The question about ``key`` (all its values when there are several) and the room of its answer."""
    plural = "_all" if len(values) > 1 else ""
    text = template.fill("question" + plural, key=key) + template.fill("answer" + plural, key=key)
    room = sum(len(_encode(tokenizer, " " + v)) for v in values) + 2 * (len(values) - 1) + ANSWER_SLACK
    return NeedleQuery(key, tuple(values), _encode(tokenizer, text), room)


def _layout(task: str, keys: list[str], values: list[str], depth: float,
            rng: random.Random) -> tuple[list[tuple[str, str, bool, float]], list[tuple[str, list[str]]]]:
    """The needles (key, value, asked, depth) in the order planted, and the queries (key, values) in the order
    asked."""
    if task == "multi_value":
        spread = [(keys[0], v, True, (i + rng.uniform(0.2, 0.8)) / len(values)) for i, v in enumerate(values)]
        return spread, [(keys[0], values)]
    if task == "multi_key":
        target = 0.05 + 0.8 * depth  # one distractor always comes later: the latest number is never the answer
        depths = [rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0), rng.uniform(target, 1.0)]
        distractors = [(k, v, False, d) for k, v, d in zip(keys[1:], values[1:], depths, strict=True)]
        needles = [(keys[0], values[0], True, target), *distractors]
        return sorted(needles, key=lambda n: (n[3], not n[2])), [(keys[0], values[:1])]
    if task == "multi_query":
        needles = [(k, v, True, (i + rng.uniform(0.2, 0.8)) / len(keys))
                   for i, (k, v) in enumerate(zip(keys, values, strict=True))]
        order = rng.sample(range(len(keys)), len(keys))
        return needles, [(keys[i], [values[i]]) for i in order]
    return [(keys[0], values[0], True, depth)], [(keys[0], values[:1])]


def lay_documents(haystack: Haystack, start: int, n_tokens: int) -> tuple[list[int], list[int], int]:
    """The last ``n_tokens`` ids of whole documents laid end to end from document ``start`` (the first may lose its
    beginning, so that the text ends where a document's piece ends), the offsets where pieces begin, and how many
    documents were laid (more than the haystack holds: one repeats)."""
    ids: list[int] = []
    starts: list[int] = []
    laid = 0
    for document in haystack.documents(start):
        if len(ids) >= n_tokens:
            break
        laid += 1
        for piece in document:
            if len(ids) >= n_tokens:
                break
            starts.append(len(ids))
            ids.extend(piece)
    surplus = max(len(ids) - n_tokens, 0)
    return ids[surplus:], [0] + [s - surplus for s in starts if s > surplus], laid


def needle_prompt(tokenizer: Any, texts: Haystack | Sequence[str], task: str, length: int, seed: int | str = 0,
                  depth: float | None = None, split: str = "heldout") -> NeedlePrompt:
    """One trial of ``task`` whose ``length`` is exactly ``length`` tokens: the head, documents laid from a seeded
    start with the needles planted at sentence starts, the queries with the room of their answers.

    ``depth`` (0 to 1, default drawn): where the asked needle of a single-needle task goes (``multi_key``: within
    0.05-0.85, a distractor after it); the multi-needle tasks spread theirs. ``split``: whose templates and words
    (the probe's are ``heldout``). The same seed gives the same prompt."""
    template = needle_template(task, split)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"needles: depth must be in [0, 1], got {depth}")
    haystack = texts if isinstance(texts, Haystack) else Haystack(tokenizer, texts)
    rng = random.Random(seed)  # a str seed is hashed deterministically
    depth = rng.uniform(0.05, 0.95) if depth is None else depth
    n_keys = MULTI_KEYS if task in ("multi_key", "multi_query") else 1
    n_values = rng.choice((3, 4)) if task == "multi_value" else n_keys
    keys = _keys(tokenizer, n_keys, rng)
    values = needle_values(template.parts["form"], split, n_values, rng)
    laid_out, asked = _layout(task, keys, values, depth, rng)
    needles = [Needle(k, v, _encode(tokenizer, template.fill("fact", key=k, value=v)), a) for k, v, a, _ in laid_out]
    queries = [_query(tokenizer, template, key, vals) for key, vals in asked]
    head = tokenizer(template.parts["head"])["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    fixed = len(head) + sum(len(n.ids) for n in needles) + sum(len(q.ids) + q.max_new_tokens for q in queries)
    if length - fixed < len(needles) + 1:
        raise ValueError(f"needles: length {length} is too short for {task} (its needles, questions and answers "
                         f"take {fixed} tokens)")
    start = rng.randrange(len(haystack.texts))
    filler, starts, laid = lay_documents(haystack, start, length - fixed)
    body, offsets = plant(filler, starts, [n.ids for n in needles], [d for *_, d in laid_out])
    return NeedlePrompt(task, tuple(head + body), tuple(needles), tuple(len(head) + o for o in offsets),
                        tuple(queries), start, laid, laid > len(haystack.texts))


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
    ``ood`` (the embedded corpus's license texts), each read only when a prompt needs it."""
    from ..data.corpus import embedded_texts

    unknown = [n for n in names if n not in NEEDLE_HAYSTACKS]
    if unknown or not names:
        raise ValueError(f"needles: haystacks must be some of {list(NEEDLE_HAYSTACKS)}, got {list(names)}")
    sources: dict[str, Sequence[str] | Callable[[], list[str]]] = {}
    for name in names:
        sources[name] = heldout if name == "heldout" and heldout is not None else (
            lambda split=name: embedded_texts(split))
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
) -> dict[str, Any]:
    """Recall of needles in natural text per task, haystack and length.

    ``haystacks``: documents by name (or a function reading them, called only when a prompt needs them; see
    ``natural_haystacks``). Each (task, haystack, length) cell runs ``prompts`` prompts, prompt t with its asked
    needle at depth (t + 0.5) / prompts, seeded by ``(seed, haystack, task, length, t)``. Returns ``cells``
    ``{task: {haystack: {length: cell_summary}}}``, ``accuracy`` ``{haystack: mean over its cells}`` and every
    trial under ``answers``; lengths beyond the model's ``max_position_embeddings`` are listed under
    ``skipped``. ``progress``: the label of a progress bar over the prompts (None: no bar)."""
    check_needle_args(tasks, lengths, prompts)
    limit = max_positions(model)
    runs = [n for n in lengths if limit is None or n <= limit]
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    answers: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    documents: dict[str, int] = {}
    with eval_mode(model), progress_bar(len(haystacks) * len(tasks) * len(runs) * prompts, progress, "prompt") as bar:
        for name, source in haystacks.items():
            if not runs:
                break
            texts = source() if callable(source) else source
            if not any(t.strip() for t in texts):
                raise ValueError(f"needles: haystack {name!r} holds no text")
            haystack = Haystack(tokenizer, texts)
            documents[name] = len(haystack.texts)
            for task in tasks:
                for length in runs:
                    rows = []
                    for t in range(prompts):
                        prompt = needle_prompt(tokenizer, haystack, task, length, f"{seed}:{name}:{task}:{length}:{t}",
                                               depth=(t + 0.5) / prompts)
                        rows.append(score_needle_prompt(model, tokenizer, prompt))
                        bar.update()
                    cells.setdefault(task, {}).setdefault(name, {})[str(length)] = cell_summary(rows)
                    answers.setdefault(task, {}).setdefault(name, {})[str(length)] = rows
    return {"accuracy": _haystack_means(cells), "cells": cells, "tasks": list(tasks), "haystacks": documents,
            "lengths": list(lengths), "prompts": prompts, "seed": seed,
            "skipped": [n for n in lengths if n not in runs], "answers": answers}


def _haystack_means(cells: Mapping[str, Mapping[str, Mapping[str, dict[str, Any]]]]) -> dict[str, float]:
    """The mean accuracy of each haystack's cells (every task and length weighs the same)."""
    shares: dict[str, list[float]] = {}
    for per_haystack in cells.values():
        for name, per_length in per_haystack.items():
            shares.setdefault(name, []).extend(cell["accuracy"] for cell in per_length.values())
    return {name: sum(values) / len(values) for name, values in shares.items()}
