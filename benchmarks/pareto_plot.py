"""The Pareto figure of benchmarks/pareto.py: cache size against perplexity ratio and recall.

Every point carries a number, not its name; a key beside the panels maps numbers to names (models in the order of
the table, kvpress peers after them). Numbers of points that lie on top of each other share one label. Models
whose cache grows with the context are drawn hollow, and a step line draws the constant-memory frontier: the
lowest perplexity ratio, or the best recall, that a model of constant cache reaches at each cache size or below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_recattn.conversion.recipe import load_recipe
from hf_recattn.modeling.registry import expand_preset, mixer_class

PEER_COLOR = "C3"
NESTED_SPECS = ("far", "others")  # options that hold a mixer spec, possibly as a family or preset name
LABEL_RADIUS = (0.045, 0.035)  # axes fractions (x, y) within which numbers share one label


# ----- which caches grow ------------------------------------------------------------------------------------
def spec_grows(spec: Any, where: str) -> bool:
    """Whether a mixer spec (nested ones included: a hybrid's ``far``) keeps a KV cache of the whole context."""
    if isinstance(spec, str):
        spec = {"mixer": spec}
    if not isinstance(spec, dict) or spec.get("mixer") == "none":  # a hybrid without a far part
        return False
    if isinstance(spec.get("mixer"), str):
        spec = expand_preset(spec)
        kind = mixer_class(spec["mixer"], where).state_kind
        if spec["mixer"] == "retrieval_heads":
            kind = "kv" if spec.get("heads") else "window"  # no heads listed: the other mixer's kind, checked below
        if kind == "kv":
            return True
    nested = [value for key, value in spec.items() if isinstance(value, dict) or key in NESTED_SPECS]
    return any(spec_grows(value, where) for value in nested)


def _attention_grows(attention: Any, overrides: dict[str, Any] | None, where: str) -> bool:
    layers = (overrides or {}).items()
    return spec_grows(attention, where) or any(spec_grows(spec, f"{where} layer {k}") for k, spec in layers)


def _recipe_grows(name: str, recipe_name: str) -> bool:
    try:
        recipe = load_recipe(recipe_name)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"pareto plot: row {name!r} has no cache_grows and its recipe does not load ({err})") from err
    kept_teacher_layers = recipe.layers is not None and recipe.layers.get("convert") != "full_attention"
    return (kept_teacher_layers or recipe.retrieval_heads.max_heads > 0
            or _attention_grows(recipe.attention, recipe.attention_overrides, f"recipe {recipe_name}"))


def cache_grows(name: str, row: dict[str, Any]) -> bool:
    """Whether a row's cache grows with the context: its ``cache_grows`` field where measured with it; else the
    teacher grows, a swap grows when its recorded spec holds a KV-cache mixer, and a converted checkpoint when its
    shipped recipe does, keeps retrieval heads, or keeps teacher layers other than sliding windows."""
    if "cache_grows" in row:
        return bool(row["cache_grows"])
    if name == "teacher":
        return True
    if "attention" in row:
        swap = row["attention"]
        return _attention_grows(swap["attention"], swap.get("attention_overrides"), f"row {name!r}")
    if "recipe" in row:
        return _recipe_grows(name, row["recipe"])
    raise SystemExit(f"pareto plot: row {name!r} says neither cache_grows nor its attention spec or recipe")


# ----- the frontier and the numbers -------------------------------------------------------------------------
def frontier(points: dict[str, tuple[float, float]], lower_is_better: bool) -> list[str]:
    """The names whose value (second item) beats every point of no larger cache (first item), by cache."""
    sign = 1.0 if lower_is_better else -1.0
    best, names = None, []
    for name, (_, value) in sorted(points.items(), key=lambda item: (item[1][0], sign * item[1][1], item[0])):
        if best is None or sign * value < sign * best:
            names.append(name)
            best = value
    return names


def constant_frontier(rows: dict[str, dict[str, Any]], value: Callable[[dict[str, Any]], float | None],
                      lower_is_better: bool) -> list[str]:
    """The frontier of ``value`` over the rows whose cache does not grow with the context."""
    points = {name: (row["cache_mib"], value(row)) for name, row in rows.items() if not cache_grows(name, row)}
    return frontier({name: p for name, p in points.items() if p[1] is not None}, lower_is_better)


