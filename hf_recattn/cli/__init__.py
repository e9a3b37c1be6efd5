"""The ``hf-recattn`` command line: one sub-command per job, each registered by a small ``add_*`` function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..extras import MissingExtra, install_command
from ..modeling import backends
from .catalog import add_mixers, add_state_size, add_zoo
from .common import SubParsers
from .convert import add_convert
from .corpus import add_corpus
from .demo import add_demo
from .evaluate import add_eval, add_generate
from .push import add_push
from .serve import add_serve
from .train import add_finetune, add_pretrain

#: what ``hf-recattn --help`` says above the list of commands
DESCRIPTION = (
    "Recurrent forms of attention as Hugging Face Transformers models: convert a softmax checkpoint, train, "
    "evaluate, generate, serve and publish. Run 'hf-recattn COMMAND --help' for a command's options."
)
#: the ``add_*`` function of every command, in the order ``--help`` lists them
SUBCOMMANDS: list[Callable[[SubParsers], None]] = [
    add_state_size, add_mixers, add_demo, add_eval, add_generate, add_serve,
    add_convert, add_push, add_zoo, add_pretrain, add_finetune, add_corpus,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-recattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        backends.check_mode()  # a kernel choice this machine cannot run: refused before any work
        return int(args.handler(args) or 0)
    except MissingExtra as err:  # an optional dependency group is not installed: name it, no traceback
        print(f"hf-recattn {args.command} needs the {err.extra} extra: {install_command(err.extra)}", file=sys.stderr)
        return 2
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"hf-recattn {args.command}: error: {err}", file=sys.stderr)
        return 2
