"""Next-token loss against position in long blocks: what a model loses when its memory is a window.

For the teacher (``--teacher``), its untrained windows with attention sinks (``--windows``: every layer
``{"mixer": "hybrid", "window": W, "far": "none", "sink_tokens": --sinks}`` through ``from_teacher``, on the
teacher's weights) and students given as checkpoint folders (``--student NAME=PATH``: a ``hf-recattn convert``
output folder or its ``model/``), on the same ``--blocks`` blocks of ``--length`` tokens of each kind of
held-out text of the embedded corpus (``heldout``: its held-out files, one file per block; ``ood``: its license
texts, which no single text fills at 8,192 tokens, so whole texts are joined with the EOS token between two:
``hf_recattn.evaluation.heldout.long_blocks(..., join=True)``), it measures

* the mean next-token loss (nats) by position bucket (``--buckets``, by default 1-64, 64-256, ..., 4096-8192:
  the predicted token's position p in its block, start <= p < end),
* the perplexity of the blocks' first ``--prefix-lengths`` tokens (a causal model's loss there does not depend
  on the later tokens, so it is its perplexity on blocks of that length) and of the whole blocks,

and writes them with the run's provenance to ``--out``, rewritten after every model (a rerun with the same
settings skips the models measured), prints the table (``render_markdown``) and draws loss against position
(log x, power-of-two bins, one line per model, a panel per kind) to ``--plot`` (matplotlib).

    nice python benchmarks/loss_by_position.py --threads 2 --blocks 2 --plot docs/loss_by_position.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from results_file import add_out_argument, run_record, write_results

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.embedded import embedded_corpus
from hf_recattn.data.pinned import CORPUS_SHA256
from hf_recattn.evaluation.heldout import bucket_losses, long_rows, position_buckets, position_losses

KINDS = ("heldout", "ood")
KIND_NAMES = {"heldout": "held-out", "ood": "license texts (ood)"}
PLOT_FROM = 8  # the plot's loss axis spans the bins from this position on


# ----- arguments ----------------------------------------------------------------------------------------------
def parse_student(text: str) -> tuple[str, Path]:
    """``NAME=PATH``: a name for the table and a checkpoint folder (a convert output folder or its ``model/``)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--student {text!r}: expected NAME=PATH")
    folder = Path(path)
    model_dir = folder / "model" if (folder / "model" / "config.json").is_file() else folder
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--student {name}: neither {path} nor its model/ holds a config.json")
    return name, model_dir


def window_spec(window: int, sinks: int) -> dict[str, Any]:
    """The untrained baseline: the teacher's softmax over the last ``window`` tokens and the first ``sinks``."""
    return {"mixer": "hybrid", "window": window, "far": "none", "sink_tokens": sinks}


