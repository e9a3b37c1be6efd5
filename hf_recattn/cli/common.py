"""What every command module of the ``hf-recattn`` command line shares: declaring a sub-command, and the heap
setting of the long-running ones."""

from __future__ import annotations

import argparse

from ..heap import DEFAULT_MMAP_THRESHOLD, OPTION, fix_mmap_threshold

#: the object ``add_subparsers`` returns, to which each command module adds its sub-commands
SubParsers = argparse._SubParsersAction


def add_command(sub: SubParsers, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """Declare sub-command ``name``: ``help`` is its line in ``hf-recattn --help``, ``description`` (if any) heads
    its own ``--help``."""
    return sub.add_parser(name, help=help, description=description)


def add_heap_option(p: argparse.ArgumentParser) -> None:
    """``--malloc-mmap-threshold`` of a training command (see ``hf_recattn.heap``)."""
    p.add_argument(OPTION, type=int, default=None, metavar="BYTES",
                   help=f"Linux with glibc: allocations of BYTES or more are mapped on their own and given back to "
                   f"the system when freed, which keeps a training step's freed activations from fragmenting the "
                   f"heap (default {DEFAULT_MMAP_THRESHOLD}, unless MALLOC_* or GLIBC_TUNABLES tune malloc; 0: "
                   "glibc's own adjustable threshold)")


def apply_heap_option(args: argparse.Namespace) -> None:
    """Set glibc's mmap threshold as ``--malloc-mmap-threshold`` says, before the command allocates its models."""
    fix_mmap_threshold(args.malloc_mmap_threshold)
