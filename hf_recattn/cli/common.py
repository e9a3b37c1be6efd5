"""What every command module of the ``hf-recattn`` command line shares: declaring a sub-command."""

from __future__ import annotations

import argparse

#: the object ``add_subparsers`` returns, to which each command module adds its sub-commands
SubParsers = argparse._SubParsersAction


def add_command(sub: SubParsers, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """Declare sub-command ``name``: ``help`` is its line in ``hf-recattn --help``, ``description`` (if any) heads
    its own ``--help``."""
    return sub.add_parser(name, help=help, description=description)
