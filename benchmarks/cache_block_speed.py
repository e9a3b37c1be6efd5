"""The exact cache's training forms: one pass against span by span, per layer of the Gemma 3 cache recipes.

A hybrid layer with ``cache_slots`` runs a block's queries in spans cut after each decision of its cache
(modeling/hybrid_cached.py); where the decisions keep the newest pairs (``cache_score: recent``, or a block that
evicts nothing, as a 2,048-token training block under 3,036 slots) and no far part takes them, it runs the block in
one masked softmax instead (modeling/hybrid_cache_newest.py). This times both on one layer of Gemma 3 270M's shape
(hidden 640, 4 query heads and 1 KV head of 256, random weights, fp32, batch 1): the forward and backward of a
training step (the uncached forward, which runs the chunked form over 64-token chunks, and its backward) on
``--tokens`` tokens, each form in each of ``--rounds`` interleaved rounds. The table gives the median step, the
speed-up of the one pass, and the largest relative difference of the two forms' outputs and input gradients.

    python benchmarks/cache_block_speed.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from results_file import add_out_argument, run_record, write_results

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.hybrid_cached import ExactCacheForms

SLIDING = {"mixer": "hybrid", "window": 4, "sink_tokens": 4, "far": "none", "distant_positions": "clamp",
           "clamp_distance": 511, "cache_slots": 120, "cache_score": "recent", "cache_dtype": "int4"}
#: label -> the layer's attention spec (the layers of benchmarks/recipes/gemma3-270m-w4-recent120-*.yaml)
LAYERS: dict[str, dict[str, Any]] = {
    "sliding: window 4, 120 recent int4 pairs, 4 clamped sinks": SLIDING,
    "full: window 16, 1,878 KeyDiff int8 pairs, 4 sinks": {
        "mixer": "hybrid", "window": 16, "sink_tokens": 4, "far": "none", "cache_slots": 1878,
        "cache_score": "keydiff", "cache_dtype": "int8"},
    "full: window 16, 3,036 KeyDiff int4 pairs, 4 sinks": {
        "mixer": "hybrid", "window": 16, "sink_tokens": 4, "far": "none", "cache_slots": 3036,
        "cache_score": "keydiff", "cache_dtype": "int4"},
}
SHAPE: dict[str, Any] = dict(hidden_size=640, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=256, vocab_size=256, max_position_embeddings=32768)
FORMS = {"span by span": False, "one pass": True}


def timed_step(model: RecAttnForCausalLM, tokens: torch.Tensor, one_pass: bool) -> tuple[float, torch.Tensor,
                                                                                        torch.Tensor]:
    """Seconds of one forward and backward with the form chosen, the logits and the embeddings' gradient."""
    ExactCacheForms.newest_pass = one_pass
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logits = model(tokens, use_cache=False).logits
    logits.square().mean().backward()
    seconds = time.perf_counter() - start
    return seconds, logits.detach(), model.get_input_embeddings().weight.grad.clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    models = {}
    for label, spec in LAYERS.items():
        torch.manual_seed(0)
        models[label] = RecAttnForCausalLM(RecAttnConfig(**SHAPE, attention=spec)).train()
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, dict[str, list[float]]] = {label: {form: [] for form in FORMS} for label in LAYERS}
    for label, model in models.items():  # warm-up, and the two forms' outputs compared
        (_, logits_spans, grad_spans), (_, logits_one, grad_one) = (timed_step(model, tokens, f) for f in (False, True))
        cells[label] = {"logits_rel": rel(logits_one, logits_spans), "grad_rel": rel(grad_one, grad_spans)}
        print(f"{label}: warmed up and compared", file=sys.stderr)
    for round_index in range(args.rounds):
        for label, model in models.items():
            for form, one_pass in FORMS.items():
                seconds[label][form].append(timed_step(model, tokens, one_pass)[0])
        print(f"round {round_index + 1} of {args.rounds} timed", file=sys.stderr)
    ExactCacheForms.newest_pass = True
    for label in LAYERS:
        cells[label].update({form: statistics.median(seconds[label][form]) for form in FORMS})
        cells[label]["spec"] = LAYERS[label]
    return cells


def notes(tokens: int, rounds: int) -> list[str]:
    """What the table measured, in words."""
    return [f"Forward and backward of one layer of Gemma 3 270M's shape (random weights, fp32, batch 1) over "
            f"{tokens:,} tokens in the training forward (chunks of 64), median of {rounds} interleaved rounds; the "
            "differences compare the two forms' logits and the embeddings' gradient."]


def render_markdown(results: dict[str, Any]) -> str:
    lines = ["| layer | span by span, s | one pass, s | speed-up | outputs rel. diff | gradients rel. diff |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, cell in results["cells"].items():
        spans, one = cell["span by span"], cell["one pass"]
        lines.append(f"| {label} | {spans:.2f} | {one:.2f} | {spans / one:.1f}x | {cell['logits_rel']:.1e} | "
                     f"{cell['grad_rel']:.1e} |")
    return "\n".join([*lines, "", *results["notes"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sequence (a training block)")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per form and layer, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_out_argument(parser, "cache_block_speed_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = run_record()
    cells = measure(args)
    results = write_results(args.out, "cache_block_speed", record,
                            {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads, "cells": cells,
                             "notes": notes(args.tokens, args.rounds)})
    print(render_markdown(results))


if __name__ == "__main__":
    main()
