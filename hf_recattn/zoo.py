"""The zoo: shipped recipes applied to the embedded teachers, with what their conversion reports measured.

Entries are never typed by hand: ``scripts/build_zoo.py`` reads conversion output folders (``report.json`` and
``model/``), renders one model card per entry into ``model_cards/`` and writes the index (``model_cards/README.md``
and ``model_cards/zoo.json``, which ships inside the package as ``hf_recattn/zoo.json``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .atomic import write_text
from .conversion.recipe import NO_BUDGETS, is_packaged_source, report_training_tokens
from .embedded_teachers import DEFAULT, EMBEDDED, embedded_teacher
from .evaluation.needles import NEEDLE_HAYSTACKS
from .evaluation.report import needle_means
from .model_card import BYTES_PER_ELEMENT, build_model_card
from .modeling.configuration import read_checkpoint_config
from .modeling.hybrid_options import hybrid_cache_slots
from .provenance import provenance_line
from .state_size import exact_cache_bytes, state_bytes, state_size_report, teacher_kv_bytes

ZOO_FILE = Path(__file__).parent / "zoo.json"
STATE_CONTEXT = 8192


def zoo_entries(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The zoo index as a list of dicts (name, recipe, teacher, state size, quality, command, card)."""
    path = Path(path) if path is not None else ZOO_FILE
    if not path.is_file():
        return []
    return json.loads(path.read_text())["entries"]


def teacher_label(spec: str) -> str:
    """A short lowercase name for the teacher a run was given: the embedded teacher's table name, else the last
    part of its path or Hub id (``embedded`` is the default teacher's name)."""
    if embedded_teacher(spec) is not None:
        return DEFAULT if spec.strip().lower() == EMBEDDED else spec.strip().lower()
    return re.sub(r"[^a-z0-9.]+", "-", Path(spec.rstrip("/")).name.lower()).strip("-") or "teacher"


def entry_from_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """One zoo entry from a conversion output folder; ValueError naming the file when it lacks a report."""
    run = Path(run_dir)
    report_path = run / "report.json"
    if not report_path.is_file():
        raise ValueError(f"{report_path}: no conversion report (run `hf-recattn convert` to completion first)")
    report = json.loads(report_path.read_text())
    if not report.get("student") or not report.get("comparison"):
        raise ValueError(f"{report_path}: the conversion ran without evaluation (--no-eval); rerun it with it")
    if not isinstance(report.get("provenance"), dict):
        raise ValueError(f"{report_path}: no provenance record (written by an older hf_recattn); rerun the conversion")
    config = read_checkpoint_config(run / "model")
    rows = state_size_report(config, STATE_CONTEXT)
    state = state_bytes(rows, BYTES_PER_ELEMENT)
    kv = teacher_kv_bytes(rows, BYTES_PER_ELEMENT)
    recipe = report["recipe"]
    student, teacher = report["student"], report["comparison"]["teacher"]
    passkey = student.get("passkey") or {}
    budget = recipe.get("budget", "quick")
    teacher_spec = _run_teacher(run)
    return {
        "name": _entry_name(teacher_label(teacher_spec), recipe["name"]),
        "recipe": recipe["name"],
        "teacher": report.get("teacher"),
        "budget": budget,
        "training_tokens": report_training_tokens(report),
        "state_mib_at_8k": round(state / 2**20, 3),
        "teacher_kv_mib_at_8k": round(kv / 2**20, 3),
        "state_fraction_at_8k": round(state / kv, 4),
        "cache_slots": hybrid_cache_slots(config),
        "exact_cache_mib_at_8k": round(exact_cache_bytes(config, STATE_CONTEXT, BYTES_PER_ELEMENT) / 2**20, 3),
        "perplexity": round(student["perplexity"], 3),
        "teacher_perplexity": round(teacher["perplexity"], 3),
        "perplexity_ratio": round(student["perplexity"] / teacher["perplexity"], 4),
        "eval_tokens": student.get("eval_tokens"),
        "passkey": passkey.get("accuracy"),
        "teacher_passkey": (teacher.get("passkey") or {}).get("accuracy"),
        "associative_recall": (student.get("associative_recall") or {}).get("mean_accuracy"),
        "teacher_associative_recall": (teacher.get("associative_recall") or {}).get("mean_accuracy"),
        "recall_by_distance": (student.get("recall_by_distance") or {}).get("accuracy"),
        "teacher_recall_by_distance": (teacher.get("recall_by_distance") or {}).get("accuracy"),
        "needles": needle_means(student),
        "teacher_needles": needle_means(teacher),
        "command": f"hf-recattn convert --teacher {teacher_spec} --recipe {_recipe_argument(recipe)}"
        f"{_budget_argument(budget)} --output runs/{recipe['name']}",
        "card": f"{recipe['name']}.md",
        "provenance": report["provenance"],
    }


