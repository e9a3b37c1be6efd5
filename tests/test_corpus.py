"""Corpus sources (local files, saved datasets), held-out splits and token packing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny_lm import tiny_tokenizer

from hf_recattn.data.corpus import clean_text, load_texts, split_heldout, token_blocks


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
