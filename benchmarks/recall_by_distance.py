"""Recall at fixed distances with word-valued facts: the rows of benchmarks/natural_recall.py (the teacher, the
untrained window of 512 tokens + 4 sinks, training-free swaps, converted checkpoints) on the probe of
``hf_recattn.evaluation.distance``: one fact in the held-out ``words`` template (``The capital of NAME is WORD.``, a
word of the held-out word list), then exactly d tokens of text, then the question; teacher-forced, a trial passes
when every token of the word is the argmax.

The needles of natural_recall.py ask for numbers; this asks for a word in other wording, so a model whose recall
serves one format only shows it here. Each (haystack, distance) cell runs ``--trials`` prompts: ``heldout`` plants
the fact in the embedded corpus's held-out manuals, ``ood`` in its license texts. Results go to ``--out``
(rewritten after every model; a rerun with the same settings skips the models already measured) and the table is
printed.

    nice python benchmarks/recall_by_distance.py --threads 1 --converted runs/retrieval9-w96-sink4 \\
        --out benchmarks/results/recall_by_distance_cpu.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from natural_recall import add_row_arguments, measure_rows, run_settings
from results_file import add_out_argument

from hf_recattn.data.corpus import embedded_texts
from hf_recattn.evaluation.distance import distance_recall_probe
from hf_recattn.evaluation.needles import NEEDLE_HAYSTACKS, wilson_interval

NOTES = ["A cell: the share of trials whose word came back whole, with its Wilson 95% interval; the same prompts "
         "for every row. heldout: the embedded corpus's held-out manuals; ood: its license texts."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_arguments(parser)
    parser.add_argument("--distances", type=int, nargs="+", default=[100, 1000, 3000],
                        help="tokens of text between the fact and the question")
    parser.add_argument("--trials", type=int, default=20, help="prompts per (haystack, distance) cell")
    parser.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    add_out_argument(parser, "recall_by_distance.json")
    return parser.parse_args(argv)


def measure(name: str, model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    cells: dict[str, dict[str, Any]] = {}
    for haystack in args.haystacks:
        probe = distance_recall_probe(model.eval(), tokenizer, embedded_texts(haystack), args.distances,
                                      trials=args.trials, progress=f"{name} {haystack}")
        cells[haystack] = {}
        for distance, rows in probe["answers"].items():
            correct = sum(bool(row["queries"][0]["correct"]) for row in rows)
            low, high = wilson_interval(correct, len(rows))
            cells[haystack][distance] = {"accuracy": correct / len(rows), "correct": correct, "n": len(rows),
                                         "interval": [round(low, 4), round(high, 4)]}
    mean = {h: sum(c["accuracy"] for c in by.values()) / len(by) for h, by in cells.items() if by}
    return {"cells": cells, "accuracy": mean, "seconds": time.perf_counter() - start}


def render_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    columns = [(h, str(d)) for h in s["haystacks"] for d in s["distances"]]
    lines = ["| model | " + " | ".join(f"{h} {d}" for h, d in columns) + " |", "|---|" + "---:|" * len(columns)]
    for model, row in sorted(results["models"].items(), key=lambda item: item[0] != "teacher"):  # the teacher first
        cells = []
        for haystack, distance in columns:
            cell = row["cells"].get(haystack, {}).get(distance)
            if cell is None:
                cells.append("-")
                continue
            low, high = cell["interval"]
            cells.append(f"{100 * cell['accuracy']:.0f}% [{100 * low:.0f}-{100 * high:.0f}]")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + " ".join(results.get("notes", NOTES)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kept_by = run_settings(args, "teacher", "distances", "trials", "haystacks")
    results = measure_rows(args, "recall_by_distance", kept_by, NOTES,
                           lambda name, model, config, tokenizer: measure(name, model, tokenizer, args), "accuracy")
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
