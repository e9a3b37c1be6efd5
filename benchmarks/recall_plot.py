"""The figure of docs/recall.md: recall on natural text against the bytes a model keeps per sequence.

One panel per length: every row of a ``natural_recall.py`` results file (the teacher at its KV cache, the window
of 512 + 4 sinks, swaps and students) and every press of a ``kv_needles`` results file (kv_compression.py
``--probe needles``) in each mode, at its kept tokens' bytes. A point pools the haystacks' cells of one task
(accuracy over all their prompts, with its Wilson 95% interval). Presses of one budget are drawn slightly apart
sideways so that they do not hide each other (their bytes are the budget's); a line joins a press's budgets in one
mode. matplotlib comes with the ``bench`` extra.

    python benchmarks/recall_plot.py --recall benchmarks/results/natural_recall_single_cpu.json \\
        --presses benchmarks/results/kv_needles_cpu.json --out docs/recall_vs_bytes.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kv_needles import AGNOSTIC, MODES, NEEDLE_PRESSES, pooled

from hf_recattn.atomic import atomic_file

REFERENCE_COLORS = ("0.35", "C5", "C6", "C8", "C7", "C9")
SPREAD = 0.025  # how far apart sideways (a share of the bytes) points of the same bytes are drawn
TICKS = (2, 5, 10, 20, 50, 100, 200, 500, 1000)


def reference_series(recall: dict[str, Any], task: str, haystacks: list[str]) -> list[dict[str, Any]]:
    """A series per natural_recall row: {length: (MiB at that length, accuracy, interval)}."""
    out = []
    for name, row in recall["models"].items():
        per_haystack = row["cells"].get(task, {})
        points = {}
        for length in map(str, recall["settings"]["lengths"]):
            got = pooled(per_haystack, haystacks, length)
            if got is not None and length in row["cache_mib"]:
                points[length] = (row["cache_mib"][length], got[0], got[1])
        out.append({"label": name, "kind": "teacher" if name == "teacher" else "model", "points": points})
    same: dict[tuple[float, ...], list[dict[str, Any]]] = {}  # rows of the same bytes: drawn slightly apart
    for series in out:
        same.setdefault(tuple(round(p[0], 3) for p in series["points"].values()), []).append(series)
    for group in same.values():
        for k, series in enumerate(group):
            nudge = 1 + SPREAD * (k - (len(group) - 1) / 2)
            series["points"] = {n: (p[0] * nudge, *p[1:]) for n, p in series["points"].items()}
    return out


def press_series(presses: dict[str, Any], task: str, haystacks: list[str]) -> list[dict[str, Any]]:
    """A series per press and mode (its budgets joined), each point nudged sideways by the press's place."""
    slots = [(p, m) for p in NEEDLE_PRESSES for m in MODES]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in presses["rows"].values():
        if row["press"] is None or "error" in row:
            continue
        slot = (row["press"], row["mode"])
        nudge = 1 + SPREAD * (slots.index(slot) - (len(slots) - 1) / 2) if slot in slots else 1.0
        series = out.setdefault(slot, {"label": f"{row['press']} ({row['mode']})", "kind": "press",
                                       "press": row["press"], "mode": row["mode"], "points": {}})
        for length in map(str, presses["settings"]["lengths"]):
            got = pooled(row["cells"].get(task, {}), haystacks, length)
            if got is not None:
                series["points"].setdefault(length, []).append((row["cache_mib"] * nudge, got[0], got[1]))
    return [s | {"points": {n: sorted(p) for n, p in s["points"].items()}} for s in out.values() if s["points"]]


def _style(series: dict[str, Any], index: int) -> dict[str, Any]:
    if series["kind"] == "teacher":
        return {"color": "black", "marker": "*", "markersize": 12, "linestyle": "none"}
    if series["kind"] == "model":  # colors the presses (C0-C4) do not use
        return {"color": REFERENCE_COLORS[index % len(REFERENCE_COLORS)], "marker": "PXD^v<>"[index % 7],
                "markersize": 9, "linestyle": "none"}
    color = f"C{NEEDLE_PRESSES.index(series['press'])}" if series["press"] in NEEDLE_PRESSES else "C9"
    filled = series["mode"] == AGNOSTIC
    return {"color": color, "marker": "o" if filled else "s", "markersize": 6, "linewidth": 0.8,
            "markerfacecolor": color if filled else "white", "linestyle": "-" if filled else "--"}


def plot(recall: dict[str, Any], presses: dict[str, Any] | None, path: str | Path, task: str = "single_number",
         haystacks: list[str] | None = None) -> str:
    """Draw the figure to ``path`` (written atomically); returns a line naming it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    haystacks = haystacks or list(recall["settings"]["haystacks"])
    lengths = [str(n) for n in recall["settings"]["lengths"]]
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    every = reference_series(recall, task, haystacks) + (press_series(presses, task, haystacks) if presses else [])
    xs = [p[0] for s in every for got in s["points"].values() for p in (got if isinstance(got, list) else [got])]
    limits = (min(xs) / 1.4, max(xs) * 1.4)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths) + 3.2, 4.6), sharey=True, squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        for index, series in enumerate(every):
            points = series["points"].get(length)
            if not points:
                continue
            points = points if isinstance(points, list) else [points]
            xs, ys = [p[0] for p in points], [100 * p[1] for p in points]
            errors = [[100 * (p[1] - p[2][0]) for p in points], [100 * (p[2][1] - p[1]) for p in points]]
            ax.errorbar(xs, ys, yerr=errors, capsize=2, elinewidth=0.6, label=series["label"],
                        **_style(series, index))
        ax.set_xscale("log")
        ax.set_xlim(*limits)
        ax.xaxis.set_major_locator(FixedLocator(TICKS))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{task}, {int(length) // 1024}k tokens ({' + '.join(haystacks)})")
        ax.set_xlabel("cache per sequence, MiB (fp32, log scale)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("recall, % (Wilson 95% interval)")
    axes[0][0].set_ylim(-3, 103)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 3.0 / fig.get_figwidth(), 1))
    with atomic_file(path, binary=True) as file:
        fig.savefig(file, dpi=110, format="png")
    plt.close(fig)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recall", type=Path, required=True, help="a natural_recall.py results file")
    parser.add_argument("--presses", type=Path, default=None, help="a kv_compression.py --probe needles results file")
    parser.add_argument("--task", default="single_number")
    parser.add_argument("--out", type=Path, default=Path("docs/recall_vs_bytes.png"))
    args = parser.parse_args(argv)
    recall = json.loads(args.recall.read_text())
    presses = json.loads(args.presses.read_text()) if args.presses else None
    print(plot(recall, presses, args.out, args.task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
