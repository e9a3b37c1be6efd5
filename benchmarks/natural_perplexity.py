"""Perplexity where memory matters: the rows of benchmarks/natural_recall.py (the teacher, the untrained window of 512
tokens + 4 sinks, training-free swaps, converted checkpoints) on short and long blocks of held-out text of both
kinds, side by side with the ratio to the teacher.

Blocks come from ``long_blocks`` (consecutive tokens of one document each; documents shorter than a block joined
with EOS only when the long ones run out): the embedded corpus's held-out manuals (``heldout``) and its license
texts (``ood``), the same blocks for every row. Results go to ``--out`` (rewritten after every model; a rerun with
the same settings skips the models already measured) and the table is printed.

    nice python benchmarks/natural_perplexity.py --threads 2 --converted runs/retrieval9-w96-sink4 \\
        --out benchmarks/results/natural_perplexity_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import torch
from natural_recall import add_row_arguments, measure_rows, measured_elsewhere, run_settings
from results_file import add_out_argument

from hf_recattn.data.corpus import embedded_texts
from hf_recattn.evaluation.heldout import long_rows, perplexity
from hf_recattn.evaluation.needles import NEEDLE_HAYSTACKS
from hf_recattn.modeling.modeling import RecAttnForCausalLM
from hf_recattn.training.forms import fastest_forms

NOTES = ["Perplexity over every predicted token of the blocks (the same blocks for every row); x teacher: the row's "
         "perplexity over the teacher's on the same blocks. heldout: the embedded corpus's held-out manuals; ood: "
         "its license texts, which no recipe trains on."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="block lengths")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per (haystack, length): blocks = tokens / "
                        "length")
    parser.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    add_out_argument(parser, "natural_perplexity.json")
    return parser.parse_args(argv)


def block_sets(tokenizer: Any, args: argparse.Namespace) -> dict[str, dict[str, torch.Tensor]]:
    """haystack -> length -> [n, length] blocks."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in args.haystacks:
        texts = embedded_texts(name)
        out[name] = {}
        for length in args.lengths:
            blocks, _ = long_rows(tokenizer, texts, length, max(1, args.tokens // length), join=True)
            if blocks.numel() == 0:
                raise SystemExit(f"{name}: no {length}-token block in its documents")
            out[name][str(length)] = blocks
    return out


def measure(model: torch.nn.Module, blocks: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    start = time.perf_counter()
    cells: dict[str, dict[str, float]] = {}
    recurrent = isinstance(model, RecAttnForCausalLM)
    for name, by_length in blocks.items():
        cells[name] = {}
        for length, rows in by_length.items():
            forms = fastest_forms(model, rows.shape[1]) if recurrent else contextlib.nullcontext()
            with forms, torch.no_grad():
                cells[name][length] = perplexity(model.eval(), rows, batch_size=1)
    return {"perplexity": cells, "blocks": {n: {k: int(v.shape[0]) for k, v in b.items()} for n, b in blocks.items()},
            "seconds": time.perf_counter() - start}


def render_markdown(results: dict[str, Any]) -> str:
    rows = results["models"]
    teacher = rows.get("teacher", {}).get("perplexity", {})
    columns = [(name, length) for name in results["settings"]["haystacks"] for length in map(str, results["settings"]
                                                                                                ["lengths"])]
    head = "| model | " + " | ".join(f"{n} {length}" for n, length in columns) + " |"
    lines = [head, "|---|" + "---:|" * len(columns)]
    for model, row in sorted(rows.items(), key=lambda item: item[0] != "teacher"):  # the teacher first
        cells = []
        for name, length in columns:
            value = row["perplexity"][name][length]
            base = teacher.get(name, {}).get(length)
            ratio = f" ({value / base:.3f}x)" if base and model != "teacher" else ""
            cells.append(f"{value:.2f}{ratio}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    blocks = next(iter(rows.values()))["blocks"] if rows else {}
    counts = ", ".join(f"{n}: " + " / ".join(f"{v} x {k}" for k, v in b.items()) for n, b in blocks.items())
    elsewhere = measured_elsewhere(results)
    return ("\n".join(lines) + f"\n\nBlocks: {counts}. " + " ".join(results.get("notes", [])) + "\n"
            + (f"\n{elsewhere}\n" if elsewhere else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    blocks: dict[str, dict[str, torch.Tensor]] = {}

    def measure_row(name: str, model: torch.nn.Module, config: Any, tokenizer: Any) -> dict[str, Any]:
        if not blocks:  # the same blocks for every row, cut once
            blocks.update(block_sets(tokenizer, args))
        return measure(model, blocks)

    kept_by = run_settings(args, "teacher", "lengths", "tokens", "haystacks")
    results = measure_rows(args, "natural_perplexity", kept_by, NOTES, measure_row, "perplexity")
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
