"""RecAttnForCausalLM on tiny random configs: loss, hidden states, checkpointing, tying, save/load, Auto
classes, RoPE scaling, padding and attention_mask errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import hf_recattn
from hf_recattn import RecAttnConfig, RecAttnForCausalLM, RecAttnModel, from_teacher

VOCAB = 100
MIXED = [
    {"mixer": "softmax"},
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms", "chunk_size": 4},
    {"mixer": "sliding_window", "window": 4},
    {"mixer": "linear", "feature_map": "cosine", "normalize": "layernorm", "chunk_size": 4},
    {"mixer": "linear", "feature_map": "taylor2", "chunk_size": 4},  # has non-persistent index buffers
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Tiny tensors: extra threads only add synchronization (very slow on a busy 2-core machine)."""
    torch.set_num_threads(1)


def tiny(attention: object = "softmax", layers: int = 2, **kw: object) -> RecAttnConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    values.update(kw)
    return RecAttnConfig(**values, attention=attention)


def perturb_mixers(model: torch.nn.Module) -> None:
    """Move new mixer parameters off their initial values, so that a reload that re-initializes them shows."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def ids(batch: int = 2, length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----- loss, hidden states, checkpointing -------------------------------------------------------------------
def test_labels_loss_is_shifted_cross_entropy() -> None:
    model = RecAttnForCausalLM(tiny(MIXED, layers=len(MIXED))).eval()
    x = ids()
    labels = x.clone()
    labels[0, :3] = -100  # ignored positions
    out = model(x, labels=labels)
    manual = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(out.loss, manual, rtol=1e-6, atol=0)
    assert out.loss.item() > 0.5 * torch.log(torch.tensor(float(VOCAB))).item()  # random model: near log(V)


def test_output_hidden_states() -> None:
    model = RecAttnForCausalLM(tiny(MIXED, layers=len(MIXED))).eval()
    out = model(ids(), output_hidden_states=True)
    assert len(out.hidden_states) == len(MIXED) + 1
    assert all(h.shape == (2, 10, 32) for h in out.hidden_states)
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(ids()))
    # the last one is after the final norm (Llama convention) and gives the logits
    assert torch.allclose(model.lm_head(out.hidden_states[-1]), out.logits, atol=1e-6)


def test_gradient_checkpointing_same_gradients() -> None:
    torch.manual_seed(0)
    model = RecAttnForCausalLM(tiny(MIXED, layers=len(MIXED)))
    perturb_mixers(model)
    model.train()
    x = ids(length=12)
    calls = []
    model.model.layers[1].self_attn.register_forward_hook(lambda *a: calls.append(1))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    assert len(calls) == 1
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    calls.clear()
    ckpt = grads()
    assert len(calls) == 2  # the layer really was recomputed in the backward pass
    assert plain.keys() == ckpt.keys() and any(".mixer." in n for n in plain)
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], rtol=1e-5, atol=1e-7), name


# ----- tying, save / load, Auto classes ---------------------------------------------------------------------
def _tensor_names(path) -> set[str]:  # noqa: ANN001
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_save_load_keeps_weights_and_tying(tmp_path, tied: bool) -> None:  # noqa: ANN001
    model = RecAttnForCausalLM(tiny(MIXED, layers=len(MIXED), tie_word_embeddings=tied)).eval()
    perturb_mixers(model)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert (embed.data_ptr() == head.data_ptr()) is tied
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    names = _tensor_names(tmp_path)
    assert "model.embed_tokens.weight" in names and ("lm_head.weight" in names) is (not tied)
    assert any(".mixer.feature_map." in n for n in names) and any(".mixer.output_norm." in n for n in names)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is RecAttnForCausalLM
    assert (loaded.model.embed_tokens.weight.data_ptr() == loaded.lm_head.weight.data_ptr()) is tied
    if not tied:
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
        assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)
    # the base model loads from the same folder through AutoModel
    base = AutoModel.from_pretrained(tmp_path).eval()
    assert type(base) is RecAttnModel
    with torch.no_grad():
        assert torch.equal(base(x).last_hidden_state, model.model(x).last_hidden_state)


def test_auto_classes_registered_without_overriding_llama() -> None:
    assert CONFIG_MAPPING["recattn"] is RecAttnConfig
    assert CONFIG_MAPPING["llama"] is LlamaConfig
    assert type(AutoConfig.for_model("recattn")) is RecAttnConfig
    assert type(AutoConfig.for_model("llama")) is LlamaConfig
    llama_cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert type(AutoModelForCausalLM.from_config(llama_cfg)) is LlamaForCausalLM
    assert type(AutoModel.from_config(llama_cfg)) is LlamaModel
    assert type(AutoModelForCausalLM.from_config(tiny())) is RecAttnForCausalLM
    assert type(AutoModel.from_config(tiny())) is RecAttnModel
    hf_recattn.register_auto_classes()  # idempotent
    assert CONFIG_MAPPING["recattn"] is RecAttnConfig


# ----- RoPE scaling: a converted Llama keeps its positions --------------------------------------------------
#: the 40-token input exceeds the original context (16) of every scaled type; dynamic NTK reads it from
#: max_position_embeddings (16 for it), the others from original_max_position_embeddings (64 otherwise).
#: Forwards run with use_cache=False: with a cache the model refuses inputs beyond max_position_embeddings.
ROPES = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def _llama(rope: dict | None, seed: int = 0, max_positions: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        **({} if rope is None else {"rope_parameters": rope}),
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaky attention, so that positions visibly matter (init std 0.02 is near uniform)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    return model


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_rope_scaling_matches_llama(rope_type: str, tmp_path) -> None:  # noqa: ANN001
    max_positions = 16 if rope_type == "dynamic" else 64
    teacher = _llama(ROPES[rope_type], max_positions=max_positions)
    student = from_teacher(teacher)
    assert student.config.rope_parameters["rope_type"] == rope_type
    x = ids(length=40)
    with torch.no_grad():
        want = teacher(x, use_cache=False).logits
        assert (student(x, use_cache=False).logits - want).abs().max() <= 1e-4
        # the scaling is really used: the same weights with default RoPE give other logits and other angles
        plain = _llama(None, max_positions=max_positions)
        assert (plain(x, use_cache=False).logits - want).abs().max() > 1e-2
        h, pos = torch.zeros(1, 40, 32), torch.arange(40)[None]
        cos, _ = student.model.rotary_emb(h, pos)
        assert (cos - plain.model.rotary_emb(h, pos)[0]).abs().max() > 1e-2
    # and it survives save / load
    student.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == rope_type
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert (reloaded(x, use_cache=False).logits - want).abs().max() <= 1e-4


# ----- padding and attention_mask ---------------------------------------------------------------------------
def test_left_padding_changes_nothing_for_real_tokens() -> None:
    """A left-padded row, with positions counted from its first real token, gives the unpadded logits."""
    model = RecAttnForCausalLM(tiny(MIXED, layers=len(MIXED))).eval()
    perturb_mixers(model)
    pad, x = 3, ids(batch=1, length=9)
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = model(x).logits
        got = model(padded, attention_mask=mask, position_ids=positions).logits[:, pad:]
        assert (got - want).abs().max() <= 1e-5
        # an all-ones mask is the same as no mask
        assert torch.equal(model(x, attention_mask=torch.ones_like(x)).logits, want)


def test_bad_attention_mask_is_a_clear_error() -> None:
    model = RecAttnForCausalLM(tiny()).eval()
    x = ids(length=6)
    with pytest.raises(ValueError, match=r"attention_mask must be a 2D .* got shape \(2, 1, 6, 6\)"):
        model(x, attention_mask=torch.ones(2, 1, 6, 6))
    with pytest.raises(ValueError, match=r"attention_mask covers 5 tokens .* 6"):
        model(x, attention_mask=torch.ones(2, 5, dtype=torch.long))


def test_exactly_one_of_ids_and_embeds() -> None:
    model = RecAttnForCausalLM(tiny()).eval()
    x = ids(length=4)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(x, inputs_embeds=model.model.embed_tokens(x))
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=model.model.embed_tokens(x)).logits, model(x).logits)


def test_rope_false_makes_a_layer_position_free() -> None:
    """With rope=False the linear layers see no positions: shifting every position changes nothing."""
    x = ids(length=8)
    shifted = torch.arange(5, 13)[None]
    for rope, changes in ((False, False), (True, True)):
        spec = {"mixer": "linear", "feature_map": "elu", "rope": rope}
        model = RecAttnForCausalLM(tiny(spec)).eval()
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(20.0)  # make positions matter when present
            model.model.layers[0].self_attn.k_proj.weight.mul_(20.0)
            diff = (model(x, position_ids=shifted).logits - model(x).logits).abs().max()
        assert bool(diff > 1e-4) is changes, (rope, diff)


@pytest.mark.parametrize("mixer", ["linear", "taylor", "heinsen"])
def test_bidirectional_layer_trains_with_default_config_but_cannot_continue(mixer: str) -> None:
    model = RecAttnForCausalLM(tiny(["softmax", {"mixer": mixer, "causal": False}]))
    assert model.config.use_cache  # the default: a training forward builds a cache
    x = ids(length=8)
    model.train()
    model(x, labels=x).loss.backward()
    model.eval()
    with torch.no_grad():
        out = model(x)
        assert torch.equal(out.logits, model(x, use_cache=False).logits)
        with pytest.raises(ValueError, match=rf"layer 1 \({mixer}\): causal=False has no recurrent form"):
            model(x[:, :1], past_key_values=out.past_key_values)
