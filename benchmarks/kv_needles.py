"""KV-cache compression of the unchanged teacher (NVIDIA kvpress) on the natural-text needle probe, at the bytes of
the constant-memory rows of ``benchmarks/natural_recall.py``: the ``needles`` probe of ``kv_compression.py``.

The prompts are natural_recall's (``hf_recattn.evaluation.needles``: same task, haystacks, lengths, prompts per
cell and seeds, so the same tokens); answers are greedy and scored by ``needle_answered``, each cell with its
Wilson 95% interval. A budget (a ``--recall`` row's cache MiB, or ``--bytes``) divided by the teacher's KV bytes
per token gives the tokens a press keeps, in two modes:

* ``question-agnostic``: the press compresses the context before the question arrives; the question and the
  answer's lead-in follow through the compressed cache, unseen by the press (as a constant-memory model reads);
* ``question-aware``: the press compresses the context and the question together, as kvpress's ``query_aware``
  evaluation does (the question appended to the context); the answer's lead-in follows.

SnapKV, which scores tokens by the attention of the last 64 queries (the question, when it is there), runs only
question-aware. ``multi_query`` asks its keys in turn, each answer left in the context of the next question, as
``needle_answers`` asks a student: it runs question-agnostic only (the context is compressed once; the questions and
answers follow it uncompressed), every query scored.

The presses run in ``.venv-kvpress`` through ``kvpress_worker.py`` (one prefill per prompt, every press replayed on
it; the first ``--verify`` prompts of the first cell measured where a press compresses also run each press in a real
prefill). Results go to ``--out`` after every cell; a rerun with the same settings measures only the (run, cell)
pairs missing (``--modes question-agnostic`` on a rerun leaves the question-aware rows' missing cells out).

A teacher with sliding-window layers (Gemma 3: 15 of its 18 layers see the last 512 tokens) is pressed as kvpress
presses Gemma 3, in its full-attention layers only: the sliding-window layers keep their window (the last 511
tokens, as the teacher's own cache and the project's byte count hold them), and the rest of the budget goes to the
full-attention layers, the same kept tokens in each. Kept tokens then count per full-attention layer.

``--cache-dtype int8`` holds what the presses keep (and, in the row without a press, the teacher's whole cache) as
int8 codes with a float32 scale per key and per value, the rounding of the students' ``cache_dtype: int8``: a
budget then buys about four times the tokens, so eviction rules compare at the precision of an int8 student;
``--cache-dtype int4`` likewise at ``cache_dtype: int4``'s (a float32 scale per 32 dimensions), ``int4g16`` at
``cache_dtype: int4g16``'s (a float16 scale per 16), ``k8v4g16`` at ``cache_dtype: k8v4g16``'s (int8 keys, int4g16
values).

    nice python benchmarks/kv_compression.py --probe needles --threads 2 \\
        --recall benchmarks/results/natural_recall_single_cpu.json --out benchmarks/results/kv_needles_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import kv_compression as kv

from hf_recattn.atomic import write_json
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.pinned import CORPUS_SHA256
from hf_recattn.evaluation.needles import (
    cell_summary,
    natural_haystacks,
    needle_answered,
    needle_prompt,
    needle_template,
    wilson_interval,
)
from hf_recattn.modeling.cache_precision import MODEL, pair_codes
from hf_recattn.prompting.haystack import Haystack
from hf_recattn.provenance import provenance

AGNOSTIC, AWARE = "question-agnostic", "question-aware"
MODES = (AGNOSTIC, AWARE)
AWARE_ONLY = ("SnapKV",)  # presses that score by the last queries: without the question they see only text
NEEDLE_PRESSES = ("StreamingLLM", "KNorm", "ExpectedAttention", "KeyDiff", "SnapKV")
#: tasks whose keys are asked in turn: their cells run question-agnostic only
IN_TURN_TASKS = ("multi_query",)


# ----- the prompts ------------------------------------------------------------------------------------------
def question_split(tokenizer: Any, task: str, key: str, query_ids: tuple[int, ...]) -> int:
    """Where the question ends and the answer's lead-in begins in a query's ids."""
    question = tuple(tokenizer(needle_template(task).fill("question", key=key), add_special_tokens=False)["input_ids"])
    if query_ids[: len(question)] != question or len(question) >= len(query_ids):
        raise ValueError(f"needles task {task}: the question's ids are not a prefix of the query's; cannot split it")
    return len(question)


def needle_cells(tokenizer: Any, haystacks: dict[str, Any], task: str, lengths: list[int], prompts: int,
                 seed: int = 0) -> list[dict[str, Any]]:
    """natural_recall's prompts of ``task`` (the seeds and depths of ``needle_probe``), one cell per length and
    haystack, each prompt split into the context, its first query and where that query's question ends; the
    queries asked after it (``multi_query``) under ``later``."""
    cells = []
    texts = {name: Haystack(tokenizer, source() if callable(source) else source) for name, source in haystacks.items()}
    for length in lengths:  # the shortest first: a run cut short has every haystack's cells of a length
        for name, haystack in texts.items():
            cases = []
            for t in range(prompts):
                prompt = needle_prompt(tokenizer, haystack, task, length, f"{seed}:{name}:{task}:{length}:{t}",
                                       depth=(t + 0.5) / prompts)
                first, *later = prompt.queries
                case = {"context_ids": list(prompt.context), "query_ids": list(first.ids),
                        "split": question_split(tokenizer, task, first.key, first.ids), **_query_fields(first),
                        "repeated": prompt.repeated}
                if later:
                    case["later"] = [{"query_ids": list(query.ids), **_query_fields(query)} for query in later]
                cases.append(case)
            cells.append({"key": f"{task}/{name}/{length}", "task": task, "haystack": name, "length": length,
                          "cases": cases})
    return cells


def _query_fields(query: Any) -> dict[str, Any]:
    return {"max_new_tokens": query.max_new_tokens, "key": query.key, "values": list(query.values)}


def runs_of_cell(cell: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs a cell takes: every one, or the question-agnostic ones for a task that asks in turn (which
    question a press would see with the context has no answer there)."""
    return [run for run in runs if run["mode"] == AGNOSTIC or cell["task"] not in IN_TURN_TASKS]


