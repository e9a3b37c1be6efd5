"""Provenance records, and the docs' generated tables: every one up to date with the result file it comes from,
with that file's provenance line under it; no section of the docs titled by when or where it was measured."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from hf_recattn.data import pinned
from hf_recattn.provenance import provenance, provenance_line

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
render_docs = importlib.util.module_from_spec(spec)
sys.modules["render_docs"] = render_docs
spec.loader.exec_module(render_docs)


def test_provenance_names_code_corpus_packages_machine_and_command() -> None:
    record = provenance(["python", "benchmarks/x.py", "--flag", "a b"])
    assert record["command"] == "python benchmarks/x.py --flag 'a b'"
    assert record["corpus"] == {"version": pinned.CORPUS_VERSION, "sha256": pinned.CORPUS_SHA256}
    assert record["packages"]["torch"] and record["packages"]["transformers"] and record["packages"]["python"]
    assert record["machine"]["cpu"] and record["machine"]["cores"] >= 1
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", record["commit"])
    assert "corpus" not in provenance([], corpus=False)
    line = provenance_line(record)
    assert line.startswith(f"Measured on embedded corpus v{pinned.CORPUS_VERSION} (sha256 {pinned.CORPUS_SHA256[:12]})")
    assert record["packages"]["torch"] in line and record["date"] in line


def _report(with_provenance: bool = True) -> dict:
    row = {"perplexity": 12.0, "eval_tokens": 64}
    report = {"comparison": {"teacher": {"perplexity": 10.0, "eval_tokens": 64}, "student": row}}
    if with_provenance:
        report["provenance"] = provenance(["hf-recattn", "convert"])
    return report


def test_a_marked_table_is_rendered_with_its_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_docs, "ROOT", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps(_report()))
    text = "intro\n<!-- render: r.json conversion -->\nold table\n<!-- /render -->\nafter\n"
    out = render_docs.render_text(text, "doc.md")
    body = out.split("-->\n", 1)[1].split("<!-- /render -->")[0]
    assert "old table" not in out and out.endswith("<!-- /render -->\nafter\n")
    assert "| student | 12.00 | 1.200 |" in body
    assert body.rstrip("\n").endswith(provenance_line(_report()["provenance"]))
    assert render_docs.render_text(out, "doc.md") == out  # rendering is idempotent


def test_bad_markers_and_results_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_docs, "ROOT", tmp_path)
    (tmp_path / "old.json").write_text(json.dumps(_report(with_provenance=False)))
    (tmp_path / "anon.json").write_text(json.dumps(_report()))
    cases = {
        "missing.json conversion": "doc.md:2: missing.json: no such results file",
        "old.json conversion": "doc.md:2: old.json has no provenance record",
        "anon.json": "doc.md:2: anon.json has no 'benchmark' field",
        "anon.json nowhere": "no renderer 'nowhere'",
    }
    for marker, message in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            render_docs.render_text(f"x\n<!-- render: {marker} -->\n<!-- /render -->\n", "doc.md")


def test_the_docs_tables_are_up_to_date() -> None:
    assert render_docs.main(["--check"]) == 0


def test_no_docs_section_is_titled_by_when_or_where_it_was_measured() -> None:
    dated = re.compile(r"^#+ .*\b(later|earlier|another host|this machine|under load|before the|after the)\b",
                       re.IGNORECASE | re.MULTILINE)
    for path in render_docs.documents():
        titles = dated.findall(path.read_text())
        assert not titles, f"{path.relative_to(ROOT)}: section titled by time or place: {titles}"
