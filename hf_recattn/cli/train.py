"""``hf-recattn pretrain`` and ``hf-recattn finetune``: training runs with transformers' Trainer (resumable)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..extras import require
from .common import SubParsers, add_command, add_heap_option, apply_heap_option


def _training_run(command: str, run: Callable[[], Any]) -> int:
    """Run a pretrain / finetune job: a missing file is a clear error, an interrupt says how to resume."""
    import os

    try:
        result = run()
    except FileNotFoundError as err:
        print(f"hf-recattn {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hf-recattn {command}: interrupted; rerun the same command to resume from the last checkpoint",
              file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per process
        print(f"hf-recattn {command}: {result.global_step} steps; model saved to {result.model_dir}")
    return 0


def add_pretrain(sub: SubParsers) -> None:
    p = add_command(sub, "pretrain", "pretrain a model from scratch with Trainer, as a YAML says (resumable)",
                    "Pretrain an hf_recattn model from a YAML (model, tokenizer, data, block_size, training: "
                    "TrainingArguments). Rerun the same command to resume; see docs/training.md.")
    p.add_argument("--config", required=True, help="the YAML file")
    p.add_argument("--output", default=None, help="override training.output_dir")
    add_heap_option(p)

    def run(args: argparse.Namespace) -> int:
        require("train", "hf-recattn pretrain")
        apply_heap_option(args)
        from ..training import pretrain

        return _training_run("pretrain", lambda: pretrain(args.config, output_dir=args.output))

    p.set_defaults(handler=run)


def add_finetune(sub: SubParsers) -> None:
    p = add_command(sub, "finetune", "finetune an hf_recattn checkpoint (LoRA, full or mixers only; plain or chat "
                    "data)", "Finetune a checkpoint with Trainer (+ peft) and save the merged model to "
                    "OUTPUT/model. Rerun the same command to resume; see docs/training.md.")
    p.add_argument("--model", required=True, help="an hf_recattn checkpoint folder or Hub id")
    p.add_argument("--data", required=True, help="embedded, a .txt/.jsonl/.parquet file or folder, a saved "
                   "dataset folder or a Hub dataset; a 'messages' column makes it chat data")
    p.add_argument("--config", default=None, help="a finetune YAML (method, lora, block_size, data, training)")
    p.add_argument("--output", default=None, help="output folder (overrides training.output_dir)")
    add_heap_option(p)

    def run(args: argparse.Namespace) -> int:
        require("train", "hf-recattn finetune")
        apply_heap_option(args)
        from ..training import finetune

        return _training_run("finetune", lambda: finetune(args.model, args.data, args.config, output_dir=args.output))

    p.set_defaults(handler=run)