def compressed_lengths(cells: list[dict[str, Any]], mode: str) -> list[int]:
    """Every length a press compresses in ``mode``: the context, or the context and the question."""
    return sorted({len(c["context_ids"]) + (c["split"] if mode == AWARE else 0) for cell in cells
                   for c in cell["cases"]})


def plan_needle_runs(presses: list[str], modes: list[str], kept: dict[int, list[str]],
                     cells: list[dict[str, Any]], cache_dtype: str = "model") -> list[dict[str, Any]]:
    """The teacher without a press, then every press in every mode at every budget, with kvpress's compression
    ratio for each length it compresses (presses of ``AWARE_ONLY`` question-aware only); every run holds its cache
    as ``cache_dtype`` says."""
    runs = [{"name": kv.NO_PRESS, "press": None, "mode": AGNOSTIC, "kept": None, "budget_of": [], "ratios": {}}]
    for tokens, names in kept.items():
        for mode in modes:
            lengths = compressed_lengths(cells, mode)
            runs += [{"name": f"{press} {mode} {tokens}", "press": press, "mode": mode, "kept": tokens,
                      "budget_of": names, "ratios": {str(n): kv.compression_ratio(tokens, n) for n in lengths}}
                     for press in presses if mode == AWARE or press not in AWARE_ONLY]
    return [run | {"cache_dtype": cache_dtype} for run in runs]


def coded_bytes_per_token(per_token: int, head_dim: int, cache_dtype: str) -> int:
    """A teacher's KV cache per token held as a coded ``cache_dtype`` (its codes and scales per key and per value,
    cache_precision.PairCodes), from its float32 bytes per token and its heads' dimension."""
    pairs = per_token // (8 * head_dim)  # the key-value pairs of every layer and KV head
    return pairs * pair_codes(cache_dtype).pair_bytes(head_dim)


def recall_budgets(recall: dict[str, Any] | None) -> dict[str, float]:
    """The cache MiB of every constant-memory row of a natural_recall results file."""
    if recall is None:
        return {}
    if recall.get("benchmark") != "natural_recall":
        raise SystemExit("--recall: not a benchmarks/natural_recall.py results file")
    return {name: min(row["cache_mib"].values()) for name, row in recall["models"].items() if row["constant_memory"]}


