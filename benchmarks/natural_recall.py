"""Recall on natural text at constant memory: the needle probe (hf_recattn/evaluation/needles.py) on the teacher, the
untrained window of 512 tokens + 4 sinks, training-free swaps and converted checkpoints, side by side with the bytes
each keeps per sequence.

Every row runs the same prompts (facts stated once in held-out corpus documents, ``heldout``, and in the corpus's
license texts, ``ood``, worded by the held-out templates), greedy answers through the model's cache; each cell gives
the share answered, its prompt count and a Wilson 95% interval. The cache columns count every state element at 4
bytes (as benchmarks/pareto.py) at the ``--contexts`` given; a model whose cache is the same at every context keeps
constant memory. Results go to ``--out`` (rewritten after every model; a rerun with the same settings skips the
models already measured) and the table is printed. Each row keeps the commit and date it was measured at, and the
table's notes name the rows measured at another commit than the file's last run; ``--merge`` takes in the rows of
other runs' files of the same settings (runs side by side, each with its own ``--out``).

    nice python benchmarks/natural_recall.py --threads 2 --converted runs/hybrid-w64-sink4-gdn-learned64 \\
        --out benchmarks/results/natural_recall_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pareto import cache_mib, converted_folder, parse_swap
from results_file import add_out_argument, run_record, write_results

from hf_recattn import from_teacher
from hf_recattn.conversion.baselines import BASELINES
from hf_recattn.conversion.from_teacher import recattn_config_from
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.pinned import CORPUS_SHA256
from hf_recattn.evaluation.needles import NEEDLE_HAYSTACKS, NEEDLE_TASKS, natural_haystacks, needle_probe
from hf_recattn.modeling.configuration import RecAttnConfig
from hf_recattn.modeling.modeling import RecAttnForCausalLM

#: the untrained baseline every student is read against: the teacher's weights, softmax over 512 tokens + 4 sinks
WINDOW_LABEL, WINDOW_SPEC = BASELINES["window"]


NOTES = ["MiB: every state element at 4 bytes (int8 and int4 cache codes and their scales at their own bytes), per "
         "sequence; a row with the same MiB at every context keeps constant memory. A cell: the share of the queries "
         "answered, with its Wilson 95% interval, over the prompts of one task, haystack (heldout: held-out corpus "
         "documents; ood: the corpus's license texts) and length."]


def add_row_arguments(parser: argparse.ArgumentParser) -> None:
    """The rows measured: ``--teacher``, ``--swap``, ``--converted`` (``models``), and ``--threads``."""
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--swap", nargs="*", default=[], metavar="NAME=SPEC",
                        help="training-free variants: the teacher's weights with this attention (the window of 512 + "
                        "4 sinks is always measured)")
    parser.add_argument("--converted", nargs="*", default=[], metavar="DIR", help="converted checkpoints")
    parser.add_argument("--converted-swap", nargs="*", default=[], metavar="NAME=SPEC",
                        help='a converted checkpoint\'s weights under another attention, nothing trained: SPEC as '
                        '--swap\'s with "weights": the checkpoint\'s folder')
    parser.add_argument("--merge", nargs="*", type=Path, default=[], metavar="JSON",
                        help="take in the rows of other runs' results files of the same settings (their --out) that "
                        "--out lacks, each with the commit and date it was measured at")
    parser.add_argument("--threads", type=int, default=None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_arguments(parser)
    parser.add_argument("--tasks", nargs="+", default=["single_number", "multi_key", "multi_query"],
                        choices=NEEDLE_TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    parser.add_argument("--prompts", type=int, default=20, help="prompts per (task, haystack, length) cell")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 32768],
                        help="contexts of the cache columns")
    add_out_argument(parser, "natural_recall.json")
    return parser.parse_args(argv)


def run_settings(args: argparse.Namespace, *keys: str) -> dict[str, Any]:
    """What a results file is kept by (``measure_rows``): the pinned corpus and these arguments' values."""
    return {"corpus": CORPUS_SHA256} | {key: getattr(args, key) for key in keys}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return run_settings(args, "teacher", "tasks", "lengths", "haystacks", "prompts", "contexts")


