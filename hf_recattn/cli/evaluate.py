"""``hf-recattn eval`` and ``hf-recattn generate``: evaluate a checkpoint (or run lm-evaluation-harness on it, see
``lm_eval.py``), stream a continuation through its cache."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..conversion.baselines import BASELINES, DEFAULT_BASELINES, baseline_models, check_baseline_names
from ..modeling.cache import cache_of
from .common import SubParsers, add_command

if TYPE_CHECKING:
    from ..evaluation import RecallSizes


def _label(spec: str) -> str:
    path = Path(spec)
    return path.resolve().name if path.exists() else spec


#: the ``hf-recattn eval`` options that set the recall probes, by RecallSizes field
RECALL_OPTIONS = ("passkey_lengths", "passkey_depths", "passkey_trials", "recall_lengths", "recall_pairs",
                  "recall_trials", "distances", "distance_trials", "long_lengths", "long_blocks", "needle_tasks",
                  "needle_lengths", "needle_prompts", "needle_haystacks", "needle_cells")


def recall_sizes(args: argparse.Namespace) -> RecallSizes:
    """The recall probes' sizes: ``--quick``'s or the full defaults, overridden by the options given; a bad
    value is a ValueError naming its option."""
    from ..evaluation import RecallSizes

    given = {name: tuple(value) if isinstance(value, list) else value
             for name in RECALL_OPTIONS if (value := getattr(args, name, None)) is not None}
    try:
        return dataclasses.replace(RecallSizes.for_mode(bool(args.quick)), **given)
    except ValueError as err:
        field = str(err).split(" ", 1)[0]
        if field not in RECALL_OPTIONS:
            raise
        raise ValueError(f"--{field.replace('_', '-')}: {err}") from None


def hybrid_options(pairs: list[str] | None) -> dict[str, Any]:
    """``--hybrid-option KEY=VALUE`` pairs as a dict, each VALUE read as JSON (else kept as a string); a pair
    without ``=`` is a ValueError naming the option."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--hybrid-option: expected KEY=VALUE (e.g. cache_slots=64), got {pair!r}")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def load_evaluated(spec: str, options: dict[str, Any],
                   layers: list[int] | None = None) -> tuple[Any, Any, str]:
    """The model to evaluate, its tokenizer and its row label: ``spec`` loaded, its hybrid layers (those among
    ``layers`` when given) given ``options`` (same weights; the label then names them)."""
    from ..conversion.teacher import load_causal_lm
    from ..modeling.hybrid_options import layer_ranges, with_hybrid_options

    if layers is not None and not options:
        raise ValueError("--hybrid-layers needs --hybrid-option (the options to set on those layers)")
    model, tokenizer = load_causal_lm(spec)
    name = _label(spec)
    if not options:
        return model, tokenizer, name
    if getattr(model.config, "model_type", None) != "recattn":
        raise ValueError(f"--hybrid-option: {spec} is not an hf_recattn checkpoint, so it has no hybrid layers")
    changed = with_hybrid_options(model, options, layers)
    where = "" if layers is None else f" on layers {layer_ranges(layers)}"
    return changed, tokenizer, name + "+" + ",".join(f"{k}={v}" for k, v in options.items()) + where


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint (and the teacher on the same tokens and prompts if given); write eval.json."""
    from ..conversion.teacher import load_teacher
    from ..data.corpus import is_embedded, load_splits, long_documents, token_blocks
    from ..evaluation import comparison_table, evaluate, write_report
    from ..modeling.hybrid_options import parse_layers
    from ..provenance import provenance

    sizes = recall_sizes(args)  # bad sizes and options fail before any model is loaded
    options = hybrid_options(args.hybrid_option)
    layers = parse_layers(args.hybrid_layers)
    check_baseline_names(args.baselines, "--baselines")
    torch.manual_seed(args.seed)
    model, tokenizer, name = load_evaluated(args.checkpoint, options, layers)
    _, heldout = load_splits(args.corpus, seed=args.seed)
    blocks = token_blocks(tokenizer, heldout, args.block_size, max_tokens=args.tokens, seed=args.seed)
    long_texts = long_documents(args.corpus, heldout)
    print(f"held-out: {blocks.shape[0]} blocks of {blocks.shape[1]} tokens from {args.corpus or 'embedded'}",
          file=sys.stderr)
    rows: dict[str, dict[str, Any]] = {}
    if args.teacher:
        teacher, teacher_tokenizer = load_teacher(args.teacher)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"teacher {args.teacher}: its tokenizer differs from the checkpoint's, so "
                             "perplexities on the same tokens would not be comparable")
        rows["teacher"] = evaluate(teacher, teacher_tokenizer, blocks, quick=args.quick, recall_texts=heldout,
                                   sizes=sizes, progress="teacher", long_texts=long_texts)
        for label, baseline in baseline_models(teacher, args.baselines):
            rows[label] = evaluate(baseline, tokenizer, blocks, quick=args.quick, recall_texts=heldout,
                                   sizes=sizes, progress=label, long_texts=long_texts)
            del baseline
        del teacher
    rows[name] = evaluate(model, tokenizer, blocks, quick=args.quick, recall_texts=heldout, sizes=sizes,
                          progress=name, long_texts=long_texts)
    print(comparison_table(rows))
    for sample in rows[name]["samples"]:
        print(f"\n> {sample['prompt']}\n{sample['output']}")
    out_dir = Path(args.output) if args.output else (
        Path(args.checkpoint) if Path(args.checkpoint).is_dir() else Path.cwd()
    )
    report = {"checkpoint": args.checkpoint, "teacher": args.teacher, "corpus": args.corpus or "embedded",
              "heldout_tokens": int(blocks.numel()), "block_size": args.block_size, "results": rows,
              "provenance": provenance(corpus=is_embedded(args.corpus))}
    if options:
        report["hybrid_options"] = options
    if layers is not None:
        report["hybrid_layers"] = layers
    path = write_report(out_dir, report, name="eval.json")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of one prompt through the model's cache."""
    from transformers import TextStreamer

    from ..conversion.teacher import load_causal_lm
    from ..evaluation import cache_nbytes, pad_id, prompt_ids

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.checkpoint)
    ids = prompt_ids(tokenizer, args.prompt, chat=False if args.raw else None)
    sampling: dict[str, Any] = {"do_sample": False}
    if args.sample:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            use_cache=True,
            pad_token_id=pad_id(tokenizer),
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            return_dict_in_generate=True,
            **sampling,
        )
    seconds = time.perf_counter() - start
    new = out.sequences.shape[1] - ids.shape[1]
    print(f"[{ids.shape[1]} prompt + {new} new tokens in {seconds:.1f} s; "
          f"cache {cache_nbytes(cache_of(out)) / 2**20:.2f} MiB]", file=sys.stderr)
    return 0


