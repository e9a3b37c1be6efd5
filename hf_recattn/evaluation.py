"""Built-in evaluation of teachers and converted students: perplexity, passkey, samples, decode cost.

Every function takes any causal LM (the softmax teacher or a hf_recattn student), so the numbers in a
conversion report are measured the same way on both. Generation always goes through the model's cache
(the recurrent state for hf_recattn models).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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
def passkey_prompt(tokenizer: Any, context_length: int, key: str, depth: float) -> torch.Tensor:
    """[1, ~context_length] ids: filler, ``The pass key is KEY`` at relative ``depth``, the question."""
    head = "There is a pass key hidden in the text below. Find it and remember it.\n\n"
    needle = f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
    tail = "\n\nWhat is the pass key? The pass key is"
    unit = len(tokenizer(_FILLER, add_special_tokens=False)["input_ids"])
    fixed = len(tokenizer(head + needle + tail)["input_ids"])
    repeats = max(2, (context_length - fixed) // max(unit, 1))
    before = round(repeats * depth)
    text = head + _FILLER * before + needle + _FILLER * (repeats - before) + tail
    ids = tokenizer(text)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def passkey_probe(
    model: Any,
    tokenizer: Any,
    context_lengths: Sequence[int] = (1024, 2048, 4096),
    trials: int = 3,
    seed: int = 0,
    max_new_tokens: int = 8,
) -> dict[str, Any]:
    """Hide a random 5-digit key at a random depth in ~L tokens of filler, ask for it, greedy-decode through
    the cache; a trial passes when the key's digits appear in the answer. Accuracy per context length;
    lengths beyond the model's ``max_position_embeddings`` are listed under ``skipped``."""
    if trials < 1 or not context_lengths:
        raise ValueError("passkey_probe needs trials >= 1 and at least one context length")
    rng = random.Random(seed)
    was_training = model.training
    model.eval()
    accuracy: dict[str, float] = {}
    answers: dict[str, list[dict[str, Any]]] = {}
    skipped: list[int] = []
    limit = max_positions(model)
    try:
        for length in context_lengths:
            trial_args = [(f"{rng.randrange(10_000, 100_000)}", rng.uniform(0.1, 0.9)) for _ in range(trials)]
            prompts = [passkey_prompt(tokenizer, length, key, depth) for key, depth in trial_args]
            if limit is not None and max(p.shape[1] for p in prompts) + max_new_tokens > limit:
                skipped.append(length)
                continue
            hits = 0
            answers[str(length)] = []
            for (key, depth), ids in zip(trial_args, prompts, strict=True):
                new = _generate(model, tokenizer, ids, max_new_tokens, do_sample=False)
                answer = tokenizer.decode(new, skip_special_tokens=True)
                ok = key in re.sub(r"\s+", "", answer)
                hits += ok
                answers[str(length)].append({"key": key, "depth": round(depth, 3), "tokens": ids.shape[1],
                                             "answer": answer.strip(), "correct": ok})
            accuracy[str(length)] = hits / trials
    finally:
        model.train(was_training)
    mean = sum(accuracy.values()) / len(accuracy) if accuracy else None
    return {"accuracy": accuracy, "mean_accuracy": mean, "trials": trials, "skipped": skipped,
            "answers": answers}


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
        cache = out.past_key_values
        cache_bytes = cache_nbytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            cache = out.past_key_values
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


def evaluate(
    model: Any,
    tokenizer: Any,
    heldout_blocks: torch.Tensor,
    quick: bool = False,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
) -> dict[str, Any]:
    """Perplexity on ``heldout_blocks``, passkey accuracy, greedy samples and decode cost, in one dict.

    ``quick`` shrinks the probes (passkey at 1k only, 2 trials; 2 samples of 24 tokens; decode at 512 context)
    for smoke runs; the perplexity always uses all the blocks given."""
    start = time.perf_counter()
    report: dict[str, Any] = {"model": describe_model(model), "quick": quick}
    report["perplexity"] = perplexity(model, heldout_blocks)
    report["eval_tokens"] = int(heldout_blocks.numel())
    report["block_size"] = int(heldout_blocks.shape[1])
    if quick:
        report["passkey"] = passkey_probe(model, tokenizer, context_lengths=(1024,), trials=2)
        chosen, new_tokens = list(prompts)[:2], 24
        report["decode"] = decode_stats(model, context_length=512, steps=8)
    else:
        report["passkey"] = passkey_probe(model, tokenizer)
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

    The ratio column divides each perplexity by the ``reference`` row's (the first row if there is none)."""
    if not rows:
        raise ValueError("comparison_table needs at least one row")
    ref_name = reference if reference in rows else next(iter(rows))
    ref_ppl = rows[ref_name].get("perplexity")
    lines = [
        f"| model | perplexity | × {ref_name} | passkey | decode ms/token | context | cache MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, report in rows.items():
        ppl = report.get("perplexity")
        ratio = ppl / ref_ppl if ppl is not None and ref_ppl else None
        passkey = (report.get("passkey") or {}).get("mean_accuracy")
        decode = report.get("decode") or {}
        mib = decode["cache_bytes"] / 2**20 if "cache_bytes" in decode else None
        lines.append(
            f"| {name} | {_fmt(ppl, '.2f')} | {_fmt(ratio, '.3f')} | {_fmt(passkey, '.0%')} | "
            f"{_fmt(decode.get('median_ms_per_token'), '.1f')} | {_fmt(decode.get('context_length'), 'd')} | "
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
