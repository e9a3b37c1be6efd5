"""The embedded corpus's report: version, checksum (actual and pinned), sources, and per split its documents,
characters, tokens and checksum; as text (``hf-recattn corpus``) or as the table of docs/corpus.md."""

from __future__ import annotations

from typing import Any

from . import pinned
from .embedded import SPLITS, Corpus


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
    """The report as the text ``hf-recattn corpus`` prints."""
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
