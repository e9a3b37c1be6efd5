"""glibc's mmap threshold (hf_recattn.heap): set by default by the training commands, left alone where the user tunes
malloc or asks for glibc's own behaviour, a clear error for a bad value, a no-op where the C library is not glibc.
What it does to memory is measured by benchmarks/conversion_scale.py, not here."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hf_recattn import heap
from hf_recattn.cli import common, main

MIB = 2**20


@pytest.mark.parametrize("environ", [
    {"MALLOC_MMAP_THRESHOLD_": "1048576"},
    {"MALLOC_ARENA_MAX": "2"},
    {"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=on:glibc.malloc.trim_threshold=65536"},
], ids=["threshold", "other-malloc-variable", "glibc-tunables"])
def test_an_environment_that_tunes_malloc_is_left_alone(environ: dict[str, str]) -> None:
    assert heap.chosen_threshold(None, environ) is None
    assert heap.fix_mmap_threshold(None, environ) is None
    assert heap.chosen_threshold(MIB, environ) == MIB  # the option, given, says what to do


def test_the_default_and_the_option() -> None:
    assert heap.chosen_threshold(None, {}) == heap.DEFAULT_MMAP_THRESHOLD
    assert heap.chosen_threshold(None, {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}) == heap.DEFAULT_MMAP_THRESHOLD
    assert heap.chosen_threshold(16 * MIB, {}) == 16 * MIB
    assert heap.chosen_threshold(0, {}) is None  # glibc's own, adjustable threshold
    assert heap.fix_mmap_threshold(0, {}) is None


@pytest.mark.parametrize("value", [-1, heap.MAX_MMAP_THRESHOLD + 1])
def test_a_bad_value_is_an_error_naming_the_option(value: int) -> None:
    with pytest.raises(ValueError, match=r"--malloc-mmap-threshold must be between 0 .* got " + str(value)):
        heap.chosen_threshold(value, {})


@pytest.mark.skipif(heap._glibc() is None, reason="glibc only")
def test_on_glibc_the_threshold_is_set() -> None:
    assert heap.fix_mmap_threshold(None, {}) == heap.DEFAULT_MMAP_THRESHOLD
    assert heap.fix_mmap_threshold(2 * MIB, {}) == 2 * MIB
    libc = heap._glibc()
    assert isinstance(libc, ctypes.CDLL) and libc.mallopt(heap.M_MMAP_THRESHOLD, heap.DEFAULT_MMAP_THRESHOLD) == 1


@pytest.mark.parametrize("confstr", [None, "ValueError", "musl"], ids=["no-confstr", "macos", "musl"])
def test_another_c_library_is_a_logged_no_op(confstr: str | None, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def fake(name: str) -> str | None:
        if confstr == "ValueError":
            raise ValueError("unrecognized configuration name")
        return None

    if confstr is None:
        monkeypatch.delattr(heap.os, "confstr")
    else:
        monkeypatch.setattr(heap.os, "confstr", fake)
    with caplog.at_level(logging.DEBUG, logger="hf_recattn.heap"):
        assert heap._glibc() is None and heap.fix_mmap_threshold(None, {}) is None
    assert "not glibc" in caplog.text


@pytest.mark.parametrize(("args", "job"), [
    (["convert", "--recipe", "gdn", "--output", "{tmp}/run", "--threads", "{threads}"], "conversion.pipeline.convert"),
    (["pretrain", "--config", "{tmp}/pretrain.yaml"], "training.pretrain"),
    (["finetune", "--model", "{tmp}/model", "--data", "embedded"], "training.finetune"),
])
def test_the_training_commands_set_it_before_their_job(args: list[str], job: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    import importlib

    import torch

    calls: list[Any] = []
    module, name = f"hf_recattn.{job}".rsplit(".", 1)
    done = SimpleNamespace(global_step=0, model_dir=tmp_path)
    monkeypatch.setattr(importlib.import_module(module), name, lambda *a, **k: calls.append("job") or done)
    monkeypatch.setattr(common, "fix_mmap_threshold", lambda value: calls.append(value))
    argv = [a.format(tmp=tmp_path, threads=torch.get_num_threads()) for a in args]  # the threads left as they are
    assert main(argv) == 0 and calls == [None, "job"]
    calls.clear()
    assert main([*argv, "--malloc-mmap-threshold", "0"]) == 0 and calls == [0, "job"]
    monkeypatch.setattr(common, "fix_mmap_threshold", heap.fix_mmap_threshold)
    calls.clear()
    capsys.readouterr()
    assert main([*argv, "--malloc-mmap-threshold", "-5"]) == 2 and calls == []
    assert capsys.readouterr().err == (f"hf-recattn {args[0]}: error: --malloc-mmap-threshold must be between 0 "
                                       f"(glibc's default) and {heap.MAX_MMAP_THRESHOLD} bytes, got -5\n")