def measure(name: str, model: torch.nn.Module, config: RecAttnConfig, tokenizer: Any,
            args: argparse.Namespace) -> dict[str, Any]:
    """One row: the cache at every context, whether it grows, and the probe's cells."""
    start = time.perf_counter()
    caches = {str(n): cache_mib(config, n) for n in args.contexts}
    probe = needle_probe(model.eval(), tokenizer, natural_haystacks(args.haystacks), args.tasks, args.lengths,
                         args.prompts, progress=name)
    return {"cache_mib": caches, "constant_memory": len(set(caches.values())) == 1, "cells": probe["cells"],
            "accuracy": probe["accuracy"], "skipped": probe["skipped"], "seconds": time.perf_counter() - start}


def models(args: argparse.Namespace, teacher: torch.nn.Module):  # noqa: ANN201 (a generator of rows to measure)
    """(name, model, config, facts) of every row, built one at a time."""
    yield "teacher", teacher, recattn_config_from(teacher.config, {"mixer": "softmax"}), {"training_tokens": 0}
    swaps = dict([(WINDOW_LABEL, {"attention": WINDOW_SPEC}), *(parse_swap(s) for s in args.swap)])
    for name, swap in swaps.items():
        student = from_teacher(teacher, swap["attention"], swap.get("attention_overrides"))
        yield name, student, student.config, {"training_tokens": 0, "attention": swap}
    for name, model_dir, facts in (converted_folder(path) for path in args.converted):
        student = RecAttnForCausalLM.from_pretrained(model_dir)
        yield name, student, student.config, facts
    for name, swap, folder in (parse_converted_swap(s) for s in args.converted_swap):
        student, facts = reattended(name, folder, swap, teacher.config)
        yield name, student, student.config, facts | {"attention": swap}


def parse_converted_swap(text: str) -> tuple[str, dict[str, Any], str]:
    """``NAME=SPEC`` of ``--converted-swap``: (name, the swap as ``parse_swap`` gives it, the weights' folder)."""
    name, swap = parse_swap(text, "--converted-swap", frozenset({"weights"}))
    folder = swap.pop("weights", None)
    if not isinstance(folder, str):
        raise SystemExit(f'--converted-swap {name}: SPEC must be a JSON object with "weights": a converted folder')
    return name, swap, folder


def reattended(name: str, folder: str, swap: dict[str, Any], teacher_config: Any) -> tuple[RecAttnForCausalLM,
                                                                                          dict[str, Any]]:
    """The converted checkpoint in ``folder`` with the swap's attention in place of its own (its cache changed,
    nothing trained), and the run's facts. Refused when the checkpoint's parameters and the new attention's differ
    (a learned score or a far part the swap drops or adds)."""
    _, model_dir, facts = converted_folder(folder)
    requested = recattn_config_from(teacher_config, swap["attention"], swap.get("attention_overrides"))
    saved = RecAttnConfig.from_pretrained(model_dir).to_dict()
    config = RecAttnConfig.from_dict(saved | {"attention": requested.attention,
                                              "attention_overrides": requested.attention_overrides})
    student, info = RecAttnForCausalLM.from_pretrained(model_dir, config=config, output_loading_info=True)
    unmatched = {key: sorted(info[key]) for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[key]}
    if unmatched:
        raise SystemExit(f"--converted-swap {name}: the weights in {folder} do not fit this attention: {unmatched}")
    return student, facts | {"weights": folder}


def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    low, high = cell["interval"]
    return f"{100 * cell['accuracy']:.0f}% [{100 * low:.0f}-{100 * high:.0f}]"


