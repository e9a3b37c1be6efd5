"""Which converted layers survive past the teacher's context: the teacher's own attention, restricted, on one long
document, with its loss by position.

Runs the teacher's weights (no training) as ``from_teacher`` students whose every layer is

* ``window``: softmax over the last ``W`` tokens (``sliding_window``): logits at distances below W only;
* ``window+sinks``: the same plus the first ``N`` tokens as exact keys (``hybrid`` with ``far: none`` and
  ``sink_tokens: N``): the sinks' logits reach the query's full distance back, through RoPE;
* ``window+sinks, clamped``: the same with ``distant_positions: clamp`` (modeling/key_distance.py): a sink more
  than ``max_position_embeddings`` - 1 tokens back is scored as if it sat exactly that far back;
* ``softmax``: the teacher's attention as it is (every earlier key),

on the first ``--length`` tokens of the embedded corpus's longest file, through the cache in pieces of 1,024, and
prints the mean next-token loss of each span of ``--span`` tokens. Beyond the teacher's ``max_position_embeddings``
(8,192 for SmolLM2) only the window sees no rotation it was not trained on. The models that need positions
(``RecAttnConfig.length_limit``) refuse to run past it; here their ``max_position_embeddings`` is raised to the
length, which changes nothing else for a teacher with the default rotary (SmolLM2's). ``--rows`` runs only the rows
named and keeps the others from ``--out`` when it holds the same length and span (their provenance goes with them,
under ``earlier``).

    nice python benchmarks/sinks_past_context.py --length 24576 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from results_file import add_out_argument, run_record, write_results

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.embedded import embedded_corpus

PIECE = 1024


def specs(window: int, sinks: int) -> dict[str, dict[str, Any]]:
    """The students' layer spec by row name."""
    return {
        f"window {window}": {"mixer": "sliding_window", "window": window},
        f"window {window} + {sinks} sinks": {"mixer": "hybrid", "window": window, "far": "none", "sink_tokens": sinks},
        f"window {window} + {sinks} sinks, clamped": {"mixer": "hybrid", "window": window, "far": "none",
                                                      "sink_tokens": sinks, "distant_positions": "clamp"},
        "softmax (the teacher)": {"mixer": "softmax"},
    }


def longest_document(tokenizer: Any, length: int) -> torch.Tensor:
    """[1, length]: the first tokens of the corpus's longest file (train and held-out splits)."""
    corpus = embedded_corpus()
    files = corpus.files("train") + corpus.files("heldout")
    encoded = tokenizer(files, add_special_tokens=False, verbose=False)["input_ids"]
    longest = max(encoded, key=len)
    if len(longest) < length:
        raise ValueError(f"--length {length}: the longest corpus file has {len(longest)} tokens")
    return torch.tensor([longest[:length]])


@torch.no_grad()
def token_losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[T - 1] next-token losses, the sequence run through the cache in pieces of ``PIECE`` tokens."""
    cache, losses = model.new_cache(), []
    for start in range(0, ids.shape[1], PIECE):
        logits = model(ids[:, start : start + PIECE], past_key_values=cache, use_cache=True).logits.float()
        targets = ids[0, start + 1 : start + PIECE + 1]
        losses.append(F.cross_entropy(logits[0, : targets.shape[0]], targets, reduction="none"))
    return torch.cat(losses)


def span_losses(losses: torch.Tensor, span: int) -> dict[str, float]:
    """Mean loss by span of positions, keyed "start-stop"."""
    return {f"{a}-{min(a + span, losses.shape[0] + 1)}": round(float(losses[a : a + span].mean()), 4)
            for a in range(0, losses.shape[0], span)}


def earlier_rows(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rows not in ``names`` from ``--out`` when it was measured with the same length and span (its first span,
    "0-S", gives S), and their provenance (by row name); empty otherwise."""
    if not args.out.is_file():
        return {}, {}
    old = json.loads(args.out.read_text())
    first = f"0-{min(args.span, args.length - 1)}"
    if old.get("length") != args.length or any(first not in row for row in old["rows"].values()):
        return {}, {}
    kept = {name: row for name, row in old["rows"].items() if name not in names}
    earlier = old.get("earlier", {})
    return kept, {name: earlier.get(name, old["provenance"]) for name in kept}


def render_markdown(results: dict[str, Any]) -> str:
    """The table: mean next-token loss per span of positions (in order), one row per student."""
    rows = results["rows"]
    spans = sorted(next(iter(rows.values())), key=lambda s: int(s.split("-")[0]))  # the JSON sorts them as text
    limit = results["max_position_embeddings"]
    head = [f"{s}{' *' if int(s.split('-')[1]) > limit else ''}" for s in spans]
    lines = ["| attention | " + " | ".join(head) + " |", "|---|" + "---:|" * len(spans)]
    for name, by_span in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_span[s]:.2f}" for s in spans) + " |")
    lines.append("")
    lines.append(f"Mean next-token loss (nats) by token positions; * past the teacher's max_position_embeddings "
                 f"({limit}). {results['notes'][0]}")
    earlier = results.get("earlier", {})
    for commit in dict.fromkeys(record["commit"] for record in earlier.values()):
        names = [name for name, record in earlier.items() if record["commit"] == commit]
        date = next(record["date"] for record in earlier.values() if record["commit"] == commit)
        lines.append(f"Rows {', '.join(names)}: measured in an earlier run (commit {commit[:10]}, {date}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=24576)
    parser.add_argument("--span", type=int, default=4096)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                        help="run only these rows (names as printed); keep the others from --out")
    add_out_argument(parser, "sinks_past_context_cpu.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run_record()
    teacher, tokenizer = load_teacher(args.teacher)
    ids = longest_document(tokenizer, args.length)
    chosen = specs(args.window, args.sinks)
    unknown = sorted(set(args.rows or ()) - set(chosen))
    if unknown:
        raise ValueError(f"--rows {unknown}: unknown; the rows are {sorted(chosen)}")
    rows, earlier = earlier_rows(args, args.rows) if args.rows else ({}, {})
    for name, spec in chosen.items():
        if name in rows:
            continue
        student = from_teacher(teacher, spec).eval()
        student.config.max_position_embeddings = max(student.config.max_position_embeddings, args.length)
        began = time.perf_counter()
        rows[name] = span_losses(token_losses(student, ids), args.span)
        print(f"{name}: {rows[name]} ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    note = (f"The first {args.length} tokens of the embedded corpus's longest file, through the cache in pieces "
            f"of {PIECE}; the teacher's weights, untrained.")
    results = write_results(args.out, "sinks_past_context", record, {
        "max_position_embeddings": teacher.config.max_position_embeddings, "length": args.length,
        "rows": {name: rows[name] for name in chosen if name in rows}, "notes": [note],
        **({"earlier": earlier} if earlier else {})})
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
