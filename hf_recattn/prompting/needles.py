"""The needle prompts, after RULER (arXiv:2404.06654): facts about made-up names planted in whole documents laid end
to end, then asked for after the text, in a ``needles`` template's words.

``needle_prompt`` writes the probe's trial (``evaluation/needles.py``: the queries with the room of greedy answers);
``needle_training_prompt`` writes the same layouts teacher-forced, each query followed by its answer, as a
``RecallPrompt`` of an exact length (the training blocks of ``conversion/retrieval_data.py``, in the ``train``
templates' words and values). Tasks:

* ``single_number``, ``single_word``, ``single_phrase``: one fact whose value is a 7-digit number, a word, or three
  words;
* ``multi_key``: the asked fact among 3 distractors of the same form with other keys, one of them after it (the
  most recent number is never the answer);
* ``multi_value``: one key stated with 3 or 4 values at spread places, all asked for at once;
* ``multi_query``: 4 keys, each asked in turn;
* ``paraphrase``: a fact stated in plain prose, asked with a question in other words (its value: 4 digits).

A prompt depends only on the texts, the tokenizer, the template and the seed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .facts import Fact, fact_ids, made_up_name
from .haystack import Haystack
from .pieces import fill_tokens, plant
from .recall import RecallPrompt
from .templates import Template, templates, word_list

NEEDLE_TASKS = ("single_number", "single_word", "single_phrase", "multi_key", "multi_value", "multi_query",
                "paraphrase")
#: the form of template (``templates.NEEDLE_FORMS``) each task asks in
TASK_FORMS = {"single_number": "number", "single_word": "word", "single_phrase": "phrase", "multi_key": "number",
              "multi_value": "number", "multi_query": "number", "paraphrase": "paraphrase"}
MULTI_KEYS = 4  # multi_key: the asked fact and 3 distractors; multi_query: 4 keys asked in turn
ANSWER_SLACK = 4  # answer tokens decoded beyond the values' own (and 2 per separator between values)
PHRASE_WORDS = 3

#: a drawn layout: the needles (key, value, asked, depth) in the order planted, the queries (key, values) in the
#: order asked
Layout = tuple[list[tuple[str, str, bool, float]], list[tuple[str, list[str]]]]


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


def needle_template(task: str, split: str = "heldout") -> Template:
    """The template ``task`` asks in: the first ``split`` needles template of its form."""
    found = needle_templates(task, split)
    if not found:
        raise ValueError(f"no {split} needles template of form {TASK_FORMS[task]!r} (task {task})")
    return found[0]


def needle_templates(task: str, split: str) -> tuple[Template, ...]:
    """Every ``split`` needles template ``task`` can ask in (those of its form), in file order."""
    if task not in TASK_FORMS:
        raise ValueError(f"unknown needle task {task!r}; use one of {list(NEEDLE_TASKS)}")
    return tuple(t for t in templates("needles", split) if t.parts["form"] == TASK_FORMS[task])


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


def _layout(task: str, keys: list[str], values: list[str], depth: float, rng: random.Random) -> Layout:
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


def draw_needles(tokenizer: Any, template: Template, task: str, rng: random.Random,
                 depth: float | None = None) -> Layout:
    """The keys, values and layout of one ``task`` prompt in ``template``'s form and split, drawn from ``rng``:
    ``depth`` (default drawn) places a single-needle task's asked needle; the multi-needle tasks spread theirs."""
    depth = rng.uniform(0.05, 0.95) if depth is None else depth
    n_keys = MULTI_KEYS if task in ("multi_key", "multi_query") else 1
    n_values = rng.choice((3, 4)) if task == "multi_value" else n_keys
    keys = _keys(tokenizer, n_keys, rng)
    values = needle_values(template.parts["form"], template.split, n_values, rng)
    return _layout(task, keys, values, depth, rng)