@dataclass(frozen=True)
class TeacherLayout:
    """The teacher's layers as the presses see them: ``window_layers`` keep a sliding window of ``window`` tokens
    (the current one included) and are not pressed; the others are."""

    layers: int
    window_layers: tuple[int, ...] = ()
    window: int | None = None

    @classmethod
    def of(cls, config: Any) -> TeacherLayout:
        """From a transformers config: its ``sliding_attention`` layers, if it has any."""
        types = getattr(config, "layer_types", None) or []
        window_layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return cls(config.num_hidden_layers, window_layers, config.sliding_window if window_layers else None)

    def window_bytes(self, per_token: int) -> float:
        """What the sliding-window layers hold, whatever the budget: window - 1 tokens each, at ``per_token``
        bytes per token over all layers."""
        return len(self.window_layers) * ((self.window or 1) - 1) * per_token / self.layers

    def pressed_bytes(self, per_token: int) -> float:
        """A token's bytes over the pressed layers."""
        return per_token * (self.layers - len(self.window_layers)) / self.layers

    def kept(self, mib: float, per_token: int, name: str) -> int:
        """The tokens each pressed layer keeps in ``mib`` MiB (the bytes left when the windows are held)."""
        tokens = kv.kept_tokens(mib - self.window_bytes(per_token) / 2**20, self.pressed_bytes(per_token))
        if tokens < 1:
            raise SystemExit(f"budget {name} ({mib:g} MiB): the teacher's sliding-window layers alone hold "
                             f"{self.window_bytes(per_token) / 2**20:.2f} MiB; no press can keep it")
        return tokens

    def mib(self, kept: int, per_token: int) -> float:
        """The cache MiB of ``kept`` tokens in each pressed layer beside the windows."""
        return (self.window_bytes(per_token) + kept * self.pressed_bytes(per_token)) / 2**20


#: a teacher whose every layer is pressed
EVERY_LAYER = TeacherLayout(layers=1)


def kept_by_budget(named: dict[str, float], per_token: int,
                   layout: TeacherLayout = EVERY_LAYER) -> dict[int, list[str]]:
    """Kept tokens (per pressed layer) -> the budgets (name: MiB) that give them, the most tokens first."""
    out: dict[int, list[str]] = {}
    for name, mib in named.items():
        out.setdefault(layout.kept(mib, per_token, name), []).append(name)
    return dict(sorted(out.items(), reverse=True))


