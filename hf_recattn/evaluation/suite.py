"""The whole evaluation of one model: perplexity (512-token blocks and long blocks), the recall probes (the
synthetic passkey, and needles, associative recall and recall by distance in natural text), greedy samples and
decode cost.

Every function takes any causal LM (the softmax teacher or a hf_recattn student), so the numbers in a
conversion report are measured the same way on both. Generation always goes through the model's cache
(the recurrent state for hf_recattn models). Every probe asks in the words of a held-out template
(``templates.py``) and plants its facts in held-out text.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .decode import cache_nbytes, decode_stats
from .distance import DISTANCES, distance_recall_probe
from .generation import DEFAULT_PROMPTS, generation_samples, greedy_continuation, prompt_ids
from .heldout import LONG_LENGTHS, long_perplexity, perplexity
from .needles import NEEDLE_HAYSTACKS, NEEDLE_PROMPTS, NEEDLE_TASKS, TASK_FORMS, natural_haystacks, needle_probe
from .passkey import PASSKEY_DEPTHS, passkey_probe
from .recall import associative_recall_probe, texts_from_blocks
from .store import ProbeStore, cached


def describe_model(model: Any) -> dict[str, Any]:
    """Architecture, parameter count and (hf_recattn) the mixers per layer."""
    config = model.config
    info: dict[str, Any] = {
        "model_type": getattr(config, "model_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": getattr(config, "num_hidden_layers", None),
    }
    if callable(getattr(config, "layer_specs", None)):
        specs = config.layer_specs()
        info["mixers"] = dict(Counter(s["mixer"] for s in specs))
        info["attention"] = specs
    return info


@dataclass(frozen=True)
class RecallSizes:
    """How much of the probes ``evaluate`` runs: context lengths, key depths, pair counts, distances, long
    perplexity block lengths, trials; the needle tasks, their lengths, prompts per cell and haystacks."""

    passkey_lengths: tuple[int, ...] = (1024, 4096, 8192)
    passkey_depths: tuple[float, ...] = PASSKEY_DEPTHS
    passkey_trials: int = 6
    recall_lengths: tuple[int, ...] = (1024, 4096)
    recall_pairs: tuple[int, ...] = (1, 4, 16)
    recall_trials: int = 3
    distances: tuple[int, ...] = DISTANCES
    distance_trials: int = 3
    long_lengths: tuple[int, ...] = LONG_LENGTHS
    long_blocks: int = 4
    needle_tasks: tuple[str, ...] = NEEDLE_TASKS
    needle_lengths: tuple[int, ...] = (1024, 2048, 4096)
    needle_prompts: int = NEEDLE_PROMPTS
    needle_haystacks: tuple[str, ...] = NEEDLE_HAYSTACKS
    #: only these needle cells, each ``TASK@LENGTH`` (e.g. ``single_number@4096``), instead of every task at every
    #: length; empty: the whole grid of ``needle_tasks`` x ``needle_lengths``
    needle_cells: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("passkey_lengths", "recall_lengths", "recall_pairs", "distances", "long_lengths",
                     "needle_lengths"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
        if not self.passkey_depths or any(not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ValueError(f"passkey_depths must lie in [0, 1], got {list(self.passkey_depths)}")
        for name in ("passkey_trials", "recall_trials", "distance_trials", "long_blocks", "needle_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        parse_needle_cells(self.needle_cells)
        for name, known in (("needle_tasks", tuple(TASK_FORMS)), ("needle_haystacks", NEEDLE_HAYSTACKS)):
            values = getattr(self, name)
            if not values or any(v not in known for v in values):
                raise ValueError(f"{name} must be some of {list(known)}, got {list(values)}")

    def needle_grid(self) -> tuple[tuple[str, ...], tuple[int, ...], list[tuple[str, int]] | None]:
        """The needle probe's tasks, lengths and cells: ``needle_cells``' when given (their tasks and lengths in
        order), else every task at every length (cells None)."""
        cells = parse_needle_cells(self.needle_cells)
        if not cells:
            return self.needle_tasks, self.needle_lengths, None
        tasks = tuple(dict.fromkeys(task for task, _ in cells))
        return tasks, tuple(sorted({length for _, length in cells})), cells

    @classmethod
    def for_mode(cls, quick: bool) -> RecallSizes:
        """The full probes, or the quick ones: 1k tokens only, one trial per depth and per pair count, recall at
        100 and 1,000 tokens back (two trials each), one long block of 4,096 and one of 8,192 tokens of each kind of
        text, and the needle tasks
        single_number and multi_key at 1k on both haystacks (20 prompts each)."""
        if not quick:
            return cls()
        return cls(passkey_lengths=(1024,), passkey_trials=len(PASSKEY_DEPTHS), recall_lengths=(1024,),
                   recall_trials=1, distances=(100, 1000), distance_trials=2, long_lengths=(4096, 8192), long_blocks=1,
                   needle_tasks=("single_number", "multi_key"), needle_lengths=(1024,))


def parse_needle_cells(cells: Sequence[str]) -> list[tuple[str, int]]:
    """``TASK@LENGTH`` strings as (task, length) pairs; ValueError naming the bad one."""
    pairs = []
    for cell in cells:
        task, sep, length = str(cell).partition("@")
        if not sep or task not in TASK_FORMS or not length.isdigit() or int(length) < 1:
            raise ValueError(f"needle_cells must be TASK@LENGTH with a task among {list(TASK_FORMS)} and a positive "
                             f"length, got {cell!r}")
        pairs.append((task, int(length)))
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"needle_cells must not repeat a cell, got {list(cells)}")
    return pairs


def evaluate(
    model: Any,
    tokenizer: Any,
    heldout_blocks: torch.Tensor,
    quick: bool = False,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    recall_texts: Sequence[str] | None = None,
    sizes: RecallSizes | None = None,
    progress: str | None = None,
    long_texts: Sequence[str] | None = None,
    needle_texts: Mapping[str, Sequence[str]] | None = None,
    store: ProbeStore | None = None,
) -> dict[str, Any]:
    """Perplexity on ``heldout_blocks`` (and on as many blocks of text of another kind, when the needle probe has
    its ``ood`` haystack) and on long blocks, passkey accuracy, needles in natural text,
    associative recall, recall at fixed distances, greedy samples and decode cost.

    The recall probes plant their facts in ``recall_texts`` (held-out documents), else in the documents of
    ``heldout_blocks``; the long blocks come from ``long_texts`` (whole held-out documents, e.g.
    ``data.corpus.long_documents``), else from the same documents. The needle probe's ``heldout`` haystack is
    those documents too, its ``ood`` one the embedded corpus's license texts (read when first needed);
    ``needle_texts`` replaces either by name. ``sizes`` sets the probes (default:
    ``RecallSizes.for_mode(quick)``). ``quick`` shrinks the probes (recall probes at 1k only; 2 samples of 24
    tokens; decode at 512 context) for smoke runs; the perplexity always uses all the blocks given. ``progress``
    (e.g. the model's name) labels a progress bar for each pass and probe; None shows none. ``store``: where each
    finished probe (each needle cell) is kept, so that a rerun after an interrupt reads it back instead of running
    it again (``resumed_probes`` lists those; ``seconds`` counts this call only)."""
    sizes = sizes or RecallSizes.for_mode(quick)
    texts = texts_from_blocks(tokenizer, heldout_blocks) if recall_texts is None else recall_texts
    start = time.perf_counter()
    report: dict[str, Any] = {"model": describe_model(model), "quick": quick}
    report["perplexity"] = cached(store, "perplexity", lambda: perplexity(
        model, heldout_blocks, progress=_label(progress, "perplexity")))
    report["eval_tokens"] = int(heldout_blocks.numel())
    report["block_size"] = int(heldout_blocks.shape[1])
    report["passkey"] = cached(store, "passkey", lambda: passkey_probe(
        model, tokenizer, context_lengths=sizes.passkey_lengths, trials=sizes.passkey_trials,
        depths=sizes.passkey_depths, progress=_label(progress, "passkey")))
    haystacks = {**natural_haystacks(sizes.needle_haystacks, heldout=texts), **{
        name: source for name, source in (needle_texts or {}).items() if name in sizes.needle_haystacks}}
    tasks, lengths, cells = sizes.needle_grid()
    report["needles"] = needle_probe(model, tokenizer, haystacks, tasks=tasks, lengths=lengths,
                                     prompts=sizes.needle_prompts, progress=_label(progress, "needles"), store=store,
                                     cells=cells)
    report["associative_recall"] = cached(store, "associative_recall", lambda: associative_recall_probe(
        model, tokenizer, texts, context_lengths=sizes.recall_lengths, pairs=sizes.recall_pairs,
        trials=sizes.recall_trials, progress=_label(progress, "associative recall")))
    if "ood" in haystacks:
        report["perplexity_ood"] = cached(store, "perplexity_ood", lambda: ood_perplexity(
            model, tokenizer, haystacks["ood"], heldout_blocks, progress=_label(progress, "perplexity (OOD)")))
    report.update(_long_context(model, tokenizer, texts, long_texts, haystacks.get("ood"), sizes, progress, store))
    decoding = _label(progress, "decode timing")
    if quick:
        chosen, new_tokens = list(prompts)[:2], 24
        report["decode"] = cached(store, "decode", lambda: decode_stats(
            model, context_length=512, steps=8, progress=decoding))
    else:
        chosen, new_tokens = list(prompts), 40
        report["decode"] = cached(store, "decode", lambda: decode_stats(model, progress=decoding))
    outputs = cached(store, "samples", lambda: generation_samples(model, tokenizer, chosen,
                                                                  max_new_tokens=new_tokens))
    report["samples"] = [{"prompt": p, "output": o} for p, o in zip(chosen, outputs, strict=True)]
    if store is not None and store.resumed:
        report["resumed_probes"] = list(store.resumed)
    report["seconds"] = time.perf_counter() - start
    return report


def _long_context(model: Any, tokenizer: Any, texts: Sequence[str], long_texts: Sequence[str] | None,
                  ood: Sequence[str] | Callable[[], Sequence[str]] | None, sizes: RecallSizes,
                  progress: str | None, store: ProbeStore | None = None) -> dict[str, Any]:
    """The report's long-context fields: recall at fixed distances and perplexity on long blocks of held-out text
    and (``ood``: the needle probe's out-of-distribution haystack, when it runs) of text of another kind; documents
    too short for a block are joined (``long_blocks(join=True)``)."""
    fields = {
        "recall_by_distance": cached(store, "recall_by_distance", lambda: distance_recall_probe(
            model, tokenizer, texts, sizes.distances, trials=sizes.distance_trials,
            progress=_label(progress, "recall by distance"))),
        "long_perplexity": cached(store, "long_perplexity", lambda: long_perplexity(
            model, tokenizer, texts if long_texts is None else long_texts, sizes.long_lengths,
            blocks=sizes.long_blocks, join=True, progress=_label(progress, "long perplexity"))),
    }
    if ood is not None:
        fields["long_perplexity_ood"] = cached(store, "long_perplexity_ood", lambda: long_perplexity(
            model, tokenizer, ood() if callable(ood) else ood, sizes.long_lengths, blocks=sizes.long_blocks,
            join=True, progress=_label(progress, "long perplexity (OOD)")))
    return fields


def ood_perplexity(model: Any, tokenizer: Any, ood: Sequence[str] | Callable[[], Sequence[str]],
                   heldout_blocks: torch.Tensor, progress: str | None = None) -> dict[str, Any]:
    """Perplexity on blocks of text of another kind (``ood``: the needle probe's out-of-distribution haystack) of
    the held-out blocks' length and, as far as its documents reach, their number (``long_perplexity``'s fields at
    that one length), so that the report's short-block perplexity has both kinds of text."""
    count, length = heldout_blocks.shape
    return long_perplexity(model, tokenizer, ood() if callable(ood) else ood, [length], blocks=count, join=True,
                           progress=progress)


def _label(progress: str | None, probe: str) -> str | None:
    return None if progress is None else f"{progress}: {probe}"


def cache_sample(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """A greedy continuation of ``prompt`` through an hf_recattn model's cache: the prompt, the new text, the
    cache's bytes and kinds after it and the whole sequence's length (``tokens``); {} when ``max_new_tokens`` is
    not positive."""
    if max_new_tokens <= 0:
        return {}
    ids = prompt_ids(tokenizer, prompt)
    out = greedy_continuation(model, tokenizer, ids, max_new_tokens)
    return {
        "prompt": prompt,
        "output": tokenizer.decode(out.tokens, skip_special_tokens=True),
        "cache_bytes": cache_nbytes(out.cache),
        "cache_kinds": sorted({layer.kind for layer in out.cache.layers}),
        "tokens": ids.shape[1] + len(out.tokens),
    }