def numbering(models: dict[str, dict[str, Any]], peers: dict[str, dict[str, Any]] | None = None) -> dict[str, int]:
    """1, 2, ... for the models by cache (largest first, then by name), then the peers the same way."""
    clash = set(models) & set(peers or {})
    if clash:
        raise SystemExit(f"pareto plot: {sorted(clash)} name both a model and a peer")

    def order(rows: dict[str, dict[str, Any]]) -> list[str]:
        return sorted(rows, key=lambda name: (-rows[name]["cache_mib"], name))

    return {name: i for i, name in enumerate(order(models) + order(peers or {}), start=1)}


def label_groups(points: list[tuple[int, float, float]], radius: tuple[float, float] = LABEL_RADIUS
                 ) -> list[tuple[list[int], float, float]]:
    """(numbers, x, y) labels: each point (number, x, y in axes fractions) joins the first label within
    ``radius`` of it, else starts one."""
    groups: list[tuple[list[int], float, float]] = []
    for number, x, y in sorted(points):
        for numbers, gx, gy in groups:
            if abs(x - gx) <= radius[0] and abs(y - gy) <= radius[1]:
                numbers.append(number)
                break
        else:
            groups.append(([number], x, y))
    return groups


# ----- drawing ----------------------------------------------------------------------------------------------
def _mean(cells: dict[str, float]) -> float:
    return sum(cells.values()) / max(len(cells), 1)


def _label(ax: Any, points: list[tuple[int, float, float]], color: str, below: bool = False) -> None:
    """Numbered labels for data points (number, x, y), points close on screen sharing one; above right of the
    points, or ``below`` right (the peers, so that theirs and the models' labels do not meet)."""
    ax.autoscale_view()
    to_axes = ax.transData + ax.transAxes.inverted()
    placed = [(n, *to_axes.transform((x, y))) for n, x, y in points]
    for numbers, x, y in label_groups(placed):
        ax.annotate(",".join(map(str, numbers)), (x, y), xycoords="axes fraction", fontsize=7, color=color,
                    xytext=(3, -10 if below else 3), textcoords="offset points")


def _step(ax: Any, rows: dict[str, dict[str, Any]], names: list[str], value: Callable, x_end: float, **kw: Any
          ) -> None:
    xs = [rows[n]["cache_mib"] for n in names] + [x_end]
    ys = [value(rows[n]) for n in names]
    ax.step(xs, [*ys, ys[-1]], where="post", lw=1, alpha=0.6, **kw)


def _scatter(ax: Any, x: float, y: float, marker: str, color: str, hollow: bool) -> None:
    if marker == "x":  # an unfilled marker: growing caches thinner
        ax.scatter(x, y, marker=marker, color=color, linewidths=0.6 if hollow else 1.2)
    else:
        ax.scatter(x, y, marker=marker, facecolors="none" if hollow else color, edgecolors=color, linewidths=1)


def _perplexity_panel(ax: Any, results: dict[str, Any], numbers: dict[str, int],
                      peers: dict[str, dict[str, Any]]) -> None:
    rows, teacher = results["models"], results["models"]["teacher"]
    evals = [k.removeprefix("perplexity_") for k in teacher if k.startswith("perplexity_")]
    for e, marker, color in zip(evals, "os^", ("C0", "C2", "C4"), strict=False):
        for name, row in rows.items():
            _scatter(ax, row["cache_mib"], row[f"perplexity_{e}"] / teacher[f"perplexity_{e}"], marker, color,
                     cache_grows(name, row))
        ax.scatter([], [], marker=marker, color=color, label=f"held-out perplexity / teacher ({e})")
    first = evals[0]

    def ratio(row: dict[str, Any]) -> float:
        return row[f"perplexity_{first}"] / teacher[f"perplexity_{first}"]

    x_end = max(row["cache_mib"] for row in {**rows, **peers}.values())
    _step(ax, rows, constant_frontier(rows, ratio, lower_is_better=True), ratio, x_end, color="C0",
          label=f"constant-memory frontier ({first})")
    peer_points = [(numbers[n], r["cache_mib"], r["perplexity_ratio"]["in-distribution"]) for n, r in peers.items()
                   if "in-distribution" in r["perplexity_ratio"]]
    for _, x, y in peer_points:
        ax.scatter(x, y, marker="D", color=PEER_COLOR)
    if peers:
        ax.scatter([], [], marker="D", color=PEER_COLOR, label="kvpress on the teacher (continuation perplexity)")
    ax.set(xscale="log", yscale="log", ylabel="perplexity / teacher")
    ax.axhline(1.0, color="grey", lw=0.5)
    _label(ax, [(numbers[n], r["cache_mib"], ratio(r)) for n, r in rows.items()], "black")
    _label(ax, peer_points, PEER_COLOR, below=True)