def _recipe_argument(recipe: dict[str, Any]) -> str:
    """What ``--recipe`` takes to convert the run again: a packaged recipe's name, else its file's path (as the
    report's ``source`` gives it)."""
    return recipe["name"] if is_packaged_source(recipe.get("source")) else recipe["source"]


def _budget_argument(budget: str) -> str:
    """`` --budget NAME``, or nothing for a recipe without budgets (whose run names its budget ``default``)."""
    return "" if budget == NO_BUDGETS else f" --budget {budget}"


def _budget_label(budget: str) -> str:
    """The budget as the index shows it beside the recipe: `` (NAME)``, nothing for a recipe without budgets."""
    return "" if budget == NO_BUDGETS else f" ({budget})"


def _entry_name(teacher: str, recipe: str) -> str:
    """``TEACHER-RECIPE``, or the recipe's name alone when it already starts with the teacher's."""
    return recipe if recipe.startswith(f"{teacher}-") else f"{teacher}-{recipe}"


def _run_teacher(run: Path) -> str:
    """The ``--teacher`` a conversion folder was made with (its ``run.json``), ``embedded`` when it has none."""
    run_json = run / "run.json"
    return json.loads(run_json.read_text()).get("teacher", EMBEDDED) if run_json.is_file() else EMBEDDED


def format_zoo(entries: list[dict[str, Any]], card_prefix: str = "") -> str:
    """A markdown table of the zoo; ``card_prefix`` is the cards' folder as seen from the page (none: beside it).
    Entries measured on another machine than most are named under it."""
    if not entries:
        return "The zoo is empty (no zoo.json shipped)."
    lines = [
        "| name | recipe | training tokens | state at 8k | × teacher's KV | exact cache | perplexity (× teacher) "
        "| needles held-out / OOD (teacher) | passkey (synthetic) | recall by distance | associative recall | card |",
        "|---|---|---:|---:|---:|---|---:|---|---|---|---:|---|",
    ]
    for e in entries:
        recall = "-" if e.get("associative_recall") is None else f"{e['associative_recall']:.0%}"
        cache = f"{e['cache_slots']} slots, {e['exact_cache_mib_at_8k']:.2f} MiB" if e.get("cache_slots") else "-"
        lines.append(
            f"| {e['name']} | `{e['recipe']}`{_budget_label(e['budget'])} | {e['training_tokens']:,} | "
            f"{e['state_mib_at_8k']:.2f} MiB | {e['state_fraction_at_8k']:.3f} | {cache} | "
            f"{e['perplexity']:.2f} ({e['perplexity_ratio']:.3f}x) | {_needles(e)} | {_by_length(e.get('passkey'))} | "
            f"{_by_length(e.get('recall_by_distance'))} | {recall} | [{e['card']}]({card_prefix}{e['card']}) |"
        )
    machine = _main_machine(entries)
    elsewhere = [e for e in entries if e["provenance"].get("machine") != machine]
    if elsewhere:
        lines += ["", "Measured on another machine than the line below says: " + "; ".join(
            f"{e['name']}: {provenance_line(e['provenance'])[len('Measured on '):].rstrip('.')}" for e in elsewhere
        ) + "."]
    return "\n".join(lines)


def _main_machine(entries: list[dict[str, Any]]) -> Any:
    """The machine most entries were measured on (the earliest listed of equally many)."""
    machines = [e["provenance"].get("machine") for e in entries]
    return max(machines, key=machines.count)


