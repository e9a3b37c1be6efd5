"""Facts for the recall prompts: made-up names with values, written by a ``codes`` or ``words`` template.

A fact is planted as the template's ``fact`` sentence and asked with its ``query`` (by default the same
sentence): the asked sentence is tokenized whole and split where the value begins and ends, so that the
value's tokens are the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .templates import Template, word_list

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class Fact:
    """One fact as ids: the asked sentence's ``prefix`` (up to the value), ``answer`` (the value's tokens) and
    ``suffix`` (what closes it); ``statement``, the planted sentence when it differs from the asked one."""

    name: str
    value: str
    prefix: tuple[int, ...]
    answer: tuple[int, ...]
    suffix: tuple[int, ...]
    statement: tuple[int, ...] = ()

    @property
    def ids(self) -> tuple[int, ...]:
        """The asked sentence with its answer."""
        return self.prefix + self.answer + self.suffix

    @property
    def planted(self) -> tuple[int, ...]:
        """The sentence planted in the text."""
        return self.statement or self.ids


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def fact_ids(tokenizer: Any, name: str, value: str, stem: str, tail: str = ".") -> Fact:
    """The sentence ``stem VALUE`` + ``tail``, tokenized whole and split where the value begins and ends."""
    prefix, with_value = _encode(tokenizer, stem), _encode(tokenizer, f"{stem} {value}")
    full = _encode(tokenizer, f"{stem} {value}{tail}")
    if len(with_value) > len(prefix) and with_value[: len(prefix)] == prefix and full[: len(with_value)] == with_value:
        return Fact(name, value, prefix, with_value[len(prefix) :], full[len(with_value) :])
    # a tokenizer merging across the parts
    return Fact(name, value, prefix, _encode(tokenizer, f" {value}"), _encode(tokenizer, tail))


def template_fact(tokenizer: Any, template: Template, name: str, value: str) -> Fact:
    """The fact ``name`` -> ``value`` in ``template``'s words: asked with its ``query`` (else its ``fact``),
    planted as its ``fact``."""
    stem, tail = template.asked.split(" {value}")
    fact = fact_ids(tokenizer, name, value, stem.format(key=name), tail.format(key=name))
    if "query" not in template.parts:
        return fact
    return Fact(name, value, fact.prefix, fact.answer, fact.suffix,
                _encode(tokenizer, template.fill("fact", key=name, value=value)))


def made_up_name(rng: random.Random) -> str:
    """A capitalized name of two or three consonant-vowel syllables."""
    syllables = rng.choice((2, 3))
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)).capitalize()


def fact_values(template: Template, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct values: 4-digit numbers (``codes``) or words of the template's split (``words``)."""
    if template.kind == "words":
        words = word_list(template.split)
        if count > len(words):
            raise ValueError(f"{template.where}: {count} facts need more than the {len(words)} "
                             f"{template.split} words")
        return rng.sample(words, count)
    if template.kind != "codes":
        raise ValueError(f"{template.where}: a {template.kind} template does not write facts")
    return [str(v) for v in rng.sample(range(1000, 10_000), count)]


def make_facts(tokenizer: Any, count: int, rng: random.Random, template: Template) -> list[Fact]:
    """``count`` facts in ``template``'s words, with distinct made-up names (distinct as tokens too) and distinct
    values."""
    values = fact_values(template, count, rng)
    facts: list[Fact] = []
    names: set[str] = set()
    prefixes: set[tuple[int, ...]] = set()
    for _ in range(100 * count):
        if len(facts) == count:
            break
        name = made_up_name(rng)
        if name in names:
            continue
        fact = template_fact(tokenizer, template, name, values[len(facts)])
        if fact.prefix not in prefixes:
            facts.append(fact)
            names.add(name)
            prefixes.add(fact.prefix)
    if len(facts) < count:
        raise ValueError(f"associative recall: the tokenizer tells apart only {len(facts)} of {count} names")
    return facts
