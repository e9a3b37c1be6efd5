"""State size against quality against recall: the Pareto table of docs/conversion.md, every figure measured here.

For the teacher, training-free swaps of its attention (``--swap NAME=SPEC``) and converted checkpoints
(``--converted DIR``, a ``hf-recattn convert`` output folder or its ``model/``), on the same tokens:

* cache per sequence at ``--context`` tokens (MiB, fp32: every state element counted at 4 bytes; in a bf16 model
  keys, values and windows halve while accumulating states stay fp32) and its share of the teacher's KV cache,
* held-out perplexity on the embedded corpus (the split ``hf-recattn convert`` evaluates on) and on
  ``--ood`` text (default: the corpus's license texts), as ratios to the teacher,
* passkey retrieval (``--passkey-lengths``, keys at depths 0.1 / 0.5 / 0.9) and associative recall
  (``--recall-lengths``, 1 / 4 / 16 planted pairs, teacher-forced).

Results go to ``--out`` (JSON, rewritten after every model; a rerun with the same settings skips the models
already measured), a markdown table is printed, and ``--plot`` draws cache size against perplexity ratio and
recall (matplotlib; benchmarks/pareto_plot.py). ``--plot-only RESULTS --plot PNG`` draws a result file again
without measuring.

    nice python benchmarks/pareto.py --threads 2 \\
        --swap 'window-64+4-sinks={"mixer": "hybrid", "window": 64, "far": "none", "sink_tokens": 4}' \\
        --converted runs/hybrid-w64-sink4-hedgehog \\
        --out benchmarks/results/pareto_cpu.json --plot docs/pareto.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from convert_smollm2 import ood_blocks
from pareto_plot import plot

from hf_recattn import from_teacher
from hf_recattn.atomic import write_json
from hf_recattn.conversion.from_teacher import recattn_config_from
from hf_recattn.conversion.recipe import report_training_tokens
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_splits, token_blocks
from hf_recattn.data.pinned import CORPUS_SHA256
from hf_recattn.evaluation import passkey_probe, perplexity
from hf_recattn.evaluation.recall import associative_recall_probe
from hf_recattn.modeling.configuration import RecAttnConfig
from hf_recattn.modeling.modeling import RecAttnForCausalLM
from hf_recattn.provenance import provenance
from hf_recattn.state_size import state_bytes, state_size_report
from hf_recattn.training.forms import fastest_forms

BYTES_PER_ELEMENT = 4


# ----- the models -------------------------------------------------------------------------------------------
def parse_swap(text: str, option: str = "--swap", extra_keys: frozenset[str] = frozenset()
               ) -> tuple[str, dict[str, Any]]:
    """``NAME=SPEC``: SPEC is an attention spec as JSON, or ``{"attention": ..., "attention_overrides": ...}``
    (and ``extra_keys``, which ``option`` takes besides: they are left in the returned mapping)."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"{option} {text!r}: expected NAME=SPEC (SPEC a JSON attention spec)")
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as err:
        raise SystemExit(f"{option} {name}: SPEC is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise SystemExit(f"{option} {name}: SPEC must be a JSON object")
    if "attention" not in value:
        extras = {key: value.pop(key) for key in extra_keys if key in value}
        value = {"attention": value, **extras}
    unknown = set(value) - {"attention", "attention_overrides", *extra_keys}
    if unknown:
        raise SystemExit(f"{option} {name}: unknown keys {sorted(unknown)}")
    return name, value


def converted_folder(path: str) -> tuple[str, Path, dict[str, Any]]:
    """(name, model folder, facts from the run) for a convert output folder or a model folder."""
    folder = Path(path)
    model_dir = folder / "model" if (folder / "model" / "config.json").is_file() else folder
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--converted {path}: neither it nor its model/ holds a config.json")
    run_file = model_dir.parent / "run.json"
    recipe_file = model_dir.parent / "recipe.json"
    facts: dict[str, Any] = {"folder": str(folder)}
    name = folder.name
    if run_file.is_file() and recipe_file.is_file():
        run, recipe = json.loads(run_file.read_text()), json.loads(recipe_file.read_text())
        name = f"{run['recipe']} ({run['budget']})"
        report_file = model_dir.parent / "report.json"
        report = json.loads(report_file.read_text()) if report_file.is_file() else {}
        facts["training_tokens"] = report_training_tokens(report, recipe)
        facts["recipe"] = run["recipe"]
    return name, model_dir, facts


def cache_mib(config: RecAttnConfig, context: int) -> float:
    """Every layer's cache per sequence at ``context`` tokens, MiB at BYTES_PER_ELEMENT."""
    return state_bytes(state_size_report(config, context), BYTES_PER_ELEMENT) / 2**20


# ----- measuring --------------------------------------------------------------------------------------------
def measure(model: torch.nn.Module, tokenizer: Any, evals: dict[str, torch.Tensor], recall_texts: list[str],
            args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {}
    t0 = time.perf_counter()
    recurrent = isinstance(model, RecAttnForCausalLM)
    for name, blocks in evals.items():
        with fastest_forms(model, blocks.shape[1]) if recurrent else contextlib.nullcontext():
            row[f"perplexity_{name}"] = perplexity(model, blocks, batch_size=2)
    passkey = passkey_probe(model, tokenizer, args.passkey_lengths, trials=args.passkey_trials)
    row["passkey"] = passkey["accuracy"]
    row["passkey_answers"] = {k: [a["answer"] for a in v] for k, v in passkey["answers"].items()}
    recall = associative_recall_probe(model, tokenizer, recall_texts, args.recall_lengths, trials=args.recall_trials)
    row["associative_recall"] = recall["accuracy"]
    row["associative_recall_mean"] = recall["mean_accuracy"]
    row["seconds"] = time.perf_counter() - t0
    return row


def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("context", "heldout_tokens", "ood", "ood_tokens", "block_size", "passkey_lengths", "passkey_trials",
            "recall_lengths", "recall_trials")
    return {"corpus": CORPUS_SHA256} | {key: getattr(args, key) for key in keys}


# ----- output -----------------------------------------------------------------------------------------------
def _by_pairs(cells: dict[str, float]) -> list[tuple[str, float]]:
    """A recall row's cells in the order of their pair counts (the JSON file keeps its keys sorted as text)."""
    return sorted(cells.items(), key=lambda cell: int(cell[0]))


def _ppl_cell(row: dict[str, Any], teacher: dict[str, Any], e: str) -> str:
    if "perplexity_ratio" in row:  # a peer row: its own measure, as a ratio to the teacher
        ratio = row["perplexity_ratio"].get(e)
        return "-" if ratio is None else f"{ratio:.3f}"
    return f"{row[f'perplexity_{e}'] / teacher[f'perplexity_{e}']:.3f}"


def _passkey_cell(row: dict[str, Any], n: str) -> str:
    if n not in row["passkey"] and "perplexity_ratio" in row:  # a peer row measured at other lengths
        return "-"
    return f"{100 * row['passkey'].get(n, float('nan')):.0f}%"


def _recall_cell(row: dict[str, Any], n: str) -> str:
    if "associative_recall" not in row:
        return "-"
    return "/".join(f"{100 * v:.0f}" for _, v in _by_pairs(row["associative_recall"].get(n, {}))) + "%"


def table(results: dict[str, Any], peers: dict[str, dict[str, Any]] | None = None) -> str:
    """The markdown table; ``peers`` (``peer_rows``) join the models in the order of their cache size."""
    rows = results["models"]
    teacher = rows["teacher"]
    evals = [k.removeprefix("perplexity_") for k in teacher if k.startswith("perplexity_")]
    passkey_lengths = sorted(teacher["passkey"], key=int)
    recall_lengths = sorted(teacher["associative_recall"], key=int)
    first = teacher["associative_recall"][recall_lengths[0]] if recall_lengths else {}
    pairs = "/".join(n for n, _ in _by_pairs(first))
    head = (["model", f"cache MiB @{results['settings']['context']}", "x teacher KV"]
            + [f"ppl x teacher ({e})" for e in evals] + [f"passkey {n}" for n in passkey_lengths]
            + [f"recall {n} ({pairs} pairs)" for n in recall_lengths] + ["training tokens"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, row in sorted({**rows, **(peers or {})}.items(), key=lambda item: -item[1]["cache_mib"]):
        cells = [name, f"{row['cache_mib']:.2f}", f"{row['cache_mib'] / teacher['cache_mib']:.3f}"]
        cells += [_ppl_cell(row, teacher, e) for e in evals]
        cells += [_passkey_cell(row, n) for n in passkey_lengths]
        cells += [_recall_cell(row, n) for n in recall_lengths]
        cells.append(f"{row['training_tokens']:,}" if row.get("training_tokens") is not None else "0")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_rows(paths: list[str]) -> dict[str, dict[str, Any]]:
    """Rows of other methods measured on the same probes: every press that ran in ``kv_compression.py`` result
    files, with its cache MiB, passkey accuracy and its perplexity ratio (a continuation of a compressed held-out
    context against the teacher without a press) under in-distribution. A press at one budget in several files
    (e.g. passkey lengths measured apart) is one row with every length."""
    peers: dict[str, dict[str, Any]] = {}
    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise SystemExit(f"--peers {path}: no such file")
        results = json.loads(file.read_text())
        if results.get("benchmark") != "kv_compression":
            raise SystemExit(f"--peers {path}: not a benchmarks/kv_compression.py results file")
        rows = results["rows"]
        base = rows.get("teacher (no press)", {}).get("continuation_perplexity")
        for row in rows.values():
            if row.get("press") is None or "error" in row:
                continue
            ratio = {"in-distribution": row["continuation_perplexity"] / base} if base else {}
            name = f"{row['press']} {row['kept_tokens']} tokens (kvpress)"
            if name in peers:  # the same press and budget in another file (e.g. other passkey lengths): one row
                earlier = peers[name]["perplexity_ratio"].get("in-distribution")
                if earlier and ratio and abs(ratio["in-distribution"] / earlier - 1) > 1e-6:
                    raise SystemExit(f"--peers {path}: {name} has another perplexity ratio than in an earlier "
                                     f"file ({ratio} against {peers[name]['perplexity_ratio']})")
                peers[name]["passkey"] = {**peers[name]["passkey"], **row["passkey"]}
                peers[name]["perplexity_ratio"] = peers[name]["perplexity_ratio"] or ratio
                continue
            peers[name] = {"cache_mib": row["cache_mib"], "passkey": dict(row["passkey"]),
                           "perplexity_ratio": ratio, "training_tokens": 0}
    return peers


render_markdown = table


def merge(paths: list[str], out: Path, plot_path: str | None, peers: dict[str, dict[str, Any]] | None = None) -> int:
    """One result file from parts measured in several processes with the same settings; the provenance of the
    part holding the teacher, with the parts' commands (a merged file among the parts brings its own list)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    if any(part["settings"] != parts[0]["settings"] for part in parts):
        raise SystemExit("pareto.py --merge: the files were measured with different settings")
    holders = [part for part in parts if "teacher" in part["models"]]
    if not holders:
        raise SystemExit("pareto.py --merge: no file holds the teacher's row")
    results = {**holders[0], "models": {name: row for part in parts for name, row in part["models"].items()}}
    # a file merged before keeps the commands of its own parts
    results["parts"] = [command for part in parts for command in part.get("parts", [part["provenance"]["command"]])]
    write_json(out, results)
    print(table(results, peers))
    if plot_path:
        print(plot(results, plot_path, peers))
    return 0


def plot_only(path: Path, plot_path: str | None, peers: dict[str, dict[str, Any]] | None) -> int:
    """The table and the figure of a result file, measuring nothing."""
    if not path.is_file():
        raise SystemExit(f"--plot-only {path}: no such file")
    if not plot_path:
        raise SystemExit("--plot-only: name the figure with --plot PNG")
    results = json.loads(path.read_text())
    if results.get("benchmark") != "pareto" or "teacher" not in results.get("models", {}):
        raise SystemExit(f"--plot-only {path}: not a benchmarks/pareto.py result file with the teacher's row")
    print(table(results, peers))
    print(plot(results, plot_path, peers))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--swap", nargs="*", default=[], metavar="NAME=SPEC",
                        help="training-free variants: the teacher's weights with this attention")
    parser.add_argument("--converted", nargs="*", default=[], metavar="DIR", help="converted checkpoints")
    parser.add_argument("--context", type=int, default=8192, help="context of the cache-size column")
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--ood", nargs="*", default=["embedded"], metavar="FILE",
                        help="out-of-distribution text: 'embedded' (the corpus's license texts, default) or files")
    parser.add_argument("--ood-tokens", type=int, default=4096)
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--passkey-trials", type=int, default=6)
    parser.add_argument("--recall-lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--recall-trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/pareto.json")
    parser.add_argument("--plot", default=None, metavar="PNG")
    parser.add_argument("--no-teacher", action="store_true",
                        help="measure only the swaps and checkpoints given (a part of a run split over processes)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="measure nothing: join result files of one setting (one holding the teacher) into --out")
    parser.add_argument("--plot-only", default=None, metavar="JSON",
                        help="measure nothing: the table and the --plot of this result file")
    parser.add_argument("--peers", nargs="+", default=None, metavar="JSON",
                        help="add the presses of benchmarks/kv_compression.py result files to the table and plot")
    return parser.parse_args(argv)


def start_results(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The results of this setting: the models ``out`` already holds for the same settings, none otherwise."""
    results: dict[str, Any] = {"settings": settings(args), "models": {}}
    if out.is_file():
        earlier = json.loads(out.read_text())
        if earlier.get("settings") == results["settings"]:
            results["models"] = earlier.get("models", {})
    results.update(benchmark="pareto", provenance=provenance(["python", *sys.argv]))
    return results


def measure_models(args: argparse.Namespace, results: dict[str, Any], out: Path, swaps: dict[str, dict[str, Any]],
                   converted: list[tuple[str, Path, dict[str, Any]]]) -> None:
    """Measure the teacher (unless ``--no-teacher``), the swaps and the converted checkpoints not measured yet,
    rewriting ``out`` after each."""
    teacher, tokenizer = load_teacher(args.teacher)
    teacher.requires_grad_(False)
    _, heldout_texts = load_splits()
    evals = {"in-distribution": token_blocks(tokenizer, heldout_texts, args.block_size,
                                             max_tokens=args.heldout_tokens, seed=0)}
    if args.ood:
        evals["out-of-distribution"] = ood_blocks(args.ood, tokenizer, args.block_size, args.ood_tokens)

    def record(name: str, model: torch.nn.Module, config: RecAttnConfig, facts: dict[str, Any]) -> None:
        if name in results["models"]:
            print(f"{name}: measured earlier", flush=True)
            return
        grows = cache_mib(config, 2 * args.context) > cache_mib(config, args.context)
        row = {"cache_mib": cache_mib(config, args.context), "cache_grows": grows, **facts}
        row.update(measure(model.eval(), tokenizer, evals, heldout_texts, args))
        results["models"][name] = row
        write_json(out, results)
        ppl = ", ".join(f"{k.removeprefix('perplexity_')} {v:.2f}" for k, v in row.items() if k.startswith("perp"))
        print(f"{name}: cache {row['cache_mib']:.2f} MiB, {ppl}, passkey {row['passkey']}, "
              f"recall {row['associative_recall_mean']:.2f} ({row['seconds']:.0f} s)", flush=True)

    if not args.no_teacher:
        record("teacher", teacher, recattn_config_from(teacher.config, {"mixer": "softmax"}), {"training_tokens": 0})
    for name, swap in swaps.items():
        student = from_teacher(teacher, swap["attention"], swap.get("attention_overrides"))
        record(name, student, student.config, {"training_tokens": 0, "attention": swap})
        del student
    for name, model_dir, facts in converted:
        student = RecAttnForCausalLM.from_pretrained(model_dir)
        record(name, student, student.config, facts)
        del student


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers = peer_rows(args.peers) if args.peers else None
    if args.plot_only:
        return plot_only(Path(args.plot_only), args.plot, peers)
    if args.merge:
        return merge(args.merge, Path(args.out), args.plot, peers)
    swaps = dict(parse_swap(s) for s in args.swap)
    converted = [converted_folder(path) for path in args.converted]
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = start_results(args, out)
    measure_models(args, results, out, swaps, converted)
    write_json(out, results)  # this command, even when every model was measured earlier
    if "teacher" not in results["models"]:  # a part of a split run: the table needs the teacher's row
        print(f"results: {out} (join the parts with --merge for the table)")
        return 0
    print(table(results, peers))
    if args.plot:
        print(plot(results, args.plot, peers))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
