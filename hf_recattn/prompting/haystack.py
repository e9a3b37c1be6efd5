"""The text facts are hidden in: documents cut into sentence pieces and laid end to end (``Haystack``), and the
documents of packed token blocks as texts (``texts_from_blocks``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .pieces import sentence_pieces, token_pieces


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
