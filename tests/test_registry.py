"""The runtime's imports: the registry knows no family, no module imports inside a function (where it would hide
a circle), and each module imports first in a fresh interpreter (the static circle check is test_import_graph.py).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_import_graph import import_graph

import hf_recattn

PACKAGE = Path(hf_recattn.__file__).parent
MODELING = PACKAGE / "modeling"
#: optional dependencies a function may import where it is first needed
OPTIONAL = {"triton"}


def test_registry_imports_no_mixer_module() -> None:
    """registry.py reads only the mixer contract: every family module imports it, never the other way."""
    assert import_graph(PACKAGE)["hf_recattn.modeling.registry"] == {"hf_recattn.modeling.mixer_base"}


def test_no_import_inside_a_function_in_the_runtime() -> None:
    """Dependencies stand at the top of each runtime module; only optional kernels load late."""
    late = []
    for path in sorted(MODELING.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                    if not {n.split(".")[0] for n in names} <= OPTIONAL:
                        late.append(f"{path.name}:{node.lineno}")
    assert late == []


CHILD = textwrap.dedent(
    r"""
    import importlib, json, shutil, sys, tempfile
    from pathlib import Path

    sys.dont_write_bytecode = False  # compile each module once, not once per round
    sys.pycache_prefix = tempfile.mkdtemp()
    package, modules = sys.argv[1], json.loads(sys.argv[2])
    if len(sys.argv) > 3:  # the flat runtime as a checkpoint ships it: a package of its own
        root = Path(tempfile.mkdtemp())
        shutil.copytree(sys.argv[3], root / package, ignore=shutil.ignore_patterns("__pycache__"))
        sys.path.insert(0, str(root))
    failures = []
    for first in [*modules, None]:  # each module first (what it needs follows it), then all of them
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
        try:
            for name in modules if first is None else [first]:
                importlib.import_module(name)
        except Exception as err:
            failures.append(f"{first}: {type(err).__name__}: {err}")
    print(json.dumps(failures))
    """
)


def _import_each_first(package: str, modules: list[str], *flat: str) -> list[str]:
    """In a fresh interpreter: for each module, forget ``package`` and import that module first; then all."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, package, json.dumps(modules), *flat],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_runtime_module_imports_first_in_a_fresh_interpreter() -> None:
    """The flat runtime as a checkpoint ships it (a package of its own, as trust_remote_code loads it): each
    module imported first."""
    modules = sorted(f"flat_runtime.{p.stem}" for p in MODELING.glob("*.py") if p.stem != "__init__")
    assert _import_each_first("flat_runtime", modules, str(MODELING)) == []


@pytest.mark.slow
def test_every_package_module_imports_first_in_a_fresh_interpreter() -> None:
    """The whole package, each module imported first (the circle checks above cover every order statically;
    this runs them)."""
    assert _import_each_first("hf_recattn", sorted(import_graph(PACKAGE))) == []
