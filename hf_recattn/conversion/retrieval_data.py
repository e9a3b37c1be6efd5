"""Retrieval-shaped training prompts: facts hidden in training text and asked for at the end, in the training
templates' words.

Plain text rarely asks a model to fetch one token from a thousand tokens back, so stage 2 on plain blocks gives
a converted model's far state (or its retrieval heads) little reason to do it. ``retrieval_blocks`` builds blocks
that do, of the kinds given in turn (by default ``passkey``, ``codes``, ``words``): a number hidden in training text
and asked for at the end (``passkey``: the passkey probe's kind of task), one to four made-up names with 4-digit
numbers (``codes``) or with words (``words``), planted and asked for in any order (the associative recall probe's
kind of task), and, opted into by name, ``needles``: the needle probe's tasks (one fact of a number, a word or a
phrase; the asked fact among distractors; one key with several values; several keys asked in turn; a fact in
prose asked in other words) at distances up to the block's length, one drawn per block, or one of them always when
the kind is the task's name (``multi_key``, ...). Each block takes its wording (and its word values) from a
``train`` template of its kind (``hf_recattn/templates/retrieval``, ``prompting/templates.py``) and
its text from the training texts given, so that the probes, which use the ``heldout`` templates and held-out text,
ask in words and about text training never showed. With ``min_distance`` (both stages pass the recipe's longest
attention window) every fact stays at least that many tokens of text before its question when the block has room.
Each block comes with per-token loss weights: ``answer_weight`` on the tokens that answer a question, 1 elsewhere,
so that a handful of answer tokens can count as much as the rest of the block.

``mix_blocks`` interleaves them evenly with the plain blocks (Trainer then shuffles them). The seeds differ from
those of the head search and of the probes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..modeling.mixers import validate_spec
from ..prompting.facts import fact_ids
from ..prompting.haystack import Haystack
from ..prompting.needles import NEEDLE_TASKS, needle_templates, needle_training_prompt
from ..prompting.pieces import fill_tokens, plant
from ..prompting.recall import RecallPrompt, recall_prompt
from ..prompting.templates import Template, templates
from .recipe import Recipe
from .settings import DEFAULT_RETRIEVAL_KINDS, RETRIEVAL_KINDS

#: the kinds of retrieval block taken in turn by default (``RETRIEVAL_KINDS``: every kind there is)
KINDS = DEFAULT_RETRIEVAL_KINDS
_FACT_COUNTS = (1, 2, 4)


def needle_prompt(tokenizer: Any, haystack: Haystack, context_length: int, depth: float, seed: str,
                  template: Template | None = None, min_distance: int = 0) -> RecallPrompt:
    """One number hidden in training text at ``depth`` and asked for at the end, as a one-query ``RecallPrompt``,
    in the words of a ``passkey`` training template (default: the first). ``min_distance``: the last that many
    tokens of text stay free of the number when the text is longer."""
    template = template or templates("passkey", "train")[0]
    rng = random.Random(seed)
    value = str(rng.randrange(10_000, 100_000))

    def encode(text: str, special: bool = False) -> list[int]:
        return tokenizer(text, add_special_tokens=special)["input_ids"]

    fact = fact_ids(tokenizer, template.name, value, stem=template.parts["answer"])
    head, question = encode(template.parts["head"], True), encode(template.parts["question"])
    needle = encode(template.fill("fact", value=value))
    room = context_length - len(head) - len(needle) - len(question) - len(fact.ids)
    if room < 1:
        raise ValueError(f"context length {context_length} leaves no room for text around the hidden number")
    filler, starts = fill_tokens(haystack.pieces(rng.randrange(len(haystack.texts))), room)
    body, (offset,) = plant(filler, starts, [needle], [depth], reserve=min_distance)
    return RecallPrompt(tuple(head + body + question), (fact,), (len(head) + offset,), (0,))


def retrieval_prompt(tokenizer: Any, haystack: Haystack, block_size: int, index: int, seed: int,
                     min_distance: int = 0, kinds: Sequence[str] = KINDS) -> RecallPrompt:
    """Block ``index`` of the set: of kind ``kinds[index % len(kinds)]``, in the words of a training template of it
    (``needles``: a needle task drawn, then a training template of its form; a needle task's name: that task)."""
    rng = random.Random(f"stage2-retrieval-{seed}-{index}")
    kind = kinds[index % len(kinds)]
    if kind == "needles" or kind in NEEDLE_TASKS:
        task = rng.choice(NEEDLE_TASKS) if kind == "needles" else kind
        return needle_training_prompt(tokenizer, haystack, task, block_size, f"stage2-needles-{seed}-{index}",
                                      rng.choice(needle_templates(task, "train")), min_distance)
    template = rng.choice(templates(kind, "train"))
    if kind == "passkey":
        return needle_prompt(tokenizer, haystack, block_size, rng.random(), f"stage2-needle-{seed}-{index}", template,
                             min_distance)
    return recall_prompt(tokenizer, haystack, block_size, rng.choice(_FACT_COUNTS),
                         seed=f"stage2-recall-{seed}-{index}", template=template, min_distance=min_distance)


def retrieval_blocks(
    tokenizer: Any, texts: Sequence[str], count: int, block_size: int, answer_weight: float = 1.0, seed: int = 0,
    min_distance: int = 0, kinds: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` retrieval prompts of exactly ``block_size`` tokens as ``[count, block_size]`` ids, and their
    loss weights ``[count, block_size]``: weight i belongs to the prediction of token i (``answer_weight`` where
    token i answers a question, 1 elsewhere; the first token is never predicted). The text comes from ``texts``
    (training documents only); ``min_distance`` as in ``retrieval_prompt``; ``kinds``: of ``RETRIEVAL_KINDS``,
    taken in turn (None: ``KINDS``)."""
    if count < 1:
        raise ValueError(f"stage 2 retrieval data: count must be >= 1, got {count}")
    if answer_weight <= 0:
        raise ValueError(f"stage 2 retrieval data: answer_weight must be > 0, got {answer_weight}")
    kinds = KINDS if kinds is None else tuple(kinds)
    if not kinds or any(kind not in RETRIEVAL_KINDS for kind in kinds):
        raise ValueError(f"stage 2 retrieval data: kinds must be some of {list(RETRIEVAL_KINDS)}, got {list(kinds)}")
    ids, answers = retrieval_rows(tokenizer, texts, count, block_size, seed, min_distance, kinds)
    return ids, torch.where(answers, float(answer_weight), 1.0)


def retrieval_rows(tokenizer: Any, texts: Sequence[str], count: int, block_size: int, seed: int = 0,
                   min_distance: int = 0, kinds: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``retrieval_blocks``'s ``[count, block_size]`` ids and where their answer tokens are (bool, same shape)."""
    kinds = KINDS if kinds is None else tuple(kinds)
    haystack = Haystack(tokenizer, texts)
    ids = torch.empty(count, block_size, dtype=torch.long)
    answers = torch.zeros(count, block_size, dtype=torch.bool)
    for i in range(count):
        try:
            prompt = retrieval_prompt(tokenizer, haystack, block_size, i, seed, min_distance, kinds)
        except ValueError as err:
            raise ValueError(f"stage 2 retrieval data: block_size {block_size}: {err}") from None
        row = prompt.ids()[0]
        if row.numel() != block_size:  # the prompt builders promise the length; a bug if not
            raise RuntimeError(f"retrieval prompt {i} has {row.numel()} tokens, not {block_size}")
        ids[i] = row
        for span in prompt.answer_spans():
            answers[i, list(span)] = True
    return ids, answers


def recipe_window(recipe: Recipe) -> int:
    """The longest attention window of the recipe's specs (0 without any): stage 2's facts stay beyond it."""
    specs = recipe.attention if isinstance(recipe.attention, list) else [recipe.attention]
    specs = [*specs, *(recipe.attention_overrides or {}).values()]
    return max(_windows(validate_spec(spec, f"{recipe.source}: attention")) for spec in specs)


def _windows(spec: Any) -> int:
    """The largest ``window`` value anywhere in a (validated, nested) spec."""
    if isinstance(spec, dict):
        own = spec.get("window")
        return max([own if isinstance(own, int) else 0, *(_windows(v) for v in spec.values())])
    if isinstance(spec, Iterable) and not isinstance(spec, str):
        return max([0, *(_windows(v) for v in spec)])
    return 0


def extra_rows(total: int, count: int) -> torch.Tensor:
    """[total] bool: the rows ``mix_blocks`` gives the ``count`` extra blocks (the same every time)."""
    # extra block j goes to the slot floor((j + 0.5) * total / count): evenly spaced, never at the same slot
    slots = ((torch.arange(count, dtype=torch.float64) + 0.5) * total / count).long()
    is_extra = torch.zeros(total, dtype=torch.bool)
    is_extra[slots] = True
    return is_extra


def mix_blocks(
    text_blocks: torch.Tensor, extra: torch.Tensor, extra_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text blocks with the ``extra`` blocks spread evenly among them (``extra_rows``), and the loss weights of
    the whole set (1 for text blocks)."""
    if text_blocks.shape[1:] != extra.shape[1:] or extra.shape != extra_weights.shape:
        raise ValueError(f"stage 2: blocks {tuple(text_blocks.shape)} and retrieval blocks {tuple(extra.shape)} "
                         "differ in length")
    is_extra = extra_rows(text_blocks.shape[0] + extra.shape[0], extra.shape[0])
    rows = text_blocks.new_empty((is_extra.shape[0], *text_blocks.shape[1:]))
    rows[is_extra], rows[~is_extra] = extra.to(rows.dtype), text_blocks
    weights = torch.ones(rows.shape, dtype=extra_weights.dtype)
    weights[is_extra] = extra_weights
    return rows, weights


def with_retrieval_blocks(blocks: torch.Tensor, recipe: Recipe, section: str, tokenizer: Any, texts: list[str],
                          log: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A stage's ``blocks`` with ``{section}.retrieval_share`` of them replaced by retrieval prompts of the kinds
    ``{section}.retrieval_kinds`` (default ``KINDS``) built from the training ``texts`` (same count and length,
    facts beyond the recipe's longest window), the loss weights (``{section}.answer_weight`` on the answers, where
    the section has it) and where the answer tokens are (bool); the blocks unchanged and two Nones without the
    share."""
    settings = getattr(recipe, section)
    count = round((settings.retrieval_share or 0.0) * blocks.shape[0])
    if count == 0:
        return blocks, None, None
    weighted = hasattr(settings, "answer_weight")  # stage 1 matches attention: no token weights
    answer_weight = (settings.answer_weight if weighted else None) or 1.0
    kinds = settings.retrieval_kinds or KINDS
    log(f"      {count} of {blocks.shape[0]} blocks hide facts in training text and ask for them ({', '.join(kinds)})"
        + (f" (answer weight {answer_weight:g})" if weighted else ""))
    try:
        extra, answers = retrieval_rows(tokenizer, texts, count, settings.block_size, seed=recipe.seed,
                                        min_distance=recipe_window(recipe), kinds=kinds)
    except ValueError as err:
        raise ValueError(f"{recipe.source}: {section}.retrieval_share: {err}") from None
    extra_weights = torch.where(answers, float(answer_weight), 1.0)
    mixed, weights = mix_blocks(blocks[: blocks.shape[0] - count], extra, extra_weights)
    answers_all = torch.zeros(mixed.shape, dtype=torch.bool)
    answers_all[extra_rows(mixed.shape[0], count)] = answers
    return mixed, weights, answers_all

