"""The speed benchmarks' result files: each names its script, carries the provenance of the run that wrote it, and
renders through its script's ``render_markdown`` (the table the docs show)."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from hf_recattn.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = {
    "decode_cpu.json": "decode",
    "decode_cpu_tiny.json": "decode",
    "prefill_cpu.json": "prefill",
    "train_throughput_cpu.json": "train_throughput",
    "cache_block_speed_cpu.json": "cache_block_speed",
    "kernel_speed_cpu.json": "kernel_speed",
    "kernel_speed_cuda.json": "kernel_speed",
    "mesanet_solver_cpu.json": "mesanet_solver",
    "conversion_scale_cpu.json": "conversion_scale",
    "conversion_scale_cuda.json": "conversion_scale",
    "needles_smollm2_cpu.json": "needles",
    "sinks_past_context_cpu.json": "sinks_past_context",
    "natural_recall_single_cpu.json": "natural_recall",
    "natural_recall_multi_cpu.json": "natural_recall",
    "natural_perplexity_cpu.json": "natural_perplexity",
    "natural_recall_single_gemma3_cpu.json": "natural_recall",
    "natural_recall_multi_gemma3_cpu.json": "natural_recall",
    "natural_recall_gemma3_sinks_cpu.json": "natural_recall",
    "natural_recall_gemma3_selection_cpu.json": "natural_recall",
    "natural_perplexity_gemma3_cpu.json": "natural_perplexity",
    "natural_recall_multikey40_gemma3_cpu.json": "natural_recall",
    "natural_recall_multikey40_cpu.json": "natural_recall",
    "cache_code_error_cpu.json": "cache_code_error",
    "cache_code_error_gemma3_cpu.json": "cache_code_error",
    "recall_by_distance_cpu.json": "recall_by_distance",
    "needles_past_context_retrieval9_cpu.json": "needles",
    "needles_past_context_near_cpu.json": "needles",
    "needles_past_context_multikey_cpu.json": "needles",
    "needles_past_context_teacher_cpu.json": "needles",
    "needles_past_context_teacher32k_cpu.json": "needles",
    "needles_past_context_near_multikey_cpu.json": "needles",
    "needles_past_context_near_teacher_cpu.json": "needles",
    "needles_multikey_windows_cpu.json": "needles",
    "loss_by_position_cpu.json": "loss_by_position",
    "recall_bar.json": "recall_bar",
}


def _script(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("file, name", sorted(RESULTS.items()))
def test_a_result_file_names_its_script_and_run_and_renders(file: str, name: str) -> None:
    results = json.loads((ROOT / "benchmarks" / "results" / file).read_text())
    assert results["benchmark"] == name
    record = results["provenance"]
    assert record["command"].startswith(f"python benchmarks/{name}.py")
    assert record["machine"]["cpu"] and record["packages"]["torch"] and record["date"]
    table = _script(name).render_markdown(results)
    header, rule = table.splitlines()[:2] if not table.startswith("floors") else table.splitlines()[2:4]
    assert header.startswith("| ") and set(rule) <= set("|-: ")
    assert all(note in table for note in results["notes"])


def test_write_results_adds_the_name_and_provenance(tmp_path: Path) -> None:
    results_file = _script("results_file")
    record = provenance(["python", "benchmarks/x.py"], corpus=False)
    out = tmp_path / "sub" / "x.json"
    written = results_file.write_results(out, "x", record, {"rows": [1, 2]})
    assert json.loads(out.read_text()) == written == {"benchmark": "x", "provenance": record, "rows": [1, 2]}
    assert [p.name for p in out.parent.iterdir()] == ["x.json"]  # nothing half-written left beside it


def _strings(value: object, key: str = "") -> list[tuple[str, str]]:
    """Every string in a parsed JSON value, with the key it sits under."""
    if isinstance(value, dict):
        return [pair for k, item in value.items() for pair in _strings(item, str(k))]
    if isinstance(value, list):
        return [pair for item in value for pair in _strings(item, key)]
    return [(key, value)] if isinstance(value, str) else []


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")), ids=lambda p: p.name)
def test_no_result_file_names_an_absolute_path(path: Path) -> None:
    """Paths in a committed result file are the repository's (``runs/...``, ``hf_recattn/recipes/...``), never the
    folders of the machine that ran it; the one exception is the text files a run declares as its ``ood_files``
    (the earliest conversions read the operating system's license texts)."""
    strings = _strings(json.loads(path.read_text()))
    declared = {text for key, text in strings if key == "ood_files"}
    found = [word for key, text in strings if key != "ood_files" for word in text.split()
             if re.match(r"/\w+/\w", word) and word not in declared]
    assert not found, found[:3]
