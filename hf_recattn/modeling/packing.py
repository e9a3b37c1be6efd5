"""Packed documents: several documents in one row, told apart by position ids that restart.

The convention is transformers' ``DataCollatorWithFlattening``: the position ids of each document count up by one
from its first token, so a document starts at every token whose position id is not the previous token's plus one
(typically 0 again). Boundaries next to a padded token are ignored, so left or right padding with positions
counted over real tokens (``generate()``'s convention) is not mistaken for packing.

Every mixer then runs each document on its own, uncached, as if it were the whole sequence: the documents of
all rows are gathered into a few right-padded batches of similar lengths (each group's documents are longer than
half its longest, so at most half the slots are padding and there are about log2(longest) groups), the mixer runs
once per group with the slots past a document's end marked as padding, and the outputs are put back in place.
Queries and keys are rotary-embedded before the split, with the given position ids, so RoPE matches each
document run alone with the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentGroup:
    """Documents of similar length, gathered as the rows of a right-padded batch ``[n, length]``."""

    index: torch.Tensor  # [n, L] long: flat position b * T + t of each slot (past a document's end: its last token)
    inside: torch.Tensor  # [n, L] bool: the slot lies inside its document
    padding_mask: torch.Tensor | None  # [n, L] bool for the mixer: inside and a real token; None: all real

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[n, L, ...]``."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat[self.index.reshape(-1)].view(*self.index.shape, *x.shape[2:])

    def take_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, D]`` -> ``[n, H, L, D]``."""
        return self.take(x.transpose(1, 2)).transpose(1, 2)


@dataclass(frozen=True)
class PackedDocuments:
    """Where the documents of a packed batch lie, and how to put per-document outputs back."""

    groups: tuple[DocumentGroup, ...]
    restore: torch.Tensor  # [B * T] long: for each token, its row in the concatenated inside slots of all groups
    batch_size: int
    seq_len: int

    def merge(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Per-group outputs ``[n, L, ...]`` -> ``[B, T, ...]``."""
        inside = torch.cat([out[group.inside] for group, out in zip(self.groups, outputs, strict=True)])
        return inside[self.restore].view(self.batch_size, self.seq_len, *inside.shape[1:])


def document_starts(position_ids: torch.Tensor, padding_mask: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """[B, T - 1] bool: token t + 1 starts a new document (its position is not the previous one's plus one)."""
    positions = position_ids.expand(batch_size, -1)
    starts = positions[:, 1:] != positions[:, :-1] + 1
    if padding_mask is not None:
        real = padding_mask[:, -positions.shape[1] :]
        starts = starts & real[:, 1:] & real[:, :-1]
    return starts


def find_documents(
    position_ids: torch.Tensor, padding_mask: torch.Tensor | None, batch_size: int
) -> PackedDocuments | None:
    """The documents packed in a batch by restarting position ids, or None when each row is one document.

    ``padding_mask`` is the ``[B, T]`` bool mask of real tokens (None: all real). Costs one device sync.
    """
    seq_len = position_ids.shape[-1]
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch_size):
        raise ValueError(
            f"position_ids must be [batch, tokens] or [1, tokens], got shape {tuple(position_ids.shape)} for "
            f"a batch of {batch_size}"
        )
    starts = document_starts(position_ids, padding_mask, batch_size)
    if not bool(starts.any()):
        return None
    segments: list[tuple[int, int, int]] = []  # (length, row, first token)
    for row, cuts in enumerate(starts.cpu().tolist()):
        bounds = [0, *(t + 1 for t, cut in enumerate(cuts) if cut), seq_len]
        segments += [(stop - start, row, start) for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    segments.sort(key=lambda s: -s[0])
    device = position_ids.device
    groups: list[DocumentGroup] = []
    order: list[torch.Tensor] = []
    first = 0
    while first < len(segments):
        longest = segments[first][0]
        last = first
        while last < len(segments) and 2 * segments[last][0] > longest:
            last += 1
        chosen = segments[first:last]
        lengths = torch.tensor([n for n, _, _ in chosen], device=device)
        starts_flat = torch.tensor([row * seq_len + start for _, row, start in chosen], device=device)
        slots = torch.arange(longest, device=device)
        inside = slots[None, :] < lengths[:, None]
        index = starts_flat[:, None] + torch.minimum(slots[None, :], lengths[:, None] - 1)
        real = inside
        if padding_mask is not None:
            real = inside & padding_mask[:, -seq_len:].reshape(-1)[index]
        all_real = len({n for n, _, _ in chosen}) == 1 and (padding_mask is None or bool(real.all()))
        groups.append(DocumentGroup(index, inside, None if all_real else real))
        order.append(index[inside])
        first = last
    flat_order = torch.cat(order)
    restore = torch.empty_like(flat_order)
    restore[flat_order] = torch.arange(flat_order.numel(), device=device)
    return PackedDocuments(tuple(groups), restore, batch_size, seq_len)


def positions_from_cu_seqlens(cu_seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[1, T]`` position ids restarting at each boundary of FlashAttention's ``cu_seq_lens`` (``[docs + 1]``)."""
    cu = torch.as_tensor(cu_seq_lens).long().flatten()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_len or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seq_lens_q must rise from 0 to the number of tokens ({seq_len}), got {cu.tolist()}"
        )
    tokens = torch.arange(seq_len, device=cu.device)
    doc = torch.searchsorted(cu[1:], tokens, right=True)
    return (tokens - cu[doc])[None]
