"""The loader of transformers' common test files (tests/transformers_suite.py), on a local stand-in sdist."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import transformers_suite as suite
from archives import write_tar_gz


def _fake_sdist(folder: Path, version: str) -> Path:
    archive = folder / f"transformers-{version}.tar.gz"
    files = {"LICENSE": "license", "tests/test_modeling_common.py": "# common", "tests/models/x/test_x.py": "# x",
             "src/transformers/__init__.py": "# real package"}
    return write_tar_gz(archive, f"transformers-{version}", files)


@pytest.fixture
def fake_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    archive = _fake_sdist(tmp_path, "9.9.9")
    monkeypatch.setattr(suite, "_download_sdist", lambda version, into: Path(shutil.copy(archive, into)))
    return archive


def test_fetch_lays_out_the_tests_once(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hashlib.sha256(fake_index.read_bytes()).hexdigest()
    monkeypatch.setitem(suite.SDIST_SHA256, "9.9.9", digest)
    root = suite.sdist_tests("9.9.9")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "src/transformers/__init__.py", "tests/LICENSE", "tests/__init__.py", "tests/test_modeling_common.py",
        "tiny_models/reports/tiny_model_summary.json",
    ]
    assert (root / "src/transformers/__init__.py").read_text() == ""  # the marker, not the sdist's package
    monkeypatch.setattr(suite, "_download_sdist", lambda *a: pytest.fail("fetched twice"))
    assert suite.sdist_tests("9.9.9") == root


def test_a_wrong_checksum_leaves_nothing(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(suite.SDIST_SHA256, "9.9.9", "0" * 64)
    with pytest.raises(suite.SuiteUnavailable, match="sha256 .* != pinned 0000"):
        suite.sdist_tests("9.9.9")
    assert [p.name for p in (suite.cache_root() / "transformers_tests").iterdir()] == []


def test_an_unpinned_release_is_refused(fake_index: Path) -> None:
    with pytest.raises(suite.SuiteUnavailable, match="no pinned sdist checksum for transformers 9.9.8"):
        suite.sdist_tests("9.9.8")
