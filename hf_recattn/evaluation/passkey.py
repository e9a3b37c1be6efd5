"""The passkey probe: a random 5-digit key hidden at fixed depths in plain filler, answered greedily through the
cache. Its wording and filler are the held-out ``passkey`` template's (``probe_template("passkey")``); the prompt
(``passkey_ids``, ``passkey_prompt``) is built in ``hf_recattn.prompting.passkey``."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..prompting.passkey import passkey_ids, passkey_prompt, passkey_question_ids
from .generation import eval_mode, greedy_continuation, max_positions
from .progress import progress_bar

__all__ = [
    "PASSKEY_ANSWER_TOKENS",
    "PASSKEY_DEPTHS",
    "passkey_answered",
    "passkey_ids",
    "passkey_keys",
    "passkey_probe",
    "passkey_prompt",
    "passkey_question_ids",
]

#: where the passkey sits in its prompt (0 = start, 1 = end): a fixed grid shared by every model
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
#: the answer's room: ``passkey_probe``'s prompts have ``length - PASSKEY_ANSWER_TOKENS`` tokens
PASSKEY_ANSWER_TOKENS = 8


def _check_passkey_args(context_lengths: Sequence[int], trials: int, depths: Sequence[float],
                        max_new_tokens: int) -> None:
    if trials < 1 or not context_lengths:
        raise ValueError("passkey_probe needs trials >= 1 and at least one context length")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"passkey_probe: depths must be a non-empty list of values in [0, 1], got {list(depths)}")
    if max_new_tokens < 1 or any(length <= max_new_tokens for length in context_lengths):
        raise ValueError(f"passkey_probe: every context length must exceed max_new_tokens={max_new_tokens}")


def passkey_probe(
    model: Any,
    tokenizer: Any,
    context_lengths: Sequence[int] = (1024, 4096, 8192),
    trials: int = 3,
    seed: int = 0,
    max_new_tokens: int = PASSKEY_ANSWER_TOKENS,
    depths: Sequence[float] = PASSKEY_DEPTHS,
    progress: str | None = None,
) -> dict[str, Any]:
    """Hide a random 5-digit key in filler, ask for it, greedy-decode the answer through the cache; a trial
    passes when the key's digits appear in the answer.

    Each context length gets ``trials`` prompts of ``length - max_new_tokens`` tokens (prompt and answer fill
    the length), trial i with its key at ``depths[i % len(depths)]``: use a multiple of the number of depths.
    Returns the accuracy per length and its mean, ``accuracy_by_depth`` ``{length: {depth: accuracy}}``, and
    every answer. Lengths beyond the model's ``max_position_embeddings`` are listed under ``skipped``. The keys
    depend only on ``seed``, so every model sees the same prompts. ``progress``: the label of a progress bar over
    the prompts (None: no bar)."""
    _check_passkey_args(context_lengths, trials, depths, max_new_tokens)
    accuracy: dict[str, float] = {}
    by_depth: dict[str, dict[str, float]] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    skipped: list[int] = []
    limit = max_positions(model)
    runs = sum(limit is None or length <= limit for length in context_lengths)
    drawn = passkey_keys(context_lengths, trials, seed)
    with eval_mode(model), progress_bar(runs * trials, progress, "prompt") as bar:
        for length in context_lengths:
            keys = drawn[length]
            if limit is not None and length > limit:
                skipped.append(length)
                continue
            rows = []
            for i, key in enumerate(keys):
                rows.append(_passkey_trial(model, tokenizer, length - max_new_tokens, key, depths[i % len(depths)],
                                           max_new_tokens))
                bar.update()
            answers[str(length)] = rows
            accuracy[str(length)] = sum(r["correct"] for r in rows) / trials
            by_depth[str(length)] = _share_by(rows, "depth")
    mean = sum(accuracy.values()) / len(accuracy) if accuracy else None
    return {"accuracy": accuracy, "mean_accuracy": mean, "accuracy_by_depth": by_depth, "trials": trials,
            "depths": list(depths), "skipped": skipped, "answers": answers}


def passkey_keys(context_lengths: Sequence[int], trials: int, seed: int = 0) -> dict[int, list[str]]:
    """The 5-digit keys ``passkey_probe`` plants, ``trials`` per context length, drawn in the order of the lengths:
    the same ``seed`` and lengths give the same keys."""
    rng = random.Random(seed)
    return {length: [f"{rng.randrange(10_000, 100_000)}" for _ in range(trials)] for length in context_lengths}


def _passkey_trial(model: Any, tokenizer: Any, prompt_length: int, key: str, depth: float,
                   max_new_tokens: int) -> dict[str, Any]:
    ids, needle = passkey_ids(tokenizer, prompt_length, key, depth)
    prompt = torch.tensor([ids], dtype=torch.long)
    new = greedy_continuation(model, tokenizer, prompt, max_new_tokens).tokens
    answer = tokenizer.decode(new, skip_special_tokens=True)
    return {"key": key, "depth": depth, "needle_at": needle, "tokens": len(ids), "answer": answer.strip(),
            "correct": passkey_answered(answer, key)}


def passkey_answered(answer: str, key: str) -> bool:
    """The verdict on one trial: the key's digits appear in the answer (whitespace ignored)."""
    return key in re.sub(r"\s+", "", answer)


def _share_by(rows: Sequence[dict[str, Any]], field: str) -> dict[str, float]:
    """The share of correct rows for each value of ``field`` (keys formatted with ``g``), in first-seen order."""
    groups: dict[str, list[bool]] = {}
    for row in rows:
        groups.setdefault(format(row[field], "g"), []).append(bool(row["correct"]))
    return {name: sum(hits) / len(hits) for name, hits in groups.items()}