def _recall_panel(ax: Any, results: dict[str, Any], numbers: dict[str, int],
                  peers: dict[str, dict[str, Any]]) -> None:
    rows = results["models"]

    def passkey(row: dict[str, Any]) -> float:
        return 100 * _mean(row["passkey"])

    def recall(row: dict[str, Any]) -> float:
        return 100 * (row["associative_recall_mean"] or 0.0)

    x_end = max(row["cache_mib"] for row in {**rows, **peers}.values())
    for value, marker, color, what in ((passkey, "o", "C0", "passkey (mean over lengths)"),
                                       (recall, "x", "C1", "associative recall (mean over cells)")):
        for name, row in rows.items():
            _scatter(ax, row["cache_mib"], value(row), marker, color, cache_grows(name, row))
        ax.scatter([], [], marker=marker, color=color, label=what)
        _step(ax, rows, constant_frontier(rows, value, lower_is_better=False), value, x_end, color=color,
              label=f"constant-memory frontier: {what.split(' (')[0]}")
    for row in peers.values():
        ax.scatter(row["cache_mib"], passkey(row), marker="D", color=PEER_COLOR)
    if peers:
        ax.scatter([], [], marker="D", color=PEER_COLOR, label="kvpress on the teacher: passkey")
    ax.set(xscale="log", ylabel="accuracy %", ylim=(-5, 105))
    points = [(numbers[n], r["cache_mib"], passkey(r)) for n, r in rows.items()]
    points += [(numbers[n], r["cache_mib"], recall(r)) for n, r in rows.items() if abs(recall(r) - passkey(r)) > 3]
    _label(ax, [p for p in points if p[2] > 0], "black")  # the floor holds every other model: unnumbered
    _label(ax, [(numbers[n], r["cache_mib"], passkey(r)) for n, r in peers.items() if passkey(r) > 0], PEER_COLOR,
           below=True)
    ax.text(0.01, 0.06, "unnumbered points: 0%", fontsize=7, style="italic", transform=ax.transAxes)


def _key(ax: Any, results: dict[str, Any], numbers: dict[str, int]) -> None:
    """The numbers' names, one a line; models whose cache grows marked."""
    ax.axis("off")
    lines = len(numbers) + 2
    for i, (name, number) in enumerate(sorted(numbers.items(), key=lambda item: item[1])):
        row = results["models"].get(name)
        mark = " (cache grows)" if row is not None and cache_grows(name, row) else ""
        ax.text(0, 1 - (i + 1) / lines, f"{number:>2}  {name}{mark}", fontsize=7, va="center",
                color="black" if row is not None else PEER_COLOR, transform=ax.transAxes)
    ax.text(0, 1, "hollow: cache grows with the context", fontsize=7, va="center", style="italic",
            transform=ax.transAxes)


def plot(results: dict[str, Any], path: str, peers: dict[str, dict[str, Any]] | None = None) -> str:
    """Cache size against perplexity ratio and against recall (``peers`` as diamonds), numbered points and their
    key; returns what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    peers = peers or {}
    numbers = numbering(results["models"], peers)
    fig, (left, right, key) = plt.subplots(1, 3, figsize=(17, 7), width_ratios=(1, 1, 0.55))
    _perplexity_panel(left, results, numbers, peers)
    _recall_panel(right, results, numbers, peers)
    for ax in (left, right):
        ax.set_xlabel(f"cache MiB per sequence at {results['settings']['context']} tokens (log)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    _key(key, results, numbers)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
