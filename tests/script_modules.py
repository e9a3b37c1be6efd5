"""Import a script of the repository (``benchmarks/NAME.py``, ``scripts/NAME.py``) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(folder: str, name: str) -> ModuleType:
    """``ROOT/folder/name.py`` as the module ``name``; its folder is on the path while it loads, so that it can
    import its siblings."""
    where = str(ROOT / folder)
    sys.path.insert(0, where)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(where)
    return module
