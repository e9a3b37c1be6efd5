"""The package's imports: the registry knows no family, no module imports inside a function, no import circle.

The circle checks read every import statement, those inside functions included (an import moved into a function
hides a circle without removing it), and import each module first in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hf_recattn

PACKAGE = Path(hf_recattn.__file__).parent
MODELING = PACKAGE / "modeling"
#: optional dependencies a function may import where it is first needed
OPTIONAL = {"triton"}
#: known circles outside the runtime, as sets of module names (empty once every circle is gone)
KNOWN_CIRCLES: list[set[str]] = [{"hf_recattn.evaluation", "hf_recattn.recall"}]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules an import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    found = {f"{target}.{alias.name}" for alias in node.names} & MODULES.keys()
    return found or ({target} & MODULES.keys())


def _imports(module: str) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(MODULES[module].read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _circles(prefix: str) -> list[set[str]]:
    """Strongly connected groups of more than one module among those under ``prefix`` (every import counted)."""
    names = [m for m in MODULES if m.startswith(prefix)]
    graph = {m: {t for node in _imports(m) for t in _imported(m, node) if t.startswith(prefix)} for m in names}
    reach = {m: set() for m in names}
    for m in names:  # the modules each one reaches (a few dozen modules: plain search is enough)
        todo = list(graph[m])
        while todo:
            n = todo.pop()
            if n not in reach[m]:
                reach[m].add(n)
                todo.extend(graph[n])
    groups = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in names if m in reach[m]}
    return [set(g) for g in groups]


def test_registry_imports_no_mixer_module() -> None:
    """registry.py reads only the mixer contract: every family module imports it, never the other way."""
    module = "hf_recattn.modeling.registry"
    loaded = {t for node in _imports(module) for t in _imported(module, node)}
    assert loaded == {"hf_recattn.modeling.mixer_base"}


def test_no_import_inside_a_function_in_the_runtime() -> None:
    """Dependencies stand at the top of each runtime module; only optional kernels load late."""
    late = []
    for module, path in MODULES.items():
        if not module.startswith("hf_recattn.modeling"):
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                    if not {n.split(".")[0] for n in names} <= OPTIONAL:
                        late.append(f"{path.name}:{node.lineno}")
    assert late == []


def test_no_import_circle_in_the_runtime() -> None:
    assert _circles("hf_recattn.modeling.") == []


def test_no_new_import_circle_in_the_package() -> None:
    circles = _circles("hf_recattn")
    assert [c for c in circles if c not in KNOWN_CIRCLES] == []


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
    assert _import_each_first("hf_recattn", sorted(MODULES)) == []
