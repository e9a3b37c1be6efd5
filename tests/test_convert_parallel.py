"""Conversion under torchrun (2 gloo processes) equals one process on the same batches; bfloat16 teachers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_teacher_folder, write_recipe
from safetensors.torch import load_file

from hf_recattn.cli import main


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {
        "teacher": tiny_teacher_folder(root / "teacher"),
        "corpus": tiny_corpus_file(root / "corpus.jsonl"),
        "recipe": write_recipe(root / "tiny.yaml", tiny_recipe_dict()),
    }


def _args(assets: dict[str, Path], out: Path, *extra: str, evaluate: bool = False) -> list[str]:
    return ["convert", "--teacher", str(assets["teacher"]), "--recipe", str(assets["recipe"]), "--output", str(out),
            "--corpus", str(assets["corpus"]), "--no-progress", "--threads", "1", *extra,
            *([] if evaluate else ["--no-eval"])]


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_processes_convert_like_one(assets: dict[str, Path], tmp_path: Path) -> None:
    """Stage 1 (hand-written loop, gradients all-reduced) and stage 2 (Trainer, DDP) on 2 x 2 blocks per step
    against 1 process on 4: the same stage-1 parameters and the same converted model; only rank 0 writes."""
    assert main(_args(assets, tmp_path / "one")) == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_RECATTN_CACHE": str(tmp_path / "cache")}
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "hf_recattn.cli",
               *_args(assets, tmp_path / "two")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("saved the converted model") == 1  # rank 0 logs and writes
    one, two = tmp_path / "one", tmp_path / "two"
    stage1 = "stage1/result/mixer.safetensors"
    assert _largest_difference(load_file(one / stage1), load_file(two / stage1)) <= 1e-5
    model = "model/model.safetensors"
    assert _largest_difference(load_file(one / model), load_file(two / model)) <= 1e-5
    summary = json.loads((two / "stage1/result/summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 4 * 32  # the recipe's batches, shared out
    # the comparison can tell runs apart: another seed gives another model
    assert main(_args(assets, tmp_path / "seed1", "--seed", "1")) == 0
    assert _largest_difference(load_file(one / model), load_file(tmp_path / "seed1" / model)) > 1e-3


def test_a_batch_that_does_not_split_is_refused(assets: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_recattn.training.parallel import local_share

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"stage1.batch_size 4 does not split over 3 processes"):
        local_share(4, "stage1.batch_size")


def test_bfloat16_teacher_float32_student(assets: dict[str, Path], tmp_path: Path) -> None:
    """``--teacher-dtype bfloat16``: the teacher runs in bfloat16, the student (a copy of its bfloat16 weights)
    trains and is saved in float32, and the run says which dtype its teacher had."""
    out = tmp_path / "bf16"
    assert main(_args(assets, out, "--teacher-dtype", "bfloat16", evaluate=True)) == 0
    saved = load_file(out / "model" / "model.safetensors")
    assert {value.dtype for value in saved.values()} == {torch.float32}
    teacher = load_file(assets["teacher"] / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj.weight"  # not trained by either stage: the teacher's, rounded
    assert torch.equal(saved[key], teacher[key].to(torch.bfloat16).float())
    assert not torch.equal(saved[key], teacher[key])
    stage1 = json.loads((out / "stage1/result/summary.json").read_text())
    assert all(0 < value < 1 for value in stage1["relative_last"].values())
    assert json.loads((out / "run.json").read_text())["teacher_dtype"] == "bfloat16"
    report = json.loads((out / "report.json").read_text())
    assert report["teacher_dtype"] == "bfloat16"
    assert all(0 < row["perplexity"] < 200 for row in report["comparison"].values())  # teacher and student