_CHECKPOINT_HELP = "hf_recattn checkpoint folder, or a teacher spec (embedded, gemma3-270m, .gguf, folder, Hub id)"


#: the eval options that size the recall probes (unset: ``RecallSizes.for_mode``): flag, type, nargs, metavar, help
_PROBE_SIZE_OPTIONS: tuple[tuple[str, type, str | None, str, str], ...] = (
    ("--passkey-lengths", int, "+", "TOKENS", "passkey context lengths (default 1024 4096 8192; --quick: 1024)"),
    ("--passkey-depths", float, "+", "DEPTH", "positions of the key in the context, 0 to 1 (default 0.1 0.5 0.9)"),
    ("--passkey-trials", int, None, "N",
     "passkey prompts per length, cycling through the depths (default 6; --quick: 3)"),
    ("--recall-lengths", int, "+", "TOKENS", "associative recall context lengths (default 1024 4096; --quick: 1024)"),
    ("--recall-pairs", int, "+", "N", "numbers of facts planted per associative recall prompt (default 1 4 16)"),
    ("--recall-trials", int, None, "N",
     "associative recall prompts per length and number of facts (default 3; --quick: 1)"),
    ("--distances", int, "+", "TOKENS",
     "recall with the fact this many tokens before the question (default 100 1000 4000 16000; --quick: 100 1000)"),
    ("--distance-trials", int, None, "N", "recall-by-distance prompts per distance (default 3; --quick: 2)"),
    ("--long-lengths", int, "+", "TOKENS",
     "block lengths of the long-block perplexity, each block from one document (default 4096 16384; --quick: 4096)"),
    ("--long-blocks", int, None, "N", "long blocks per length at most (default 4; --quick: 1)"),
    ("--needle-tasks", str, "+", "TASK", "needle tasks in natural text: single_number single_word single_phrase "
     "multi_key multi_value multi_query paraphrase (default all; --quick: single_number multi_key)"),
    ("--needle-lengths", int, "+", "TOKENS", "needle prompt lengths, any (default 1024 2048 4096; --quick: 1024; "
     "lengths beyond the model's positions are skipped)"),
    ("--needle-prompts", int, None, "N", "needle prompts per task, haystack and length (default 20)"),
    ("--needle-haystacks", str, "+", "NAME", "needle haystacks: heldout (the corpus's held-out documents), ood (the "
     "embedded corpus's license texts) (default both)"),
    ("--needle-cells", str, "+", "TASK@TOKENS", "only these needle cells instead of every task at every length, "
     "e.g. single_number@1024 single_number@4096 multi_key@2048 multi_query@2048 (the recall bar's cells)"),
)


