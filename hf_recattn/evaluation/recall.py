"""Multi-query associative recall on natural text.

N facts (by default the held-out ``codes`` template: ``The code of NAME is NNNN.``, made-up names, distinct
4-digit codes) are planted at spread positions in held-out documents; at the end some of the names are asked
again in a random order (``The code of NAME is``) and a query passes when the model reproduces the value. The
passkey probe asks where in a context one fact is lost; this probe asks how many facts a model holds at once.
The same prompt builder writes training prompts from the training templates (``conversion/retrieval_data.py``).

A prompt depends only on the texts, the tokenizer, the template and the seed, so a teacher and its students see the
same tokens. Both scorings run through the model's cache: the context is prefilled once, then the queries follow.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..modeling.cache import CACHE_NAME, cache_of
from .facts import Fact, fact_ids, make_facts
from .generation import eval_mode, greedy_continuation, max_positions, model_device
from .progress import progress_bar
from .prompts import fill_tokens, plant, sentence_pieces, token_pieces
from .templates import Template, probe_template

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


# ----- prompts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecallPrompt:
    """One trial: ``context`` (the head, the text with the facts planted, the lead-in to the queries), the
    ``facts`` in the order they appear, where each begins in ``context`` (``positions``) and the facts asked
    (``queries``: indices into ``facts``, in the order asked). A query is its fact's asked sentence."""

    context: tuple[int, ...]
    facts: tuple[Fact, ...]
    positions: tuple[int, ...]
    queries: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens of the whole teacher-forced sequence (``ids()``)."""
        return len(self.context) + sum(len(self.facts[q].ids) for q in self.queries)

    def ids(self) -> torch.Tensor:
        """[1, length]: the context, then every query followed by its answer."""
        tail = [token for q in self.queries for token in self.facts[q].ids]
        return torch.tensor([list(self.context) + tail], dtype=torch.long)

    def answer_spans(self) -> list[range]:
        """Where each query's answer lies in ``ids()``, in the order asked."""
        spans, offset = [], len(self.context)
        for q in self.queries:
            fact = self.facts[q]
            start = offset + len(fact.prefix)
            spans.append(range(start, start + len(fact.answer)))
            offset += len(fact.ids)
        return spans

    def depths(self) -> list[float]:
        """Where each fact begins, relative to the context's length."""
        return [p / len(self.context) for p in self.positions]


class Haystack:
    """Documents cut into sentence pieces, tokenized on first use, laid end to end from any document."""

    def __init__(self, tokenizer: Any, texts: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = [t for t in texts if t.strip()]
        if not self.texts:
            raise ValueError("associative recall needs at least one non-empty held-out text")
        self._separator = token_pieces(tokenizer, ["\n\n"])
        self._documents: dict[int, list[list[int]]] = {}

    def _document(self, index: int) -> list[list[int]]:
        if index not in self._documents:
            self._documents[index] = token_pieces(self.tokenizer, sentence_pieces(self.texts[index]))
        return self._documents[index]

    def documents(self, start: int) -> Iterator[list[list[int]]]:
        """The pieces of each document from ``start`` on, one list per document, the blank line between documents
        at the start of every list but the first; the documents start over (repeat) when a context needs more text
        than there is."""
        for k in itertools.count():
            if k == len(self.texts) and not any(self._documents.values()):
                raise ValueError("associative recall: the held-out texts hold no tokens")
            yield (self._separator if k else []) + self._document((start + k) % len(self.texts))

    def pieces(self, start: int) -> Iterator[list[int]]:
        """The pieces of every document from ``start`` on, a blank line between documents (``documents`` laid end to
        end)."""
        for document in self.documents(start):
            yield from document


def texts_from_blocks(tokenizer: Any, blocks: torch.Tensor) -> list[str]:
    """The documents in ``[N, T]`` token blocks (packed end to end, EOS between documents) as texts."""
    if blocks.dim() != 2:
        raise ValueError(f"blocks must be [N, T] token ids, got shape {tuple(blocks.shape)}")
    eos = getattr(tokenizer, "eos_token_id", None)
    documents: list[list[int]] = [[]]
    for token in blocks.reshape(-1).tolist():
        if token == eos:
            documents.append([])
        else:
            documents[-1].append(token)
    texts = [tokenizer.decode(doc, skip_special_tokens=True) for doc in documents if doc]
    return [t for t in texts if t.strip()]


def recall_prompt(
    tokenizer: Any,
    texts: Haystack | Sequence[str],
    context_length: int,
    pairs: int,
    seed: int | str = 0,
    max_queries: int = 8,
    template: Template | None = None,
    min_distance: int = 0,
) -> RecallPrompt:
    """One trial's prompt: ``pairs`` facts planted in the texts at spread depths (fact i near
    ``(i + u) / pairs`` of the text, u uniform in [0.2, 0.8], at a sentence start), then ``min(pairs,
    max_queries)`` of them asked in a random order. Teacher-forced (``.ids()``) it has exactly
    ``context_length`` tokens. The same ``seed`` gives the same prompt.

    ``template``: a ``codes`` or ``words`` template (default: the probe's, ``probe_template("codes")``).
    ``min_distance``: the last that many tokens of text stay free of facts when the text is longer (0: none)."""
    if pairs < 1 or max_queries < 1:
        raise ValueError(f"associative recall needs pairs >= 1 and max_queries >= 1, got {pairs}, {max_queries}")
    template = template or probe_template("codes")
    haystack = texts if isinstance(texts, Haystack) else Haystack(tokenizer, texts)
    rng = random.Random(seed)  # a str seed is hashed deterministically
    facts = make_facts(tokenizer, pairs, rng, template)
    queries = tuple(rng.sample(range(pairs), min(pairs, max_queries)))
    head = tokenizer(template.parts["head"])["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    intro = tokenizer(template.parts["intro"], add_special_tokens=False)["input_ids"]
    fixed = len(head) + len(intro) + sum(len(f.planted) for f in facts) + sum(len(facts[q].ids) for q in queries)
    room = context_length - fixed
    if room < pairs:
        raise ValueError(f"associative recall: context length {context_length} is too short for {pairs} pairs "
                         f"(the facts, the queries and the instructions take {fixed} tokens)")
    depths = [(i + rng.uniform(0.2, 0.8)) / pairs for i in range(pairs)]
    filler, starts = fill_tokens(haystack.pieces(rng.randrange(len(haystack.texts))), room)
    body, offsets = plant(filler, starts, [f.planted for f in facts], depths, reserve=min_distance)
    positions = tuple(len(head) + offset for offset in offsets)
    return RecallPrompt(tuple(head + body + intro), tuple(facts), positions, queries)


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
