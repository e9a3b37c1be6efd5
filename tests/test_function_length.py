"""No function of the package, its scripts or its benchmarks is longer than ``MAX_LINES`` lines.

A function's length runs from its ``def`` line to its last line, less its docstring (the Args / Returns / Example
an op documents are not code to split) and its decorators; nested functions count inside their parent and on their
own. Triton kernels (decorated with ``triton.jit``) are exempt: a kernel is one fused loop whose pieces cannot be
calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("hf_recattn", "scripts", "benchmarks")
MAX_LINES = 60


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def long_functions(files: list[Path], root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` (file relative to ``root``) for every function longer than ``limit`` lines."""
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_triton_kernel(node):
                continue
            lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
            if lines > limit:
                found.append(f"{file.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    files = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
    assert any(p.name == "ops_delta.py" and p.parent.name == "modeling" for p in files)  # the walk saw the package
    assert long_functions(files) == []


@pytest.mark.parametrize("decorator", ["@triton.jit", "@triton.jit(do_not_specialize=['n'])"])
def test_the_check_counts_code_lines_and_exempts_only_triton_kernels(tmp_path: Path, decorator: str) -> None:
    body = "".join(f"    x = {i}\n" for i in range(MAX_LINES - 1))  # with its def line: MAX_LINES lines
    file = tmp_path / "m.py"
    text = (f"def fits():\n{body}\n\ndef too_long():\n{body}    x += 1\n\n\n"
            f'def documented():\n    """Args:\n\n    x: y\n    """\n{body}\n\n'
            f"{decorator}\ndef kernel():\n{body}    x += 1\n\n\n@other.jit\ndef not_a_kernel():\n{body}    x += 1\n")
    file.write_text(text)
    line = {name: text.splitlines().index(f"def {name}():") + 1 for name in ("too_long", "not_a_kernel")}
    assert long_functions([file], tmp_path) == [f"m.py:{line[name]} {name} ({MAX_LINES + 1} lines)" for name in line]
