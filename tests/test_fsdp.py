"""FSDP2 on the CPU with 2 processes (gloo): pretrain, a LoRA finetune and both conversion stages give what one
process gives (also with the loss over chunks of positions), with the trained parameters really sharded;
interrupted runs resume; the saved models are plain full checkpoints; a request that cannot shard is refused before
any work.

The 2-process runs go through tests/fsdp_worker.py, which notes before every optimizer step how the parameters it
updates are held: every one must be a DTensor of which each process holds a part (the parts adding up to the
whole), what a silent fallback to DDP (plain tensors, whole on each process) would fail.

Tolerance: 1e-5 on every saved weight against one process with the whole batch, as for DDP (gradients reduced in
another order; measured: pretrain 1.4e-6, LoRA finetune 4e-8, stage 1 1.2e-7, the converted model 4.9e-6, the last
two what DDP gives too; with ``loss_chunk_size``: pretrain 1.4e-6, the converted model 1.2e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from distill_fixtures import (
    tiny_corpus_file,
    tiny_recipe_dict,
    tiny_teacher_folder,
    tiny_texts,
    tiny_tokenizer,
    write_recipe,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_recattn.cli import main
from hf_recattn.training import pretrain, sharding
from hf_recattn.training.runner import train_with_resume

WORKER = Path(__file__).with_name("fsdp_worker.py")
ACCELERATE_CONFIG = Path(sharding.__file__).parent / "configs" / "accelerate_fsdp.yaml"
TOLERANCE = 1e-5
MODEL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
    "attention": {"mixer": "linear", "feature_map": "hedgehog"},
    "attention_overrides": {"0": {"mixer": "sliding_window", "window": 8}},
}
FSDP = {"fsdp": True, "fsdp_config": {"version": 2}}
#: stage 1 with each layer's gradients clipped at every step, trained q/k projections and the attention-weight KL
STAGE1 = {"max_grad_norm": 1.0e-3, "projections": ["q_proj", "k_proj"], "attention_kl": 0.1}


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One thread; the FSDP variables accelerate and transformers set in the process restored afterwards."""
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    tiny_tokenizer().save_pretrained(root / "tokenizer")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in tiny_texts(12) * 3))
    return {"root": root, "tokenizer": root / "tokenizer", "docs": docs,
            "teacher": tiny_teacher_folder(root / "teacher"), "corpus": tiny_corpus_file(root / "corpus.jsonl"),
            "recipe": write_recipe(root / "r.yaml", tiny_recipe_dict(stage1=STAGE1))}


def _yaml(path: Path, value: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(value, sort_keys=False))
    return path


def _training(out: Path, batch: int, steps: int, **extra: Any) -> dict[str, Any]:
    return {"output_dir": str(out), "max_steps": steps, "per_device_train_batch_size": batch, "learning_rate": 1e-2,
            "warmup_steps": 0, "save_steps": 2, "train_sampling_strategy": "sequential", "disable_tqdm": True,
            "logging_steps": 1, "report_to": "none", **extra}


def _pretrain_yaml(files: dict[str, Path], out: Path, batch: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "tokenizer": str(files["tokenizer"]), "block_size": 32,
            "data": {"source": str(files["docs"]), "eval_fraction": 0.0, "cache_dir": str(files["root"] / "hf")},
            "training": _training(out, batch, 4, **extra)}


def _finetune_yaml(files: dict[str, Path], out: Path, batch: int, **extra: Any) -> dict[str, Any]:
    return {"method": "lora", "lora": {"r": 4, "alpha": 8}, "block_size": 32,
            "data": {"eval_fraction": 0.0, "cache_dir": str(files["root"] / "hf")},
            "training": _training(out, batch, 2, **extra)}