# ----- scoring ----------------------------------------------------------------------------------------------
def score_cell(record: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    """One run's cell from a worker record: every prompt's answer and verdict, the cell summary (needles.py's), the
    cache tokens after the press, and how the replayed press agreed with a real prefill where checked."""
    prompts = []
    for case, got in zip(cell["cases"], record["answers"], strict=True):
        asked = [case, *case.get("later", [])]
        answers = [got["answer"], *got.get("later_answers", [])]
        if len(answers) != len(asked):
            raise ValueError(f"cell {cell['key']}: {len(answers)} answers to {len(asked)} queries")
        queries = [{"key": query["key"], "values": query["values"], "answer": answer.strip(),
                    "correct": needle_answered(answer, query["values"])}
                   for query, answer in zip(asked, answers, strict=True)]
        prompts.append({"queries": queries, "repeated": case["repeated"], "cache_tokens": got["cache_tokens"]})
    checked = [got for got in record["answers"] if "hooked_answer" in got]
    out = {"summary": cell_summary(prompts), "prompts": prompts}
    if checked:
        out["verified"] = {"prompts": len(checked),
                           "same_answers": sum(g["hooked_answer"] == g["answer"] for g in checked),
                           "max_difference": max(g["difference"] for g in checked)}
    return out


def new_row(run: dict[str, Any], per_token: int, layout: TeacherLayout = EVERY_LAYER) -> dict[str, Any]:
    """A results row for a run, before its cells."""
    mib = None if run["kept"] is None else layout.mib(run["kept"], per_token)
    return {"press": run["press"], "mode": run["mode"], "kept_tokens": run["kept"], "budget_of": run["budget_of"],
            "cache_mib": mib, "cells": {}}


def add_record(results: dict[str, Any], record: dict[str, Any], cells: dict[str, dict[str, Any]]) -> str:
    """Put a worker record into ``results``; returns a line to print."""
    if "name" not in record:
        results["seconds"][record["cell"]] = record["seconds"]
        return f"{record['cell']}: {record['prompts']} prompts in {record['seconds']:.0f} s"
    row, cell = results["rows"][record["name"]], cells[record["cell"]]
    if "error" in record:
        row["error"] = record["error"]
        return f"{record['name']}: could not run: {record['error']}"
    scored = score_cell(record, cell)
    row["cells"].setdefault(cell["task"], {}).setdefault(cell["haystack"], {})[str(cell["length"])] = scored
    summary = scored["summary"]
    return f"{record['name']} {record['cell']}: {summary['correct']}/{summary['n']}"


# ----- the run ----------------------------------------------------------------------------------------------
def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("teacher", "tasks", "haystacks", "lengths", "prompts", "seed")
    # files measured as computed keep their settings
    held = {"cache_dtype": args.cache_dtype} if args.cache_dtype != MODEL else {}
    fixed = {"probe": "needles", "corpus": CORPUS_SHA256, "pins": list(kv.PINS)}
    return fixed | {k: getattr(args, k) for k in keys} | held


def start_results(args: argparse.Namespace) -> dict[str, Any]:
    """The results of this setting: what ``--out`` already holds for the same settings, nothing otherwise."""
    results: dict[str, Any] = {"settings": settings(args), "rows": {}, "seconds": {}}
    if args.out.is_file():
        earlier = json.loads(args.out.read_text())
        if earlier.get("settings") == results["settings"]:
            results.update({k: earlier[k] for k in ("rows", "seconds", "worker_versions") if k in earlier})
    return results | {"benchmark": "kv_needles", "provenance": provenance(["python", *sys.argv])}


def measured(row: dict[str, Any], cell: dict[str, Any]) -> bool:
    """Whether a row holds a cell already (or could not run)."""
    return "error" in row or str(cell["length"]) in row["cells"].get(cell["task"], {}).get(cell["haystack"], {})


def mark_verified_cell(cells: list[dict[str, Any]], runs: list[dict[str, Any]], verify: int) -> None:
    """Give ``verify`` prompts to check against a real prefill to the first cell where a press compresses (a cell
    whose prompts every budget holds whole has nothing to check), none to the others."""
    by_name = {run["name"]: run for run in runs}

    def compresses(cell: dict[str, Any]) -> bool:
        return any(by_name[name]["press"] is not None and any(
            by_name[name]["ratios"].get(str(n)) is not None for n in compressed_lengths([cell], by_name[name]["mode"]))
            for name in cell["runs"])

    first = next((index for index, cell in enumerate(cells) if compresses(cell)), None)
    for index, cell in enumerate(cells):
        cell["verify"] = verify if index == first else 0


def probe_file(args: argparse.Namespace, results: dict[str, Any], teacher: Any, tokenizer: Any) -> dict[str, Any]:
    """The worker's input: the cells with the runs each still needs (cells with none left out), and the teacher's
    sliding-window layers that no press touches."""
    per_token, layout = results["bytes_per_token"], TeacherLayout.of(teacher.config)
    named = {f"{mib:g} MiB": mib for mib in args.bytes} | recall_budgets(
        json.loads(args.recall.read_text()) if args.recall else None)
    if not named:
        raise SystemExit("kv_compression.py --probe needles: give budgets with --recall JSON or --bytes MIB ...")
    cells = [cell for task in args.tasks for cell in needle_cells(
        tokenizer, natural_haystacks(args.haystacks), task, args.lengths, args.prompts, args.seed)]
    runs = plan_needle_runs(args.presses or list(NEEDLE_PRESSES), args.modes,
                            kept_by_budget(named, per_token, layout), cells, args.cache_dtype)
    for run in runs:
        results["rows"].setdefault(run["name"], new_row(run, per_token, layout))
    for cell in cells:
        cell["runs"] = [run["name"] for run in runs_of_cell(cell, runs)
                        if not measured(results["rows"][run["name"]], cell)]
    cells = [cell for cell in cells if cell["runs"]]
    mark_verified_cell(cells, runs, args.verify)
    folder = kv.save_teacher(teacher, tokenizer, args.work / args.teacher)
    if layout.window_layers:
        results["window_layers"] = {"layers": list(layout.window_layers), "window": layout.window}
    return {"kind": "needles", "model": str(folder), "runs": runs, "cells": cells,
            "window_layers": list(layout.window_layers), "window": layout.window}


def run(args: argparse.Namespace, python: Any) -> int:
    """The needles probe: plan, run the worker, score each cell as it comes, print the table."""
    results = start_results(args)
    teacher, tokenizer = load_teacher(args.teacher)
    results["bytes_per_token"] = kv.bytes_per_token(teacher)
    if args.cache_dtype != MODEL:
        head_dim = kv.recattn_config_from(teacher.config, {"mixer": "softmax"}).head_dim
        results["bytes_per_token"] = coded_bytes_per_token(results["bytes_per_token"], head_dim, args.cache_dtype)
    probes = probe_file(args, results, teacher, tokenizer)
    del teacher
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / f"needle_probes-{args.out.stem}.json"  # runs with distinct outputs run side by side
    write_json(path, probes, indent=0)
    cells = {cell["key"]: cell for cell in probes["cells"]}
    print(f"{len(cells)} cells to measure, {sum(len(c['runs']) for c in cells.values())} (run, cell) pairs",
          flush=True)
    for record in kv.worker_lines(python, path, args.threads) if cells else []:
        if "versions" in record:
            results["worker_versions"] = record["versions"]
            continue
        print(add_record(results, record, cells), flush=True)
        if "name" not in record:  # a cell is done
            write_json(args.out, results)
    write_json(args.out, results)
    print(render_markdown(results))
    print(f"results: {args.out}")
    return 0


# ----- the table --------------------------------------------------------------------------------------------
def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    summary = cell["summary"]
    low, high = summary["interval"]
    return f"{100 * summary['accuracy']:.0f}% [{100 * low:.0f}-{100 * high:.0f}]"


def row_order(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
    """The teacher first, then the most kept tokens first, question-agnostic before question-aware, presses in
    NEEDLE_PRESSES order."""
    name, row = item
    press = NEEDLE_PRESSES.index(row["press"]) if row["press"] in NEEDLE_PRESSES else len(NEEDLE_PRESSES)
    return row["press"] is not None, -(row["kept_tokens"] or 0), MODES.index(row["mode"]), press, name


def render_markdown(results: dict[str, Any]) -> str:
    """One row per press, mode and budget: kept tokens, cache MiB, then each (task, length, haystack) cell; under
    it, the rows whose bytes the budgets are."""
    s = results["settings"]
    columns = [(t, str(n), h) for t in s["tasks"] for n in s["lengths"] for h in s["haystacks"]]
    head = ["press", "mode", "kept tokens", "cache MiB", *(f"{t} {h} {int(n) // 1024}k" for t, n, h in columns)]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for name, row in sorted(results["rows"].items(), key=row_order):
        kept = "all" if row["kept_tokens"] is None else f"{row['kept_tokens']:,}"
        mib = "all" if row["cache_mib"] is None else f"{row['cache_mib']:.2f}"
        cells = [row["press"] or name, row["mode"] if row["press"] else "-", kept, mib]
        if "error" in row:
            cells += [f"could not run: {row['error'].splitlines()[0][:150]}"] + [""] * (len(columns) - 1)
        else:
            cells += [_cell(row["cells"].get(t, {}).get(h, {}).get(n)) for t, n, h in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + " ".join(notes(results))


def notes(results: dict[str, Any]) -> list[str]:
    """The lines under the table: what a cell is, the environment, and how the replayed presses were checked."""
    versions = ", ".join(f"{k} {v}" for k, v in sorted(results.get("worker_versions", {}).items()))
    checked = [cell["verified"] for row in results["rows"].values() for per_h in row["cells"].values()
               for per_n in per_h.values() for cell in per_n.values() if "verified" in cell]
    budgets = {row["kept_tokens"]: row["budget_of"] for row in results["rows"].values() if row["budget_of"]}
    coded = results["settings"].get("cache_dtype")
    held = (f"{pair_codes(coded).description}, the press's choice and the unpressed teacher's cache alike" if coded
            else "fp32")
    out = ["A cell: the share of the prompts answered, with its Wilson 95% interval. Kept tokens: the bytes of "
           + "; ".join(f"{', '.join(names)} ({kept})" for kept, names in sorted(budgets.items(), reverse=True)) + ".",
           f"Presses run with {versions}; teacher KV {results['bytes_per_token']:,} bytes per token ({held})."]
    if "window_layers" in results:
        windows = results["window_layers"]
        out.append(f"As kvpress presses Gemma 3, the presses compress the full-attention layers only: the "
                   f"{len(windows['layers'])} sliding-window layers keep their last {windows['window'] - 1} tokens "
                   f"(counted in the cache MiB), and kept tokens are per full-attention layer.")
    if checked:
        same = sum(c["same_answers"] for c in checked)
        total = sum(c["prompts"] for c in checked)
        out.append(f"Each press replayed on a recorded prefill; against a real prefill with the press, "
                   f"{same} of {total} answers the same.")
    return out


def pooled(cells: dict[str, Any], haystacks: list[str], length: str) -> tuple[float, tuple[float, float], int] | None:
    """Accuracy over the ``haystacks``' cells at ``length`` (one task's cells: {haystack: {length: cell}}, a cell
    with a ``summary`` or the summary itself), its Wilson 95% interval and n; None when a cell is missing."""
    parts = [cells.get(h, {}).get(length) for h in haystacks]
    if not parts or any(p is None for p in parts):
        return None
    summaries = [p.get("summary", p) for p in parts]
    correct, n = sum(s["correct"] for s in summaries), sum(s["n"] for s in summaries)
    return correct / n, wilson_interval(correct, n), n
