"""KV-cache compression of the unchanged teacher (NVIDIA kvpress) at the cache bytes of our students.

Each press keeps as many of the teacher's context tokens as fit in a student's cache: the student's cache MiB (a
``--pareto`` results file, at its context; or ``--bytes MiB ...``) divided by the teacher's KV bytes per token (every
layer's keys and values, 4 bytes per element as in benchmarks/pareto.py) gives the kept tokens, and for a context of
L tokens the press's ``compression_ratio`` is 1 - kept / L (DuoAttention: the share of streaming heads that keeps
kept tokens per head on average). A press that cannot run is listed with its error. On the Pareto table's probes:

* passkey retrieval (``--passkey-lengths``, keys at depths 0.1 / 0.5 / 0.9, the same prompts and keys as
  ``hf_recattn.evaluation.passkey_probe`` over those lengths, or, with ``--passkey-drawn-before``, over those
  lengths first and then ``--passkey-lengths``): the prompt up to the question is the context the press compresses
  once at prefill; the question ("What is the pass key? The pass key is") follows through the compressed cache,
  unseen by the press (question-agnostic, like a constant-size state); greedy answers, scored as the project does;
* perplexity of ``--ppl-continuation`` held-out tokens continuing a ``--ppl-context``-token held-out context
  compressed by the press (teacher-forced through the compressed cache), as a ratio to the teacher without a press
  on the same tokens.

The teacher without a press runs the same probes and also the Pareto table's 512-token perplexity blocks: its
figures must reproduce the teacher's own (the project's perplexity, and the teacher row of ``--pareto``).

``--probe needles`` runs the natural-text needle probe of ``benchmarks/natural_recall.py`` instead, at the bytes of
its constant-memory rows (``--recall``), question-agnostic and question-aware: see ``benchmarks/kv_needles.py``.

kvpress 0.5.5 needs transformers < 5.3, so the presses run in their own environment, ``.venv-kvpress/`` (built
when missing, or with ``--setup``, from the pinned ``PINS``: kvpress==0.5.5, transformers==5.2.0, torch==2.13.0
CPU, tokenizers==0.22.2, safetensors==0.8.0, huggingface-hub==1.33.0, accelerate==1.15.0, datasets==5.2.0,
numpy==2.4.6), through ``benchmarks/kvpress_worker.py``, which imports only torch, transformers and kvpress.
This script saves the teacher once as a safetensors folder, writes the probe token ids as JSON, reads the
worker's answers and scores them. Results go to ``--out`` (rewritten after every press; a rerun with the same
settings skips the rows measured already); a markdown table is printed. ``pareto.py --peers FILE`` shows the rows.

    nice python benchmarks/kv_compression.py --threads 2 --pareto benchmarks/results/pareto_cpu.json \\
        --out benchmarks/results/kv_compression_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pareto import cache_mib

from hf_recattn.atomic import atomic_folder, write_json
from hf_recattn.conversion.from_teacher import recattn_config_from
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_splits, token_blocks
from hf_recattn.data.pinned import CORPUS_SHA256
from hf_recattn.evaluation import PASSKEY_DEPTHS, passkey_ids, perplexity
from hf_recattn.evaluation.needles import NEEDLE_HAYSTACKS, NEEDLE_TASKS
from hf_recattn.evaluation.passkey import passkey_answered, passkey_question_ids
from hf_recattn.modeling.cache_precision import CACHE_DTYPES, MODEL
from hf_recattn.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "kvpress_worker.py"
#: the presses' environment: every version that can change a figure, pinned
PINS = ("torch==2.13.0", "transformers==5.2.0", "kvpress==0.5.5", "tokenizers==0.22.2", "safetensors==0.8.0",
        "huggingface-hub==1.33.0", "accelerate==1.15.0", "datasets==5.2.0", "numpy==2.4.6")
PRESSES = ("StreamingLLM", "SnapKV", "KeyDiff", "ExpectedAttention", "KNorm", "DuoAttention")
NO_PRESS = "teacher (no press)"
MAX_NEW_TOKENS = 8  # as passkey_probe
DUO_STREAMING_TOKENS = 128 + 256  # the sink and recent tokens of kvpress's DuoAttention streaming heads


# ----- the environment and the teacher ----------------------------------------------------------------------
def ensure_env(venv: Path, rebuild: bool = False) -> Path:
    """The presses' python: ``venv`` built from ``PINS`` when missing, when its pins differ, or on ``rebuild``."""
    python, stamp = venv / "bin" / "python", venv / "pins.txt"
    if not rebuild and python.is_file() and stamp.is_file() and stamp.read_text().split() == list(PINS):
        return python
    print(f"building {venv} with {' '.join(PINS)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PINS], check=True)
    stamp.write_text("\n".join(PINS) + "\n")
    return python


def save_teacher(teacher: Any, tokenizer: Any, folder: Path) -> Path:
    """The teacher as a safetensors folder the worker loads, written once and whole (runs started together: the
    first to finish writing it wins, none reads a half-written one)."""
    if not folder.is_dir():
        with atomic_folder(folder, replace=False) as tmp:
            teacher.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return folder


def bytes_per_token(teacher: Any) -> int:
    """The teacher's KV cache per token: every layer's keys and values at pareto.py's bytes per element."""
    return round(cache_mib(recattn_config_from(teacher.config, {"mixer": "softmax"}), 1) * 2**20)


# ----- budgets ----------------------------------------------------------------------------------------------
def kept_tokens(mib: float, per_token: float) -> int:
    """How many teacher tokens fit in ``mib`` MiB."""
    return int(mib * 2**20 / per_token + 1e-9)


def compression_ratio(kept: int, length: int) -> float | None:
    """kvpress's ``compression_ratio`` that keeps ``kept`` of ``length`` tokens (kvpress keeps
    int(length * (1 - ratio))); None when the budget holds the whole context (no press needed)."""
    if kept < 1:
        raise ValueError(f"a budget of {kept} tokens keeps nothing")
    return None if kept >= length else 1.0 - (kept + 0.5) / length


def duo_head_share(kept: int, length: int) -> float | None:
    """DuoAttention's share of streaming heads (they keep its 128 sink + 256 recent tokens, the other heads all
    ``length``) whose mean kept tokens per head is ``kept``; None when the budget holds the whole context."""
    if kept >= length:
        return None
    return min(1.0, (length - kept) / (length - DUO_STREAMING_TOKENS))


def press_ratio(press: str, kept: int, length: int) -> float | None:
    """What the worker passes to the press: DuoAttention's head share, every other press's compression ratio."""
    return duo_head_share(kept, length) if press == "DuoAttention" else compression_ratio(kept, length)


def budgets(bytes_mib: list[float], pareto: dict[str, Any] | None, students: list[str] | None,
            per_token: int) -> dict[int, list[str]]:
    """Kept tokens -> the budgets that give them (``--bytes`` values, the students of a Pareto results file)."""
    named = {f"{mib:g} MiB": mib for mib in bytes_mib}
    if pareto is not None:
        rows = {name: row["cache_mib"] for name, row in pareto["models"].items() if name != "teacher"}
        unknown = sorted(set(students or []) - set(rows))
        if unknown:
            raise SystemExit(f"--students: {unknown} are not rows of the --pareto file (it has {sorted(rows)})")
        named.update((name, mib) for name, mib in rows.items() if not students or name in students)
    out: dict[int, list[str]] = {}
    for name, mib in named.items():
        out.setdefault(kept_tokens(mib, per_token), []).append(name)
    return dict(sorted(out.items(), reverse=True))


# ----- the probes -------------------------------------------------------------------------------------------
def passkey_cases(tokenizer: Any, lengths: list[int], trials: int, seed: int = 0,
                  drawn_before: Sequence[int] = ()) -> list[dict[str, Any]]:
    """passkey_probe's prompts (its keys, depths and lengths), each split into the context and the question.
    ``drawn_before``: lengths a probe measured first, whose keys are drawn and dropped, so that the keys of
    ``lengths`` are the ones that probe gave them (the Pareto table's 4k keys follow its 1k ones)."""
    rng = random.Random(seed)
    for _ in range(len(drawn_before) * trials):
        rng.randrange(10_000, 100_000)
    question = passkey_question_ids(tokenizer)
    cases = []
    for length in lengths:
        keys = [f"{rng.randrange(10_000, 100_000)}" for _ in range(trials)]
        for i, key in enumerate(keys):
            ids, _ = passkey_ids(tokenizer, length - MAX_NEW_TOKENS, key, PASSKEY_DEPTHS[i % len(PASSKEY_DEPTHS)])
            if ids[-len(question):] != question:
                raise ValueError("passkey_ids no longer ends with the passkey question: update passkey_cases")
            cases.append({"length": length, "key": key, "context_ids": ids[: -len(question)],
                          "question_ids": question, "max_new_tokens": MAX_NEW_TOKENS})
    return cases


def perplexity_probes(tokenizer: Any, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Held-out contexts and continuations (the Pareto split, documents in the same order), and the Pareto
    table's perplexity blocks."""
    span = args.ppl_context + args.ppl_continuation
    long = token_blocks(tokenizer, texts, span, max_tokens=span * args.ppl_blocks, seed=0)
    blocks = token_blocks(tokenizer, texts, args.block_size, max_tokens=args.heldout_tokens, seed=0)
    return {"contexts": long[:, : args.ppl_context].tolist(), "continuations": long[:, args.ppl_context :].tolist(),
            "blocks": blocks.tolist()}


def plan_runs(presses: list[str], kept: dict[int, list[str]], lengths: list[int]) -> list[dict[str, Any]]:
    """The teacher without a press, then every press at every budget: the ratio for each context length."""
    runs = [{"name": NO_PRESS, "press": None, "kept": None, "ratios": {}, "budget_of": []}]
    for tokens, names in kept.items():
        runs += [{"name": f"{press} {tokens}", "press": press, "kept": tokens, "budget_of": names,
                  "ratios": {str(n): press_ratio(press, tokens, n) for n in lengths}} for press in presses]
    return runs


def write_probes(path: Path, model_dir: Path, cases: list[dict[str, Any]], ppl: dict[str, Any],
                 runs: list[dict[str, Any]]) -> None:
    """Everything the worker needs, as JSON."""
    write_json(path, {"model": str(model_dir), "passkey": cases, "perplexity": ppl, "runs": runs}, indent=0)


def read_probes(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# ----- running the worker and scoring -----------------------------------------------------------------------
def worker_lines(python: Path, probes: Path, threads: int | None) -> Iterator[dict[str, Any]]:
    """The worker's records as they come (its stderr goes to ours)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [str(python), str(WORKER), str(probes)] + (["--threads", str(threads)] if threads else [])
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as worker:
        for line in worker.stdout:
            if line.startswith("{"):
                yield json.loads(line)
    if worker.returncode:
        raise SystemExit(f"kvpress_worker.py stopped with exit status {worker.returncode}")


def score(record: dict[str, Any], run: dict[str, Any], cases: list[dict[str, Any]], per_token: int) -> dict:
    """A table row from a worker record: passkey accuracy per length (the project's verdict), perplexities."""
    row: dict[str, Any] = {"press": run["press"], "kept_tokens": run["kept"], "budget_of": run["budget_of"],
                           "cache_mib": None if run["kept"] is None else run["kept"] * per_token / 2**20,
                           "seconds": record["seconds"]}
    if "error" in record:
        return row | {"error": record["error"]}
    answers = {n: [a.strip() for a in got] for n, got in record["passkey_answers"].items()}
    keys: dict[str, list[str]] = {}
    for case in cases:
        keys.setdefault(str(case["length"]), []).append(case["key"])
    row["passkey"] = {n: sum(map(passkey_answered, answers[n], keys[n])) / len(keys[n]) for n in keys}
    row["passkey_answers"] = answers
    row["passkey_cache_tokens"] = record["passkey_cache_tokens"]
    row["continuation_perplexity"] = math.exp(record["continuation_nll"] / record["continuation_tokens"])
    row["continuation_cache_tokens"] = record["continuation_cache_tokens"]
    if "block_perplexity" in record:
        row["block_perplexity"] = record["block_perplexity"]
    return row


def sanity(results: dict[str, Any], pareto: dict[str, Any] | None) -> str:
    """The no-press teacher's figures beside the teacher's own (the project's code, the Pareto teacher row)."""
    row, own = results["rows"].get(NO_PRESS, {}), results.get("teacher_perplexity")
    if "block_perplexity" not in row:
        return f"sanity: no figures for the teacher without a press ({row.get('error', 'not measured')})"
    lines = [f"sanity: perplexity of the Pareto blocks, teacher in the kvpress environment "
             f"{row['block_perplexity']:.4f}, with hf_recattn {own:.4f}"]
    if pareto is not None and "teacher" in pareto["models"]:
        theirs = pareto["models"]["teacher"]
        lines.append(f"  Pareto teacher row: perplexity {theirs['perplexity_in-distribution']:.4f}, passkey "
                     f"{theirs['passkey']}; here without a press: passkey {row['passkey']}")
        same = [row["passkey_answers"].get(n) == theirs.get("passkey_answers", {}).get(n) for n in row["passkey"]]
        lines.append(f"  the same passkey answers as the Pareto teacher: {all(same)}")
    return "\n".join(lines)


# ----- output -----------------------------------------------------------------------------------------------
def _row_cells(name: str, row: dict[str, Any], lengths: list[str], base: float | None) -> list[str]:
    kept = "all" if row["kept_tokens"] is None else f"{row['kept_tokens']:,}"
    mib = "all" if row["cache_mib"] is None else f"{row['cache_mib']:.2f}"
    cells = [row["press"] or name, ", ".join(row["budget_of"]) or "-", kept, mib]
    if "error" in row:
        error = row["error"].splitlines()[0]
        return cells + [f"could not run: {error[:150]}"] + [""] * len(lengths)
    cells += [f"{100 * row['passkey'][n]:.0f}%" for n in lengths]
    ratio = row["continuation_perplexity"] / base if base else float("nan")
    return cells + [f"{ratio:.3f}"]


def render_markdown(results: dict[str, Any]) -> str:
    """The table: each press at each budget, the teacher without a press first."""
    settings, rows = results["settings"], results["rows"]
    lengths = [str(n) for n in settings["passkey_lengths"]]
    base = rows.get(NO_PRESS, {}).get("continuation_perplexity")
    head = (["press", "budget of", "kept tokens", "cache MiB"] + [f"passkey {n}" for n in lengths]
            + [f"ppl x no press ({settings['ppl_context']}+{settings['ppl_continuation']})"])
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    order = sorted(rows.items(), key=lambda item: (item[1]["kept_tokens"] is not None, -(item[1]["kept_tokens"] or 0),
                                                   PRESSES.index(item[1]["press"]) if item[1]["press"] else -1))
    lines += ["| " + " | ".join(_row_cells(name, row, lengths, base)) + " |" for name, row in order]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(results.get("worker_versions", {}).items()))
    lines += ["", f"Presses run with {versions}; teacher KV {results['bytes_per_token']:,} bytes per token (fp32)."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="embedded", help="embedded (SmolLM2) or gemma3-270m")
    parser.add_argument("--bytes", type=float, nargs="*", default=[], metavar="MIB", help="cache budgets, MiB")
    parser.add_argument("--pareto", default=None, metavar="JSON", help="take the students' cache MiB as budgets")
    parser.add_argument("--students", nargs="*", default=None, metavar="NAME", help="only these --pareto rows")
    parser.add_argument("--probe", default="passkey", choices=("passkey", "needles"),
                        help="passkey and perplexity (the Pareto table's probes), or natural-text needles "
                        "(benchmarks/kv_needles.py)")
    parser.add_argument("--presses", nargs="+", default=None, choices=PRESSES,
                        help="default: all of them (passkey), all but DuoAttention (needles)")
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--passkey-trials", type=int, default=6)
    parser.add_argument("--passkey-drawn-before", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="lengths the compared probe measured before --passkey-lengths (their keys are drawn "
                             "and dropped, so the keys match it; e.g. 1024 to measure only the Pareto table's 4096)")
    parser.add_argument("--ppl-context", type=int, default=1024)
    parser.add_argument("--ppl-continuation", type=int, default=256)
    parser.add_argument("--ppl-blocks", type=int, default=4)
    parser.add_argument("--heldout-tokens", type=int, default=4096, help="the Pareto table's perplexity tokens")
    parser.add_argument("--block-size", type=int, default=512, help="the Pareto table's perplexity blocks")
    needles = parser.add_argument_group("--probe needles")
    needles.add_argument("--recall", type=Path, default=None, metavar="JSON",
                         help="take the constant-memory rows of a natural_recall.py results file as budgets")
    needles.add_argument("--tasks", nargs="+", default=["single_number"], choices=NEEDLE_TASKS)
    needles.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    needles.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    needles.add_argument("--prompts", type=int, default=20, help="prompts per (task, haystack, length) cell")
    needles.add_argument("--seed", type=int, default=0)
    needles.add_argument("--modes", nargs="+", default=["question-agnostic", "question-aware"],
                         choices=("question-agnostic", "question-aware"))
    needles.add_argument("--cache-dtype", default=MODEL, choices=CACHE_DTYPES,
                         help="int8: every run holds its cache as int8 codes with a float32 scale per key and per "
                              "value, a budget buying about four times the tokens; int4: as int4 codes with a "
                              "float32 scale per 32 dimensions; int4g16: with a float16 scale per 16; k8v4g16: keys "
                              "as int8, values as int4g16 (kv_needles.py)")
    needles.add_argument("--verify", type=int, default=1, metavar="N",
                         help="the first N prompts of the first cell also run each press in a real prefill")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-kvpress")
    parser.add_argument("--setup", action="store_true", help="(re)build the presses' environment first")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "kv_compression",
                        help="where the saved teacher and the probe files go (one per --out, so runs with distinct "
                             "outputs can share it)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/kv_compression.json (kv_needles.json with --probe needles)")
    args = parser.parse_args(argv)
    default = "kv_needles.json" if args.probe == "needles" else "kv_compression.json"
    args.out = args.out or ROOT / "benchmarks" / "results" / default
    args.presses = args.presses or [p for p in PRESSES if args.probe == "passkey" or p != "DuoAttention"]
    return args


def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("teacher", "passkey_lengths", "passkey_trials", "ppl_context", "ppl_continuation", "ppl_blocks",
            "heldout_tokens", "block_size")
    drawn = {"passkey_drawn_before": args.passkey_drawn_before} if args.passkey_drawn_before else {}
    return {"corpus": CORPUS_SHA256, "pins": list(PINS)} | {key: getattr(args, key) for key in keys} | drawn


def start_results(args: argparse.Namespace) -> dict[str, Any]:
    """The results of this setting: the rows ``--out`` already holds for the same settings, none otherwise."""
    results: dict[str, Any] = {"settings": settings(args), "rows": {}}
    if args.out.is_file():
        earlier = json.loads(args.out.read_text())
        if earlier.get("settings") == results["settings"]:
            results.update(rows=earlier.get("rows", {}), worker_versions=earlier.get("worker_versions", {}))
    return results | {"benchmark": "kv_compression", "provenance": provenance(["python", *sys.argv])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pareto = json.loads(Path(args.pareto).read_text()) if args.pareto else None
    python = ensure_env(args.venv, args.setup)
    if args.probe == "needles":
        import kv_needles  # imports this module: imported here, not at the top

        return kv_needles.run(args, python)
    if not args.bytes and pareto is None:
        if args.setup:
            return 0
        raise SystemExit("kv_compression.py: give budgets with --bytes MIB ... or --pareto JSON")
    results = start_results(args)
    teacher, tokenizer = load_teacher(args.teacher)
    if "sliding_attention" in (getattr(teacher.config, "layer_types", None) or []):
        raise SystemExit(f"--teacher {args.teacher} has sliding-window layers: only --probe needles presses "
                         "their full-attention layers apart from them")
    per_token = bytes_per_token(teacher)
    kept = budgets(args.bytes, pareto, args.students, per_token)
    cases = passkey_cases(tokenizer, args.passkey_lengths, args.passkey_trials,
                          drawn_before=args.passkey_drawn_before)
    lengths = sorted({len(c["context_ids"]) for c in cases} | {args.ppl_context})
    for tokens in [t for t in kept if t >= max(lengths)]:
        print(f"{', '.join(kept.pop(tokens))}: {tokens} tokens hold every context here, nothing to compress")
    _, heldout = load_splits()
    ppl = perplexity_probes(tokenizer, heldout, args)
    runs = [run for run in plan_runs(args.presses, kept, lengths) if run["name"] not in results["rows"]]
    results.update(bytes_per_token=per_token, teacher_perplexity=perplexity(
        teacher.eval(), torch.tensor(ppl["blocks"]), batch_size=2))
    args.work.mkdir(parents=True, exist_ok=True)
    probes = args.work / f"probes-{args.out.stem}.json"  # runs with distinct outputs run side by side
    write_probes(probes, save_teacher(teacher, tokenizer, args.work / args.teacher), cases, ppl, runs)
    del teacher
    args.out.parent.mkdir(parents=True, exist_ok=True)
    by_name = {run["name"]: run for run in runs}
    for record in worker_lines(python, probes, args.threads) if runs else []:
        if "versions" in record:
            results["worker_versions"] = record["versions"]
            continue
        results["rows"][record["name"]] = row = score(record, by_name[record["name"]], cases, per_token)
        write_json(args.out, results)
        print(f"{record['name']}: {row.get('error') or row['passkey']} ({row['seconds']:.0f} s)", flush=True)
    results["sanity"] = sanity(results, pareto)
    write_json(args.out, results)
    print(render_markdown(results))
    print(results["sanity"])
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
