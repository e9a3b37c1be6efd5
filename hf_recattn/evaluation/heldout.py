"""Held-out perplexity: the same blocks for teacher and student, every predicted token weighted alike;
perplexity on long blocks, each from one long document or, where asked, from short documents joined
(``long_perplexity``); and the next-token loss by position in the block (``loss_by_position``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .generation import eval_mode, max_positions, model_device
from .progress import progress_bar

#: predicted positions per float32 log-softmax in ``perplexity``: at a 152k vocabulary and 4,096 positions the
#: whole log-softmax would hold 2.5 GB beside the logits
NLL_ROWS = 512


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 4, progress: str | None = None) -> float:
    """exp(mean next-token NLL) over every predicted token of every block ([N, T] token ids, no padding).

    Token-weighted: each block contributes T - 1 predictions. Pass the same blocks to teacher and student.
    ``progress``: the label of a progress bar over the blocks (None: no bar).
    """
    _check_blocks(blocks, batch_size)
    device = model_device(model)
    total_nll, count = 0.0, 0
    with eval_mode(model), progress_bar(blocks.shape[0], progress, "block") as bar:
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            for row in range(ids.shape[0]):
                total_nll += float(summed_nll(logits[row, :-1], ids[row, 1:]))
                count += ids.shape[1] - 1
            del logits
            bar.update(ids.shape[0])
    if not math.isfinite(total_nll):
        return float("inf")
    return math.exp(total_nll / count)


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token NLL of ``logits`` [N, V] at ``targets`` [N], bit for bit
    ``F.cross_entropy(logits.float(), targets, reduction="sum")``, with the float32 log-softmax of ``NLL_ROWS``
    positions alive at a time: each row's log-softmax does not depend on the others, and the sum is nll_loss's
    own over the gathered log-probabilities, in the same order."""
    return F.nll_loss(_picked_log_probs(logits, targets), torch.zeros_like(targets), reduction="sum")


