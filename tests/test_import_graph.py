"""No module of hf_recattn imports another in a circle.

The import graph is read from the source (every ``import`` and ``from ... import`` statement, at module level or
inside a function alike): an edge A -> B says that A names module B (``from .pkg import name`` points at the
module ``pkg.name`` when there is one, else at ``pkg``). A package's ``__init__`` running before its submodules
is not an edge. The graph must have no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_recattn

PACKAGE_DIR = Path(hf_recattn.__file__).parent

def _modules(package_dir: Path) -> dict[str, tuple[Path, str]]:
    """Every module under ``package_dir``: its dotted name -> (file, the package its relative imports start in)."""
    modules = {}
    for file in sorted(package_dir.rglob("*.py")):
        parts = file.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            modules[".".join(parts)] = (file, ".".join(parts))
        else:
            modules[".".join(parts)] = (file, ".".join(parts[:-1]))
    return modules


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere in its source."""
    modules = _modules(package_dir)
    graph: dict[str, set[str]] = {}
    for name, (file, package) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        targets.add(submodule)
                    elif source in modules:
                        targets.add(source)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_another_in_a_circle() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert "hf_recattn.evaluation.suite" in graph and "hf_recattn.modeling.mixers" in graph  # the walk saw it all
    assert cycles(graph) == []


def test_the_graph_sees_circles_through_function_level_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from .sub.b import g\n\ndef f():\n    return g()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def g():\n    from .. import c\n    return c\n")
    (package / "c.py").write_text("import pkg.sub\n")
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.sub"}}
    assert cycles(graph) == []  # a package's __init__ is not an edge to its submodules
    (package / "c.py").write_text("def h():\n    from .a import f\n    return f\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_training_does_not_import_conversion() -> None:
    """Conversion builds on the training package (stage 2 is its distillation finetune), never the reverse."""
    graph = import_graph(PACKAGE_DIR)
    backwards = sorted((m, d) for m, deps in graph.items() if m.startswith("hf_recattn.training")
                       for d in deps if d.startswith("hf_recattn.conversion"))
    assert backwards == []
