"""The needle probe (``hf_recattn.evaluation.needles``, docs/recall.md) on one or more models: recall of facts
planted in natural text, per task, haystack and length, with a Wilson 95% interval per cell.

Each ``--models`` spec (``embedded``, another teacher, a ``.gguf`` file, an hf_recattn checkpoint folder) is
loaded as ``hf-recattn eval`` loads it and measured on the same prompts (same ``--seed``, same tokenizer). The
haystacks are the embedded corpus's held-out split (``heldout``) and its license texts (``ood``).

    python benchmarks/needles.py --models embedded --tasks single_number multi_key --lengths 1024 --prompts 20 \\
        --threads 1 --out benchmarks/results/needles_smollm2_cpu.json

Past the teacher's context (docs/recall.md): ``--hybrid-options '{"distant_positions": "clamp"}'`` sets options on
every hybrid layer of an hf_recattn checkpoint (``modeling.hybrid_options``; the label names them), and
``--max-positions N`` raises a model's ``max_position_embeddings`` to N where it is lower, so that a teacher runs
past its context with its own rotary (changing nothing else for a rotary that does not read it, SmolLM2's).
``--hybrid-layers 0-10`` sets the options on those layers only (which layers' windows a task needs, say); runs
that differ only in it add their rows to the same file. ``--prefill-chunk 2048`` prefills a softmax teacher's prompt
2,048 tokens at a time through its cache: the same attention in exact arithmetic, and on Gemma 3 at 16k-32k tokens
its sliding-window layers attend over at most 2,559 keys a chunk instead of scoring the whole masked square.

    python benchmarks/needles.py --models runs/hybrid-w64-sink4-gdn-learned64-long/model --tasks single_number \
        --lengths 16384 32768 --prompts 2 --hybrid-options '{"distant_positions": "clamp"}' --threads 2 \
        --out benchmarks/results/needles_past_context_cpu.json

The results and their provenance go to ``--out`` (default ``benchmarks/results/needles_cpu.json``), rewritten after
every model; a rerun with the same settings skips the models measured before. ``scripts/render_docs.py`` renders
the docs' table from that file with ``render_markdown``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from results_file import add_out_argument, run_record, write_results

from hf_recattn.evaluation import (
    NEEDLE_HAYSTACKS,
    NEEDLE_LENGTHS,
    NEEDLE_PROMPTS,
    NEEDLE_TASKS,
    natural_haystacks,
    needle_probe,
)
from hf_recattn.modeling.hybrid_options import layer_ranges, parse_layers

NOTE = ("n counts the queries of a cell (multi_query asks 4 per prompt, multi_value one for all its values); "
        "the interval is Wilson's at 95%")


def _label(spec: str, options: dict[str, Any] | None = None, layers: list[int] | None = None) -> str:
    path = Path(spec)
    name = path.resolve().name if path.exists() else spec
    if name == "model" and path.exists():  # a conversion's output folder holds its model under model/
        name = path.resolve().parent.name
    where = f" on layers {layer_ranges(layers)}" if layers is not None else ""
    return name + "".join(f", {key}={value}" for key, value in (options or {}).items()) + where


def measure(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model's probe result (its answers included) and the seconds it took."""
    from hf_recattn.conversion.teacher import load_causal_lm

    model, tokenizer = load_causal_lm(spec)
    if args.hybrid_options:
        from hf_recattn.modeling.hybrid_options import with_hybrid_options

        model = with_hybrid_options(model, args.hybrid_options, args.hybrid_layers)
    if args.max_positions and model.config.max_position_embeddings < args.max_positions:
        model.config.max_position_embeddings = args.max_positions
    if args.prefill_chunk:
        if getattr(model.config, "model_type", None) == "recattn":
            raise ValueError(f"--prefill-chunk: {spec} is an hf_recattn checkpoint, which prefills in its own forms; "
                             "give it to softmax teachers only")
        model.generation_config.prefill_chunk_size = args.prefill_chunk
    start = time.perf_counter()
    result = needle_probe(model, tokenizer, natural_haystacks(args.haystacks), tasks=args.tasks,
                          lengths=args.lengths, prompts=args.prompts, seed=args.seed, depths=args.depths,
                          progress=None if args.no_progress else _label(spec, args.hybrid_options,
                                                                        args.hybrid_layers))
    return {**result, "seconds": round(time.perf_counter() - start, 1)}


