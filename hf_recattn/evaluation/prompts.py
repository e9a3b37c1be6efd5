"""The pieces prompts are built from: this path keeps existing imports working; they live in
:mod:`hf_recattn.prompting.pieces`, which the probes and the training data share."""

from __future__ import annotations

from ..prompting.pieces import fill_tokens, plant, sentence_pieces, token_pieces

__all__ = ["fill_tokens", "plant", "sentence_pieces", "token_pieces"]
