"""No module of hf_recattn imports another in a circle.

The import graph is read from the source (every ``import`` and ``from ... import`` statement, at module level or
inside a function alike): an edge A -> B says that A names module B (``from .pkg import name`` points at the
module ``pkg.name`` when there is one, else at ``pkg``). A package's ``__init__`` running before its submodules
is not an edge. The graph must have no cycle, and three rules of direction hold: training never imports conversion;
the prompt builders (``hf_recattn.prompting``) import neither the probes (``evaluation``) nor conversion; conversion
and training import nothing of ``evaluation`` but what runs the evaluation itself (the modules listed in
``EVALUATION_USERS``, and only the package's public names), so the training data is built from the shared builders.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_recattn

PACKAGE_DIR = Path(hf_recattn.__file__).parent
#: the modules of conversion and training that may import ``hf_recattn.evaluation`` (its public names only): they
#: run the evaluation after a conversion (``comparison``, the report of ``pipeline``) or set its sizes in a recipe
EVALUATION_USERS = {"hf_recattn.conversion.comparison", "hf_recattn.conversion.pipeline",
                    "hf_recattn.conversion.settings"}

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


def edges_into(graph: dict[str, set[str]], sources: tuple[str, ...], target: str) -> list[tuple[str, str]]:
    """The edges from the modules under any of ``sources`` into ``target`` or a module under it, sorted."""
    def under(module: str, prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    return sorted((m, d) for m, deps in graph.items() if any(under(m, s) for s in sources)
                  for d in deps if under(d, target))


def test_the_prompt_builders_import_neither_the_probes_nor_conversion() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert {"hf_recattn.prompting.recall", "hf_recattn.prompting.needles"} <= set(graph)
    for other in ("hf_recattn.evaluation", "hf_recattn.conversion"):
        assert edges_into(graph, ("hf_recattn.prompting",), other) == []


def test_conversion_and_training_import_the_evaluation_only_to_run_it() -> None:
    """The training data (``retrieval_data``, the head search, both stages) takes its prompts from
    ``hf_recattn.prompting``; only the evaluation's own steps import ``hf_recattn.evaluation``, and only its public
    names (the package), never a probe module."""
    graph = import_graph(PACKAGE_DIR)
    found = edges_into(graph, ("hf_recattn.conversion", "hf_recattn.training"), "hf_recattn.evaluation")
    assert [(m, d) for m, d in found if m not in EVALUATION_USERS or d != "hf_recattn.evaluation"] == []
    assert {m for m, _ in found} == EVALUATION_USERS  # the allowed list holds no stale name
    for module in ("retrieval_data", "retrieval_heads"):  # the training data's builders: from the shared package
        assert edges_into(graph, (f"hf_recattn.conversion.{module}",), "hf_recattn.prompting"), module


def test_edges_into_sees_an_import_of_a_probe_module(tmp_path: Path) -> None:
    """The rule can fail: a builder module importing a probe module, at function level and relatively."""
    package = tmp_path / "pkg"
    for folder in ("prompting", "evaluation", "conversion"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "evaluation" / "recall.py").write_text("X = 1\n")
    (package / "prompting" / "facts.py").write_text("def f():\n    from ..evaluation.recall import X\n    return X\n")
    (package / "conversion" / "data.py").write_text("from ..evaluation import recall\n")
    graph = import_graph(package)
    probe = "pkg.evaluation.recall"
    assert edges_into(graph, ("pkg.prompting",), "pkg.evaluation") == [("pkg.prompting.facts", probe)]
    assert edges_into(graph, ("pkg.conversion",), "pkg.evaluation") == [("pkg.conversion.data", probe)]


def test_the_builders_keep_their_older_import_paths() -> None:
    """Users, scripts and benchmarks import the builders from the probes' modules: the same objects as the shared
    package's."""
    import importlib

    from hf_recattn import prompting

    older = {
        "hf_recattn.evaluation": ("Template", "TemplateError", "probe_template", "fill_tokens", "plant",
                                  "sentence_pieces", "token_pieces", "passkey_ids", "passkey_prompt",
                                  "needle_prompt", "NeedlePrompt", "NEEDLE_TASKS", "distance_prompt"),
        "hf_recattn.evaluation.templates": ("Template", "TemplateError", "templates", "word_list", "probe_template"),
        "hf_recattn.evaluation.facts": ("Fact", "fact_ids", "make_facts"),
        "hf_recattn.evaluation.prompts": ("fill_tokens", "plant", "sentence_pieces", "token_pieces"),
        "hf_recattn.evaluation.recall": ("Haystack", "RecallPrompt", "recall_prompt", "texts_from_blocks", "Fact"),
        "hf_recattn.evaluation.needles": ("NeedlePrompt", "needle_prompt", "NEEDLE_TASKS"),
        "hf_recattn.evaluation.passkey": ("passkey_ids", "passkey_prompt", "passkey_question_ids"),
        "hf_recattn.evaluation.distance": ("distance_prompt",),
        "hf_recattn.recall": ("Haystack", "RecallPrompt", "recall_prompt"),
    }
    for module, names in older.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert getattr(loaded, name) is getattr(prompting, name), f"{module}.{name}"
