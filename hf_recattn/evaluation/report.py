"""Reports: the comparison table of evaluated models and the report file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..atomic import write_text
from .needles import NEEDLE_HAYSTACKS

#: the comparison table's header of each needle haystack's column
NEEDLE_COLUMNS = {"heldout": "needles (held-out)", "ood": "needles (OOD)"}


#: the report's long-block perplexity fields and the mark of their columns
LONG_FIELDS = {"long_perplexity": "", "long_perplexity_ood": " OOD"}


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def comparison_table(rows: dict[str, dict[str, Any]], reference: str = "teacher") -> str:
    """A markdown table, one row per evaluated model (e.g. teacher / window-only / far-only / hybrid).

    The ratio column divides each perplexity by the ``reference`` row's (the first row if there is none); the
    perplexity on as many blocks of text of another kind (OOD) and its ratio follow when some row has it. The
    passkey column is the synthetic probe (a key in repeated filler); the needle columns (natural-text recall,
    mean accuracy over the tasks and lengths of the held-out and of the out-of-distribution haystack) appear when
    some row has that probe's results, and so do the associative recall column, the recall-by-distance column
    (accuracy at each distance) and a long-block perplexity column for each length measured, of held-out text and
    (marked OOD) of text of another kind."""
    if not rows:
        raise ValueError("comparison_table needs at least one row")
    ref_name = reference if reference in rows else next(iter(rows))
    ref_ppl = rows[ref_name].get("perplexity")
    ref_ood = ood_perplexity(rows[ref_name])
    ood = any(ood_perplexity(report) is not None for report in rows.values())
    recall = any("associative_recall" in report for report in rows.values())
    distances = _measured(rows, "recall_by_distance", "accuracy")
    long = [(field, n) for field in LONG_FIELDS for n in _measured(rows, field, "perplexity")]
    haystacks = [h for h in NEEDLE_HAYSTACKS if any(h in needle_means(report) for report in rows.values())]
    extra_head = ((f" recall @ {'/'.join(distances)} |" if distances else "")
                  + "".join(f" ppl @ {n}{LONG_FIELDS[field]} |" for field, n in long))
    extra_rule = "---:|" * (len(haystacks) + bool(recall) + bool(distances) + len(long))
    needle_head = "".join(f" {NEEDLE_COLUMNS[h]} |" for h in haystacks)
    ood_head = f" perplexity OOD | × {ref_name} |" if ood else ""
    lines = [
        f"| model | perplexity | × {ref_name} |{ood_head} passkey (synthetic) |{needle_head}"
        f"{' recall |' if recall else ''}{extra_head} decode ms/token | context | cache MiB |",
        f"|---|---:|---:|{'---:|---:|' if ood else ''}---:|{extra_rule}---:|---:|---:|",
    ]
    for name, report in rows.items():
        passkey = (report.get("passkey") or {}).get("mean_accuracy")
        recalled = (report.get("associative_recall") or {}).get("mean_accuracy")
        decode = report.get("decode") or {}
        mib = decode["cache_bytes"] / 2**20 if "cache_bytes" in decode else None
        lines.append(
            f"| {name} | " + _ratio_cells(report.get("perplexity"), ref_ppl)
            + (_ratio_cells(ood_perplexity(report), ref_ood) if ood else "")
            + f"{_fmt(passkey, '.0%')} | "
            + "".join(f"{_fmt(needle_means(report).get(h), '.0%')} | " for h in haystacks)
            + (f"{_fmt(recalled, '.0%')} | " if recall else "")
            + _long_cells(report, distances, long)
            + f"{_fmt(decode.get('median_ms_per_token'), '.1f')} | {_fmt(decode.get('context_length'), 'd')} | "
            f"{_fmt(mib, '.2f')} |"
        )
    return "\n".join(lines)


def ood_perplexity(report: dict[str, Any]) -> float | None:
    """A report row's perplexity on short blocks of text of another kind (``perplexity_ood``, at the held-out
    blocks' length); None when not measured."""
    values = list(((report.get("perplexity_ood") or {}).get("perplexity") or {}).values())
    return values[0] if values else None


def _ratio_cells(value: float | None, reference: float | None) -> str:
    """A perplexity cell and its ratio to the reference's."""
    ratio = value / reference if value is not None and reference else None
    return f"{_fmt(value, '.2f')} | {_fmt(ratio, '.3f')} | "


def needle_means(report: dict[str, Any]) -> dict[str, float]:
    """A report row's needle accuracy per haystack (the mean over its tasks and lengths); {} without that probe."""
    return (report.get("needles") or {}).get("accuracy") or {}


def _measured(rows: dict[str, dict[str, Any]], field: str, key: str) -> list[str]:
    """The lengths or distances measured by some row under ``field.key``, in increasing order."""
    found = {k for report in rows.values() for k in ((report.get(field) or {}).get(key) or {})}
    return sorted(found, key=int)


def _long_cells(report: dict[str, Any], distances: list[str], long: list[tuple[str, str]]) -> str:
    """The row's recall-by-distance cell (e.g. ``100/50/0%``) and long-block perplexity cells (field, length), when
    shown."""
    cells = ""
    if distances:
        accuracy = (report.get("recall_by_distance") or {}).get("accuracy") or {}
        shares = [_fmt(None if accuracy.get(d) is None else 100 * accuracy[d], ".0f") for d in distances]
        cells += ("-" if set(shares) == {"-"} else "/".join(shares) + "%") + " | "
    for field, n in long:
        cells += _fmt(((report.get(field) or {}).get("perplexity") or {}).get(n), ".2f") + " | "
    return cells


def write_report(out_dir: str | os.PathLike, report: dict[str, Any], name: str = "report.json") -> Path:
    """Write ``report`` as indented JSON to ``out_dir/name`` atomically (temporary file, then rename)."""
    text = json.dumps(report, indent=2, sort_keys=False, default=str, allow_nan=True)
    return write_text(Path(out_dir) / name, text + "\n")
