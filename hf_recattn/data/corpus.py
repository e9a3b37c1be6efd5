"""Text for distillation and evaluation: the embedded corpus, local files, or a saved ``datasets`` dataset.

The embedded corpus (``embedded.py``) is the same bytes on every machine: documentation from pinned source
archives, with a fixed train / held-out split by file and license texts as out-of-distribution text.
``load_splits`` gives (train, held-out) for any source: the pinned split for the embedded corpus, a hash of
each document's text for others.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..paths import cache_root
from . import pinned
from .embedded import clean, embedded_corpus, unit_hash, write_cache

EMBEDDED = "embedded"
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def clean_text(text: str) -> str:
    """Normalized newlines and tabs, no control characters or trailing spaces, at most one blank line."""
    return clean(text, blanks=None)


def is_embedded(source: str | os.PathLike | None) -> bool:
    return source is None or str(source).strip().lower() == EMBEDDED


def embedded_texts(split: str = "train") -> list[str]:
    """One split of the embedded corpus: "train", "heldout" or "ood" (out-of-distribution license texts)."""
    return embedded_corpus().texts(split)


def embedded_corpus_file() -> Path | None:
    """The embedded corpus's training split as a JSON-lines file (field "text") in the cache, written once;
    None when the cache folder cannot be written."""
    corpus = embedded_corpus()
    path = cache_root() / "corpus" / f"embedded-v{corpus.version}-{corpus.sha256[:12]}-train.jsonl"
    if not path.is_file():
        lines = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in corpus.texts("train"))
        write_cache(path, lines.encode("utf-8"))
    return path if path.is_file() else None


# ----- local sources ------------------------------------------------------------------------------
def _read_jsonl(path: Path, field: str = "text") -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{number}: each line needs a string field {field!r}")
            texts.append(record[field])
    return texts


def _read_parquet(path: Path, field: str = "text") -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow comes with datasets
        raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from err
    try:
        table = pq.read_table(path, columns=[field])
    except Exception as err:  # noqa: BLE001 - arrow raises several kinds for bad files / missing columns
        raise ValueError(f"{path}: cannot read a string column {field!r} ({err})") from err
    return [t for t in table.column(field).to_pylist() if isinstance(t, str)]


def _read_file(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text") from err
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"{path}: unsupported corpus file type {suffix!r}; use {list(DATA_SUFFIXES)}")


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _load_saved_dataset(location: str) -> list[str]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as err:  # pragma: no cover - datasets is in the train extra
        raise ValueError("reading a saved dataset needs `datasets` (pip install hf-recattn[train])") from err
    data = load_from_disk(location)
    if isinstance(data, DatasetDict):
        split = "train" if "train" in data else sorted(data)[0]
        data = data[split]
    if not isinstance(data, Dataset) or "text" not in data.column_names:
        columns = getattr(data, "column_names", None)
        raise ValueError(f"dataset {location}: needs a 'text' column (has {columns})")
    return [t for t in data["text"] if isinstance(t, str)]


def _iter_folder(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix.lower() in DATA_SUFFIXES and not path.name.startswith("."):
            yield path


def load_texts(source: str | os.PathLike | None = None) -> list[str]:
    """Documents from ``source``: None or "embedded" (the built-in corpus); a .txt (one document), .jsonl
    (field "text") or .parquet (column "text") file; a folder of such files (sorted, recursive); or a
    ``datasets`` dataset saved with ``save_to_disk`` (its "train" split). Empty documents are dropped. For the
    embedded corpus this is its training split (``load_splits`` gives the held-out one too)."""
    if is_embedded(source):
        return embedded_texts("train")
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"corpus {source}: no such file or folder (nor 'embedded')")
    if path.is_dir():
        if _is_saved_dataset(path):
            texts = _load_saved_dataset(str(path))
        else:
            files = list(_iter_folder(path))
            if not files:
                raise ValueError(f"corpus folder {path}: no {list(DATA_SUFFIXES)} files in it")
            texts = [t for f in files for t in _read_file(f)]
    else:
        texts = _read_file(path)
    texts = [t for t in (clean_text(t) for t in texts) if t]
    if not texts:
        raise ValueError(f"corpus {source}: holds no text")
    return texts


# ----- splitting and packing ----------------------------------------------------------------------
def split_heldout(
    texts: Sequence[str], heldout_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """(train, held-out) by a hash of each document's text: deterministic, independent of the order, and
    disjoint even with duplicated documents (equal texts land on the same side). Both sides are non-empty."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(texts) < 2:
        raise ValueError(f"need at least 2 documents to hold some out, got {len(texts)}")
    scores = [unit_hash(f"{seed}\x00{t}") for t in texts]
    held = [s < heldout_fraction for s in scores]
    if not any(held):  # tiny corpora: hold out the lowest-scoring document's text
        lowest = texts[min(range(len(texts)), key=scores.__getitem__)]
        held = [t == lowest for t in texts]
    train = [t for t, h in zip(texts, held, strict=True) if not h]
    heldout = [t for t, h in zip(texts, held, strict=True) if h]
    if not train:
        raise ValueError("every document landed in the held-out split; give more distinct documents")
    return train, heldout


def load_splits(
    source: str | os.PathLike | None = None, heldout_fraction: float = pinned.HELDOUT_FRACTION, seed: int = 0
) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of ``source``. The embedded corpus has one fixed split (5% of its files held
    out; ``seed`` plays no part); any other source is split by ``split_heldout(texts, heldout_fraction, seed)``."""
    if not is_embedded(source):
        return split_heldout(load_texts(source), heldout_fraction, seed=seed)
    if heldout_fraction != pinned.HELDOUT_FRACTION:
        raise ValueError(
            f"heldout_fraction {heldout_fraction}: the embedded corpus has one fixed held-out split "
            f"({pinned.HELDOUT_FRACTION:g} of its files) so that every figure measured on it is comparable; "
            "pass another corpus (--data / --corpus) to split differently"
        )
    corpus = embedded_corpus()
    return corpus.texts("train"), corpus.texts("heldout")


def long_documents(source: str | os.PathLike | None, heldout: Sequence[str]) -> list[str]:
    """Held-out text as whole documents, for long-context measures: the embedded corpus's held-out files, each
    with its pieces joined in order; another source's held-out documents (``heldout``) as they are."""
    return embedded_corpus().files("heldout") if is_embedded(source) else list(heldout)


def token_blocks(
    tokenizer: Any,
    texts: Sequence[str],
    block_size: int,
    max_tokens: int | None = None,
    seed: int = 0,
) -> torch.LongTensor:
    """[N, block_size] token ids: documents in a seeded order, each followed by the EOS token, packed end to
    end and cut into blocks (the incomplete tail is dropped). ``max_tokens`` caps N * block_size."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if max_tokens is not None and max_tokens < block_size:
        raise ValueError(f"max_tokens ({max_tokens}) is smaller than one block ({block_size})")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token to separate documents; set tokenizer.eos_token")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    wanted = None if max_tokens is None else (max_tokens // block_size) * block_size
    ids: list[int] = []
    for start in range(0, len(order), 32):
        batch = [texts[i] for i in order[start : start + 32]]
        for row in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
        if wanted is not None and len(ids) >= wanted:
            break
    n = len(ids) // block_size if wanted is None else min(len(ids), wanted) // block_size
    if n == 0:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one block of {block_size}")
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)