def _needles(entry: dict[str, Any]) -> str:
    """The natural-text needles' accuracy on held-out and on out-of-distribution haystacks, the teacher's beside
    it (``85 / 95% (90 / 95%)``); ``-`` for an entry indexed before the index kept them."""
    def pair(accuracy: dict[str, float] | None) -> str:
        return " / ".join("-" if accuracy.get(h) is None else f"{100 * accuracy[h]:.0f}" for h in NEEDLE_HAYSTACKS) \
            + "%"
    if not entry.get("needles"):
        return "-"
    teacher = entry.get("teacher_needles")
    return pair(entry["needles"]) + (f" ({pair(teacher)})" if teacher else "")


def _by_length(accuracy: dict[str, float] | None) -> str:
    """``{"1024": 1.0, "4096": 0.5}`` as ``1024: 100%, 4096: 50%``; ``-`` when nothing was measured."""
    return ", ".join(f"{k}: {v:.0%}" for k, v in sorted((accuracy or {}).items(), key=lambda kv: int(kv[0]))) or "-"


def common_provenance(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The provenance the entries share: that of the first entry measured on the machine most were; ValueError
    when they were measured on different corpora, which one table must not mix. Entries from other machines are
    named under the table (``format_zoo``)."""
    machine = _main_machine(entries)
    main = next(e for e in entries if e["provenance"].get("machine") == machine)
    corpus = main["provenance"].get("corpus")
    for entry in entries:
        if entry["provenance"].get("corpus") != corpus:
            raise ValueError(f"zoo entries {main['name']} and {entry['name']} differ in corpus "
                             f"({corpus} / {entry['provenance'].get('corpus')}); rebuild them on one")
    return main["provenance"]


def build_zoo(
    run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike, command: str, add: bool = False
) -> list[dict[str, Any]]:
    """Entries, cards and index for ``run_dirs``, written into ``out_dir``; ``command`` is printed in the index.

    ``add``: keep the entries (and cards) already in ``out_dir/zoo.json`` that these runs do not rebuild; the
    index then lists the earlier commands before this one (once: rerunning the last one does not repeat it).
    """
    out = Path(out_dir)
    pairs = [(entry_from_run(run), Path(run)) for run in run_dirs]
    for entry, run in pairs:
        write_text(out / entry["card"], str(build_model_card(run / "model", entry["name"])))
    entries = [entry for entry, _ in pairs]
    if add and (out / "zoo.json").is_file():
        earlier = json.loads((out / "zoo.json").read_text())
        rebuilt = {entry["name"] for entry in entries}
        entries += [entry for entry in earlier["entries"] if entry["name"] not in rebuilt]
        if earlier["command"].splitlines()[-1] != command:  # a rerun of the last command does not list it twice
            command = f"{earlier['command']}\n{command}"
        else:
            command = earlier["command"]
    entries.sort(key=lambda entry: (entry["teacher"] or "", entry["state_fraction_at_8k"]))
    record = common_provenance(entries)
    index_data = {"command": command, "provenance": record, "entries": entries}
    write_text(out / "zoo.json", json.dumps(index_data, indent=2) + "\n")
    index = [
        "# The hf_recattn zoo",
        "",
        "Shipped recipes applied to the embedded teachers (SmolLM2-135M-Instruct, Gemma 3 270M) on the embedded "
        "corpus, as each run's "
        "conversion report measured it: state per sequence at 8k tokens (bf16 elements at 2 bytes, int8 cache "
        "codes at 1) against the teacher's KV "
        "cache, held-out perplexity against the teacher's on the same tokens, recall of facts hidden in natural text "
        "(needles: the mean over the run's needle tasks and lengths on held-out documents / on the license texts, "
        "the teacher's in brackets; - for entries indexed before this column, whose cards may give it) and the "
        "synthetic passkey (a key in repeated filler, which a cache can pass without recall). Each entry's "
        "card is beside this file; its `command` (in `zoo.json`) reproduces it. In Python: "
        "`hf_recattn.zoo.zoo_entries()`; on the command line: `hf-recattn zoo`.",
        "",
        "This index, the cards and `zoo.json` were written by (in this order):",
        "",
        f"```bash\n{command}\n```",
        "",
        format_zoo(entries),
        "",
        provenance_line(record),
        "",
        "`templates/model_card.md` is the template every card (and every `hf-recattn push`) is rendered from.",
    ]
    write_text(out / "README.md", "\n".join(index) + "\n")
    return entries
