"""The results file of a speed benchmark: its measured data, the script's name and the run's provenance.

``scripts/render_docs.py`` renders the docs' tables from these files with the script's ``render_markdown``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hf_recattn.atomic import write_json
from hf_recattn.provenance import provenance

RESULTS = Path(__file__).resolve().parent / "results"


def add_out_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--out JSON``, by default ``benchmarks/results/<default>``."""
    parser.add_argument("--out", type=Path, default=RESULTS / default, metavar="JSON",
                        help=f"write the results here (default benchmarks/results/{default})")


def run_record() -> dict[str, Any]:
    """The provenance of this run; take it before measuring (after setting the thread count), so that it names
    the code that ran even if files change while it runs."""
    return provenance(["python", *sys.argv])


def write_results(path: Path, benchmark: str, record: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """Write ``data`` with ``"benchmark"`` and ``"provenance"`` to ``path`` (atomically); returns the results."""
    results = {"benchmark": benchmark, "provenance": record, **data}
    write_json(path, results)
    print(f"wrote {path}", file=sys.stderr)
    return results
