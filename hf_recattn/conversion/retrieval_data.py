"""Retrieval-shaped training blocks for stage 2: facts hidden in training text and asked for at the end.

Plain text rarely asks a model to fetch one token from a thousand tokens back, so stage 2 on plain blocks gives
a converted model's far state (or its retrieval heads) little reason to do it. ``retrieval_blocks`` builds blocks
that do: half hide a secret number in training text and ask for it at the end (the passkey probe's kind of task
in other words, other text and other numbers), half plant one to four associative-recall facts and ask for them
(the recall probe's kind of task, on training text instead of held-out text). Each block comes with per-token
loss weights: ``answer_weight`` on the tokens that answer a question, 1 elsewhere, so that a handful of answer
tokens can count as much as the rest of the block.

``mix_blocks`` interleaves them evenly with the plain blocks (Trainer then shuffles them). The seeds differ from
those of the head search and of the probes, so the evaluation's prompts are never trained on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from ..evaluation.recall import Haystack, RecallPrompt, recall_prompt
from .retrieval_heads import needle_prompt

_RECALL_FACTS = (1, 2, 4)


def retrieval_prompt(tokenizer: Any, haystack: Haystack, block_size: int, index: int, seed: int) -> RecallPrompt:
    """Block ``index`` of the set: a secret number (even ``index``) or an associative-recall prompt (odd)."""
    rng = random.Random(f"stage2-retrieval-{seed}-{index}")
    if index % 2 == 0:
        return needle_prompt(tokenizer, haystack, block_size, rng.random(), f"stage2-needle-{seed}-{index}")
    facts = rng.choice(_RECALL_FACTS)
    return recall_prompt(tokenizer, haystack, block_size, facts, seed=f"stage2-recall-{seed}-{index}")


def retrieval_blocks(
    tokenizer: Any, texts: Sequence[str], count: int, block_size: int, answer_weight: float = 1.0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` retrieval prompts of exactly ``block_size`` tokens as ``[count, block_size]`` ids, and their
    loss weights ``[count, block_size]``: weight i belongs to the prediction of token i (``answer_weight`` where
    token i answers a question, 1 elsewhere; the first token is never predicted)."""
    if count < 1:
        raise ValueError(f"stage 2 retrieval data: count must be >= 1, got {count}")
    if answer_weight <= 0:
        raise ValueError(f"stage 2 retrieval data: answer_weight must be > 0, got {answer_weight}")
    haystack = Haystack(tokenizer, texts)
    ids = torch.empty(count, block_size, dtype=torch.long)
    weights = torch.ones(count, block_size)
    for i in range(count):
        try:
            prompt = retrieval_prompt(tokenizer, haystack, block_size, i, seed)
        except ValueError as err:
            raise ValueError(f"stage 2 retrieval data: block_size {block_size}: {err}") from None
        row = prompt.ids()[0]
        if row.numel() != block_size:  # the prompt builders promise the length; a bug if not
            raise RuntimeError(f"retrieval prompt {i} has {row.numel()} tokens, not {block_size}")
        ids[i] = row
        for span in prompt.answer_spans():
            weights[i, list(span)] = answer_weight
    return ids, weights


def mix_blocks(
    text_blocks: torch.Tensor, extra: torch.Tensor, extra_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text blocks with the ``extra`` blocks spread evenly among them (same total order every time), and the
    loss weights of the whole set (1 for text blocks)."""
    if text_blocks.shape[1:] != extra.shape[1:] or extra.shape != extra_weights.shape:
        raise ValueError(f"stage 2: blocks {tuple(text_blocks.shape)} and retrieval blocks {tuple(extra.shape)} "
                         "differ in length")
    total = text_blocks.shape[0] + extra.shape[0]
    # extra block j goes to the slot floor((j + 0.5) * total / count): evenly spaced, never at the same slot
    slots = ((torch.arange(extra.shape[0], dtype=torch.float64) + 0.5) * total / extra.shape[0]).long()
    is_extra = torch.zeros(total, dtype=torch.bool)
    is_extra[slots] = True
    rows = text_blocks.new_empty((total, *text_blocks.shape[1:]))
    rows[is_extra], rows[~is_extra] = extra.to(rows.dtype), text_blocks
    weights = torch.ones(rows.shape, dtype=extra_weights.dtype)
    weights[is_extra] = extra_weights
    return rows, weights
