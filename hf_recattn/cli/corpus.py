"""``hf-recattn corpus``: the embedded corpus's version, checksum, sources and split sizes, and an export of its
splits so that others can train or evaluate on exactly the same text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..data import pinned
from ..data.embedded import SPLITS, Corpus, embedded_corpus, write_splits


def corpus_report(corpus: Corpus, tokenizer: Any = None) -> dict[str, Any]:
    """Version, sha256 (pinned and actual), sources, and per split: documents, characters, tokens, sha256."""
    splits = {}
    for split in SPLITS:
        texts = corpus.texts(split)
        row: dict[str, Any] = {"documents": len(texts), "characters": sum(map(len, texts)),
                               "sha256": corpus.split_sha256(split)}
        if tokenizer is not None:
            row["tokens"] = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        splits[split] = row
    return {
        "version": corpus.version,
        "sha256": corpus.sha256,
        "pinned_sha256": pinned.CORPUS_SHA256,
        "heldout_fraction": pinned.HELDOUT_FRACTION,
        "sources": [
            {"name": s.name, "version": s.version, "sha256": s.sha256, "license": s.license,
             "documents": list(s.documents), "exclude": list(s.exclude), "ood": list(s.ood)}
            for s in pinned.SOURCES
        ],
        "splits": splits,
    }


def format_corpus_report(report: dict[str, Any]) -> str:
    lines = [f"embedded corpus v{report['version']}, sha256 {report['sha256']} "
             f"({'matches the pin' if report['sha256'] == report['pinned_sha256'] else 'DIFFERS from the pin'})",
             "", "sources (source archives on the package index, sha256-pinned):"]
    for s in report["sources"]:
        parts = []
        if s["documents"]:
            parts.append("documents " + ", ".join(s["documents"]))
        if s["exclude"]:
            parts.append("except " + ", ".join(s["exclude"]))
        if s["ood"]:
            parts.append("out-of-distribution " + ", ".join(s["ood"]))
        lines.append(f"  {s['name']}=={s['version']}  [{s['license']}]  {'; '.join(parts)}")
    with_tokens = all("tokens" in row for row in report["splits"].values())
    lines += ["", f"{'split':<8} {'documents':>9} {'characters':>11}" + (f" {'tokens':>10}" if with_tokens else "")
              + "  sha256"]
    for split, row in report["splits"].items():
        tokens = f" {row['tokens']:>10,}" if with_tokens else ""
        lines.append(f"{split:<8} {row['documents']:>9,} {row['characters']:>11,}{tokens}  {row['sha256']}")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    """The per-split table of a report (for docs/corpus.md)."""
    with_tokens = all("tokens" in row for row in report["splits"].values())
    head = "| split | documents | characters |" + (" tokens (SmolLM2 tokenizer) |" if with_tokens else "") + " sha256 |"
    lines = [head, "|---|---:|---:|" + ("---:|" if with_tokens else "") + "---|"]
    for split in SPLITS:  # the file may hold them sorted by name
        row = report["splits"][split]
        tokens = f" {row['tokens']:,} |" if with_tokens else ""
        lines.append(f"| {split} | {row['documents']:,} | {row['characters']:,} |{tokens} `{row['sha256'][:16]}…` |")
    return "\n".join(lines)


def run_corpus(args: argparse.Namespace) -> int:
    corpus = embedded_corpus(refresh=args.rebuild)
    tokenizer = None
    if not args.no_tokens:
        from ..conversion.teacher import teacher_tokenizer

        tokenizer = teacher_tokenizer(args.tokenizer)
    report = corpus_report(corpus, tokenizer)
    if args.out:
        from ..conversion.checkpoints import atomic_write_json
        from ..provenance import provenance

        atomic_write_json(Path(args.out), {**report, "benchmark": "corpus", "provenance": provenance()})
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_corpus_report(report))
    if args.write:
        written = write_splits(corpus, Path(args.write), args.format)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
