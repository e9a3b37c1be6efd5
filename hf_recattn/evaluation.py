"""Built-in evaluation of teachers and converted students: perplexity, passkey, samples, decode cost (the
associative recall probe lives in ``hf_recattn.recall``).

Every function takes any causal LM (the softmax teacher or a hf_recattn student), so the numbers in a
conversion report are measured the same way on both. Generation always goes through the model's cache
(the recurrent state for hf_recattn models).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .modeling.cache import CACHE_NAME, cache_of

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
)

# filler for the passkey probe: plain sentences with no numbers, repeated to the wanted length
_FILLER = (
    "The river runs past the old mill and on toward the town. Birds sing in the hedges in the morning. "
    "The road climbs slowly through the quiet hills, and the fields turn gold in late summer. "
)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def max_positions(model: Any) -> int | None:
    """The longest sequence the model supports (``max_position_embeddings``), or None when unbounded."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


# ----- perplexity ---------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over every predicted token of every block ([N, T] token ids, no padding).

    Token-weighted: each block contributes T - 1 predictions. Pass the same blocks to teacher and student.
    """
    if blocks.dim() != 2 or blocks.shape[1] < 2 or blocks.shape[0] == 0:
        raise ValueError(f"blocks must be [N >= 1, T >= 2] token ids, got shape {tuple(blocks.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    device = _device(model)
    total_nll, count = 0.0, 0
    try:
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            for row in range(ids.shape[0]):  # one row at a time keeps the fp32 log-softmax copy small
                nll = F.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="sum")
                total_nll += float(nll)
                count += ids.shape[1] - 1
            del logits
    finally:
        model.train(was_training)
    if not math.isfinite(total_nll):
        return float("inf")
    return math.exp(total_nll / count)


# ----- generation ---------------------------------------------------------------------------------
def pad_id(tokenizer: Any) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@torch.no_grad()
def _generate(
    model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, **kwargs: Any
) -> torch.Tensor:
    """New token ids for one prompt ([1, T]), decoded through the model's cache."""
    ids = ids.to(_device(model))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        use_cache=True,
        pad_token_id=pad_id(tokenizer),
        **kwargs,
    )
    return out[0, ids.shape[1] :]


def prompt_ids(tokenizer: Any, prompt: str, chat: bool | None = None) -> torch.Tensor:
    """[1, T] ids of ``prompt``, in the chat template when the tokenizer has one (or ``chat=True``)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def generation_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 40,
) -> list[str]:
    """Greedy continuations (new text only) of each prompt, one prompt at a time, through the cache."""
    was_training = model.training
    model.eval()
    try:
        outputs = []
        for prompt in prompts:
            new = _generate(model, tokenizer, prompt_ids(tokenizer, prompt), max_new_tokens, do_sample=False)
            outputs.append(tokenizer.decode(new, skip_special_tokens=True).strip())
        return outputs
    finally:
        model.train(was_training)


# ----- passkey retrieval --------------------------------------------------------------------------
#: where the passkey sits in its prompt (0 = start, 1 = end): a fixed grid shared by every model
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
_PASSKEY_HEAD = "There is a pass key hidden in the text below. Find it and remember it.\n\n"
_PASSKEY_TAIL = "\n\nWhat is the pass key? The pass key is"
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
    filler: Sequence[int], starts: Sequence[int], inserts: Sequence[Sequence[int]], depths: Sequence[float]
) -> tuple[list[int], list[int]]:
    """Insert ``inserts[i]`` into ``filler`` at the piece start nearest to ``depths[i]`` of its length.

    ``depths`` must be non-decreasing; each insert goes at a later start than the one before (any token
    boundary when the filler has too few piece starts). Returns the ids and the offset of each insert in them."""
    if len(inserts) != len(depths) or any(b < a for a, b in itertools.pairwise(depths)):
        raise ValueError("plant needs one non-decreasing depth per insert")
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


def _passkey_ids(tokenizer: Any, context_length: int, key: str, depth: float) -> tuple[list[int], int]:
    """The passkey prompt's ids (exactly ``context_length``) and the offset of the needle in them."""
    head = tokenizer(_PASSKEY_HEAD)["input_ids"]  # the tokenizer's special tokens (a BOS) go first
    needle = tokenizer(f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n",
                       add_special_tokens=False)["input_ids"]
    tail = tokenizer(_PASSKEY_TAIL, add_special_tokens=False)["input_ids"]
    room = context_length - len(head) - len(needle) - len(tail)
    if room < 1:
        raise ValueError(f"passkey: context length {context_length} leaves no room for filler (the question and "
                         f"the key take {context_length - room} tokens)")
    pieces = token_pieces(tokenizer, sentence_pieces(" " + _FILLER.strip()))
    filler, starts = fill_tokens(itertools.cycle(pieces), room)
    within = min(max((depth * context_length - len(head)) / room, 0.0), 1.0)  # the depth in the whole prompt
    body, (offset,) = plant(filler, starts, [needle], [within])
    return head + body + tail, len(head) + offset