def _largest_difference(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def _launch(launcher: list[str], notes: Path, *commands: list[str]) -> list[list[dict[str, Any]]]:
    """Run the worker's commands in 2 processes; each process's notes, per command."""
    args = [str(WORKER), str(notes)]
    for command in commands:
        args += [*(["---"] if len(args) > 2 else []), *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(notes.with_name(f"{notes.stem}-rank{rank}{notes.suffix}").read_text()) for rank in (0, 1)]


def _assert_sharded(ranks: list[list[dict[str, Any]]], command: int, steps: list[int]) -> None:
    """In ``command``, each optimizer made ``steps`` steps on DTensors, each process holding a part of them."""
    first, second = (notes[command]["optimizers"] for notes in ranks)
    assert [note["steps"] for note in first] == [note["steps"] for note in second] == steps
    for a, b in zip(first, second, strict=True):
        assert a["dtensors"] == a["params"] == b["dtensors"] > 0
        assert a["total"] == b["total"] == a["local"] + b["local"] and 0 < b["local"] <= a["local"] < a["total"]


def _assert_plain_checkpoint(folder: Path) -> None:
    """A full checkpoint that loads without FSDP, whose remote code names the model's own classes."""
    assert not list(folder.glob("_fsdp*"))
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling.RecAttnForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "RecAttnForCausalLM"


# ----- refused before any work ----------------------------------------------------------------------------------
def test_one_process_cannot_shard(files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    config = _yaml(tmp_path / "pretrain.yaml", _pretrain_yaml(files, tmp_path / "out", 4, **FSDP))
    with pytest.raises(ValueError, match=r"pretrain.yaml: training.fsdp: FSDP shards the model over several "
                                         r"processes, and this run has one"):
        pretrain(config)
    assert not (tmp_path / "out").exists()
    args = ["convert", "--teacher", str(files["teacher"]), "--recipe", str(files["recipe"]), "--output",
            str(tmp_path / "conv"), "--corpus", str(files["corpus"]), "--fsdp"]
    assert main(args) == 2
    assert "--fsdp: FSDP shards the model over several processes" in capsys.readouterr().err
    assert not (tmp_path / "conv").exists()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch with an FSDP config, and 1 process
    monkeypatch.setenv("FSDP_VERSION", "2")
    plain = _yaml(tmp_path / "plain.yaml", _pretrain_yaml(files, tmp_path / "out", 4))
    with pytest.raises(ValueError, match=r"the accelerate config's distributed_type: FSDP .*this run has one"):
        pretrain(plain)


def test_what_cannot_shard_is_refused(files: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    version_1 = type("Arguments", (), {"fsdp_plugin_args": {"fsdp_version": 1}})()
    with pytest.raises(ValueError, match=r"ft.yaml: training.fsdp: FSDP version 1 is not supported; use version 2"):
        sharding.check_arguments(version_1, "ft.yaml: training.fsdp")


def test_a_checkpoint_resumes_only_the_way_it_was_written(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "optimizer.bin").write_bytes(b"")  # accelerate's FSDP optimizer file
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), is_fsdp_enabled=False)
    with pytest.raises(ValueError, match=r"checkpoint-2: written with FSDP; resume it with FSDP"):
        train_with_resume(trainer)
    (checkpoint / "optimizer.bin").rename(checkpoint / "optimizer.pt")  # Trainer's own
    trainer.is_fsdp_enabled = True
    with pytest.raises(ValueError, match=r"checkpoint-2: written without FSDP; resume it without FSDP"):
        train_with_resume(trainer)


# ----- 2 processes ----------------------------------------------------------------------------------------------
def test_pretrain_and_lora_finetune_shard_like_one_process(files: dict[str, Path], tmp_path: Path) -> None:
    """``accelerate launch`` with the packaged FSDP config: pretrain (interrupted at step 3, resumed from its
    step-2 checkpoint), then a LoRA finetune (its YAML asking for FSDP too); against one process each."""
    one = pretrain(_yaml(tmp_path / "one.yaml", _pretrain_yaml(files, tmp_path / "one", 4)))
    ft_one = _yaml(tmp_path / "ft1.yaml", _finetune_yaml(files, tmp_path / "ft1", 4))
    assert main(["finetune", "--model", str(one.model_dir), "--data", str(files["docs"]), "--config",
                 str(ft_one)]) == 0
    two = _yaml(tmp_path / "two.yaml", _pretrain_yaml(files, tmp_path / "two", 2))
    ft_two = _yaml(tmp_path / "ft2.yaml", _finetune_yaml(files, tmp_path / "ft2", 2, **FSDP))
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ACCELERATE_CONFIG),
                  "--num_processes", "2"]
    finetune = ["finetune", "--model", str(one.model_dir), "--data", str(files["docs"]), "--config", str(ft_two)]
    ranks = _launch(accelerate, tmp_path / "notes.json", ["3", "pretrain", "--config", str(two)],
                    ["pretrain", "--config", str(two)], finetune)
    assert [note["code"] for note in ranks[0]] == [130, 0, 0]
    _assert_sharded(ranks, 0, [2])
    _assert_sharded(ranks, 1, [2])  # steps 3 and 4 after the checkpoint of step 2
    _assert_sharded(ranks, 2, [2])
    weights = "model/model.safetensors"
    assert _largest_difference(tmp_path / "one" / weights, tmp_path / "two" / weights) <= TOLERANCE
    assert _largest_difference(tmp_path / "ft1" / weights, tmp_path / "ft2" / weights) <= TOLERANCE
    _assert_plain_checkpoint(tmp_path / "two" / "model")
    _assert_plain_checkpoint(tmp_path / "ft2" / "model")


