"""Where each constant-memory student stands against the project's recall bar, read from the natural-text result
files (nothing is measured here): single needles at 1k and 4k within 10 points of the teacher, multi-key and
multi-query at 2k within 20, perplexity on 512- and 4,096-token blocks at most 1.10x the teacher's, each on
held-out corpus documents and on the corpus's license texts (docs/recall.md). Beside each recall cell, the best
figure of the window of 512 + 4 sinks and of every kvpress press that keeps no more bytes than the student.

    python benchmarks/recall_bar.py             # every teacher and student of STUDENTS; writes recall_bar.json
    python benchmarks/recall_bar.py --student gemma3-270m "NAME (default)" --out /tmp/bar.json   # another row

A student counts as within the bar on a cell when it is no further below the teacher than the bar allows; the
last column names the cells where it is not. A cell measured on more prompts (a ``wider`` file: a natural_recall
run with a larger ``--prompts``, its kvpress rivals in ``wider_presses``) is read from there when that file holds
both the student and the teacher: the student, the teacher and the rivals of a cell always answer the same prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from results_file import RESULTS, add_out_argument, run_record, write_results

from hf_recattn.evaluation.needles import NEEDLE_PROMPTS

#: per teacher: its label and the result files the bar reads
SOURCES: dict[str, dict[str, Any]] = {
    "embedded": {
        "label": "SmolLM2-135M-Instruct",
        "single": "natural_recall_single_cpu.json",
        "multi": "natural_recall_multi_cpu.json",
        "perplexity": "natural_perplexity_cpu.json",
        "presses": ["kv_needles_cpu.json", "kv_needles_int8_cpu.json", "kv_needles_int4_cpu.json",
                    "kv_needles_int4_ood_cpu.json", "kv_needles_multi_cpu.json", "kv_needles_multi_int8_cpu.json",
                    "kv_needles_multi_int4_cpu.json"],
        "wider": ["natural_recall_multikey40_cpu.json"],
        "wider_presses": ["kv_needles_multikey40_cpu.json", "kv_needles_multikey40_int8_cpu.json",
                          "kv_needles_multikey40_int4_cpu.json"],
    },
    "gemma3-270m": {
        "label": "Gemma 3 270M",
        "single": "natural_recall_single_gemma3_cpu.json",
        "multi": "natural_recall_multi_gemma3_cpu.json",
        "perplexity": "natural_perplexity_gemma3_cpu.json",
        "presses": ["kv_needles_gemma3_int4_cpu.json", "kv_needles_gemma3_int4_aware_cpu.json",
                    "kv_needles_gemma3_multi_int4_cpu.json", "kv_needles_gemma3_multi_int4g16_cpu.json"],
        "wider": ["natural_recall_multikey40_gemma3_cpu.json"],
        "wider_presses": ["kv_needles_gemma3_multikey40_int4_cpu.json",
                          "kv_needles_gemma3_multikey40_int4g16_cpu.json",
                          "kv_needles_gemma3_multikey40_k8v4g16_cpu.json"],
    },
}

#: the students the table shows, per teacher (row names of the result files)
STUDENTS: dict[str, list[str]] = {
    "embedded": ["retrieval9-int8-int4keydiff (default)", "retrieval9-int8-int4keydiff-w16 (quick)",
                 "retrieval9-int8-int4keydiff-lora32-multikey (quick)"],
    "gemma3-270m": ["gemma3-270m-w16-sink4c-int8keydiff1960 (default)",
                    "gemma3-270m-w8-recent240-int4keydiff1960 (default)",
                    "gemma3-270m-w4-recent240-int8keydiff1505 (default)",
                    "gemma3-270m-w4-recent120-int8keydiff1878 (default)",
                    "gemma3-270m-w4-recent120-int4keydiff3036 (default)",
                    "gemma3-270m-w4-recent120-int4keydiffspan3036 (default)",
                    "gemma3-270m-w4-recent120-int4keydiffspan3036 weights, full-attention caches k8v4g16 2313"],
}

WINDOW = "window 512 + 4 sinks"
#: after a press's name where its budget held every prompt of the cell whole: the teacher, its cache rounded
WHOLE = ", every prompt whole"
#: a press sized to a student's bytes keeps whole tokens, so its cache may exceed them by a fraction of a token
SAME_BYTES = 1e-3
HAYSTACKS = ("heldout", "ood")
#: (column, task, length, points below the teacher the bar allows)
RECALL_CELLS = (("single 1k", "single_number", "1024", 10), ("single 4k", "single_number", "4096", 10),
                ("multi-key 2k", "multi_key", "2048", 20), ("multi-query 2k", "multi_query", "2048", 20))
#: (column, block length, the most perplexity over the teacher's the bar allows)
PERPLEXITY_CELLS = (("ppl x teacher 512", "512", 1.10), ("ppl x teacher 4096", "4096", 1.10))


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / name
    if not path.is_file():
        raise SystemExit(f"recall_bar: {path} is missing: run the benchmark that writes it first")
    return json.loads(path.read_text())


def _cell(row: dict[str, Any], task: str, haystack: str, length: str) -> dict[str, Any] | None:
    return row.get("cells", {}).get(task, {}).get(haystack, {}).get(length)


def _accuracy(row: dict[str, Any], task: str, haystack: str, length: str) -> float | None:
    cell = _cell(row, task, haystack, length)
    return None if cell is None else cell["accuracy"]


def _press_rows(files: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every press row of the kvpress results (by file name): its name, cache MiB, accuracy per
    "task/haystack/length", and the cells whose every prompt its budget held whole (``whole``: nothing pressed,
    the teacher's cache only rounded to the row's dtype), and each cell's prompt count."""
    rows = []
    for results in files.values():
        coded = results["settings"].get("cache_dtype") or "fp32"
        for row in results["rows"].values():
            if row.get("press") is None or row.get("cache_mib") is None or "error" in row:
                continue
            cells = {f"{task}/{h}/{n}": cell for task, per_h in row["cells"].items() for h, per_n in per_h.items()
                     for n, cell in per_n.items()}
            whole = {key for key, cell in cells.items()
                     if all(prompt.get("cache_tokens", math.inf) < row["kept_tokens"] for prompt in cell["prompts"])}
            mode = str(row.get("mode", "")).removeprefix("question-")
            rows.append({"name": f"{row['press']} {mode}, {coded}".replace(" ,", ","), "cache_mib": row["cache_mib"],
                         "accuracy": {key: cell["summary"]["accuracy"] for key, cell in cells.items()},
                         "prompts": {key: cell["summary"].get("prompts") for key, cell in cells.items()},
                         "whole": whole})
    return rows


