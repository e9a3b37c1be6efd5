"""A command that needs an optional extra which is not installed stops with one line naming the extra (exit code
2, no traceback), before it does any work; the extras it knows are pyproject's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_recattn.cli import main
from hf_recattn.extras import EXTRAS, MissingExtra, require
from hf_recattn.provenance import _program

ROOT = Path(__file__).resolve().parents[1]


def _line(command: str, extra: str) -> str:
    return f'hf-recattn {command} needs the {extra} extra: pip install "hf-recattn[{extra}]"\n'


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file that passes the GGUF magic check, with an empty cache (no plain copy of its tokenizer)."""
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "teacher.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_extras_are_those_of_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = [re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0] for requirement in optional[extra]]
        assert list(modules) == names, extra


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    require("gguf", "reading a GGUF file")  # installed here
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingExtra) as caught:
        require("train", "LoRA")
    assert str(caught.value) == 'LoRA needs the train extra: pip install "hf-recattn[train]"'
    assert caught.value.extra == "train"


@pytest.mark.parametrize(("args", "module", "extra"), [
    (["convert", "--recipe", "gdn", "--output", "{tmp}/run"], "peft", "train"),
    (["pretrain", "--config", "{tmp}/pretrain.yaml"], "datasets", "train"),
    (["finetune", "--model", "{tmp}/model", "--data", "embedded"], "accelerate", "train"),
    (["corpus", "--no-tokens", "--write", "{tmp}/splits", "--format", "dataset"], "datasets", "train"),
    (["serve", "{tmp}/model", "--port", "1"], "fastapi", "serve"),
    (["eval", "{tmp}/model", "--lm-eval", "piqa"], "lm_eval", "eval"),
    (["corpus", "--tokenizer", "{gguf}"], "gguf", "gguf"),
    (["generate", "{gguf}", "--prompt", "hello"], "gguf", "gguf"),
    (["eval", "{gguf}"], "gguf", "gguf"),
])
def test_a_command_names_its_missing_extra(args: list[str], module: str, extra: str, tmp_path: Path,
                                           fake_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    argv = [a.format(tmp=tmp_path, gguf=fake_gguf) for a in args]
    assert main(argv) == 2
    assert capsys.readouterr().err == _line(args[0], extra)
    assert not (tmp_path / "run").exists() and not (tmp_path / "splits").exists()  # nothing started


def test_in_a_core_install_the_corpus_command_names_the_gguf_extra(fake_gguf: Path) -> None:
    """``python -m hf_recattn.cli corpus`` in a fresh interpreter where gguf cannot be imported."""
    child = ("import runpy, sys; sys.modules['gguf'] = None; "
             "runpy.run_module('hf_recattn.cli', run_name='__main__', alter_sys=True)")
    env = {"PYTHONPATH": str(ROOT), "HF_RECATTN_CACHE": str(fake_gguf.parent / "cache"), "PATH": "/usr/bin:/bin",
           "HOME": str(fake_gguf.parent)}
    done = subprocess.run([sys.executable, "-c", child, "corpus", "--tokenizer", str(fake_gguf)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert (done.returncode, done.stderr) == (2, _line("corpus", "gguf")), done.stderr[-3000:]


def test_provenance_names_the_module_run_as_hf_recattn() -> None:
    assert _program(str(ROOT / "hf_recattn" / "cli" / "__main__.py")) == "hf-recattn"
    assert _program("scripts/render_docs.py") == "scripts/render_docs.py"
