"""The ``hf-recattn eval`` and ``hf-recattn generate`` commands (argument parsing lives in cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..modeling.cache import cache_of

if TYPE_CHECKING:
    from ..evaluation import RecallSizes


def _label(spec: str) -> str:
    path = Path(spec)
    return path.resolve().name if path.exists() else spec


#: the ``hf-recattn eval`` options that set the recall probes, by RecallSizes field
RECALL_OPTIONS = ("passkey_lengths", "passkey_depths", "passkey_trials", "recall_lengths", "recall_pairs",
                  "recall_trials")


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


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint (and the teacher on the same tokens and prompts if given); write eval.json."""
    from ..conversion.teacher import load_causal_lm, load_teacher
    from ..data.corpus import is_embedded, load_splits, token_blocks
    from ..evaluation import comparison_table, evaluate, write_report
    from ..provenance import provenance

    sizes = recall_sizes(args)  # bad sizes fail before any model is loaded
    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.checkpoint)
    _, heldout = load_splits(args.corpus, seed=args.seed)
    blocks = token_blocks(tokenizer, heldout, args.block_size, max_tokens=args.tokens, seed=args.seed)
    print(f"held-out: {blocks.shape[0]} blocks of {blocks.shape[1]} tokens from {args.corpus or 'embedded'}",
          file=sys.stderr)
    rows: dict[str, dict[str, Any]] = {}
    if args.teacher:
        teacher, teacher_tokenizer = load_teacher(args.teacher)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"teacher {args.teacher}: its tokenizer differs from the checkpoint's, so "
                             "perplexities on the same tokens would not be comparable")
        rows["teacher"] = evaluate(teacher, teacher_tokenizer, blocks, quick=args.quick, recall_texts=heldout,
                                   sizes=sizes)
        del teacher
    name = _label(args.checkpoint)
    rows[name] = evaluate(model, tokenizer, blocks, quick=args.quick, recall_texts=heldout, sizes=sizes)
    print(comparison_table(rows))
    for sample in rows[name]["samples"]:
        print(f"\n> {sample['prompt']}\n{sample['output']}")
    out_dir = Path(args.output) if args.output else (
        Path(args.checkpoint) if Path(args.checkpoint).is_dir() else Path.cwd()
    )
    report = {"checkpoint": args.checkpoint, "teacher": args.teacher, "corpus": args.corpus or "embedded",
              "heldout_tokens": int(blocks.numel()), "block_size": args.block_size, "results": rows,
              "provenance": provenance(corpus=is_embedded(args.corpus))}
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
