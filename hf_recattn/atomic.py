"""Crash-safe writes of files and folders, for every writer of the package, its scripts and its benchmarks.

A file or a folder is built under a temporary name beside its target and moved into place with ``os.replace``:
an interrupt (an exception, Ctrl-C, a killed process) leaves the old content or the new one, never half of it.

    write_json(out / "summary.json", summary)
    with atomic_folder(out / "model") as tmp:   # the old out/model stays until the block ends without error
        model.save_pretrained(tmp)

Temporaries are named ``.tmp-<name>-*`` and a folder being replaced is first moved to ``.old-<name>-*``;
``clean_temporaries`` removes what an interrupted write left. What lands has the permissions of a plain ``open``
or ``mkdir`` (0666 / 0777 less the umask), not the private 0600 / 0700 of ``mkstemp`` / ``mkdtemp``.

This module imports nothing else from the package, so that any layer may use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: prefixes of the temporaries beside a target (see ``clean_temporaries``)
TEMPORARY_PREFIXES = (".tmp-", ".old-")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, binary: bool = False) -> Iterator[IO[Any]]:
    """Yield an open temporary file beside ``path`` (text in UTF-8, or bytes when ``binary``); when the block
    ends without an exception it is synced and replaces ``path``, else it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically; returns the path."""
    with atomic_file(path, binary=True) as handle:
        handle.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` by ``text`` (UTF-8) atomically; returns the path."""
    with atomic_file(path) as handle:
        handle.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, value: Any, indent: int = 2, sort_keys: bool = True) -> Path:
    """Replace ``path`` by ``value`` as JSON (``indent``, ``sort_keys``, a final newline) atomically."""
    return write_text(path, json.dumps(value, indent=indent, sort_keys=sort_keys) + "\n")


def move_into_place(tmp: str | os.PathLike, target: str | os.PathLike, replace: bool = True) -> bool:
    """Move the finished folder ``tmp`` to ``target`` (a sibling) with the usual permissions; returns whether it
    landed. An existing ``target`` is replaced when ``replace``; otherwise the first writer wins and ``tmp`` is
    removed (for caches that several processes may fill at once)."""
    tmp, target = Path(tmp), Path(target)
    os.chmod(tmp, 0o777 & ~_umask())
    if not replace:
        try:
            os.rename(tmp, target)  # refused when target is a folder with content: another writer was first
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True
    if not target.exists():
        os.replace(tmp, target)
        return True
    old = target.parent / f".old-{target.name}-{os.getpid()}"  # os.replace cannot replace a folder with content
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return True


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; when the block ends without an exception it becomes
    ``target`` (see ``move_into_place`` for ``replace``), else it is removed and ``target`` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        move_into_place(tmp, target, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clean_temporaries(folder: str | os.PathLike) -> None:
    """Remove what interrupted atomic writes left directly inside ``folder`` (``.tmp-*`` / ``.old-*``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.name.startswith(TEMPORARY_PREFIXES):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