def _widest(name: str, task: str, haystack: str, length: str, sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows of the source that measured the cell on the most prompts while holding the student's and the
    teacher's cell (the first source, the cell's own file, wins ties and stands when none does)."""
    def prompts(models: dict[str, Any]) -> int:
        cells = [_cell(models.get(who, {}), task, haystack, length) for who in (name, "teacher")]
        return -1 if None in cells else min(cell.get("prompts", 0) for cell in cells)

    best = max(sources, key=prompts)  # max keeps the first of equals
    return best if prompts(best) >= 0 else sources[0]


def _student(name: str, rows: dict[str, Any], presses: list[dict[str, Any]]) -> dict[str, Any]:
    """One student's cells, the teacher's beside them (both from the file that measured the cell on the most
    prompts), and the cells where it misses the bar."""
    teacher_ppl = rows["perplexity"].get("teacher")
    single, ppl = rows["single"][name], rows["perplexity"].get(name)
    mib = single["cache_mib"]["4096"]
    out: dict[str, Any] = {"cache_mib": mib, "recall": {}, "perplexity": {}, "misses": [], "rivals": {}}
    measured: dict[str, dict[str, Any]] = {}
    for column, task, length, points in RECALL_CELLS:
        own = rows["single"] if task == "single_number" else rows["multi"]
        for h in HAYSTACKS:
            source = measured[f"{column}/{h}"] = _widest(name, task, h, length, [own, *rows["wider"]])
            got = _accuracy(source.get(name, {}), task, h, length)
            ref = _accuracy(source.get("teacher", {}), task, h, length)
            cell = _cell(source.get(name, {}), task, h, length) or {}
            out["recall"][f"{column}/{h}"] = {"student": got, "teacher": ref, "prompts": cell.get("prompts")}
            if got is None or ref is None or got < ref - points / 100 - 1e-9:
                out["misses"].append(f"{column} {h}")
    for column, length, most in PERPLEXITY_CELLS:
        for h in HAYSTACKS:
            ratio = None
            if ppl is not None and teacher_ppl is not None:
                ratio = ppl["perplexity"][h][length] / teacher_ppl["perplexity"][h][length]
            out["perplexity"][f"{column}/{h}"] = ratio
            if ratio is None or ratio > most:
                out["misses"].append(f"{column} {h}")
    for column, task, length, _points in RECALL_CELLS:
        for h in HAYSTACKS:
            key, source = f"{task}/{h}/{length}", measured[f"{column}/{h}"]
            window = source.get(WINDOW)
            prompts = out["recall"][f"{column}/{h}"]["prompts"]
            rivals = [(p["accuracy"][key], p["name"] + (WHOLE if key in p["whole"] else "")) for p in presses
                      if key in p["accuracy"] and p["cache_mib"] <= mib * (1 + SAME_BYTES)
                      and (prompts is None or p["prompts"].get(key) in (None, prompts))]
            window_accuracy = None if window is None else _accuracy(window, task, h, length)
            if window_accuracy is not None:
                rivals.append((window_accuracy, WINDOW))
            if rivals:
                best, who = max(rivals)
                mine = _accuracy(source.get(name, {}), task, h, length)
                out["rivals"][f"{column}/{h}"] = {"accuracy": best, "name": who, "student": mine}
                if mine is not None and mine < 1.0 and best >= mine:
                    out["misses"].append(f"{column} {h} (not ahead of {who})")
    return out


def collect(teachers: dict[str, list[str]]) -> dict[str, Any]:
    """The bar's cells for every teacher's students, from the result files (each read once)."""
    data: dict[str, Any] = {"teachers": {}, "sources": {}, "notes": []}
    for key, students in teachers.items():
        files = SOURCES[key]
        wider, wider_presses = files.get("wider", []), files.get("wider_presses", [])
        loaded = {name: _load(name) for name in (files["single"], files["multi"], files["perplexity"],
                                                 *files["presses"], *wider, *wider_presses)}
        for name, results in loaded.items():
            data["sources"][name] = {"commit": results["provenance"]["commit"],
                                     "date": results["provenance"]["date"]}
        rows: dict[str, Any] = {kind: loaded[files[kind]]["models"] for kind in ("single", "multi", "perplexity")}
        rows["wider"] = [loaded[name]["models"] for name in wider]
        missing = [name for name in students if name not in rows["single"]]
        if missing:
            raise SystemExit(f"recall_bar: {files['single']} has no row {missing[0]!r}: measure it first")
        presses = _press_rows({name: loaded[name] for name in (*files["presses"], *wider_presses)})
        data["teachers"][key] = {"label": files["label"],
                                 "teacher_cache_mib_8k": rows["single"]["teacher"]["cache_mib"]["8192"],
                                 "students": {name: _student(name, rows, presses) for name in students}}
    return data


def _pair(cell: dict[str, Any], field: str) -> str:
    values = [cell[f"{h}"][field] for h in HAYSTACKS]
    return " / ".join("-" if v is None else f"{100 * v:.0f}" for v in values)


def _misses(misses: list[str]) -> str:
    """The missed cells, a cell missed on both kinds of text named once: "single 4k (both), multi-key 2k heldout"."""
    haystacks: dict[tuple[str, str], list[str]] = {}
    for miss in misses:
        column, haystack, rest = re.fullmatch(r"(.*?) (heldout|ood)(.*)", miss).groups()
        haystacks.setdefault((column, rest), []).append(haystack)
    return ", ".join(f"{column} {'(both)' if len(found) == len(HAYSTACKS) else found[0]}{rest}"
                     for (column, rest), found in haystacks.items()) or "none"


def render_markdown(results: dict[str, Any]) -> str:
    """One row per student: its bytes, each recall cell as student (teacher), held-out / license texts, each
    perplexity ratio, the best rival's single needles at 4k, and the cells that miss the bar."""
    head = ["teacher", "student", "MiB", *(c[0] for c in RECALL_CELLS), *(c[0] for c in PERPLEXITY_CELLS),
            "best rival at <= bytes, single 4k", "misses the bar on"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 4) + "---|---|"]
    for per_teacher in results["teachers"].values():
        for name, row in per_teacher["students"].items():
            cells = [per_teacher["label"], name.removesuffix(" (default)"), f"{row['cache_mib']:.2f}"]
            for column, *_ in RECALL_CELLS:
                got = {h: row["recall"][f"{column}/{h}"] for h in HAYSTACKS}
                counts = sorted({c["prompts"] for c in got.values() if c.get("prompts") not in (None, NEEDLE_PROMPTS)})
                wider = "".join(f", {n} prompts" for n in counts)
                cells.append(f"{_pair(got, 'student')} ({_pair(got, 'teacher')}){wider}")
            for column, *_ in PERPLEXITY_CELLS:
                ratios = [row["perplexity"][f"{column}/{h}"] for h in HAYSTACKS]
                cells.append(" / ".join("-" if r is None else f"{r:.3f}" for r in ratios))
            rivals = [row["rivals"].get(f"single 4k/{h}") for h in HAYSTACKS]
            cells.append(" / ".join("-" if r is None else f"{100 * r['accuracy']:.0f} ({r['name']})" for r in rivals))
            cells.append(_misses(row["misses"]))
            lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"Each cell: held-out corpus documents / the corpus's license texts; recall in % of {NEEDLE_PROMPTS} prompts "
        "(of more where the cell says so: a cell measured on more prompts for the student and the teacher is read "
        "from that run, its rivals at the same count), the teacher's in brackets. The bar: single needles within 10 "
        "points of the teacher, multi-key and multi-query within 20, perplexity at most 1.10x the teacher's "
        "(docs/recall.md). MiB: the student's state per sequence at any context. The rival column: the best of the "
        "window of 512 + 4 sinks and of every kvpress press (question-agnostic or question-aware, any cache dtype) "
        "that keeps no more bytes than the student (within 0.1%: a press keeps whole tokens), shown for single "
        "needles at 4k; the bar asks the student to be ahead of the best rival in every recall cell where the student"
        " answers less than all prompts, and the last column names each cell where it is not.",
        "Read from " + ", ".join(f"{name} ({s['commit'][:10]}, {s['date'][:10]})"
                                 for name, s in sorted(results["sources"].items())) + ".",
    ]
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teachers", nargs="+", default=list(STUDENTS), choices=list(SOURCES))
    p.add_argument("--student", nargs=2, action="append", default=[], metavar=("TEACHER", "ROW"),
                   help="a row of the teacher's result files to show (repeatable; replaces that teacher's STUDENTS), "
                        "e.g. --student gemma3-270m 'gemma3-270m-w4-recent240-int8keydiff1505 (default)'")
    add_out_argument(p, "recall_bar.json")
    args = p.parse_args(argv)
    students = {key: STUDENTS[key] for key in args.teachers}
    chosen: dict[str, list[str]] = {}
    for teacher, row in args.student:
        if teacher not in SOURCES:
            p.error(f"--student {teacher!r}: the teacher must be one of {sorted(SOURCES)}")
        chosen.setdefault(teacher, []).append(row)
    students.update(chosen)
    record = run_record()
    results = write_results(Path(args.out), "recall_bar", record, collect(students))
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
