"""Corpus sources, the embedded-corpus builder (on a fake install), held-out splits and token packing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny_lm import tiny_tokenizer

from hf_recattn.data import corpus
from hf_recattn.data.corpus import clean_text, load_texts, split_heldout, token_blocks

PROSE = ("This module explains how the parser reads a file and turns each line into a record. "
         "Every record keeps the original text and the position where it was found in the input.\n\n"
         "Errors are reported with the line number so that a user can fix the input quickly. ") * 2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


# ----- local sources ------------------------------------------------------------------------------
def test_txt_jsonl_parquet_and_folders(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("first document\r\nwith two lines   \n\n\n\nand a gap\t.")
    lines = [json.dumps({"text": "second"}), "", json.dumps({"text": "third"}), ""]
    (data / "b.jsonl").write_text("\n".join(lines))
    pq.write_table(pa.table({"text": ["fourth", "", "fifth"]}), data / "sub" / "c.parquet")
    (data / "ignored.csv").write_text("a,b\n")
    assert load_texts(str(data / "a.txt")) == ["first document\nwith two lines\n\nand a gap    ."]
    assert load_texts(str(data / "b.jsonl")) == ["second", "third"]
    assert load_texts(data / "sub" / "c.parquet") == ["fourth", "fifth"]  # empty documents dropped
    assert load_texts(str(data)) == [load_texts(str(data / "a.txt"))[0], "second", "third", "fourth", "fifth"]


def test_saved_dataset(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"text": ["one doc", "two doc"]}).save_to_disk(tmp_path / "ds")
    assert load_texts(str(tmp_path / "ds")) == ["one doc", "two doc"]
    DatasetDict({"train": Dataset.from_dict({"text": ["t"]}), "test": Dataset.from_dict({"text": ["x"]})}
                ).save_to_disk(tmp_path / "dd")
    assert load_texts(str(tmp_path / "dd")) == ["t"]
    Dataset.from_dict({"body": ["no text column"]}).save_to_disk(tmp_path / "bad")
    with pytest.raises(ValueError, match="'text' column"):
        load_texts(str(tmp_path / "bad"))


def test_bad_sources_raise_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_texts(str(tmp_path / "nowhere.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_texts(str(bad))
    bad.write_text('{"content": "no text field"}\n')
    with pytest.raises(ValueError, match="field 'text'"):
        load_texts(str(bad))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="x.csv"):
        load_texts(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no"):
        load_texts(str(tmp_path / "empty"))
    (tmp_path / "blank.txt").write_text("  \n\n ")
    with pytest.raises(ValueError, match="no text"):
        load_texts(str(tmp_path / "blank.txt"))


def test_clean_text() -> None:
    assert clean_text("a \r\nb\x00\x07c\t\n\n\n\n\nd  ") == "a\nbc\n\nd"


# ----- the embedded corpus, built from a fake install ---------------------------------------------
def _fake_install(root: Path) -> Path:
    lib = root / "lib"
    (lib / "pkg" / "tests").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text(f'"""{PROSE}"""\n\ndef f():\n    """{PROSE}"""\n    return 1\n')
    (lib / "pkg" / "short.py").write_text('"""Too short to keep."""\n')
    (lib / "pkg" / "tests" / "test_x.py").write_text(f'"""{PROSE} (a test file)"""\n')
    (lib / "pkg" / "LICENSE.txt").write_text(PROSE + " licensed text")
    (lib / "pkg" / "guide.md").write_text("# Guide\n\n" + PROSE)
    (lib / "pkg" / "copy.rst").write_text("# Guide\n\n" + PROSE)  # the same text again: deduplicated
    (lib / "pkg" / "numbers.txt").write_text("1 2 3 4 5 6 7 8\n" * 80)
    (lib / "pkg" / "broken.py").write_text("def (:\n")
    return lib


def test_embedded_builder_reads_docstrings_and_docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _fake_install(tmp_path)
    monkeypatch.setattr(corpus, "_roots", lambda: [("site", lib)])
    texts = corpus.build_embedded_corpus(max_chars=10**6)
    assert len(texts) == 2  # __init__'s docstrings, and one of guide.md / copy.rst (identical texts)
    docstrings = next(t for t in texts if not t.startswith("# Guide"))
    assert docstrings == clean_text(PROSE + "\n\n" + PROSE)  # module then function docstring, cleaned
    assert all("a test file" not in t and "licensed" not in t and "1 2 3" not in t for t in texts)
    assert corpus.build_embedded_corpus(max_chars=10**6) == texts  # deterministic
    assert len(corpus.build_embedded_corpus(max_chars=10)) == 1  # stops once max_chars is reached


def test_optional_extras_leave_the_corpus_and_its_key_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = _fake_install(tmp_path)
    monkeypatch.setattr(corpus, "_roots", lambda: [("site", lib)])
    texts, key = corpus.build_embedded_corpus(max_chars=10**6), corpus._environment_key(10**6)
    (lib / "triton").mkdir()  # an optional extra, installed with its RECORD
    (lib / "triton" / "language.py").write_text(f'"""{PROSE}"""\n')
    info = lib / "triton-3.9.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("triton/language.py,sha256=x,1\ntriton-3.9.0.dist-info/RECORD,,\n")
    assert corpus.build_embedded_corpus(max_chars=10**6) == texts
    assert corpus._environment_key(10**6) == key
    other = lib / "other-1.0.dist-info"  # any other distribution changes the key
    other.mkdir()
    assert corpus._environment_key(10**6) != key


def test_embedded_texts_are_cached_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _fake_install(tmp_path)
    monkeypatch.setattr(corpus, "_roots", lambda: [("site", lib)])
    first = load_texts()
    files = list((tmp_path / "cache" / "corpus").iterdir())
    assert len(files) == 1 and files[0].suffix == ".jsonl"  # no temporary file left behind

    def fail(*_args: object) -> list[str]:
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(corpus, "build_embedded_corpus", fail)
    assert load_texts("embedded") == first


# ----- held-out split -----------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_order_free() -> None:
    texts = [f"document number {i}" for i in range(1000)] + ["duplicate"] * 5
    train, held = split_heldout(texts)
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(texts)
    assert 25 <= len(held) <= 80  # ~5 %
    assert split_heldout(texts) == (train, held)
    shuffled = texts[:]
    random.Random(3).shuffle(shuffled)
    train2, held2 = split_heldout(shuffled)
    assert set(held2) == set(held) and set(train2) == set(train)
    assert set(split_heldout(texts, seed=1)[1]) != set(held)
    assert 150 <= len(split_heldout(texts, heldout_fraction=0.2)[1]) <= 250


def test_split_small_and_bad_input() -> None:
    train, held = split_heldout(["a", "b", "c"])
    assert len(held) >= 1 and len(train) >= 1 and not set(train) & set(held)
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_heldout(["a", "b"], heldout_fraction=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        split_heldout(["a"])


# ----- packing ------------------------------------------------------------------------------------
def test_token_blocks_pack_documents_with_eos() -> None:
    tok = tiny_tokenizer()
    texts = ["the river runs", "birds sing in the morning", "the pass key is 12345", "a hash table"] * 5
    blocks = token_blocks(tok, texts, block_size=8, seed=0)
    assert blocks.dtype == torch.long and blocks.shape[1] == 8
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream += tok(texts[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(stream) // 8
    assert blocks.shape[0] == n
    assert blocks.flatten().tolist() == stream[: n * 8]
    assert torch.equal(token_blocks(tok, texts, 8, seed=0), blocks)
    assert not torch.equal(token_blocks(tok, texts, 8, seed=1), blocks)
    capped = token_blocks(tok, texts, 8, max_tokens=30, seed=0)
    assert capped.shape == (3, 8) and torch.equal(capped, blocks[:3])


def test_token_blocks_errors() -> None:
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="fewer than one block"):
        token_blocks(tok, ["short"], block_size=64)
    with pytest.raises(ValueError, match="max_tokens"):
        token_blocks(tok, ["short"], block_size=64, max_tokens=10)
    with pytest.raises(ValueError, match="block_size"):
        token_blocks(tok, ["short"], block_size=1)
    tok.eos_token = None
    with pytest.raises(ValueError, match="eos"):
        token_blocks(tok, ["short text"], block_size=2)


# ----- the real embedded corpus (opt-in) ----------------------------------------------------------
@pytest.mark.slow
def test_real_embedded_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_RECATTN_CACHE")  # the shared cache: built once per environment
    texts = load_texts()
    assert sum(map(len, texts)) >= 2_000_000 and len(texts) >= 200
    assert load_texts() == texts
    assert len(set(texts)) == len(texts)
    train, held = split_heldout(texts)
    assert sum(map(len, held)) >= 100_000  # enough for 16k held-out tokens
