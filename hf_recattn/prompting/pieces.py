"""The pieces every prompt is built from: text cut at sentence starts, filler of an exact length, inserts planted
at chosen depths."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any

# a cut after a sentence end followed by a line break or by a capital, digit, quote or bracket (not inside
# "e.g. this"), and before every blank line; hard-wrapped lines stay together
_PIECE_BREAK = re.compile(r"(?<=[.!?])(?=[ \t]+[A-Z0-9\"'(\[`*]|\n)|(?<!\n)(?=\n\n)")


def sentence_pieces(text: str) -> list[str]:
    """``text`` cut where sentences and paragraphs begin (never inside a hard-wrapped sentence); each piece
    keeps its leading whitespace, and the pieces joined give ``text`` back."""
    return [piece for piece in _PIECE_BREAK.split(text) if piece]


def token_pieces(tokenizer: Any, pieces: Sequence[str]) -> list[list[int]]:
    """The ids of each piece (no special tokens), empty pieces left out."""
    if not pieces:
        return []
    return [ids for ids in tokenizer(list(pieces), add_special_tokens=False)["input_ids"] if ids]


def fill_tokens(pieces: Iterable[Sequence[int]], n_tokens: int) -> tuple[list[int], list[int]]:
    """The last ``n_tokens`` ids of the first pieces that reach ``n_tokens`` laid end to end (the first piece
    may lose its beginning, so the text ends where a piece ends), and the offsets where pieces begin (0
    included). Fewer ids come back only when the pieces run out."""
    ids: list[int] = []
    starts: list[int] = []
    for piece in pieces:
        if len(ids) >= n_tokens:
            break
        starts.append(len(ids))
        ids.extend(piece)
    surplus = max(len(ids) - n_tokens, 0)
    return ids[surplus:], [0] + [s - surplus for s in starts if s > surplus]


def plant(
    filler: Sequence[int], starts: Sequence[int], inserts: Sequence[Sequence[int]], depths: Sequence[float],
    reserve: int = 0,
) -> tuple[list[int], list[int]]:
    """Insert ``inserts[i]`` into ``filler`` at the piece start nearest to ``depths[i]`` of its length.

    ``depths`` must be non-decreasing; each insert goes at a later start than the one before (any token
    boundary when the filler has too few piece starts). ``reserve``: the last that many filler tokens stay free
    of inserts (the depths then count in the rest) when the filler has at least one token per insert besides
    them. Returns the ids and the offset of each insert in them."""
    if len(inserts) != len(depths) or any(b < a for a, b in itertools.pairwise(depths)):
        raise ValueError("plant needs one non-decreasing depth per insert")
    if reserve > 0 and len(filler) - reserve >= len(inserts):
        cut = len(filler) - reserve
        ids, offsets = plant(filler[:cut], [s for s in starts if s <= cut], inserts, depths)
        return ids + list(filler[cut:]), offsets
    candidates = sorted({s for s in starts if 0 <= s <= len(filler)} | {len(filler)})
    if len(candidates) < len(inserts):
        candidates = list(range(len(filler) + 1))
    if len(candidates) < len(inserts):
        raise ValueError(f"plant: {len(filler)} filler tokens cannot separate {len(inserts)} inserts")
    cuts: list[int] = []
    lowest = 0  # the first candidate the next insert may take
    for k, depth in enumerate(depths):
        highest = len(candidates) - (len(depths) - k)  # keep one candidate for each later insert
        best = min(range(lowest, highest + 1), key=lambda i: abs(candidates[i] - depth * len(filler)))
        cuts.append(candidates[best])
        lowest = best + 1
    ids: list[int] = []
    offsets: list[int] = []
    previous = 0
    for cut, insert in zip(cuts, inserts, strict=True):
        ids.extend(filler[previous:cut])
        offsets.append(len(ids))
        ids.extend(insert)
        previous = cut
    ids.extend(filler[previous:])
    return ids, offsets
