"""Prefill throughput: tokens/s of filling a cache with a whole prompt, hf_recattn mixers against transformers' Llama.

A SmolLM2-135M-shaped stack (hidden 576, intermediate 1536, 9 heads, 3 KV heads, head_dim 64, vocab 49,152) cut to
``--layers`` decoder layers (default 2: every layer costs the same, so tokens/s per layer is what the table
compares), random weights shared by every model, batch 1. A prefill is what ``generate()`` runs first: one forward
of the whole prompt into a fresh cache, logits of the last position only. For hf_recattn that is each mixer's
chunked form from an empty state; for the baseline, ``LlamaForCausalLM`` with SDPA attention and a DynamicCache.

Each (model, length) cell runs ``--warmup`` untimed prefills, then one timed prefill per round in each of
``--rounds`` rounds (all cells interleaved, so load from other processes hits them alike); the table gives the
median tokens/s, the speed-up over Llama at the same length, and the change against the model's own shortest length
(flat is what a chunked form promises: O(T) work, O(chunk) memory per token).

``python benchmarks/prefill.py --help`` lists the flags; ``--quick`` is a short smoke run.
The results and their provenance go to ``--out`` (default ``benchmarks/results/prefill_cpu.json``);
``scripts/render_docs.py`` renders the docs' tables from that file with ``render_markdown``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from decode import MIXER_SPECS, SHAPE
from results_file import add_out_argument, run_record, write_results
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.mixers import MIXERS
from hf_recattn.modeling.presets import PRESETS

LENGTHS = (2048, 4096, 8192, 16384, 32768)
BASELINE = "llama (sdpa)"
#: fixed-state mixers (every recurrent family and the bounded-window ones), as labelled in benchmarks/decode.py
DEFAULT_MIXERS = (
    "sliding_window(64)", "linear elu", "linear hedgehog", "linear taylor2", "taylor(2)", "heinsen",
    "hybrid(64)+hedgehog", "hybrid(64,sink4)+hedgehog", "retnet", "gla", "deltanet", "gdn", "comba",
    "deltaproduct", "mesanet",
)
Prefill = Callable[[], object]


def _median_round_robin(cells: dict[str, Prefill], warmup: int, rounds: int) -> dict[str, float]:
    for fn in cells.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cells}
    for _ in range(rounds):
        for name, fn in cells.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _shape(layers: int) -> dict:
    return {**SHAPE, "num_hidden_layers": layers}


def llama(layers: int, max_positions: int) -> LlamaForCausalLM:
    config = LlamaConfig(**_shape(layers), max_position_embeddings=max_positions, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def recattn(spec: dict, layers: int, max_positions: int, weights: dict[str, torch.Tensor]) -> RecAttnForCausalLM:
    config = RecAttnConfig(**_shape(layers), max_position_embeddings=max_positions, attention=spec)
    config._attn_implementation = "sdpa"
    model = RecAttnForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or any(".mixer." not in name for name in missing):
        raise RuntimeError(f"weights do not map onto {spec}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def prefill(model: torch.nn.Module, ids: torch.Tensor, make_cache: Callable[[], object]) -> Prefill:
    def run() -> object:
        return model(input_ids=ids, past_key_values=make_cache(), use_cache=True, logits_to_keep=1)

    return run


def render_markdown(results: dict) -> str:
    """The table (one row per model and prompt length) and the notes of a results file."""
    lengths = results["lengths"]
    baseline = {n: seconds for n, seconds in zip(lengths, results["seconds"].get(BASELINE, []), strict=False)}
    lines = [
        f"| model | tokens | tokens/s | s | x faster than {BASELINE} | vs own {lengths[0]} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, row in results["seconds"].items():
        first = lengths[0] / row[0]
        for n, seconds in zip(lengths, row, strict=True):
            rate = n / seconds
            speedup = f"{baseline[n] / seconds:.2f}" if n in baseline else "-"
            lines.append(f"| {label} | {n} | {rate:,.0f} | {seconds:.2f} | {speedup} | {rate / first - 1:+.0%} |")
    return "\n".join([*lines, "", *results["notes"]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths")
    add("--mixers", nargs="+", default=list(DEFAULT_MIXERS),
        help=f"labels from benchmarks/decode.py: {list(MIXER_SPECS)}")
    add("--layers", type=int, default=2, help="decoder layers of the SmolLM2-shaped stack")
    add("--rounds", type=int, default=3, help="timed prefills per cell (median), interleaved")
    add("--warmup", type=int, default=1, help="untimed prefills per cell first")
    add("--threads", type=int, default=2, help="torch threads")
    add("--no-baseline", action="store_true", help="skip transformers' Llama")
    add("--quick", action="store_true", help="smoke run: 2k and 4k, 1 round, no warm-up")
    add_out_argument(p, "prefill_cpu.json")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.rounds, args.warmup = [2048, 4096], 1, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = run_record()
    lengths = sorted(args.lengths)
    unknown = [label for label in args.mixers if label not in MIXER_SPECS]
    if unknown:
        raise SystemExit(f"unknown --mixers {unknown}; known: {list(MIXER_SPECS)}")
    max_positions = max(lengths) + 8
    base = llama(args.layers, max_positions)
    weights = base.state_dict()
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, SHAPE["vocab_size"], (1, n), generator=gen) for n in lengths}
    cells: dict[str, Prefill] = {}
    labels: list[str] = []
    notes = [
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.layers} SmolLM2-shaped layers, "
        f"batch 1, fp32, median of {args.rounds} interleaved rounds after {args.warmup} warm-up prefill(s)"
    ]
    if not args.no_baseline:
        labels.append(BASELINE)
        for n in lengths:
            cells[f"{BASELINE}@{n}"] = prefill(base, prompts[n], lambda: DynamicCache(config=base.config))
    models = []
    for label in args.mixers:
        spec = MIXER_SPECS[label]
        if spec["mixer"] not in MIXERS and spec["mixer"] not in PRESETS:
            notes.append(f"skipped {label}: mixer {spec['mixer']!r} is not registered")
            continue
        model = recattn(spec, args.layers, max_positions, weights)
        models.append(model)
        labels.append(label)
        for n in lengths:
            cells[f"{label}@{n}"] = prefill(model, prompts[n], model.new_cache)
    with torch.inference_mode():
        medians = _median_round_robin(cells, args.warmup, args.rounds)
    results = write_results(args.out, "prefill", record, {
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "lengths": lengths,
        "seconds": {label: [medians[f"{label}@{n}"] for n in lengths] for label in labels},
        "notes": notes,
    })
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
