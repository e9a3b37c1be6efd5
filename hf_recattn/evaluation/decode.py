"""Decode cost: milliseconds per token through the cache after a prefill, and the bytes the cache holds."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..modeling.cache import CACHE_NAME, cache_of
from .generation import eval_mode, max_positions, model_device
from .progress import progress_bar


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a cache: hf_recattn's own count, else every tensor on the cache's layers."""
    if cache is None:
        return 0
    if callable(getattr(cache, "nbytes", None)):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


@torch.no_grad()
def decode_stats(
    model: Any, context_length: int = 2048, steps: int = 16, seed: int = 0, progress: str | None = None
) -> dict[str, Any]:
    """Prefill ``context_length`` random tokens, then time ``steps`` single-token forwards through the cache (plain
    forwards, not ``greedy_continuation``: what is timed is the model's step alone; each argmax token only feeds
    the next step).

    Returns the median milliseconds per decoded token, the prefill time and the cache's size in bytes after
    the prefill (the state a long generation carries). The context is shortened to fit the model's length limit
    (``max_positions``: none for a student that needs no positions; ``requested_context_length`` keeps the
    asked-for value). ``progress``: the label of a progress bar over the prefill and the steps (None: no bar)."""
    if context_length < 1 or steps < 1:
        raise ValueError("decode_stats needs context_length >= 1 and steps >= 1")
    requested = context_length
    limit = max_positions(model)
    if limit is not None and context_length + steps > limit:
        context_length = limit - steps
        if context_length < 1:
            raise ValueError(f"decode_stats: {steps} steps do not fit in max_position_embeddings={limit}")
    device = model_device(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    low = min(100, vocab - 1)  # skip the special tokens at the start of most vocabularies
    ids = torch.randint(low, vocab, (1, context_length), generator=gen).to(device)
    with eval_mode(model), progress_bar(1 + steps, progress, "forward") as bar:
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)  # the next token's logits only
        prefill_s = time.perf_counter() - start
        bar.update()
        cache = cache_of(out)
        cache_bytes = cache_nbytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{CACHE_NAME: cache})
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            bar.update()  # outside the timed span
            cache = cache_of(out)
    return {
        "context_length": context_length,
        "requested_context_length": requested,
        "steps": steps,
        "median_ms_per_token": 1000 * statistics.median(times),
        "prefill_s": prefill_s,
        "cache_bytes": cache_bytes,
        "cache_bytes_after_decode": cache_nbytes(cache),
        "threads": torch.get_num_threads(),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
