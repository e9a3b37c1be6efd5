"""What transformers' tools expect of a model, checked directly: attention weights, half precision, the
tensor-parallel plan, ``set_attn_implementation``, the cache layers' keys and values, assisted generation and
``layer_types`` (tests/test_transformers_common.py runs transformers' own suites; these pin the behaviour down)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.distributed import DistributedConfig

from hf_recattn import RecAttnConfig, RecAttnForCausalLM

VOCAB = 61
GDN = "gdn"
HYBRID = {"mixer": "hybrid", "window": 4, "far": {"mixer": "linear"}}


def tiny(attention: object = "softmax", **kw: object) -> RecAttnConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    values.update(kw)
    return RecAttnConfig(**values, attention=attention)


def model_of(attention: object = "softmax", seed: int = 0, **kw: object) -> RecAttnForCausalLM:
    torch.manual_seed(seed)
    return RecAttnForCausalLM(tiny(attention, **kw)).eval()


def ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----- output_attentions -------------------------------------------------------------------------------------
def _softmax_weights_by_hand(model: RecAttnForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's softmax(q.k / sqrt(d)) under the causal mask, from its own projections."""
    layer = model.model.layers[0]
    hidden = layer.input_layernorm(model.model.embed_tokens(x))
    positions = torch.arange(x.shape[1])[None]
    q, k, _ = layer.self_attn.project(hidden, model.model.rotary_emb(hidden, positions))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    return F.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_softmax_returns_its_attention_weights(implementation: str) -> None:
    model = model_of(attn_implementation=implementation)
    x = ids()
    with torch.no_grad():
        out = model(x, output_attentions=True)
        plain = model(x)
        expected = _softmax_weights_by_hand(model, x)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    torch.testing.assert_close(out.attentions[0], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits, plain.logits)  # asking for the weights changes nothing else


def test_generate_returns_attention_weights_per_step() -> None:
    model = model_of()
    out = model.generate(ids(length=5), max_new_tokens=3, do_sample=False, output_attentions=True,
                         return_dict_in_generate=True, pad_token_id=0)
    assert len(out.attentions) == 3
    assert [step[0].shape for step in out.attentions] == [(2, 4, 5, 5), (2, 4, 1, 6), (2, 4, 1, 7)]
    for step in out.attentions:
        torch.testing.assert_close(step[1].sum(-1), torch.ones(step[1].shape[:-1]))


@pytest.mark.parametrize(("attention", "name"), [(GDN, "delta"), (HYBRID, "hybrid")])
def test_mixers_without_weights_refuse_output_attentions(attention: object, name: str) -> None:
    model = model_of(attention)
    with pytest.raises(ValueError, match=rf"output_attentions=True: layer 0 \({name}\) has no attention weights"):
        model(ids(), output_attentions=True)
    with pytest.raises(ValueError, match=rf"layer 0 \({name}\)"):
        model.generate(ids(length=4), max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)


def test_packed_documents_refuse_output_attentions() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="packed documents"):
        model_of()(ids(batch=1), position_ids=positions, output_attentions=True)


# ----- the delta family in half precision --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_delta_half_precision_uncached_forward(dtype: torch.dtype, packed: bool) -> None:
    """One chunk (<= 64 tokens) or packed documents: the triangular solve runs in float32 for half types."""
    model = model_of(GDN)
    x = ids(batch=1, length=12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]) if packed else None
    with torch.no_grad():
        reference = model(x, position_ids=positions, use_cache=False).logits
        half = model.to(dtype)(x, position_ids=positions, use_cache=False).logits
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), reference, rtol=0.05, atol=0.05)


# ----- tensor parallelism -------------------------------------------------------------------------------------
def test_tensor_parallel_plan_is_well_formed_with_tied_embeddings() -> None:
    model = model_of(tie_word_embeddings=True)
    plan = model.tp_plan
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    resolved = model._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
    modules = dict(model.named_modules()) | dict(model.named_parameters(remove_duplicate=False))
    assert set(resolved) <= set(modules)  # every rule names a module or parameter of the model
    for i in range(2):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert resolved[f"model.layers.{i}.self_attn.{name}"] == "colwise"
        assert resolved[f"model.layers.{i}.self_attn.o_proj"] == "rowwise"
    assert {"lm_head", "model.embed_tokens"} <= set(resolved)


