"""Runs NVIDIA kvpress presses on an unchanged teacher: the half of ``benchmarks/kv_compression.py`` that lives in
its own environment (kvpress 0.5.5 needs transformers < 5.3). It imports only torch, transformers and kvpress.

    .venv-kvpress/bin/python benchmarks/kvpress_worker.py PROBES.json [--threads N]

PROBES.json (written by kv_compression.py) names the model folder, holds token ids (passkey contexts and
questions, perplexity contexts and continuations, plain blocks) and the runs: a press, its kept tokens and its
compression ratio for each context length. Each run prints one JSON line on stdout when it ends: the answers,
the summed negative log-likelihood of the continuations, the cache length after each prefill, or the error
that stopped it. The first line gives the package versions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import sys
import time
import traceback
from typing import Any

import kvpress
import torch
import torch.nn.functional as F
from kvpress import KVPressTextGenerationPipeline
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

#: press names of kv_compression.py -> kvpress classes
PRESSES = {
    "StreamingLLM": kvpress.StreamingLLMPress,
    "SnapKV": kvpress.SnapKVPress,
    "KeyDiff": kvpress.KeyDiffPress,
    "ExpectedAttention": kvpress.ExpectedAttentionPress,
    "KNorm": kvpress.KnormPress,
    "DuoAttention": kvpress.DuoAttentionPress,
}


def make_press(run: dict[str, Any], length: int) -> Any:
    """The run's press for a context of ``length`` tokens; None for no press or when the budget holds it all."""
    ratio = run["ratios"].get(str(length)) if run["press"] else None
    if ratio is None:
        return None
    if run["press"] == "DuoAttention":  # a share of streaming heads, their patterns scored on the fly
        return kvpress.DuoAttentionPress(head_compression_ratio=ratio, on_the_fly_scoring=True)
    return PRESSES[run["press"]](compression_ratio=ratio)


def passkey_answers(pipe: Any, run: dict[str, Any], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy answers through the pipeline's own prefill-then-question path, and the cache length each left."""
    answers: dict[str, list[str]] = {}
    kept: dict[str, list[int]] = {}
    for case in cases:
        context = torch.tensor([case["context_ids"]])
        cache = DynamicCache()
        inputs = {"context_ids": context, "questions_ids": [torch.tensor([case["question_ids"]])]}
        (answer,) = pipe._forward(inputs, max_new_tokens=case["max_new_tokens"],
                                  press=make_press(run, context.shape[1]), cache=cache)
        answers.setdefault(str(case["length"]), []).append(answer)
        kept.setdefault(str(case["length"]), []).append(cache.get_seq_length())
    return {"passkey_answers": answers, "passkey_cache_tokens": kept}


@torch.no_grad()
def continuation_nll(model: Any, run: dict[str, Any], contexts: list[list[int]],
                     continuations: list[list[int]]) -> dict[str, Any]:
    """Prefill each context (through the press), then score its continuation teacher-forced through that cache:
    the summed NLL of every continuation token after the first, their count, the cache length after prefill."""
    total, count, kept = 0.0, 0, []
    for context_ids, continuation_ids in zip(contexts, continuations, strict=True):
        context = torch.tensor([context_ids])
        continuation = torch.tensor([continuation_ids])
        cache = DynamicCache()
        press = make_press(run, context.shape[1])
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        kept.append(cache.get_seq_length())
        start = context.shape[1]
        positions = torch.arange(start, start + continuation.shape[1]).unsqueeze(0)
        logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits
        total += float(F.cross_entropy(logits[0, :-1].float(), continuation[0, 1:], reduction="sum"))
        count += continuation.shape[1] - 1
    return {"continuation_nll": total, "continuation_tokens": count, "continuation_cache_tokens": kept}


@torch.no_grad()
def block_perplexity(model: Any, blocks: list[list[int]]) -> float:
    """exp(mean next-token NLL) over the plain blocks, no cache: the teacher's own perplexity."""
    total, count = 0.0, 0
    for block in blocks:
        ids = torch.tensor([block])
        logits = model(input_ids=ids, use_cache=False).logits
        total += float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count)


def measure(pipe: Any, run: dict[str, Any], probes: dict[str, Any]) -> dict[str, Any]:
    """One run's record; the error text instead when the press cannot run."""
    row: dict[str, Any] = {"name": run["name"]}
    began = time.perf_counter()
    try:
        row.update(passkey_answers(pipe, run, probes["passkey"]))
        ppl = probes["perplexity"]
        row.update(continuation_nll(pipe.model, run, ppl["contexts"], ppl["continuations"]))
        if run["press"] is None:
            row["block_perplexity"] = block_perplexity(pipe.model, ppl["blocks"])
    except Exception as err:  # a press that cannot run here is reported, not dropped
        traceback.print_exc(limit=-3)
        row = {"name": run["name"], "error": f"{type(err).__name__}: {err}".strip()}
    row["seconds"] = time.perf_counter() - began
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", help="the JSON file written by kv_compression.py")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.probes) as file:
        probes = json.load(file)
    versions = {name: importlib.metadata.version(name) for name in ("kvpress", "transformers", "torch")}
    print(json.dumps({"versions": versions}), flush=True)
    model = AutoModelForCausalLM.from_pretrained(probes["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(probes["model"])
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
    for run in probes["runs"]:
        print(json.dumps(measure(pipe, run, probes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