def by_depth(rows: list[dict[str, Any]], depths: list[float], length: int) -> str:
    """A cell's answers per depth set with ``--depths``: ``0.95 (819 back): 2/2`` for each depth, the tokens back
    counted from the end of the context."""
    tally: dict[float, list[int]] = {}
    for t, row in enumerate(rows):
        counts = tally.setdefault(depths[t % len(depths)], [0, 0])
        counts[0] += sum(q["correct"] for q in row["queries"])
        counts[1] += len(row["queries"])
    return ", ".join(f"{d:g} ({round((1 - d) * length):,} back): {right}/{n}"
                     for d, (right, n) in sorted(tally.items(), reverse=True))


def render_markdown(results: dict[str, Any]) -> str:
    """One row per model, task, haystack and length: accuracy, its interval, n, prompts that repeated text and,
    with ``--depths``, the answers per depth."""
    depths = (results.get("settings") or {}).get("depths")
    lines = ["| model | task | haystack | tokens | accuracy | 95% interval | n | repeated text |"
             + (" by depth |" if depths else ""), "|---|---|---|---:|---:|---|---:|---:|" + ("---|" if depths else "")]
    for name, result in results["models"].items():
        for task, per_haystack in result["cells"].items():
            for haystack, per_length in per_haystack.items():
                for length, cell in per_length.items():
                    low, high = cell["interval"]
                    extra = (f" {by_depth(result['answers'][task][haystack][length], depths, int(length))} |"
                             if depths else "")
                    lines.append(f"| {name} | {task} | {haystack} | {length} | {cell['accuracy']:.0%} | "
                                 f"{low:.0%}-{high:.0%} | {cell['n']} | {cell['repeated']} |{extra}")
        if result["skipped"]:
            lines.append(f"| {name} | skipped | | {', '.join(map(str, result['skipped']))} | | | | |"
                         + (" |" if depths else ""))
    return "\n".join(lines) + "\n\n" + "\n".join(results["notes"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["embedded"], metavar="SPEC")
    parser.add_argument("--tasks", nargs="+", default=list(NEEDLE_TASKS), choices=NEEDLE_TASKS, metavar="TASK")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(NEEDLE_LENGTHS), metavar="TOKENS")
    parser.add_argument("--prompts", type=int, default=NEEDLE_PROMPTS, help="prompts per cell")
    parser.add_argument("--haystacks", nargs="+", default=list(NEEDLE_HAYSTACKS), choices=NEEDLE_HAYSTACKS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--hybrid-options", type=json.loads, default=None, metavar="JSON",
                        help="options set on every hybrid layer of an hf_recattn model, e.g. '{\"distant_positions\": "
                        "\"clamp\"}'")
    parser.add_argument("--hybrid-layers", nargs="+", default=None, metavar="LAYERS",
                        help="set --hybrid-options on these layers only: indices or inclusive ranges, e.g. 0-10 14")
    parser.add_argument("--max-positions", type=int, default=None, metavar="N",
                        help="raise each model's max_position_embeddings to N where it is lower")
    parser.add_argument("--depths", type=float, nargs="+", default=None, metavar="D",
                        help="prompt t's asked needle at depth D[t %% len(D)] (default: spread evenly); the table "
                        "then counts answers per depth")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prefill a softmax teacher's prompt N tokens at a time through its cache (generate's "
                        "prefill_chunk_size): the same attention, far less work for sliding-window layers at 16k+")
    add_out_argument(parser, "needles_cpu.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.hybrid_layers = parse_layers(args.hybrid_layers)
    except ValueError as err:
        parser.error(str(err))
    if args.hybrid_layers is not None and not args.hybrid_options:
        parser.error("--hybrid-layers needs --hybrid-options (the options to set on those layers)")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run_record()
    settings = {key: getattr(args, key) for key in ("tasks", "lengths", "prompts", "haystacks", "seed",
                                                   "hybrid_options", "max_positions")}
    if args.depths is not None:  # set later than the others: files measured without it keep their settings
        settings["depths"] = args.depths
    if args.prefill_chunk is not None:  # as above
        settings["prefill_chunk"] = args.prefill_chunk
    models: dict[str, Any] = {}
    if args.out.is_file():  # a rerun with the same settings keeps the models measured before it stopped
        earlier = json.loads(args.out.read_text())
        if earlier.get("settings") == settings:
            models = earlier.get("models", {})
    results: dict[str, Any] = {}
    for spec in args.models:
        label = _label(spec, args.hybrid_options, args.hybrid_layers)
        if label in models:
            print(f"{label}: measured earlier", flush=True)
            continue
        models[label] = measure(spec, args)
        if args.hybrid_layers is not None:  # a row per layer choice in one file: the label and the row name them
            models[label]["hybrid_layers"] = args.hybrid_layers
        results = write_results(args.out, "needles", record, {"settings": settings, "models": models,
                                                              "notes": [NOTE]})
    if not results:
        results = json.loads(args.out.read_text())
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