def window_name(window: int, sinks: int) -> str:
    return f"window {window} + {sinks} sinks"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--student", action="append", default=[], metavar="NAME=PATH",
                        help="a checkpoint folder to measure (repeat for more)")
    parser.add_argument("--windows", type=int, nargs="*", default=[512, 64],
                        help="untrained window + sinks baselines on the teacher's weights (none: no baseline)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--length", type=int, default=8192, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per kind")
    parser.add_argument("--buckets", type=int, nargs="+", default=None,
                        help="bucket edges (default: 1, 64, 256, ... up to --length)")
    parser.add_argument("--prefix-lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--plot", default=None, metavar="PNG")
    parser.add_argument("--plot-only", action="store_true", help="measure nothing: table and --plot of --out")
    add_out_argument(parser, "loss_by_position_cpu.json")
    args = parser.parse_args(argv)
    args.students = [parse_student(text) for text in args.student]
    args.buckets = list(position_buckets(args.length) if args.buckets is None else args.buckets)
    args.prefix_lengths = sorted({*args.prefix_lengths, args.length})
    if args.length < 2 or args.blocks < 1 or args.sinks < 0 or any(w < 1 for w in args.windows):
        raise SystemExit("--length >= 2, --blocks >= 1, --sinks >= 0 and --windows >= 1, please")
    if args.prefix_lengths[0] < 2 or args.prefix_lengths[-1] > args.length:
        raise SystemExit(f"--prefix-lengths must lie in 2..{args.length}, got {args.prefix_lengths}")
    if args.buckets[0] < 1 or args.buckets[-1] > args.length or args.buckets != sorted(set(args.buckets)):
        raise SystemExit(f"--buckets must be increasing edges in 1..{args.length}, got {args.buckets}")
    return args


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs' rows comparable (a rerun with other settings starts again)."""
    return {"teacher": args.teacher, "corpus": CORPUS_SHA256, "kinds": list(args.kinds), "length": args.length,
            "blocks": args.blocks, "buckets": args.buckets, "prefix_lengths": args.prefix_lengths}


# ----- measuring ----------------------------------------------------------------------------------------------
def texts_blocks(tokenizer: Any, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The blocks of each kind and how they were made (blocks, joined, documents, and in each joined block the
    positions where a text starts after the EOS token: ``starts``)."""
    corpus = embedded_corpus()
    blocks, made = {}, {}
    for kind in args.kinds:
        files = corpus.files(kind)
        rows, joined = long_rows(tokenizer, files, args.length, args.blocks, join=True)
        if rows.shape[0] == 0:
            raise SystemExit(f"the {kind} split holds fewer than {args.length} tokens, even joined")
        blocks[kind] = rows
        starts = [[p + 1 for p in (row[:-1] == tokenizer.eos_token_id).nonzero()[:, 0].tolist()]
                  for row in rows[rows.shape[0] - joined :]]
        made[kind] = {"blocks": int(rows.shape[0]), "joined": joined, "documents": len(files), "starts": starts}
    return blocks, made


def summarize(losses: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """The table's buckets, the plot's power-of-two curve and the perplexity of each prefix length."""
    wide = losses.double()
    return {
        "buckets": bucket_losses(losses, args.buckets),
        "curve": bucket_losses(losses, position_buckets(args.length, first=2, factor=2)),
        "perplexity": {str(n): math.exp(float(wide[:, : n - 1].mean())) for n in args.prefix_lengths},
    }


def measure(model: torch.nn.Module, name: str, blocks: dict[str, torch.Tensor],
            args: argparse.Namespace) -> dict[str, Any]:
    """One model's row: ``summarize`` of each kind's position losses, and the seconds they took."""
    row: dict[str, Any] = {}
    for kind, rows in blocks.items():
        began = time.perf_counter()
        losses = position_losses(model.eval(), rows, batch_size=1, progress=f"{name} {kind}")
        row[kind] = {**summarize(losses, args), "seconds": time.perf_counter() - began}
        ppl = ", ".join(f"{n}: {v:.2f}" for n, v in row[kind]["perplexity"].items())
        print(f"{name} {kind}: perplexity {ppl} ({row[kind]['seconds']:.0f} s)", flush=True)
    return row


def models_to_measure(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, how to build it) in the table's order: the teacher, the windows, the students."""
    plan: list[tuple[str, dict[str, Any]]] = [("teacher", {"kind": "teacher"})]
    plan += [(window_name(w, args.sinks), {"kind": "window", "attention": window_spec(w, args.sinks)})
             for w in args.windows]
    plan += [(name, {"kind": "student", "folder": str(path)}) for name, path in args.students]
    return plan


def measure_all(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Measure every model not yet in ``results``, rewriting ``args.out`` after each."""
    from hf_recattn.modeling.modeling import RecAttnForCausalLM

    teacher, tokenizer = load_teacher(args.teacher)
    teacher.requires_grad_(False)
    blocks, results["texts"] = texts_blocks(tokenizer, args)
    plan = models_to_measure(args)
    results["order"] = [name for name, _ in plan] + [n for n in results["models"] if n not in dict(plan)]
    for name, how in plan:
        if name in results["models"]:
            print(f"{name}: measured earlier", flush=True)
            continue
        if how["kind"] == "teacher":
            model = teacher
        elif how["kind"] == "window":
            model = from_teacher(teacher, how["attention"])
        else:
            model = RecAttnForCausalLM.from_pretrained(how["folder"])
        results["models"][name] = {**how, **measure(model, name, blocks, args)}
        write_results(args.out, "loss_by_position", results["provenance"], _data(results))
        del model


def _data(results: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in results.items() if key not in ("benchmark", "provenance")}


# ----- output -------------------------------------------------------------------------------------------------
def ordered(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The models in the order measured (the JSON file keeps its keys sorted)."""
    return [(name, results["models"][name]) for name in results.get("order", results["models"])]


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def render_markdown(results: dict[str, Any]) -> str:
    """One row per model and kind: mean loss by position bucket, then perplexity at each prefix length; notes."""
    s = results["settings"]
    edges = s["buckets"]
    head = ["model", "text"] + [f"loss {_short(a)}-{_short(b)}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    head += [f"ppl @ {n:,}" for n in s["prefix_lengths"]]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for name, row in ordered(results):
        for kind in s["kinds"]:
            cells = [name, KIND_NAMES[kind]] + [f"{b['loss']:.3f}" for b in row[kind]["buckets"]]
            cells += [f"{row[kind]['perplexity'][str(n)]:.2f}" for n in s["prefix_lengths"]]
            lines.append("| " + " | ".join(cells) + " |")
    for note in results["notes"]:
        lines += ["", note]
    return "\n".join(lines)


def _made(kind: str, made: dict[str, Any]) -> str:
    """How one kind's blocks were made, in words."""
    single = made["blocks"] - made["joined"]
    parts = [f"{single} of one file each"] if single else []
    if made["joined"]:
        parts.append(f"{made['joined']} cut from the files too short for a block, joined whole with the EOS token "
                     "between two")
    return f"{kind} ({made['documents']} files): " + " and ".join(parts)


def _positions(positions: list[int]) -> str:
    words = [f"{p:,}" for p in positions]
    return ("positions " + ", ".join(words[:-1]) + " and " if len(words) > 1 else "position ") + words[-1]


def notes(results: dict[str, Any]) -> list[str]:
    """What the table's blocks are and how its columns are read."""
    s, made = results["settings"], results["texts"]
    texts = "; ".join(_made(KIND_NAMES[k], m) for k, m in made.items())
    starts = [f" In the {KIND_NAMES[k]}, joined block {i + 1}: a text starts at {_positions(block)}."
              for k, m in made.items() for i, block in enumerate(m.get("starts", [])) if block]
    return [
        f"Blocks of {s['length']:,} tokens: {texts}." + "".join(starts),
        "loss a-b: mean next-token loss (nats) of the tokens at positions a <= p < b of their block; ppl @ n: "
        "perplexity of the blocks' first n tokens.",
    ]


def plot(results: dict[str, Any], path: str) -> str:
    """Loss against position (log x), a panel per kind, a line per model; returns what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    kinds = results["settings"]["kinds"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), sharey=True, squeeze=False)
    shown: list[float] = []
    for ax, kind in zip(axes[0], kinds, strict=True):
        for name, row in ordered(results):
            curve = row[kind]["curve"]
            ax.plot([math.sqrt(b["start"] * b["end"]) for b in curve], [b["loss"] for b in curve], marker="o",
                    markersize=3, label=name)
            shown += [b["loss"] for b in curve if b["start"] >= PLOT_FROM]
        for block in results["texts"][kind].get("starts", []):
            for start in block:
                ax.axvline(start, color="gray", linestyle=":", linewidth=1)
        ticks = [4**k for k in range(1 + int(math.log(results["settings"]["length"], 4)))]
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [_short(t) for t in ticks])
        ax.set_xlabel("position in the block (log; bins of a power of two)")
        n = results["texts"][kind]["blocks"]
        ax.set_title(f"{KIND_NAMES[kind]}: {n} block{'s' if n > 1 else ''}", fontsize=10)
        ax.grid(alpha=0.3)
    if shown:  # the first positions' losses (one token per block each, no context) lie far above
        ax.set_ylim(min(shown) - 0.3, max(shown) + 0.3)
    note = f"positions below {PLOT_FROM} lie above the axis" + ("; dotted: a joined text starts" if any(
        results["texts"][k].get("starts") for k in kinds) else "")
    fig.suptitle(f"Next-token loss against position ({note})", fontsize=10)
    axes[0][0].set_ylabel("mean next-token loss (nats)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def start_results(args: argparse.Namespace) -> dict[str, Any]:
    """This setting's results: the models ``--out`` already holds for the same settings, none otherwise."""
    results: dict[str, Any] = {"benchmark": "loss_by_position", "provenance": run_record(),
                               "settings": settings(args), "models": {}}
    if args.out.is_file():
        earlier = json.loads(args.out.read_text())
        if earlier.get("settings") == results["settings"]:
            results["models"] = earlier.get("models", {})
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        results = json.loads(args.out.read_text())
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        results = start_results(args)
        results["notes"] = []
        measure_all(args, results)
        results["notes"] = notes(results)
        results = write_results(args.out, "loss_by_position", results["provenance"], _data(results))
    print(render_markdown(results))
    if args.plot:
        print(plot(results, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
