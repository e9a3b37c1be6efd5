"""What a coded cache costs the attention: each ``cache_dtype``'s rounding of a teacher's own keys and values, per
kind of layer, on natural text.

The teacher, converted as it is (``{"mixer": "softmax"}``: its own logits), reads ``--blocks`` blocks of
``--length`` tokens from the corpus's held-out documents and from its license texts; a hook takes every layer's
queries, keys and values as its mixer receives them (after the q/k norms and RoPE). For the last ``--queries``
positions of each block, every layer's attention over its earlier keys (those within its window where it slides)
is computed with the keys and values as computed and as each coded ``cache_dtype`` holds them
(modeling/cache_precision.py). Per kind of layer (full attention, sliding window) the table gives, averaged over
layers, blocks, heads and queries: the L1 distance between the two attention distributions (the sum over keys of
|p - p'|, 0 to 2), the relative error of the attention output, and the keys' own relative error, beside the bytes a
key and its value take per KV head.

    python benchmarks/cache_code_error.py --teacher gemma3-270m --threads 1
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch
from results_file import add_out_argument, run_record, write_results

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher, teacher_name
from hf_recattn.evaluation.heldout import long_rows
from hf_recattn.evaluation.needles import NEEDLE_HAYSTACKS, natural_haystacks
from hf_recattn.modeling.cache_precision import PAIR_CODES

Captured = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def capture_layers(model: torch.nn.Module, block: torch.Tensor) -> Captured:
    """Each layer's (q [H, T, D], k and v [Hkv, T, D]) as its mixer receives them, for one block [1, T]."""
    captured: Captured = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        def keep(_module: Any, args: tuple[Any, ...], index: int = index) -> None:
            captured[index] = tuple(x[0].detach() for x in args[:3])  # type: ignore[assignment]
        hooks.append(layer.self_attn.mixer.register_forward_pre_hook(keep))
    try:
        with torch.no_grad():
            model(input_ids=block, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """Weights [H, Q, T] and outputs [H, Q, D] of the last Q queries over the keys up to each (the last ``window``
    of them where the layer slides), in float64; KV heads shared by consecutive query groups."""
    heads, queries, total = q.shape[0], q.shape[1], k.shape[1]
    group = heads // k.shape[0]
    k, v = (x.double().repeat_interleave(group, dim=0) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(total - queries, total)[:, None]
    key_pos = torch.arange(total)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    weights = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
    return weights, weights @ v


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                 queries: int) -> dict[str, dict[str, float]]:
    """Per coded ``cache_dtype``: the attention weights' mean L1 distance, the outputs' and keys' relative error."""
    q = q[:, -queries:]
    exact_weights, exact_out = attention(q, k, v, window)
    errors = {}
    for name, codes in PAIR_CODES.items():
        held_k, held_v = codes.keys.round_trip(k)[0], codes.values.round_trip(v)[0]
        weights, out = attention(q, held_k, held_v, window)
        errors[name] = {
            "attention_l1": float((weights - exact_weights).abs().sum(-1).mean()),
            "output_rel": float((out - exact_out).norm() / exact_out.norm()),
            "key_rel": float((held_k.double() - k.double()).norm() / k.double().norm()),
        }
    return errors


def measure(args: argparse.Namespace) -> dict[str, Any]:
    teacher, tokenizer = load_teacher(args.teacher)
    model = from_teacher(teacher, {"mixer": "softmax"}).eval()
    del teacher
    config = model.config
    windows = [config.layer_spec(i).get("window") for i in range(config.num_hidden_layers)]
    kinds = {i: "sliding window" if w else "full attention" for i, w in enumerate(windows)}
    sums: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for haystack, source in natural_haystacks(args.haystacks).items():
        texts = source() if callable(source) else source
        blocks, _ = long_rows(tokenizer, texts, args.length, args.blocks, join=True)
        for number, block in enumerate(blocks):
            captured = capture_layers(model, block[None])
            for index, (q, k, v) in captured.items():
                for name, errors in layer_errors(q, k, v, windows[index], args.queries).items():
                    cell = sums.setdefault(kinds[index], {}).setdefault(name, {}).setdefault(haystack, {})
                    for metric, value in errors.items():
                        cell.setdefault(metric, []).append(value)
            print(f"{haystack}: block {number + 1} of {len(blocks)}", file=sys.stderr, flush=True)
    head_dim, kv_heads = config.head_dim, config.num_key_value_heads
    return {
        "teacher": teacher_name(args.teacher), "head_dim": head_dim, "num_key_value_heads": kv_heads,
        "layers": {kind: sum(1 for k in kinds.values() if k == kind) for kind in sums},
        "blocks": len(blocks), "length": args.length, "queries": args.queries,
        "bytes_per_pair": {name: codes.pair_bytes(head_dim) for name, codes in PAIR_CODES.items()},
        "cells": {kind: {name: {h: {metric: sum(values) / len(values) for metric, values in per_h.items()}
                                for h, per_h in per_name.items()} for name, per_name in per_kind.items()}
                  for kind, per_kind in sums.items()},
    }


def render_markdown(results: dict[str, Any]) -> str:
    lines = ["| teacher | layers | cache_dtype | bytes per key + value | attention L1 | output rel. error | "
             "key rel. error |", "|---|---|---|---:|---:|---:|---:|"]
    for kind, per_kind in results["cells"].items():
        for name, per_h in per_kind.items():
            metrics = [" / ".join(f"{per_h[h][m]:.3f}" for h in per_h) for m in ("attention_l1", "output_rel",
                                                                                  "key_rel")]
            lines.append(f"| {results['teacher']} | {kind} ({results['layers'][kind]}) | `{name}` | "
                         f"{results['bytes_per_pair'][name]} | " + " | ".join(metrics) + " |")
    return "\n".join([*lines, "", *results["notes"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--length", type=int, default=2048, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per kind of text")
    parser.add_argument("--queries", type=int, default=128, help="the last positions of a block whose attention "
                                                                 "is compared")
    parser.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    parser.add_argument("--threads", type=int, default=1)
    add_out_argument(parser, "cache_code_error.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = run_record()
    measured = measure(args)
    notes = [f"{measured['teacher']}: {measured['blocks']} blocks of {args.length:,} tokens of each kind of text "
             f"({' / '.join(args.haystacks)}: cells in that order), the last {args.queries} queries of each; "
             "attention L1: the sum over keys of |p - p'| (0 to 2), means over layers, blocks, heads and queries; "
             "errors relative to the values as computed."]
    results = write_results(args.out, "cache_code_error", record, {**measured, "notes": notes})
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
