"""Documentation the code carries: every registered mixer family names its paper in its class docstring, every
public op documents its arguments and results and shows an example, and the examples run (as doctests, here).
The README's reference list names each paper a family cites, under the same arXiv id and title.

Families come from the registry, ops from the modules of ``hf_recattn.modeling`` and ``hf_recattn.ops`` whose name
starts with ``ops`` (and ``hf_recattn.ops.__all__``), so modules can move or be renamed without this test knowing,
plus the modules of plain-tensor functions the ops share (``OP_HELPERS``).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

import hf_recattn
import hf_recattn.modeling
import hf_recattn.ops
from hf_recattn.modeling.registry import MIXERS

ROOT = Path(__file__).resolve().parents[1]
ARXIV = re.compile(r"arXiv:\d{4}\.\d{4,5}")
#: a cited title and its id: ``"Title", arXiv:N`` in docstrings, ``*Title*, arXiv:N`` in markdown
DOC_CITATION = re.compile(r'"([^"]+)",\s+(arXiv:\d{4}\.\d{4,5})')
MD_CITATION = re.compile(r"\*([^*]+)\*,\s+(arXiv:\d{4}\.\d{4,5})")
#: fewer public ops than this means the search below lost a module (moved where it does not look)
MIN_OPS = 50
#: modeling modules that are no op family but hold functions the ops share (documented like the ops)
OP_HELPERS = ("fla_adapters", "triangular")


def _family_doc(cls: type) -> str:
    return cls.__dict__.get("__doc__") or ""


def _op_modules() -> list[ModuleType]:
    """Modules named ``ops*`` or in ``OP_HELPERS`` in the modeling package and in ``hf_recattn.ops`` (when that is a
    package)."""
    found = []
    for package in (hf_recattn.modeling, hf_recattn.ops):
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), package.__name__ + "."):
            if info.name.rsplit(".", 1)[-1].startswith("ops") or info.name.rsplit(".", 1)[-1] in OP_HELPERS:
                found.append(importlib.import_module(info.name))
    return found


def _public_ops() -> dict[str, Callable]:
    """Every public function defined in an ops module (its ``__all__`` where it has one), and the functional API."""
    ops: dict[str, Callable] = {}
    for module in _op_modules():
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            fn = getattr(module, name)
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                ops[f"{module.__name__}.{name}"] = fn
    for name in hf_recattn.ops.__all__:
        fn = getattr(hf_recattn.ops, name)
        ops.setdefault(f"{fn.__module__}.{name}", fn)
    return ops


OPS = _public_ops()


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_family_docstring_names_its_paper(name: str) -> None:
    doc = _family_doc(MIXERS[name])
    assert ARXIV.search(doc) or "https://" in doc, f"{MIXERS[name].__name__} ({name!r}) names no paper"


def test_every_op_module_is_found() -> None:
    assert len(OPS) >= MIN_OPS, f"only {len(OPS)} public ops found: did an ops module move? {sorted(OPS)}"


def _section(doc: str, title: str) -> str:
    """The indented block under ``title:`` (empty if absent)."""
    match = re.search(rf"^{title}:\n((?:[ \t]+\S.*\n|\n)+)", doc + "\n", flags=re.MULTILINE)
    return match.group(1) if match else ""


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_documents_args_returns_and_an_example(name: str) -> None:
    fn = OPS[name]
    doc = inspect.getdoc(fn) or ""
    args, returns = _section(doc, "Args"), _section(doc, "Returns")
    assert args and returns, f"{name}: no Args: / Returns: section"
    for param in inspect.signature(fn).parameters:
        assert re.search(rf"^\s+\**{param}:", args, flags=re.MULTILINE), f"{name}: argument {param!r} not in Args:"
    assert ">>> " in doc, f"{name}: no example"


def _needs_kernels(test: doctest.DocTest) -> bool:
    return any("hf_recattn.kernels" in example.source for example in test.examples)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_example_runs(name: str) -> None:
    fn = OPS[name]
    tests = doctest.DocTestFinder(recurse=False).find(fn, name, globs=vars(inspect.getmodule(fn)).copy())
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        if _needs_kernels(test) and importlib.util.find_spec("triton") is None:
            pytest.skip("the example runs a Triton kernel: triton is not installed")
        with torch.random.fork_rng():
            torch.manual_seed(0)
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted and not result.failed, f"{name}: {result.failed} of {result.attempted} examples failed"


def _normalized(title: str) -> str:
    return " ".join(title.replace("'", "").replace('"', "").split()).rstrip(".").lower()


def _references() -> dict[str, str]:
    """arXiv id -> title of the README's ``## References`` list."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## References\n", 1)[1].split("\n## ", 1)[0]
    return {arxiv: _normalized(title) for title, arxiv in MD_CITATION.findall(section)}


def test_readme_references_every_paper_a_family_cites() -> None:
    references = _references()
    for cls in set(MIXERS.values()):
        for title, arxiv in DOC_CITATION.findall(" ".join(_family_doc(cls).split())):
            assert arxiv in references, f"{cls.__name__} cites {arxiv}, missing from the README's references"
            assert references[arxiv] == _normalized(title), f"{arxiv}: {title!r} in {cls.__name__}, README differs"


def test_mixers_doc_cites_the_readme_references() -> None:
    references = _references()
    text = " ".join((ROOT / "docs" / "mixers.md").read_text().split())
    for arxiv in set(ARXIV.findall(text)):
        assert arxiv in references, f"docs/mixers.md cites {arxiv}, missing from the README's references"
    for title, arxiv in MD_CITATION.findall(text):
        assert references[arxiv] == _normalized(title), f"{arxiv}: docs/mixers.md says {title!r}, README differs"
