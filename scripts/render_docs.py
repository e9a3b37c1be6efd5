"""Regenerate every measured table in README.md, docs/ and model_cards/ from the result files that hold it.

    python scripts/render_docs.py           # rewrite the tables in place
    python scripts/render_docs.py --check   # exit 1, naming the place, if a table differs from its results

A generated table sits between two markers in the markdown:

    <!-- render: benchmarks/results/FILE.json [RENDERER] -->
    ... (written by this script) ...
    <!-- /render -->

RENDERER defaults to the file's "benchmark" field: ``benchmarks/NAME.py`` defines ``render_markdown(results)``.
``conversion`` renders an ``hf-recattn convert`` report, ``zoo`` the zoo index, ``corpus`` the report of
``hf-recattn corpus --out``. Below each table comes the
provenance line of the results (corpus, machine, threads, packages, commit, date): a result file without a
"provenance" record cannot be rendered.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/*.md", "model_cards/README.md")
BLOCK = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /render -->)", re.DOTALL)


def _conversion(report: dict[str, Any]) -> str:
    from hf_recattn.evaluation import comparison_table

    return comparison_table(report["comparison"])


def _zoo(index: dict[str, Any]) -> str:
    from hf_recattn.zoo import format_zoo

    return format_zoo(index["entries"], card_prefix="../model_cards/")  # rendered into docs/


def _corpus(report: dict[str, Any]) -> str:
    from hf_recattn.data.corpus_report import render_markdown

    return render_markdown(report)


BUILT_IN: dict[str, Callable[[dict[str, Any]], str]] = {"conversion": _conversion, "zoo": _zoo, "corpus": _corpus}


def renderer(name: str) -> Callable[[dict[str, Any]], str]:
    """A built-in renderer, or ``render_markdown`` of the benchmark script ``benchmarks/NAME.py``."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    script = ROOT / "benchmarks" / f"{name}.py"
    if not script.is_file():
        raise ValueError(f"no renderer {name!r}: not one of {sorted(BUILT_IN)} and no benchmarks/{name}.py")
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    module = importlib.import_module(name)
    if not hasattr(module, "render_markdown"):
        raise ValueError(f"benchmarks/{name}.py defines no render_markdown(results)")
    return module.render_markdown


def render_block(spec: str, where: str) -> str:
    """The markdown that belongs between the markers of ``spec`` ("PATH [RENDERER]")."""
    from hf_recattn.provenance import provenance_line

    parts = spec.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"{where}: a render marker takes a results path and an optional renderer, got {spec!r}")
    path = ROOT / parts[0]
    if not path.is_file():
        raise ValueError(f"{where}: {parts[0]}: no such results file")
    results = json.loads(path.read_text())
    name = parts[1] if len(parts) == 2 else results.get("benchmark")
    if not name:
        raise ValueError(f"{where}: {parts[0]} has no 'benchmark' field: name the renderer in the marker")
    record = results.get("provenance")
    if not isinstance(record, dict):
        raise ValueError(f"{where}: {parts[0]} has no provenance record; rerun the benchmark that wrote it")
    table = renderer(name)(results).strip("\n")
    return f"{table}\n\n{provenance_line(record)}\n"


def documents() -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in ROOT.glob(pattern)})


def render_text(text: str, where: str, errors: list[str] | None = None) -> str:
    """``text`` with every marked table rendered. With ``errors``, a block that cannot be rendered is left as it
    is and its error appended there; without, the error is raised."""

    def replace(match: re.Match) -> str:
        line = text.count("\n", 0, match.start()) + 1
        try:
            return match.group(1) + render_block(match.group("spec"), f"{where}:{line}") + match.group(4)
        except ValueError as err:
            if errors is None:
                raise
            errors.append(str(err))
            return match.group(0)

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    stale, errors, paths = [], [], documents()
    for path in paths:
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        new = render_text(text, where, errors)
        if new != text:
            stale.append(where)
            if not args.check:
                from hf_recattn.atomic import write_text

                write_text(path, new)
    for error in errors:
        print(f"render_docs: error: {error}", file=sys.stderr)
    if errors:
        return 2
    if args.check and stale:
        print("render_docs: out of date (run python scripts/render_docs.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("checked " if args.check else "rendered ") + f"{len(paths)} documents"
          + (f"; rewrote {', '.join(stale)}" if stale and not args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