def lay_documents(haystack: Haystack, start: int, n_tokens: int) -> tuple[list[int], list[int], int]:
    """The last ``n_tokens`` ids of whole documents laid end to end from document ``start`` (the first may lose its
    beginning, so that the text ends where a document's piece ends), the offsets where pieces begin, and how many
    documents were laid (more than the haystack holds: one repeats)."""
    laid = 0

    def pieces() -> Iterator[list[int]]:  # the documents' pieces until n_tokens are laid, counting the documents
        nonlocal laid
        total = 0
        for document in haystack.documents(start):
            if total >= n_tokens:
                return
            laid += 1
            for piece in document:
                if total >= n_tokens:
                    return
                total += len(piece)
                yield piece

    ids, starts = fill_tokens(pieces(), n_tokens)
    return ids, starts, laid


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
    laid_out, asked = draw_needles(tokenizer, template, task, rng, depth)
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


# ----- teacher-forced: the training form ----------------------------------------------------------
def listed(values: Sequence[str]) -> str:
    """Values as an answer lists them: ``a``, ``a and b``, ``a, b and c``."""
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def _needle_facts(tokenizer: Any, template: Template, layout: Layout) -> tuple[list[Fact], list[int]]:
    """One fact per planted needle (planted as the template's ``fact``; asked with its question and answer lead-in,
    the value written after it), and the needles the queries ask, in the order asked. A query for several values
    (``multi_value``) is the fact of its key's first needle, whose answer lists every value."""
    needles, asked = layout
    wanted = {key: values for key, values in asked}
    facts: list[Fact] = []
    first: dict[str, int] = {}
    for k, (key, value, _, _) in enumerate(needles):
        values = wanted.get(key, [value]) if key not in first else [value]
        plural = "_all" if len(values) > 1 else ""
        stem = template.fill("question" + plural, key=key) + template.fill("answer" + plural, key=key)
        fact = fact_ids(tokenizer, key, listed(values), stem)
        facts.append(dataclasses.replace(fact, statement=_encode(tokenizer, template.fill("fact", key=key,
                                                                                          value=value))))
        first.setdefault(key, k)
    return facts, [first[key] for key, _ in asked]


def needle_training_prompt(tokenizer: Any, texts: Haystack | Sequence[str], task: str, length: int,
                           seed: int | str = 0, template: Template | None = None,
                           min_distance: int = 0) -> RecallPrompt:
    """One ``task`` prompt teacher-forced, of exactly ``length`` tokens (``.ids()``): the head, documents laid from a
    seeded start with the needles planted at sentence starts, then each query followed by its answer and a full
    stop (``answer_spans()``: where the values are). The asked needle's depth is drawn uniformly in [0, 1], so its
    distance to the question reaches the length of the text. ``template``: a needles template of the task's form
    (default: the first ``train`` one); ``min_distance``: the last that many tokens of text stay free of needles
    when the text is longer. The same seed gives the same prompt."""
    template = template or needle_template(task, "train")
    if template.kind != "needles" or template not in needle_templates(task, template.split):
        raise ValueError(f"{template.where}: task {task} needs a needles template of form {TASK_FORMS.get(task)!r}")
    haystack = texts if isinstance(texts, Haystack) else Haystack(tokenizer, texts)
    rng = random.Random(seed)  # a str seed is hashed deterministically
    layout = draw_needles(tokenizer, template, task, rng, rng.random())
    facts, queries = _needle_facts(tokenizer, template, layout)
    head = tokenizer(template.parts["head"])["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    fixed = len(head) + sum(len(f.planted) for f in facts) + sum(len(facts[q].ids) for q in queries)
    if length - fixed < len(facts) + 1:
        raise ValueError(f"needles: length {length} is too short for {task} (its needles, questions and answers "
                         f"take {fixed} tokens)")
    filler, starts, _ = lay_documents(haystack, rng.randrange(len(haystack.texts)), length - fixed)
    body, offsets = plant(filler, starts, [f.planted for f in facts], [d for *_, d in layout[0]],
                          reserve=min_distance)
    return RecallPrompt(tuple(head + body), tuple(facts), tuple(len(head) + o for o in offsets), tuple(queries))
