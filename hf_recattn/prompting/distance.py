"""The prompt of recall at a fixed distance: one fact, then exactly d tokens of text, then the question."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from .facts import make_facts
from .haystack import Haystack
from .pieces import fill_tokens
from .recall import RecallPrompt
from .templates import Template, probe_template

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