def add_eval(sub: SubParsers) -> None:
    p = add_command(sub, "eval", "held-out perplexity (short and long blocks), passkey, needles in natural text, "
                    "associative recall, recall by distance, samples and decode cost of a checkpoint")
    p.add_argument("checkpoint", help=_CHECKPOINT_HELP)
    p.add_argument("--corpus", default=None, help="embedded (default), a .txt/.jsonl/.parquet file or "
                   "folder, or a saved datasets folder; its held-out split is used")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens for perplexity")
    p.add_argument("--block-size", type=int, default=1024, help="tokens per perplexity block")
    p.add_argument("--teacher", default=None, help="also evaluate this teacher on the same tokens")
    p.add_argument("--quick", action="store_true", help="smaller passkey / recall / sample / decode probes")
    p.add_argument("--baselines", nargs="*", default=list(DEFAULT_BASELINES), metavar="NAME",
                   help="with --teacher: untrained baselines built from its weights, evaluated beside it (known: "
                   f"{', '.join(BASELINES)}; default: {' '.join(DEFAULT_BASELINES)}; none: --baselines with no name)")
    for flag, kind, nargs, metavar, help in _PROBE_SIZE_OPTIONS:
        p.add_argument(flag, type=kind, nargs=nargs, default=None, metavar=metavar, help=help)
    p.add_argument("--hybrid-option", action="append", default=None, metavar="KEY=VALUE",
                   help="evaluate the checkpoint with this option set on every hybrid layer, the weights unchanged "
                   "(options without parameters only, e.g. cache_slots=64 adds the exact cache to a hybrid trained "
                   "without it); repeat for several")
    p.add_argument("--hybrid-layers", nargs="+", default=None, metavar="LAYERS",
                   help="set --hybrid-option on these layers only: indices or inclusive ranges, e.g. 5 11 17 or 0-10 "
                   "(a Gemma 3 student's full-attention layers, say)")
    p.add_argument("--output", default=None, help="folder for eval.json (default: the checkpoint folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm-eval", default=None, metavar="TASKS", help="run lm-evaluation-harness instead: lm_eval run "
                   "--model hf --model_args pretrained=CHECKPOINT --tasks TASKS (comma-separated; needs the eval "
                   "extra); the options above are then unused")
    p.add_argument("--lm-eval-args", default="", metavar="OPTIONS", help="with --lm-eval: more lm_eval run "
                   "options in one string, e.g. \"--num_fewshot 5 --batch_size 8 --output_path results\"")

    def run(args: argparse.Namespace) -> int:
        if args.lm_eval:
            if args.hybrid_option:
                raise ValueError("--hybrid-option: not with --lm-eval (lm_eval loads the checkpoint as saved)")
            from .lm_eval import run_lm_eval

            run_lm_eval(args.checkpoint, args.lm_eval, args.lm_eval_args)
            return 0
        return run_eval(args)

    p.set_defaults(handler=run)


def add_generate(sub: SubParsers) -> None:
    p = add_command(sub, "generate", "generate from a checkpoint through its (recurrent) cache")
    p.add_argument("checkpoint", help=_CHECKPOINT_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_generate)
