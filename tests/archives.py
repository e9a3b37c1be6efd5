"""Source archives made in tests: a .tar.gz whose files sit below one top folder, as in an sdist."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tar_gz(path: Path, top: str, files: dict[str, str]) -> Path:
    """``path``: a gzipped tar holding ``top/NAME`` with each text of ``files``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
