"""``hf-recattn convert``: distill a softmax teacher into recurrent attention with a recipe, and optionally push
the result."""

from __future__ import annotations

import argparse
import sys

from ..extras import require
from .common import SubParsers, add_command, add_heap_option, apply_heap_option
from .push import push


def _convert_threads(value: str) -> int:
    """``--threads``: an integer, or auto (1 thread when other jobs keep the cores busy)."""
    import os

    import torch

    if value != "auto":
        try:
            threads = int(value)
        except ValueError:
            raise ValueError(f"--threads must be an integer or 'auto', got {value!r}") from None
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        return threads
    default = torch.get_num_threads()
    cores = os.cpu_count() or default
    try:
        busy = os.getloadavg()[0] >= cores - 0.5
    except OSError:  # no load average on this platform
        busy = False
    return 1 if busy and default > 1 else default


def add_convert(sub: SubParsers) -> None:
    p = add_command(sub, "convert", "distill a softmax teacher into recurrent attention (stage 1 + stage 2), "
                    "evaluate, save", "Convert a Llama-shaped teacher with a recipe: attention transfer, LoRA "
                    "finetuning, evaluation against the teacher, a model card and a sample through the recurrent "
                    "cache. Rerun the same command to resume an interrupted run.")
    p.add_argument("--teacher", default="embedded", help="embedded (SmolLM2-135M-Instruct), gemma3-270m (Gemma 3 "
                   "270M, under the Gemma Terms of Use), a .gguf file, a model folder or a Hub id")
    p.add_argument("--teacher-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="load the teacher in this dtype (the student trains in float32)")
    p.add_argument("--recipe", required=True, help="a packaged recipe name or a .yaml file")
    p.add_argument("--output", required=True, help="output folder (resumed when it holds the same run)")
    p.add_argument("--budget", default=None, help="a budget of the recipe: quick (default), full; none without budgets")
    p.add_argument("--seed", type=int, default=None, help="override the recipe's seed")
    p.add_argument("--corpus", default=None, help="embedded (default), a .txt/.jsonl/.parquet file or "
                   "folder, or a saved datasets folder")
    p.add_argument("--overwrite", action="store_true", help="replace an output folder holding another run")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation (still saves the model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", default="auto", help="torch CPU threads, or auto: torch's default unless the "
                   "machine is already busy (load average >= cores - 0.5), then 1, which is faster there")
    p.add_argument("--fsdp", action="store_true", help="under torchrun / accelerate launch: shard what both "
                   "training stages train over the processes (FSDP2) instead of copying it to each (DDP)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="publish the converted model (see "
                   "`hf-recattn push`) when the conversion is done")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    add_heap_option(p)

    def run(args: argparse.Namespace) -> int:
        import torch

        require("train", "hf-recattn convert")
        apply_heap_option(args)
        if args.push_to_hub:
            from ..hub import check_repo_id

            check_repo_id(args.push_to_hub)  # before hours of training, not after

        from ..conversion.pipeline import convert
        from ..training.runner import NonFiniteLossError
        from ..training.sharding import check_flag

        check_flag(args.fsdp, "--fsdp")  # one process cannot shard: said before loading anything

        torch.set_num_threads(_convert_threads(args.threads))
        try:
            convert(teacher=args.teacher, recipe=args.recipe, output=args.output, budget=args.budget,
                    seed=args.seed, overwrite=args.overwrite, data=args.corpus, progress=not args.no_progress,
                    evaluate_models=not args.no_eval, teacher_dtype=args.teacher_dtype, fsdp=args.fsdp)
        except (NonFiniteLossError, FileNotFoundError) as err:
            print(f"hf-recattn convert: error: {err}", file=sys.stderr)
            return 3 if isinstance(err, NonFiniteLossError) else 2
        except KeyboardInterrupt:
            print(f"hf-recattn convert: interrupted; rerun the same command to resume from {args.output}",
                  file=sys.stderr)
            return 130
        if args.push_to_hub:
            return push(f"{args.output}/model", args.push_to_hub, private=args.private)
        return 0

    p.set_defaults(handler=run)