def _picked_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, 1] float32 log-probability of each target, the log-softmax of ``NLL_ROWS`` positions at a time."""
    picked = torch.empty(targets.shape[0], 1, dtype=torch.float32, device=logits.device)
    for start in range(0, targets.shape[0], NLL_ROWS):
        part = F.log_softmax(logits[start : start + NLL_ROWS].float(), dim=-1)
        picked[start : start + NLL_ROWS, 0] = part.gather(1, targets[start : start + NLL_ROWS, None])[:, 0]
    return picked



#: block lengths of the long-context perplexity, by default
LONG_LENGTHS = (4096, 8192, 16384)


def long_blocks(tokenizer: Any, documents: Sequence[str], length: int, count: int, join: bool = False) -> torch.Tensor:
    """Up to ``count`` blocks ``[n, length]`` of consecutive tokens of one document each, from the documents
    with at least ``length`` tokens: the first block of each in turn, then the second, and so on. Never spans
    two documents, so a block is long-range text, not several short documents end to end.

    ``join``: when those give fewer than ``count`` blocks, the rest are cut from the documents shorter than
    ``length`` joined whole, in their order, with the tokenizer's EOS token between two of them (as
    ``token_blocks`` packs documents); these blocks come last and span documents (``long_rows`` counts them).
    """
    return long_rows(tokenizer, documents, length, count, join)[0]


def long_rows(tokenizer: Any, documents: Sequence[str], length: int, count: int,
              join: bool = False) -> tuple[torch.Tensor, int]:
    """``long_blocks`` and how many of its blocks (the last ones) are joined from short documents."""
    if length < 2 or count < 1:
        raise ValueError(f"long_blocks needs length >= 2 and count >= 1, got {length}, {count}")
    encoded = tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"] if documents else []
    rows = [ids for ids in encoded if len(ids) >= length]
    chosen: list[list[int]] = []
    for k in range(max((len(ids) // length for ids in rows), default=0)):
        chosen += [ids[k * length : (k + 1) * length] for ids in rows if len(ids) >= (k + 1) * length]
    chosen = chosen[:count]
    joined: list[list[int]] = []
    if join and len(chosen) < count:
        joined = _joined_blocks(tokenizer, [ids for ids in encoded if 0 < len(ids) < length], length)
        joined = joined[: count - len(chosen)]
    return torch.tensor(chosen + joined, dtype=torch.long).view(-1, length), len(joined)


def _joined_blocks(tokenizer: Any, documents: list[list[int]], length: int) -> list[list[int]]:
    """Consecutive ``length``-token blocks of ``documents`` joined with the EOS token between two (tail dropped)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("long_blocks with join needs a tokenizer with an EOS token (the separator)")
    stream: list[int] = []
    for k, ids in enumerate(documents):
        stream += ([tokenizer.eos_token_id] if k else []) + list(ids)
    return [stream[k * length : (k + 1) * length] for k in range(len(stream) // length)]


def long_perplexity(model: torch.nn.Module, tokenizer: Any, documents: Sequence[str],
                    lengths: Sequence[int] = LONG_LENGTHS, blocks: int = 4,
                    progress: str | None = None, join: bool = False) -> dict[str, Any]:
    """Perplexity on up to ``blocks`` long blocks (``long_blocks``, ``join`` passed on) of each length:
    ``perplexity``, ``blocks`` (how many blocks) and ``joined`` (how many of them join short documents) by
    length; a length beyond the model's ``max_position_embeddings``, or that no document reaches (nor, with
    ``join``, the short ones joined), is left out with the reason under ``skipped``. Pass the same documents
    to teacher and student."""
    if not lengths or any(length < 2 for length in lengths):
        raise ValueError(f"long_perplexity needs lengths >= 2, got {list(lengths)}")
    limit = max_positions(model)
    result: dict[str, Any] = {"perplexity": {}, "blocks": {}, "joined": {}, "skipped": {}}
    for length in lengths:
        if limit is not None and length > limit:
            result["skipped"][str(length)] = f"beyond max_position_embeddings {limit}"
            continue
        rows, joined = long_rows(tokenizer, documents, length, blocks, join)
        if rows.shape[0] == 0:
            joined_too = ", nor all the shorter ones joined" if join else ""
            result["skipped"][str(length)] = f"no held-out document has {length} tokens{joined_too}"
            continue
        label = None if progress is None else f"{progress} {length}"
        result["perplexity"][str(length)] = perplexity(model, rows, batch_size=1, progress=label)
        result["blocks"][str(length)] = rows.shape[0]
        result["joined"][str(length)] = joined
    return result


# ----- loss by position -----------------------------------------------------------------------------------------
def position_buckets(length: int, first: int = 64, factor: int = 4) -> tuple[int, ...]:
    """Log-spaced edges of position buckets for blocks of ``length`` tokens: 1, ``first``, ``first * factor``,
    ... below ``length``, then ``length`` (for 8,192: 1, 64, 256, 1024, 4096, 8192), so that the buckets
    [1, 64), [64, 256), ... hold every predicted position of such a block."""
    if length < 2 or first < 2 or factor < 2:
        raise ValueError(f"position_buckets needs length, first and factor >= 2, got {length}, {first}, {factor}")
    edges, edge = [1], first
    while edge < length:
        edges.append(edge)
        edge *= factor
    return (*edges, length)


@torch.no_grad()
def position_losses(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 1,
                    progress: str | None = None) -> torch.Tensor:
    """[N, T - 1] float32 next-token NLL over ``blocks`` ([N, T] token ids, no padding): column p - 1 holds the
    loss of the block's token p, predicted from the p tokens before it (its position p, 1 <= p < T)."""
    _check_blocks(blocks, batch_size)
    device = model_device(model)
    losses = torch.empty(blocks.shape[0], blocks.shape[1] - 1, dtype=torch.float32)
    with eval_mode(model), progress_bar(blocks.shape[0], progress, "block") as bar:
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            for row in range(ids.shape[0]):
                losses[start + row] = -_picked_log_probs(logits[row, :-1], ids[row, 1:])[:, 0].cpu()
            del logits
            bar.update(ids.shape[0])
    return losses


def bucket_losses(losses: torch.Tensor, buckets: Sequence[int]) -> list[dict[str, Any]]:
    """The mean of ``losses`` ([N, T - 1], ``position_losses``) over the positions p with start <= p < end, for
    each bucket between consecutive edges of ``buckets`` (increasing, from 1 or more to T or less):
    ``[{"start", "end", "loss", "tokens"}]``, summed in float64. Positions outside every bucket are not counted."""
    if losses.dim() != 2 or losses.shape[0] == 0 or losses.shape[1] == 0:
        raise ValueError(f"losses must be [N >= 1, T - 1 >= 1], got shape {tuple(losses.shape)}")
    edges = [int(edge) for edge in buckets]
    if len(edges) < 2 or edges[0] < 1 or edges[-1] > losses.shape[1] + 1 or edges != sorted(set(edges)):
        raise ValueError(f"buckets must be increasing edges from >= 1 to <= {losses.shape[1] + 1} (the block "
                         f"length), got {edges}")
    wide = losses.double()
    return [{"start": a, "end": b, "loss": float(wide[:, a - 1 : b - 1].mean()), "tokens": losses.shape[0] * (b - a)}
            for a, b in zip(edges[:-1], edges[1:], strict=True)]


def loss_by_position(model: torch.nn.Module, blocks: torch.Tensor, buckets: Sequence[int] | None = None,
                     batch_size: int = 1, progress: str | None = None) -> list[dict[str, Any]]:
    """Mean next-token loss (nats) by position bucket over ``blocks`` ([N, T] token ids): ``bucket_losses`` of
    ``position_losses``, the buckets by default ``position_buckets(T)``. When the buckets cover 1..T, their
    losses weighted by ``tokens`` average to the log of ``perplexity`` on the same blocks."""
    losses = position_losses(model, blocks, batch_size=batch_size, progress=progress)
    return bucket_losses(losses, position_buckets(blocks.shape[1]) if buckets is None else buckets)


def _check_blocks(blocks: torch.Tensor, batch_size: int) -> None:
    if blocks.dim() != 2 or blocks.shape[1] < 2 or blocks.shape[0] == 0:
        raise ValueError(f"blocks must be [N >= 1, T >= 2] token ids, got shape {tuple(blocks.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
