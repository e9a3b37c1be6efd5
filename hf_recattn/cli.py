"""The ``hf-recattn`` command line: one sub-command per job, each registered by a small ``add_*`` function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], int]


def _command(
    sub: argparse._SubParsersAction, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """Declare sub-command ``name``: ``help`` is its line in ``hf-recattn --help``, ``description`` (if any) heads
    its own ``--help``."""
    return sub.add_parser(name, help=help, description=description)


def _load_config(config_or_path: str):  # noqa: ANN202
    """A RecAttnConfig from a checkpoint folder, a config.json, or an inline JSON object."""
    from pathlib import Path

    from .modeling.configuration import RecAttnConfig

    text = config_or_path.strip()
    if text.startswith("{"):
        return RecAttnConfig(**json.loads(text))
    path = Path(config_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(f"hf-recattn: no config at {config_or_path!r} (a folder, a config.json, or inline JSON)")
    values = json.loads(path.read_text())
    values.pop("model_type", None)
    return RecAttnConfig(**values)


def add_state_size(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "state-size", "per-layer decode state vs KV cache, and the break-even context")
    p.add_argument("config", help="checkpoint folder, config.json, or inline JSON config")
    p.add_argument("--context", type=int, default=4096, help="context length in tokens")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16/fp16, 4 for fp32")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def run(args: argparse.Namespace) -> int:
        from .state_size import format_report, state_size_report

        rows = state_size_report(_load_config(args.config), args.context)
        if args.json:
            print(json.dumps([r.as_dict() for r in rows], indent=2))
        else:
            print(format_report(rows, args.bytes_per_element))
        return 0

    p.set_defaults(handler=run)


def _add_listing(sub: argparse._SubParsersAction, name: str, help: str, text: str,
                 listing: Callable[[], tuple[Any, Callable[[Any], str]]]) -> None:
    """A sub-command that prints what ``listing()`` returns (the data and its formatter) as ``text`` or as JSON."""
    p = _command(sub, name, help)
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {text}")

    def run(args: argparse.Namespace) -> int:
        data, format_data = listing()
        print(json.dumps(data, indent=2) if args.json else format_data(data))
        return 0

    p.set_defaults(handler=run)


def add_mixers(sub: argparse._SubParsersAction) -> None:
    def listing() -> tuple[Any, Callable[[Any], str]]:
        from .mixer_catalog import catalog, format_catalog

        return catalog(), format_catalog

    _add_listing(sub, "mixers", "every mixer family with its options, and every preset with its spec", "text", listing)


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "demo", "build a tiny random model per mixer and generate from it through the cache")
    p.add_argument("--tokens", type=int, default=16)

    def run(args: argparse.Namespace) -> int:
        from .demo import run_demo

        run_demo(args.tokens)
        return 0

    p.set_defaults(handler=run)


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
)


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "eval", "held-out perplexity, passkey, associative recall, samples and decode cost of a "
                 "checkpoint")
    p.add_argument("checkpoint", help=_CHECKPOINT_HELP)
    p.add_argument("--corpus", default=None, help="embedded (default), a .txt/.jsonl/.parquet file or "
                   "folder, or a saved datasets folder; its held-out split is used")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens for perplexity")
    p.add_argument("--block-size", type=int, default=1024, help="tokens per perplexity block")
    p.add_argument("--teacher", default=None, help="also evaluate this teacher on the same tokens")
    p.add_argument("--quick", action="store_true", help="smaller passkey / recall / sample / decode probes")
    for flag, kind, nargs, metavar, help in _PROBE_SIZE_OPTIONS:
        p.add_argument(flag, type=kind, nargs=nargs, default=None, metavar=metavar, help=help)
    p.add_argument("--output", default=None, help="folder for eval.json (default: the checkpoint folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm-eval", default=None, metavar="TASKS", help="run lm-evaluation-harness instead: lm_eval run "
                   "--model hf --model_args pretrained=CHECKPOINT --tasks TASKS (comma-separated; needs the eval "
                   "extra); the options above are then unused")
    p.add_argument("--lm-eval-args", default="", metavar="OPTIONS", help="with --lm-eval: more lm_eval run "
                   "options in one string, e.g. \"--num_fewshot 5 --batch_size 8 --output_path results\"")

    def run(args: argparse.Namespace) -> int:
        if args.lm_eval:
            from .lm_eval_command import MissingLmEval, run_lm_eval

            try:
                run_lm_eval(args.checkpoint, args.lm_eval, args.lm_eval_args)
            except MissingLmEval as err:
                print(f"hf-recattn eval: error: {err}", file=sys.stderr)
                return 2
            return 0
        from .eval_commands import run_eval

        return run_eval(args)

    p.set_defaults(handler=run)


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "generate", "generate from a checkpoint through its (recurrent) cache")
    p.add_argument("checkpoint", help=_CHECKPOINT_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        from .eval_commands import run_generate

        return run_generate(args)

    p.set_defaults(handler=run)


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "serve", "an OpenAI-compatible endpoint for a checkpoint: transformers serve, with hf_recattn's "
                 "classes", "Run transformers' own server (`transformers serve MODEL OPTIONS`) in this process with "
                 "hf_recattn registered. OPTIONS are transformers serve's (--host, --port, --device, --dtype, ...); "
                 "--continuous-batching, --cb-* and --compile are refused. See docs/serving.md.")
    p.add_argument("model", help="a checkpoint folder or Hub id, served for every request")
    p.add_argument("options", nargs=argparse.REMAINDER, help="transformers serve options")

    def run(args: argparse.Namespace) -> int:
        from .serve_command import serve

        return serve(args.model, args.options)

    p.set_defaults(handler=run)


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


def add_convert(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "convert", "distill a softmax teacher into recurrent attention (stage 1 + stage 2), evaluate, "
                 "save", "Convert a Llama-shaped teacher with a recipe: attention transfer, LoRA finetuning, "
                 "evaluation against the teacher, a model card and a sample through the recurrent cache. Rerun the "
                 "same command to resume an interrupted run.")
    p.add_argument("--teacher", default="embedded", help="embedded (SmolLM2-135M-Instruct), gemma3-270m (Gemma 3 "
                   "270M, under the Gemma Terms of Use), a .gguf file, a model folder or a Hub id")
    p.add_argument("--teacher-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="load the teacher in this dtype (the student trains in float32)")
    p.add_argument("--recipe", required=True, help="a packaged recipe name or a .yaml file")
    p.add_argument("--output", required=True, help="output folder (resumed when it holds the same run)")
    p.add_argument("--budget", default="quick", help="a budget of the recipe: quick or full")
    p.add_argument("--seed", type=int, default=None, help="override the recipe's seed")
    p.add_argument("--corpus", default=None, help="embedded (default), a .txt/.jsonl/.parquet file or "
                   "folder, or a saved datasets folder")
    p.add_argument("--overwrite", action="store_true", help="replace an output folder holding another run")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation (still saves the model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", default="auto", help="torch CPU threads, or auto: torch's default unless the "
                   "machine is already busy (load average >= cores - 0.5), then 1, which is faster there")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="publish the converted model (see "
                   "`hf-recattn push`) when the conversion is done")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")

    def run(args: argparse.Namespace) -> int:
        import torch

        if args.push_to_hub:
            from .hub import check_repo_id

            check_repo_id(args.push_to_hub)  # before hours of training, not after

        from .conversion.pipeline import convert
        from .training.runner import NonFiniteLossError

        torch.set_num_threads(_convert_threads(args.threads))
        try:
            convert(teacher=args.teacher, recipe=args.recipe, output=args.output, budget=args.budget,
                    seed=args.seed, overwrite=args.overwrite, data=args.corpus, progress=not args.no_progress,
                    evaluate_models=not args.no_eval, teacher_dtype=args.teacher_dtype)
        except (NonFiniteLossError, FileNotFoundError) as err:
            print(f"hf-recattn convert: error: {err}", file=sys.stderr)
            return 3 if isinstance(err, NonFiniteLossError) else 2
        except KeyboardInterrupt:
            print(f"hf-recattn convert: interrupted; rerun the same command to resume from {args.output}",
                  file=sys.stderr)
            return 130
        if args.push_to_hub:
            return _push(f"{args.output}/model", args.push_to_hub, private=args.private)
        return 0

    p.set_defaults(handler=run)


def _push(folder: str, repo_id: str, **kwargs: object) -> int:
    from .hub import PushError, push_checkpoint

    try:
        url = push_checkpoint(folder, repo_id, **kwargs)
    except PushError as err:
        print(f"hf-recattn push: error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {folder} to {repo_id}: {url}")
    return 0


def add_push(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "push", "publish a checkpoint folder to the Hub with a generated model card",
                 "Publish an hf_recattn checkpoint (weights, config, runtime files, tokenizer, generation config, "
                 "report.json) with a model card rendered for REPO_ID, in one commit. HF_ENDPOINT and HF_TOKEN are "
                 "honoured as by every huggingface_hub client.")
    p.add_argument("checkpoint", help="a checkpoint folder (e.g. a conversion's OUTPUT/model)")
    p.add_argument("repo_id", help="namespace/name (or name: the token's namespace)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="a branch to push to (created from main when missing)")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--token", default=None, help="a Hub token (default: HF_TOKEN or the stored login)")

    def run(args: argparse.Namespace) -> int:
        return _push(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                     commit_message=args.commit_message, token=args.token)

    p.set_defaults(handler=run)


def add_zoo(sub: argparse._SubParsersAction) -> None:
    def listing() -> tuple[Any, Callable[[Any], str]]:
        from .zoo import format_zoo, zoo_entries

        return zoo_entries(), format_zoo

    _add_listing(sub, "zoo", "the zoo: each shipped recipe converted from the embedded teacher, measured", "a table",
                 listing)


def add_corpus(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "corpus", "the embedded corpus: version, checksum, sources, split sizes; export its splits")
    p.add_argument("--write", metavar="DIR", default=None, help="write the splits (train, heldout, ood) to DIR")
    p.add_argument("--format", choices=("jsonl", "dataset"), default="jsonl",
                   help="jsonl: DIR/SPLIT.jsonl with fields id, text; dataset: a datasets DatasetDict (save_to_disk)")
    p.add_argument("--tokenizer", default="embedded", help="count tokens with this teacher's tokenizer")
    p.add_argument("--no-tokens", action="store_true", help="skip the token counts (no tokenizer is loaded)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached corpus from its archives")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--out", metavar="FILE", default=None, help="also write the report with its provenance as JSON")

    def run(args: argparse.Namespace) -> int:
        from .corpus_command import run_corpus

        return run_corpus(args)

    p.set_defaults(handler=run)


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


def add_pretrain(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "pretrain", "pretrain a model from scratch with Trainer, as a YAML says (resumable)",
                 "Pretrain an hf_recattn model from a YAML (model, tokenizer, data, block_size, training: "
                 "TrainingArguments). Rerun the same command to resume; see docs/training.md.")
    p.add_argument("--config", required=True, help="the YAML file")
    p.add_argument("--output", default=None, help="override training.output_dir")

    def run(args: argparse.Namespace) -> int:
        from .training import pretrain

        return _training_run("pretrain", lambda: pretrain(args.config, output_dir=args.output))

    p.set_defaults(handler=run)


def add_finetune(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "finetune", "finetune an hf_recattn checkpoint (LoRA, full or mixers only; plain or chat data)",
                 "Finetune a checkpoint with Trainer (+ peft) and save the merged model to OUTPUT/model. Rerun the "
                 "same command to resume; see docs/training.md.")
    p.add_argument("--model", required=True, help="an hf_recattn checkpoint folder or Hub id")
    p.add_argument("--data", required=True, help="embedded, a .txt/.jsonl/.parquet file or folder, a saved "
                   "dataset folder or a Hub dataset; a 'messages' column makes it chat data")
    p.add_argument("--config", default=None, help="a finetune YAML (method, lora, block_size, data, training)")
    p.add_argument("--output", default=None, help="output folder (overrides training.output_dir)")

    def run(args: argparse.Namespace) -> int:
        from .training import finetune

        return _training_run("finetune", lambda: finetune(args.model, args.data, args.config, output_dir=args.output))

    p.set_defaults(handler=run)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_state_size, add_mixers, add_demo, add_eval, add_generate, add_serve
]
SUBCOMMANDS += [add_convert, add_push, add_zoo]
SUBCOMMANDS += [add_pretrain, add_finetune, add_corpus]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-recattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"hf-recattn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