def test_convert_shards_both_stages_like_one_process(files: dict[str, Path], tmp_path: Path) -> None:
    """``torchrun ... convert --fsdp``, interrupted in stage 1 (step 5, after its checkpoint of step 4) and in
    stage 2 (step 3, after its checkpoint of step 2), each time resumed; against one process."""
    def args(out: Path) -> list[str]:
        return ["convert", "--teacher", str(files["teacher"]), "--recipe", str(files["recipe"]), "--output", str(out),
                "--corpus", str(files["corpus"]), "--no-progress", "--no-eval", "--threads", "1"]

    assert main(args(tmp_path / "one")) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*args(tmp_path / "two"), "--fsdp"]
    ranks = _launch(torchrun, tmp_path / "notes.json", ["5", *command], ["5", *command], command)
    assert [note["code"] for note in ranks[0]] == [130, 130, 0]
    _assert_sharded(ranks, 0, [4])  # stage 1
    _assert_sharded(ranks, 1, [2, 2])  # stage 1 from its step 4, stage 2
    _assert_sharded(ranks, 2, [2])  # stage 2 from its step 2
    stage1, model = "stage1/result/mixer.safetensors", "model/model.safetensors"
    assert _largest_difference(tmp_path / "one" / stage1, tmp_path / "two" / stage1) <= TOLERANCE
    assert _largest_difference(tmp_path / "one" / model, tmp_path / "two" / model) <= TOLERANCE
    _assert_plain_checkpoint(tmp_path / "two" / "model")


def test_the_loss_over_chunks_shards_like_one_process(files: dict[str, Path], tmp_path: Path) -> None:
    """``loss_chunk_size`` under FSDP (the LM head run on chunks of the final hidden states outside the model's
    forward, and again in the backward): a pretrain (untied LM head) and a conversion whose stage 2 trains LoRA
    adapters (tied LM head), in one ``torchrun``; against one process each."""
    recipe = write_recipe(tmp_path / "chunked.yaml", tiny_recipe_dict(stage1=STAGE1, stage2={"loss_chunk_size": 8}))

    def convert(out: Path) -> list[str]:
        return ["convert", "--teacher", str(files["teacher"]), "--recipe", str(recipe), "--output", str(out),
                "--corpus", str(files["corpus"]), "--no-progress", "--no-eval", "--threads", "1"]

    one = {**_pretrain_yaml(files, tmp_path / "one", 4), "loss_chunk_size": 8}
    two = {**_pretrain_yaml(files, tmp_path / "two", 2, **FSDP), "loss_chunk_size": 8}
    pretrain(_yaml(tmp_path / "one.yaml", one))
    assert main(convert(tmp_path / "conv1")) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    ranks = _launch(torchrun, tmp_path / "notes.json", ["pretrain", "--config", str(_yaml(tmp_path / "two.yaml", two))],
                    [*convert(tmp_path / "conv2"), "--fsdp"])
    assert [note["code"] for note in ranks[0]] == [0, 0]
    _assert_sharded(ranks, 0, [4])
    _assert_sharded(ranks, 1, [6, 4])  # stage 1, stage 2
    model = "model/model.safetensors"
    assert _largest_difference(tmp_path / "one" / model, tmp_path / "two" / model) <= TOLERANCE
    assert _largest_difference(tmp_path / "conv1" / model, tmp_path / "conv2" / model) <= TOLERANCE
