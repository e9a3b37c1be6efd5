"""``hf-recattn state-size``, ``mixers`` and ``zoo``: what a config's decode state costs, which mixers exist, what
the zoo holds."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from .common import SubParsers, add_command


def _config_argument(text: str):  # noqa: ANN202
    """A RecAttnConfig from an inline JSON object, else from a checkpoint folder or its config.json."""
    from ..modeling.configuration import RecAttnConfig, read_checkpoint_config

    if text.strip().startswith("{"):
        return RecAttnConfig(**json.loads(text))
    return read_checkpoint_config(text)


def add_state_size(sub: SubParsers) -> None:
    p = add_command(sub, "state-size", "per-layer decode state vs the teacher's KV cache, and the break-even context")
    p.add_argument("config", help="checkpoint folder, config.json, or inline JSON config")
    p.add_argument("--context", type=int, default=4096, help="context length in tokens")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16/fp16, 4 for fp32")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def run(args: argparse.Namespace) -> int:
        from ..state_size import format_report, state_size_report

        rows = state_size_report(_config_argument(args.config), args.context)
        if args.json:
            print(json.dumps([r.as_dict() for r in rows], indent=2))
        else:
            print(format_report(rows, args.bytes_per_element))
        return 0

    p.set_defaults(handler=run)


def _add_listing(sub: SubParsers, name: str, help: str, text: str,
                 listing: Callable[[], tuple[Any, Callable[[Any], str]]]) -> None:
    """A sub-command that prints what ``listing()`` returns (the data and its formatter) as ``text`` or as JSON."""
    p = add_command(sub, name, help)
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {text}")

    def run(args: argparse.Namespace) -> int:
        data, format_data = listing()
        print(json.dumps(data, indent=2) if args.json else format_data(data))
        return 0

    p.set_defaults(handler=run)


def add_mixers(sub: SubParsers) -> None:
    def listing() -> tuple[Any, Callable[[Any], str]]:
        from ..mixer_catalog import catalog, format_catalog

        return catalog(), format_catalog

    _add_listing(sub, "mixers", "every mixer family with its options, and every preset with its spec", "text", listing)


def add_zoo(sub: SubParsers) -> None:
    def listing() -> tuple[Any, Callable[[Any], str]]:
        from ..zoo import format_zoo, zoo_entries

        return zoo_entries(), format_zoo

    _add_listing(sub, "zoo", "the zoo: each shipped recipe converted from the embedded teacher, measured", "a table",
                 listing)
