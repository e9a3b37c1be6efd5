"""Training throughput per mixer: tokens/s of a full step (forward, backward, AdamW) against softmax (SDPA).

A small Llama (hidden 256, 4 layers, 4 heads of 64, 2 KV heads, SwiGLU 768, tied embeddings, vocab 4096 by
default, ``--vocab 49152`` for SmolLM2's; the model of ``benchmarks/pretrain_sweep.py``), random weights,
fp32, batch 1, one sequence of each length (512 and 2048 tokens by default). A step is what a training loop
runs: ``zero_grad``, the uncached forward with labels (each mixer picks its parallel or chunked form itself,
as in training; the table shows which), ``backward`` and an AdamW ``step``. Each model has its own optimizer.

Every mixer x length cell runs in each of ``--rounds`` rounds (interleaved), so that load from other processes
on a shared machine hits them alike; the table gives the median step over all rounds, tokens/s and the ratio
to the softmax row measured in the same run (its SDPA kernel through transformers' attention interface).
The results and their provenance go to ``--out`` (default
``benchmarks/results/train_throughput_cpu.json``); ``scripts/render_docs.py`` renders the docs' table from it.

    nice .venv/bin/python benchmarks/train_throughput.py --threads 1
    .venv/bin/python benchmarks/train_throughput.py --quick                       # smoke run
    .venv/bin/python benchmarks/train_throughput.py --mixers softmax gdn --lengths 4096
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from results_file import add_out_argument, run_record, write_results

from hf_recattn import RecAttnConfig, RecAttnForCausalLM

BASELINE = "softmax"
#: label -> spec (a family with options or a preset name, see ``hf-recattn mixers``)
MIXER_SPECS: dict[str, dict[str, Any]] = {
    "softmax": {"mixer": "softmax"},
    "sliding_window(64)": {"mixer": "sliding_window", "window": 64},
    "linear elu": {"mixer": "linear", "feature_map": "elu"},
    "linear hedgehog": {"mixer": "linear", "feature_map": "hedgehog"},
    "linear elu gated": {"mixer": "linear", "feature_map": "elu", "decay": "gated"},
    "taylor(2)": {"mixer": "taylor", "order": 2},  # exact denominator
    "heinsen": {"mixer": "heinsen"},
    "hybrid(64)+hedgehog": {"mixer": "hybrid", "window": 64},
    "gdn": {"mixer": "gdn"},
    "deltanet": {"mixer": "deltanet"},
    "gla": {"mixer": "gla"},
    "retnet": {"mixer": "retnet"},
    "mesanet": {"mixer": "mesanet"},
    "fox": {"mixer": "fox"},
    "deltaformer": {"mixer": "deltaformer"},
    "path": {"mixer": "path"},
}
SHAPE: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                             bos_token_id=0, eos_token_id=0)
Step = Callable[[], None]


def build(spec: dict[str, Any], vocab: int, max_positions: int) -> RecAttnForCausalLM:
    """A randomly initialized model with ``spec`` in every layer, in training mode."""
    torch.manual_seed(0)
    config = RecAttnConfig(**SHAPE, vocab_size=vocab, max_position_embeddings=max_positions, attention=spec)
    config._attn_implementation = "sdpa"
    return RecAttnForCausalLM(config).train()


def training_form(model: RecAttnForCausalLM, length: int) -> str:
    """The form an uncached forward of ``length`` tokens runs (Mixer.forward's rule), per distinct layer."""
    forms = []
    for block in model.model.layers:
        mixer = block.self_attn.mixer
        chunked = mixer.is_causal_mixer and mixer.has_chunked and length > mixer.spec.get("chunk_size", length)
        forms.append("chunked" if chunked else "parallel")
    return "/".join(sorted(set(forms)))


def train_step(model: RecAttnForCausalLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> Step:
    """One full training step on ``ids`` (labels = inputs)."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


def interleaved_medians(steps: dict[str, Step], warmup: int, rounds: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of every cell; each cell runs ``repeats`` times in each of ``rounds`` rounds."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, fn in steps.items():
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(s) for key, s in samples.items()}


def render_markdown(results: dict) -> str:
    """The table (one row per mixer and length) and the notes of a results file."""
    lines = [f"| mixer | tokens | form | ms/step | tokens/s | x {BASELINE} |", "|---|---:|---|---:|---:|---:|"]
    lengths, cells = results["lengths"], results["cells"]
    for label, row in cells.items():
        for n, cell in zip(lengths, row, strict=True):
            sec = cell["seconds"]
            base = cells[BASELINE][lengths.index(n)]["seconds"] if BASELINE in cells else None
            ratio = f"{base / sec:.2f}" if base else "-"
            lines.append(f"| {label} | {n} | {cell['form']} | {sec * 1e3:.0f} | {n / sec:,.0f} | {ratio} |")
    return "\n".join([*lines, "", *results["notes"]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--mixers", nargs="+", default=None, help=f"labels to run (default all): {list(MIXER_SPECS)}")
    add("--lengths", type=int, nargs="+", default=[512, 2048], help="tokens per sequence (batch 1)")
    add("--rounds", type=int, default=3, help="interleave every cell in this many rounds")
    add("--repeats", type=int, default=2, help="timed steps per cell and round")
    add("--warmup", type=int, default=1, help="untimed steps per cell first")
    add("--vocab", type=int, default=4096, help="vocabulary size (49152: SmolLM2's)")
    add("--threads", type=int, default=1,
        help="torch threads (1: two OpenMP threads stall when another process shares a core)")
    add("--quick", action="store_true", help="smoke run: every mixer at 256 and 512 tokens, 1 round, 1 step")
    add_out_argument(p, "train_throughput_cpu.json")
    args = p.parse_args(argv)
    labels = args.mixers or list(MIXER_SPECS)
    unknown = [label for label in labels if label not in MIXER_SPECS]
    if unknown:
        p.error(f"unknown --mixers {unknown}; known: {list(MIXER_SPECS)}")
    if min(args.lengths) < 2 or min(args.rounds, args.repeats) < 1 or args.warmup < 0:
        p.error("need --lengths >= 2, --rounds >= 1, --repeats >= 1 and --warmup >= 0")
    if args.quick:
        args.lengths, args.rounds, args.repeats, args.warmup = [256, 512], 1, 1, 1
    args.labels = ([BASELINE] if BASELINE not in labels else []) + labels  # the baseline always runs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record = run_record()
    print("command: python benchmarks/train_throughput.py " + shlex.join(sys.argv[1:] if argv is None else argv),
          flush=True)
    lengths = sorted(set(args.lengths))
    steps: dict[str, Step] = {}
    forms: dict[str, str] = {}
    for label in args.labels:
        model = build(MIXER_SPECS[label], args.vocab, max(lengths))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for n in lengths:
            ids = torch.randint(0, args.vocab, (1, n), generator=torch.Generator().manual_seed(n))
            steps[f"{label}@{n}"] = train_step(model, optimizer, ids)
            forms[f"{label}@{n}"] = training_form(model, n)
    started = time.perf_counter()
    medians = interleaved_medians(steps, args.warmup, args.rounds, args.repeats)
    non_embedding = sum(p.numel() for n, p in build(MIXER_SPECS[BASELINE], args.vocab, 8).named_parameters()
                        if "embed" not in n)
    notes = [
        f"model: hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
        f"{SHAPE['num_attention_heads']} heads x {SHAPE['head_dim']}, {SHAPE['num_key_value_heads']} KV heads, "
        f"SwiGLU {SHAPE['intermediate_size']}, vocab {args.vocab} (tied), {non_embedding / 1e6:.2f}M "
        f"non-embedding parameters (softmax), fp32, batch 1, AdamW",
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of "
        f"{args.rounds * args.repeats} steps per cell after {args.warmup} warm-up, every cell interleaved in "
        f"{args.rounds} round(s); {time.perf_counter() - started:.0f} s of timing",
    ]
    results = write_results(args.out, "train_throughput", record, {
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "lengths": lengths,
        "cells": {label: [{"seconds": medians[f"{label}@{n}"], "form": forms[f"{label}@{n}"]} for n in lengths]
                  for label in args.labels},
        "notes": notes,
    })
    print()
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
