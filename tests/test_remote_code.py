"""A saved checkpoint loads with trust_remote_code=True in a Python where hf_recattn cannot be imported.

The child process runs ``python -I`` (no PYTHONPATH, no user site, no cwd on sys.path) from an empty folder
and then hides hf_recattn however it is installed: it drops meta-path finders that can find it (the editable
install's finder), drops sys.path entries that hold it, asserts ``importlib.util.find_spec('hf_recattn') is
None``, and puts a blocker first on ``sys.meta_path`` for good measure. It writes its logits to a safetensors
file that this process compares with its own (tolerance ``ATOL``: same code and weights, maybe other threads).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from isolated import HIDE_HF_RECATTN, save_tiny_recattn
from safetensors.torch import load_file, save_file

from hf_recattn import RecAttnForCausalLM

ATOL = 1e-5
LAYERS = [
    {"mixer": "softmax"},
    {"mixer": "sliding_window", "window": 4},
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms", "chunk_size": 4},
    {"mixer": "linear", "feature_map": "taylor2", "decay": "gated", "sink": True},
    {"mixer": "delta", "rule": "comba", "householder_steps": 2, "feature_map": "hedgehog", "chunk_size": 4},
    {"mixer": "retrieval_heads", "heads": [1], "others": {"mixer": "hybrid", "window": 3, "sink_tokens": 1}},
]
#: files the runtime needs for these mixers (others may be copied too: every mixer registered in mixers.py)
RUNTIME_CORE = {
    "configuration.py",
    "modeling.py",
    "architecture.py",
    "cache.py",
    "mixers.py",
    "registry.py",
    "presets.py",
    "far_part.py",
    "mixer_base.py",
    "mixer_softmax.py",
    "mixer_linear.py",
    "feature_maps.py",
    "decay.py",
    "sink.py",
    "output_norms.py",
    "ops_linear.py",
    "options.py",
    "mixer_delta.py",
    "ops_delta.py",
    "triangular.py",
    "delta_gates.py",
    "short_conv.py",
    "mixer_retrieval_heads.py",
    "mixer_hybrid.py",
}

AUTO_MAP = {
    "AutoConfig": "configuration.RecAttnConfig",
    "AutoModel": "modeling.RecAttnModel",
    "AutoModelForCausalLM": "modeling.RecAttnForCausalLM",
}

CHILD = HIDE_HF_RECATTN + textwrap.dedent(
    r"""
    # 1. hf_recattn is hidden by the preamble (tests/isolated.py)
    # 2. load with remote code and run a left-padded batch through the cached forward
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    ckpt, io = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    inputs = load_file(f"{io}/inputs.safetensors")
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    base = AutoModel.from_pretrained(ckpt, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        hidden = base(inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    save_file({"logits": logits.contiguous(), "hidden": hidden.contiguous()}, f"{io}/outputs.safetensors")
    model.save_pretrained(f"{io}/resaved")  # a remote-code model saves a self-contained checkpoint again
    print(json.dumps({
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "base_class": f"{type(base).__module__}.{type(base).__name__}",
        "config_class": f"{type(config).__module__}.{type(config).__name__}",
        "mixers": [type(layer.self_attn.mixer).__name__ for layer in model.model.layers],
        "hf_recattn_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "hf_recattn"),
    }))
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RecAttnForCausalLM]:
    path = tmp_path_factory.mktemp("ckpt")
    return path, save_tiny_recattn(path, LAYERS, seed=0)


def test_save_writes_flat_runtime_and_auto_map(saved: tuple[Path, RecAttnForCausalLM]) -> None:
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["model_type"] == "recattn"
    files = {p.name for p in path.glob("*.py")}
    assert RUNTIME_CORE <= files, sorted(RUNTIME_CORE - files)
    for name in files:
        source = (path / name).read_text()
        assert not re.search(r"^\s*(from|import)\s+hf_recattn\b", source, re.M), f"{name}: absolute import"
        assert not re.search(r"^\s*from\s+\.\s+import\b", source, re.M), (
            f"{name}: 'from . import x' fails to load"
        )
        assert not re.search(r"^\s*from\s+\.\.", source, re.M), f"{name}: parent-package import"
        for sibling in re.findall(r"^\s*from\s+\.(\w+)\s+import\b", source, re.M):
            assert f"{sibling}.py" in files, f"{name} imports .{sibling}, which was not copied"


def test_loads_without_the_package(saved: tuple[Path, RecAttnForCausalLM], tmp_path: Path) -> None:
    path, model = saved
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, str(tmp_path / "inputs.safetensors"))
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", CHILD, str(path), str(tmp_path)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hf_recattn_loaded"] == []
    for key in ("model_class", "base_class", "config_class"):
        assert report[key].startswith("transformers_modules."), report[key]
    assert report["model_class"].endswith(".modeling.RecAttnForCausalLM")
    assert report["base_class"].endswith(".modeling.RecAttnModel")
    assert report["config_class"].endswith(".configuration.RecAttnConfig")
    assert report["mixers"] == ["SoftmaxMixer", "SlidingWindowMixer", "LinearMixer", "LinearMixer", "DeltaMixer",
                                "RetrievalHeadsMixer"]
    resaved = tmp_path / "resaved"
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert RUNTIME_CORE <= {p.name for p in resaved.glob("*.py")}
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        want_hidden = model.model(ids, attention_mask=mask).last_hidden_state
    assert outputs["logits"].shape == want.shape
    assert (outputs["logits"] - want).abs().max() <= ATOL
    assert (outputs["hidden"] - want_hidden).abs().max() <= ATOL