def passkey_prompt(tokenizer: Any, context_length: int, key: str, depth: float) -> torch.Tensor:
    """[1, context_length] ids: filler, ``The pass key is KEY`` at relative ``depth``, the question.

    The needle begins at the filler's sentence start nearest to ``depth * context_length``; the first filler
    sentence is cut short so that the prompt has exactly ``context_length`` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey: depth must be in [0, 1], got {depth}")
    ids, _ = _passkey_ids(tokenizer, context_length, key, depth)
    return torch.tensor([ids], dtype=torch.long)


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
    max_new_tokens: int = 8,
    depths: Sequence[float] = PASSKEY_DEPTHS,
) -> dict[str, Any]:
    """Hide a random 5-digit key in filler, ask for it, greedy-decode the answer through the cache; a trial
    passes when the key's digits appear in the answer.

    Each context length gets ``trials`` prompts of ``length - max_new_tokens`` tokens (prompt and answer fill
    the length), trial i with its key at ``depths[i % len(depths)]``: use a multiple of the number of depths.
    Returns the accuracy per length and its mean, ``accuracy_by_depth`` ``{length: {depth: accuracy}}``, and
    every answer. Lengths beyond the model's ``max_position_embeddings`` are listed under ``skipped``. The keys
    depend only on ``seed``, so every model sees the same prompts."""
    _check_passkey_args(context_lengths, trials, depths, max_new_tokens)
    rng = random.Random(seed)
    was_training = model.training
    model.eval()
    accuracy: dict[str, float] = {}
    by_depth: dict[str, dict[str, float]] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    skipped: list[int] = []
    limit = max_positions(model)
    try:
        for length in context_lengths:
            keys = [f"{rng.randrange(10_000, 100_000)}" for _ in range(trials)]
            if limit is not None and length > limit:
                skipped.append(length)
                continue
            rows = [_passkey_trial(model, tokenizer, length - max_new_tokens, key, depths[i % len(depths)],
                                   max_new_tokens) for i, key in enumerate(keys)]
            answers[str(length)] = rows
            accuracy[str(length)] = sum(r["correct"] for r in rows) / trials
            by_depth[str(length)] = _share_by(rows, "depth")
    finally:
        model.train(was_training)
    mean = sum(accuracy.values()) / len(accuracy) if accuracy else None
    return {"accuracy": accuracy, "mean_accuracy": mean, "accuracy_by_depth": by_depth, "trials": trials,
            "depths": list(depths), "skipped": skipped, "answers": answers}


def _passkey_trial(model: Any, tokenizer: Any, prompt_length: int, key: str, depth: float,
                   max_new_tokens: int) -> dict[str, Any]:
    ids, needle = _passkey_ids(tokenizer, prompt_length, key, depth)
    prompt = torch.tensor([ids], dtype=torch.long)
    new = _generate(model, tokenizer, prompt, max_new_tokens, do_sample=False)
    answer = tokenizer.decode(new, skip_special_tokens=True)
    return {"key": key, "depth": depth, "needle_at": needle, "tokens": len(ids), "answer": answer.strip(),
            "correct": key in re.sub(r"\s+", "", answer)}


def _share_by(rows: Sequence[dict[str, Any]], field: str) -> dict[str, float]:
    """The share of correct rows for each value of ``field`` (keys formatted with ``g``), in first-seen order."""
    groups: dict[str, list[bool]] = {}
    for row in rows:
        groups.setdefault(format(row[field], "g"), []).append(bool(row["correct"]))
    return {name: sum(hits) / len(hits) for name, hits in groups.items()}


# ----- decode cost --------------------------------------------------------------------------------
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
def decode_stats(model: Any, context_length: int = 2048, steps: int = 16, seed: int = 0) -> dict[str, Any]:
    """Prefill ``context_length`` random tokens, then time ``steps`` single-token forwards through the cache.

    Returns the median milliseconds per decoded token, the prefill time and the cache's size in bytes after
    the prefill (the state a long generation carries). The context is shortened to fit the model's
    ``max_position_embeddings`` (``requested_context_length`` keeps the asked-for value)."""
    if context_length < 1 or steps < 1:
        raise ValueError("decode_stats needs context_length >= 1 and steps >= 1")
    requested = context_length
    limit = max_positions(model)
    if limit is not None and context_length + steps > limit:
        context_length = limit - steps
        if context_length < 1:
            raise ValueError(f"decode_stats: {steps} steps do not fit in max_position_embeddings={limit}")
    was_training = model.training
    model.eval()
    device = _device(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    low = min(100, vocab - 1)  # skip the special tokens at the start of most vocabularies
    ids = torch.randint(low, vocab, (1, context_length), generator=gen).to(device)
    try:
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill_s = time.perf_counter() - start
        cache = cache_of(out)
        cache_bytes = cache_nbytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{CACHE_NAME: cache})
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            cache = cache_of(out)
    finally:
        model.train(was_training)
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


# ----- the whole evaluation -----------------------------------------------------------------------
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
    """How much of the two recall probes ``evaluate`` runs: context lengths, key depths, pair counts, trials."""

    passkey_lengths: tuple[int, ...] = (1024, 4096, 8192)
    passkey_depths: tuple[float, ...] = PASSKEY_DEPTHS
    passkey_trials: int = 6
    recall_lengths: tuple[int, ...] = (1024, 4096)
    recall_pairs: tuple[int, ...] = (1, 4, 16)
    recall_trials: int = 3

    def __post_init__(self) -> None:
        for name in ("passkey_lengths", "recall_lengths", "recall_pairs"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
        if not self.passkey_depths or any(not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ValueError(f"passkey_depths must lie in [0, 1], got {list(self.passkey_depths)}")
        for name in ("passkey_trials", "recall_trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_mode(cls, quick: bool) -> RecallSizes:
        """The full probes, or the quick ones: 1k tokens only, one trial per depth and per pair count."""
        if not quick:
            return cls()
        return cls(passkey_lengths=(1024,), passkey_trials=len(PASSKEY_DEPTHS), recall_lengths=(1024,),
                   recall_trials=1)


def evaluate(
    model: Any,
    tokenizer: Any,
    heldout_blocks: torch.Tensor,
    quick: bool = False,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    recall_texts: Sequence[str] | None = None,
    sizes: RecallSizes | None = None,
) -> dict[str, Any]:
    """Perplexity on ``heldout_blocks``, passkey accuracy, associative recall, greedy samples and decode cost.

    The associative recall plants its facts in ``recall_texts`` (held-out documents), else in the documents of
    ``heldout_blocks``. ``sizes`` sets the recall probes (default: ``RecallSizes.for_mode(quick)``). ``quick``
    shrinks the probes (recall probes at 1k only; 2 samples of 24 tokens; decode at 512 context) for smoke
    runs; the perplexity always uses all the blocks given."""
    from .recall import associative_recall_probe

    sizes = sizes or RecallSizes.for_mode(quick)
    start = time.perf_counter()
    report: dict[str, Any] = {"model": describe_model(model), "quick": quick}
    report["perplexity"] = perplexity(model, heldout_blocks)
    report["eval_tokens"] = int(heldout_blocks.numel())
    report["block_size"] = int(heldout_blocks.shape[1])
    report["passkey"] = passkey_probe(model, tokenizer, context_lengths=sizes.passkey_lengths,
                                      trials=sizes.passkey_trials, depths=sizes.passkey_depths)
    report["associative_recall"] = associative_recall_probe(
        model, tokenizer, heldout_blocks if recall_texts is None else recall_texts,
        context_lengths=sizes.recall_lengths, pairs=sizes.recall_pairs, trials=sizes.recall_trials,
    )
    if quick:
        chosen, new_tokens = list(prompts)[:2], 24
        report["decode"] = decode_stats(model, context_length=512, steps=8)
    else:
        chosen, new_tokens = list(prompts), 40
        report["decode"] = decode_stats(model)
    outputs = generation_samples(model, tokenizer, chosen, max_new_tokens=new_tokens)
    report["samples"] = [{"prompt": p, "output": o} for p, o in zip(chosen, outputs, strict=True)]
    report["seconds"] = time.perf_counter() - start
    return report


# ----- reporting ----------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def comparison_table(rows: dict[str, dict[str, Any]], reference: str = "teacher") -> str:
    """A markdown table, one row per evaluated model (e.g. teacher / window-only / far-only / hybrid).

    The ratio column divides each perplexity by the ``reference`` row's (the first row if there is none). The
    associative recall column appears when some row has that probe's results."""
    if not rows:
        raise ValueError("comparison_table needs at least one row")
    ref_name = reference if reference in rows else next(iter(rows))
    ref_ppl = rows[ref_name].get("perplexity")
    recall = any("associative_recall" in report for report in rows.values())
    lines = [
        f"| model | perplexity | × {ref_name} | passkey |{' recall |' if recall else ''} decode ms/token | "
        "context | cache MiB |",
        f"|---|---:|---:|---:|{'---:|' if recall else ''}---:|---:|---:|",
    ]
    for name, report in rows.items():
        ppl = report.get("perplexity")
        ratio = ppl / ref_ppl if ppl is not None and ref_ppl else None
        passkey = (report.get("passkey") or {}).get("mean_accuracy")
        recalled = (report.get("associative_recall") or {}).get("mean_accuracy")
        decode = report.get("decode") or {}
        mib = decode["cache_bytes"] / 2**20 if "cache_bytes" in decode else None
        lines.append(
            f"| {name} | {_fmt(ppl, '.2f')} | {_fmt(ratio, '.3f')} | {_fmt(passkey, '.0%')} | "
            + (f"{_fmt(recalled, '.0%')} | " if recall else "")
            + f"{_fmt(decode.get('median_ms_per_token'), '.1f')} | {_fmt(decode.get('context_length'), 'd')} | "
            f"{_fmt(mib, '.2f')} |"
        )
    return "\n".join(lines)


def _atomic_write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_report(out_dir: str | os.PathLike, report: dict[str, Any], name: str = "report.json") -> Path:
    """Write ``report`` as indented JSON to ``out_dir/name`` atomically (temporary file, then rename)."""
    text = json.dumps(report, indent=2, sort_keys=False, default=str, allow_nan=True)
    return _atomic_write(Path(out_dir) / name, text + "\n")
