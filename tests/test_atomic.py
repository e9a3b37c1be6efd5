"""hf_recattn.atomic: files and folders replace their target whole, or not at all, with the usual permissions."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from hf_recattn.atomic import (
    atomic_file,
    atomic_folder,
    clean_temporaries,
    move_into_place,
    write_bytes,
    write_json,
    write_text,
)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_atomic_writes_keep_the_usual_permissions(tmp_path: Path) -> None:
    mask = _umask()
    write_json(tmp_path / "a.json", {"x": 1})
    with atomic_folder(tmp_path / "d") as tmp:
        (tmp / "f").write_text("y")
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~mask
    assert (tmp_path / "d" / "f").read_text() == "y" and not list(tmp_path.glob(".tmp-*"))


def test_files_are_written_whole_in_their_format(tmp_path: Path) -> None:
    assert write_text(tmp_path / "sub" / "t.txt", "é\n") == tmp_path / "sub" / "t.txt"  # creates the folder
    assert (tmp_path / "sub" / "t.txt").read_bytes() == "é\n".encode()
    write_bytes(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    write_json(tmp_path / "j.json", {"b": 1, "a": [1]})
    assert (tmp_path / "j.json").read_text() == json.dumps({"a": [1], "b": 1}, indent=2) + "\n"
    write_json(tmp_path / "k.json", {"b": 1, "a": 2}, indent=1, sort_keys=False)
    assert (tmp_path / "k.json").read_text() == '{\n "b": 1,\n "a": 2\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "j.json", "k.json", "sub"]


def test_an_interrupted_file_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_text(path, "old")
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as handle:
        handle.write("half of the new")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})  # not serializable: nothing is written
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_folder_replaces_the_old_one_or_leaves_it_intact(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with atomic_folder(target) as tmp:
        (tmp / "old.txt").write_text("1")
    with pytest.raises(KeyboardInterrupt), atomic_folder(target) as tmp:
        (tmp / "new.txt").write_text("2")
        raise KeyboardInterrupt
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left behind
    with atomic_folder(target) as tmp:
        (tmp / "new.txt").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]  # the old content is gone, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_without_replace_the_first_writer_wins(tmp_path: Path) -> None:
    target = tmp_path / "cache"
    with atomic_folder(target, replace=False) as tmp:
        (tmp / "first").write_text("1")
    with atomic_folder(target, replace=False) as tmp:
        (tmp / "second").write_text("2")
    assert [p.name for p in target.iterdir()] == ["first"] and [p.name for p in tmp_path.iterdir()] == ["cache"]
    shared = tmp_path / ".tmp-fixed"  # a temporary name several processes agree on (training.runner.save_final)
    shared.mkdir()
    (shared / "w").write_text("3")
    assert move_into_place(shared, target) and [p.name for p in target.iterdir()] == ["w"]
    assert not shared.exists()


def test_clean_temporaries_removes_only_leftovers(tmp_path: Path) -> None:
    (tmp_path / ".tmp-a-123").mkdir()
    (tmp_path / ".tmp-b.json-x").write_text("")
    (tmp_path / ".old-model-9").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / ".hidden").write_text("")
    clean_temporaries(tmp_path)
    clean_temporaries(tmp_path / "absent")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "model"]


def test_the_module_imports_nothing_of_the_package() -> None:
    """The bottom layer: every other module may import it."""
    tree = ast.parse((Path(__file__).parent.parent / "hf_recattn" / "atomic.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += ["." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.startswith((".", "hf_recattn"))]
