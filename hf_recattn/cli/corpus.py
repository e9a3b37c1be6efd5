"""``hf-recattn corpus``: the embedded corpus's version, checksum, sources and split sizes, and an export of its
splits so that others can train or evaluate on exactly the same text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data.corpus_report import corpus_report, format_corpus_report
from ..data.embedded import embedded_corpus, write_splits
from ..extras import require
from .common import SubParsers, add_command


def run_corpus(args: argparse.Namespace) -> int:
    if args.write and args.format == "dataset":
        require("train", "hf-recattn corpus --format dataset")
    tokenizer = None
    if not args.no_tokens:  # before the corpus: a tokenizer that cannot load stops the command at once
        from ..conversion.teacher import teacher_tokenizer

        tokenizer = teacher_tokenizer(args.tokenizer)
    corpus = embedded_corpus(refresh=args.rebuild)
    report = corpus_report(corpus, tokenizer)
    if args.out:
        from ..atomic import write_json
        from ..provenance import provenance

        write_json(Path(args.out), {**report, "benchmark": "corpus", "provenance": provenance()})
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_corpus_report(report))
    if args.write:
        written = write_splits(corpus, Path(args.write), args.format)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_corpus(sub: SubParsers) -> None:
    p = add_command(sub, "corpus", "the embedded corpus: version, checksum, sources, split sizes; export its splits")
    p.add_argument("--write", metavar="DIR", default=None, help="write the splits (train, heldout, ood) to DIR")
    p.add_argument("--format", choices=("jsonl", "dataset"), default="jsonl",
                   help="jsonl: DIR/SPLIT.jsonl with fields id, text; dataset: a datasets DatasetDict (save_to_disk)")
    p.add_argument("--tokenizer", default="embedded", help="count tokens with this teacher's tokenizer")
    p.add_argument("--no-tokens", action="store_true", help="skip the token counts (no tokenizer is loaded)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached corpus from its archives")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--out", metavar="FILE", default=None, help="also write the report with its provenance as JSON")
    p.set_defaults(handler=run_corpus)
