"""``hf-recattn eval CHECKPOINT --lm-eval TASKS``: lm-evaluation-harness's own command line, run in this process
with hf_recattn registered, as ``lm_eval run --model hf --model_args pretrained=CHECKPOINT --tasks TASKS``
followed by the ``--lm-eval-args`` string (a ``--model_args`` there adds to ``pretrained=...``)."""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Iterator

from ..extras import require


def lm_eval_argv(checkpoint: str, tasks: str, extra: str = "") -> list[str]:
    """The ``lm_eval run`` arguments for ``checkpoint`` and ``tasks``, then the options in ``extra`` (lm_eval
    merges a second ``--model_args`` into the first)."""
    options = shlex.split(extra)
    for option in options:
        if option.split("=", 1)[0] in ("--model", "-M", "--tasks", "-t"):
            raise ValueError(f"--lm-eval-args: {option.split('=')[0]} is set by hf-recattn eval (hf, --lm-eval)")
    return ["run", "--model", "hf", "--model_args", f"pretrained={checkpoint}", "--tasks", tasks, *options]


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    """lm_eval's command line reads sys.argv: set it for the call, restore it after."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def run_lm_eval(checkpoint: str, tasks: str, extra: str = "") -> None:
    """Run lm_eval's command line on ``checkpoint`` (see the module docstring)."""
    argv = lm_eval_argv(checkpoint, tasks, extra)
    require("eval", "hf-recattn eval --lm-eval")
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    cli = HarnessCLI()
    with _argv(["lm_eval", *argv]):
        cli.execute(cli.parse_args())