@pytest.mark.parametrize(("attention", "name"), [(GDN, "delta"), (HYBRID, "hybrid"), ("fox", "softmax")])
def test_tensor_parallel_refuses_mixers_it_cannot_split(attention: object, name: str) -> None:
    model = model_of(attention)
    with pytest.raises(ValueError, match=rf"tensor parallelism: layer 0 \({name}\) cannot be split"):
        model._resolve_parallel_plans(DistributedConfig(tp_size=2))


# ----- set_attn_implementation ------------------------------------------------------------------------------
def test_set_attn_implementation_matches_loading_with_it(tmp_path) -> None:  # noqa: ANN001
    model_of().save_pretrained(tmp_path)
    loaded = RecAttnForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    switched = RecAttnForCausalLM.from_pretrained(tmp_path).eval()
    assert switched.config._attn_implementation == "sdpa"
    switched.set_attn_implementation("eager")
    mixer = switched.model.layers[0].self_attn.mixer
    assert switched.config._attn_implementation == "eager" and mixer._implementation() == "eager"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(switched(x).logits, loaded(x).logits)
    with pytest.raises(ValueError, match="Flash Attention 2"):
        switched.set_attn_implementation("flash_attention_2")


# ----- cache layers -----------------------------------------------------------------------------------------
def test_cache_layers_expose_keys_and_values_of_softmax_layers() -> None:
    model = model_of()
    cache = model(ids(length=7), use_cache=True).past_key_values
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (2, 2, 7, 8)
        assert layer.keys is layer.state["k"]
    assert model.new_cache().layers[0].keys is None  # before the first forward, as transformers' layers


@pytest.mark.parametrize("attention", [GDN, HYBRID])
def test_cache_layers_without_keys_say_so(attention: object) -> None:
    cache = model_of(attention)(ids(length=7), use_cache=True).past_key_values
    with pytest.raises(AttributeError, match="layer 1: this cache layer holds a .* state .*, no values"):
        cache.layers[1].values  # noqa: B018
    assert not hasattr(cache.layers[0], "keys")


# ----- assisted generation and cropping ------------------------------------------------------------------------
def test_softmax_assisted_generation_matches_greedy() -> None:
    model, assistant = model_of(seed=0), model_of(seed=1)
    assert not model._is_stateful and model.rollback_refusal() is None
    x = ids(batch=1, length=6)
    greedy = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assisted = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=assistant)
    assert torch.equal(assisted, greedy)
    prompt_lookup = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=2)
    assert torch.equal(prompt_lookup, greedy)


@pytest.mark.parametrize(("attention", "name", "why"), [
    (GDN, "delta", "it keeps a recurrent state"),
    (HYBRID, "hybrid", "it keeps a window state"),
    ("path", "softmax_householder", "its cached keys carry the Householder transforms"),
    ({"mixer": "retrieval_heads", "heads": [0]}, "retrieval_heads", "its other heads' hybrid mixer: it keeps"),
])
def test_recurrent_models_refuse_assisted_generation(attention: object, name: str, why: str) -> None:
    model = model_of(attention)
    assert model._is_stateful
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    message = rf"generation needs a cache that can roll back: layer 0 \({name}\) cannot drop tokens: {why}"
    with pytest.raises(ValueError, match=message):
        model.generate(ids(batch=1, length=6), max_new_tokens=4, assistant_model=model_of(attention, seed=1))
    with pytest.raises(ValueError, match=message):
        model.generate(ids(batch=1, length=6), max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert not calls  # refused before any forward


def test_softmax_cache_crop_continues_exactly() -> None:
    model = model_of()
    x = ids(length=9)
    with torch.no_grad():
        cache = model(x, use_cache=True).past_key_values
        cache.crop(-3)
        assert cache.get_seq_length() == 6 and cache.layers[0].keys.shape[2] == 6
        continued = model(x[:, 6:], past_key_values=cache).logits
        full = model(x).logits
    torch.testing.assert_close(continued, full[:, 6:], rtol=1e-5, atol=1e-5)


# ----- layer_types ------------------------------------------------------------------------------------------
def test_layer_types_follow_the_mixers() -> None:
    mixed = ["softmax", {"mixer": "sliding_window", "window": 4}, GDN, HYBRID]
    config = tiny(mixed, num_hidden_layers=4)
    assert config.layer_types == ["full_attention", "sliding_attention", "linear_attention", "hybrid_sliding"]
    assert "layer_types" not in config.to_dict()  # derived, never saved
    assert tiny(GDN, layer_types=["linear_attention"] * 2).layer_types == ["linear_attention"] * 2
    with pytest.raises(ValueError, match="layer_types .* disagree with the mixers"):
        tiny(GDN, layer_types=["full_attention"] * 2)
