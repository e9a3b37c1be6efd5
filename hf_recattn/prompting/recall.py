"""The associative-recall prompt: facts (made-up names with values, in a ``codes`` or ``words`` template's words)
planted at spread depths in text, then some of them asked again in a random order (``recall_prompt``), as a
``RecallPrompt``: the shape every teacher-forced prompt takes (the probes', the head search's, the training
blocks'). A prompt depends only on the texts, the tokenizer, the template and the seed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .facts import Fact, make_facts
from .haystack import Haystack
from .pieces import fill_tokens, plant
from .templates import Template, probe_template


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
