"""One name per family: module, class and registered family name agree, the presets keep the papers' names.

A checkpoint stores family names only (its config.json's specs), never a module or class name, so the renames of
modules and classes leave checkpoints loading: specs with the family names earlier versions saved must load with
the package and, beside the current runtime files, through ``trust_remote_code`` in a Python without hf_recattn,
giving the same logits and greedy tokens on a left-padded batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from isolated import HIDE_HF_RECATTN, save_tiny_recattn
from safetensors.torch import load_file, save_file

from hf_recattn import RecAttnForCausalLM
from hf_recattn.modeling import mixers
from hf_recattn.modeling.mixers import BUILTIN_MIXERS, MIXERS, PRESETS

MODELING = Path(mixers.__file__).parent
#: preset (the paper's name) -> family, for the families whose names differ from their paper's
PAPER_PRESETS = {"deltaformer": "softmax_delta", "path": "softmax_householder", "gla": "gated_linear",
                 "mesanet": "mesa", "rwkv7": "generalized_delta"}
#: layer specs as config.json holds them (family names, as every earlier version wrote them)
SAVED_LAYERS = [
    {"mixer": "softmax_delta", "write_strength": "sigmoid"},
    {"mixer": "softmax_householder", "chunk_size": 4},
    {"mixer": "gated_linear", "chunk_size": 4},
    {"mixer": "mesa", "chunk_size": 4},
    {"mixer": "generalized_delta", "chunk_size": 4},
    {"mixer": "retrieval_heads", "heads": [1], "others": {"mixer": "generalized_delta", "chunk_size": 4}},
]
NEW_TOKENS = 12

CHILD = HIDE_HF_RECATTN + textwrap.dedent(
    r"""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ckpt, io, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    inputs = load_file(f"{io}/inputs.safetensors")
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    save_file({"logits": logits.contiguous(), "tokens": tokens.contiguous()}, f"{io}/outputs.safetensors")
    print(json.dumps({"mixers": [type(layer.self_attn.mixer).__name__ for layer in model.model.layers],
                      "hf_recattn_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "hf_recattn")}))
    """
)


def _camel(family: str) -> str:
    return "".join(part.capitalize() for part in family.split("_"))


def test_module_class_and_family_name_agree() -> None:
    for cls in BUILTIN_MIXERS:
        # a variant may live beside the family it subclasses (sliding_window in mixer_softmax.py)
        homes = {f"mixer_{c.name}" for c in cls.__mro__ if c in BUILTIN_MIXERS}
        assert cls.__module__.rsplit(".", 1)[-1] in homes, (cls.__name__, cls.__module__)
        assert cls.__name__ == f"{_camel(cls.name)}Mixer", (cls.name, cls.__name__)
    for path in sorted(MODELING.glob("ops_*.py")):
        assert path.stem.removeprefix("ops_") in MIXERS, f"{path.name} is named after no family"


def test_presets_keep_the_papers_names() -> None:
    for preset, family in PAPER_PRESETS.items():
        assert PRESETS[preset]["mixer"] == family
        assert f"mixer_{family}" == MIXERS[family].__module__.rsplit(".", 1)[-1]


def _batch() -> dict[str, torch.Tensor]:
    """Two identical rows, left-padded by 3."""
    prompt = torch.randint(1, 100, (6,), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([torch.zeros(3, dtype=torch.long), prompt]).repeat(2, 1)
    mask = (torch.arange(9) >= 3).long().repeat(2, 1)
    return {"input_ids": ids, "attention_mask": mask}


def _outputs(model: RecAttnForCausalLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(**batch).logits
        tokens = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return logits, tokens


def test_saved_family_names_load_with_and_without_the_package(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = tmp_path / "ckpt"
    model = save_tiny_recattn(folder, SAVED_LAYERS, seed=3)
    assert json.loads((folder / "config.json").read_text())["attention"] == SAVED_LAYERS
    batch = _batch()
    logits, tokens = _outputs(model, batch)
    assert tokens.shape == (2, 9 + NEW_TOKENS) and torch.equal(tokens[0], tokens[1])
    loaded = RecAttnForCausalLM.from_pretrained(folder).eval()
    again, again_tokens = _outputs(loaded, batch)
    assert torch.equal(again, logits) and torch.equal(again_tokens, tokens)

    save_file(batch, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", "-c", CHILD, str(folder), str(tmp_path), str(NEW_TOKENS)],
                          cwd=tmp_path / "empty", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hf_recattn_loaded"] == []
    assert report["mixers"] == [type(layer.self_attn.mixer).__name__ for layer in model.model.layers]
    remote = load_file(str(tmp_path / "outputs.safetensors"))
    assert (remote["logits"] - logits).abs().max() <= 1e-5  # the same code and weights in another process
    assert torch.equal(remote["tokens"], tokens)
