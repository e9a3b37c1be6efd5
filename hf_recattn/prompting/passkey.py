"""The passkey prompt: a key hidden at a chosen depth in a held-out ``passkey`` template's own filler, then the
question and the start of its answer."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .pieces import fill_tokens, plant, sentence_pieces, token_pieces
from .templates import Template, probe_template


def passkey_ids(tokenizer: Any, context_length: int, key: str, depth: float,
                template: Template | None = None) -> tuple[list[int], int]:
    """The passkey prompt's ids (exactly ``context_length``) and the offset of the needle in them.

    ``template``: a held-out ``passkey`` template with a ``filler`` (default: the probe's)."""
    template = template or probe_template("passkey")
    if "filler" not in template.parts:
        raise ValueError(f"{template.where}: the passkey probe needs a template with its own filler")
    head = tokenizer(template.parts["head"])["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    needle = tokenizer(template.fill("fact", value=key), add_special_tokens=False)["input_ids"]
    tail = passkey_question_ids(tokenizer, template)
    room = context_length - len(head) - len(needle) - len(tail)
    if room < 1:
        raise ValueError(f"passkey: context length {context_length} leaves no room for filler (the question and "
                         f"the key take {context_length - room} tokens)")
    pieces = token_pieces(tokenizer, sentence_pieces(" " + template.parts["filler"].strip()))
    filler, starts = fill_tokens(itertools.cycle(pieces), room)
    within = min(max((depth * context_length - len(head)) / room, 0.0), 1.0)  # the depth in the whole prompt
    body, (offset,) = plant(filler, starts, [needle], [within])
    return head + body + tail, len(head) + offset


def passkey_question_ids(tokenizer: Any, template: Template | None = None) -> list[int]:
    """The ids that end every passkey prompt: the template's question and the start of its answer (default: the
    probe's held-out template)."""
    template = template or probe_template("passkey")
    return tokenizer(template.parts["question"] + template.parts["answer"], add_special_tokens=False)["input_ids"]


def passkey_prompt(tokenizer: Any, context_length: int, key: str, depth: float) -> torch.Tensor:
    """[1, context_length] ids: filler, ``The pass key is KEY`` at relative ``depth``, the question.

    The needle begins at the filler's sentence start nearest to ``depth * context_length``; the first filler
    sentence is cut short so that the prompt has exactly ``context_length`` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey: depth must be in [0, 1], got {depth}")
    ids, _ = passkey_ids(tokenizer, context_length, key, depth)
    return torch.tensor([ids], dtype=torch.long)