def render_markdown(results: dict[str, Any]) -> str:
    """The table, the teacher first, then the others by their bytes, the most first: cache MiB at each context and
    its share of the teacher's KV cache at the longest context up to 8k, then every (task, haystack, length) cell,
    accuracy and 95% interval."""
    rows, s = results["models"], results["settings"]
    teacher = rows["teacher"]
    contexts = [str(n) for n in s["contexts"]]
    ratio_at = max((n for n in s["contexts"] if n <= 8192), default=s["contexts"][0])
    columns = [(t, h, str(n)) for t in s["tasks"] for n in s["lengths"] for h in s["haystacks"]]
    head = (["model", *(f"MiB @{int(n) // 1024}k" for n in contexts), f"x teacher KV @{ratio_at // 1024}k"]
            + [f"{t} {h} {int(n) // 1024}k" for t, h, n in columns])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    def order(item: tuple[str, dict[str, Any]]) -> tuple[bool, float, str]:  # the teacher, then by bytes, larger first
        return item[0] != "teacher", -item[1]["cache_mib"][contexts[0]], item[0]

    for name, row in sorted(rows.items(), key=order):
        cache = row["cache_mib"]
        share = cache[str(ratio_at)] / teacher["cache_mib"][str(ratio_at)]
        cells = [name, *(f"{cache[n]:.2f}" for n in contexts), f"{share:.3f}"]
        cells += [_cell(row["cells"].get(t, {}).get(h, {}).get(n)) for t, h, n in columns]
        lines.append("| " + " | ".join(cells) + " |")
    elsewhere = measured_elsewhere(results)
    return "\n".join(lines) + "\n\n" + "\n".join([*results.get("notes", NOTES), *([elsewhere] if elsewhere else [])])


#: one row's measurement: (name, model, config, tokenizer) -> the row's figures, with "seconds"
Measure = Callable[[str, torch.nn.Module, RecAttnConfig, Any], dict[str, Any]]


def measured(record: dict[str, Any]) -> dict[str, Any]:
    """What a row keeps of the run that measured it: its commit and date."""
    return {"commit": record.get("commit"), "date": record.get("date")}


def _rows_of(path: Path, run_settings: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The rows of a results file, each with the commit and date it was measured at (a row written before rows
    kept theirs takes its file's); None when the file was measured with other settings."""
    earlier = json.loads(path.read_text())
    if earlier.get("settings") != run_settings:
        return None
    stamp = measured(earlier.get("provenance", {}))
    return {name: {**row, "measured": row.get("measured", stamp)} for name, row in earlier.get("models", {}).items()}


def measured_elsewhere(results: dict[str, Any]) -> str:
    """A line naming the rows measured at another commit than the file's provenance (taken in from an earlier run or
    by ``--merge``); empty when there are none."""
    commit = results.get("provenance", {}).get("commit")
    other = [f"{name} ({(row['measured'].get('commit') or '?')[:10]}, {row['measured'].get('date')})"
             for name, row in results["models"].items() if row.get("measured", {}).get("commit", commit) != commit]
    return "Rows measured at another commit than the line below: " + "; ".join(other) + "." if other else ""


def measure_rows(args: argparse.Namespace, benchmark: str, run_settings: dict[str, Any], notes: list[str],
                 measure_row: Measure, summary: str) -> dict[str, Any]:
    """Every row of ``models`` through ``measure_row``, the results rewritten to ``args.out`` after each; rows of
    an earlier run with the same settings are kept, not measured again, and so are those of ``args.merge``'s files
    (each row keeps the commit and date it was measured at). ``summary``: the field printed per row."""
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run_record()
    results: dict[str, Any] = {"settings": run_settings, "models": {}, "notes": notes}
    if args.out.is_file():
        results["models"] = _rows_of(args.out, run_settings) or {}
    merged = 0
    for path in args.merge:
        rows = _rows_of(path, run_settings)
        if rows is None:
            raise SystemExit(f"{path}: measured with other settings than {run_settings}")
        for name, row in rows.items():
            if name not in results["models"]:
                results["models"][name] = row
                merged += 1
                print(f"{name}: taken in from {path}", flush=True)

    def write() -> dict[str, Any]:
        return write_results(args.out, benchmark, record,
                             {k: v for k, v in results.items() if k not in ("benchmark", "provenance")})

    if merged:
        results = write()
    teacher, tokenizer = load_teacher(args.teacher)
    teacher.requires_grad_(False)
    for name, model, config, facts in models(args, teacher):
        if name in results["models"]:
            print(f"{name}: measured earlier", flush=True)
            continue
        results["models"][name] = {**facts, **measure_row(name, model, config, tokenizer), "measured": measured(record)}
        results = write()
        row = results["models"][name]
        print(f"{name}: {row[summary]} ({row['seconds']:.0f} s)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = measure_rows(args, "natural_recall", settings(args), NOTES,
                           lambda name, model, config, tokenizer: measure(name, model, config, tokenizer, args),
                           "accuracy")
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
