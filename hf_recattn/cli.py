"""The ``hf-recattn`` command line: one sub-command per job, each registered by a small ``add_*`` function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]


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
    p = sub.add_parser("state-size", help="per-layer decode state vs KV cache, and the break-even context")
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


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build a tiny random model per mixer and generate from it through the cache")
    p.add_argument("--tokens", type=int, default=16)

    def run(args: argparse.Namespace) -> int:
        from .demo import run_demo

        run_demo(args.tokens)
        return 0

    p.set_defaults(handler=run)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_state_size, add_demo]


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
