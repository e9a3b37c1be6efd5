"""Students that need no positions run past max_position_embeddings; those that need them refuse, naming the layer.

The rule (``Mixer.position_need``, ``registry.position_need``, ``RecAttnConfig.length_limit``): a layer needs
positions where an exact softmax logit compares a query with a key through RoPE at a distance back that grows with
the context (softmax, retrieval heads, softmax_delta / softmax_householder with RoPE, taylor order 'exp', a
hybrid's sinks and exact cache) or where the rotary follows the length (dynamic NTK). The reference for the
forward and generation checks is the same model without a cache (the parallel forward over the whole sequence);
tolerances: fp32 logits within 1e-4 of it, greedy tokens equal exactly (std 0.1 initialization keeps the tiny
models' logits far apart).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from generation_cases import PAD, Case, left_padded_batch, one_thread, tiny_model
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

from hf_recattn import MIXERS, RecAttnConfig, RecAttnForCausalLM
from hf_recattn.evaluation import decode_stats, heldout
from hf_recattn.evaluation.generation import max_positions
from hf_recattn.modeling.registry import position_need
from hf_recattn.training.run_config import block_size, tokenizer_max_length

LIMIT = 32  # max_position_embeddings of the tiny models; every check runs past it
LINEAR_FAR = {"mixer": "linear", "feature_map": "hedgehog"}
#: a student that needs no positions: a window, a hybrid (window + far part, no sinks), Gated DeltaNet
UNBOUNDED = Case("unbounded", {"mixer": "gdn"}, {"0": {"mixer": "sliding_window", "window": 4},
                                                 "1": {"mixer": "hybrid", "window": 4, "far": LINEAR_FAR}}, layers=3)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def _config(attention: Any, **kwargs: Any) -> RecAttnConfig:
    return RecAttnConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LIMIT,
                         attention=attention, **kwargs)


# ----- the rule, family by family ---------------------------------------------------------------------------
BOUNDED_SPECS = [
    {"mixer": "softmax"},
    {"mixer": "softmax", "forget": "fox"},  # FoX keeps RoPE underneath: the recipe `fox`
    {"mixer": "hybrid", "window": 4, "sink_tokens": 2},  # sinks: their keys stay while the query moves on
    {"mixer": "hybrid", "window": 4, "far": "none", "sink_tokens": 1},
    {"mixer": "hybrid", "window": 4, "far": LINEAR_FAR, "cache_slots": 4},  # the exact cache: keys from any distance
    {"mixer": "retrieval_heads", "heads": [1], "others": {"mixer": "sliding_window", "window": 4}},
    {"mixer": "retrieval_heads", "heads": []},  # the default others: a window with 4 sinks
    {"mixer": "softmax_delta"},
    {"mixer": "deltaformer"},
    {"mixer": "softmax_householder"},
    {"mixer": "taylor", "order": "exp"},
]
UNBOUNDED_SPECS = [
    {"mixer": "sliding_window", "window": 4},
    {"mixer": "sliding_window", "window": 4, "forget": "fox"},
    {"mixer": "hybrid", "window": 4},
    {"mixer": "hybrid", "window": 4, "far": {"mixer": "taylor", "order": 2}},
    {"mixer": "hybrid", "window": 4, "far": "gdn", "combine": "sum"},
    {"mixer": "hybrid", "window": 4, "sink_tokens": 2, "rope": False},  # no RoPE: no rotation to leave its range
    {"mixer": "retrieval_heads", "heads": [], "others": {"mixer": "hybrid", "window": 4, "far": "none"}},
    {"mixer": "retrieval_heads", "heads": [0], "others": {"mixer": "sliding_window", "window": 4}, "rope": False},
    {"mixer": "softmax", "rope": False},  # NoPE
    {"mixer": "alibi"},
    {"mixer": "fox"},
    {"mixer": "path"},  # PaTH without RoPE: its positions are the Householder products of the tokens between
    {"mixer": "linear", "feature_map": "hedgehog"},
    {"mixer": "taylor", "order": 2},
    {"mixer": "taylor", "order": 2, "cache": "kv"},  # the same polynomial over a KV cache
    {"mixer": "heinsen"},
    {"mixer": "gdn"},
    {"mixer": "delta"},
    {"mixer": "mesanet"},
    {"mixer": "gla"},
    {"mixer": "rwkv7"},
    {"mixer": "retnet"},
]


def _present(spec: dict[str, Any]) -> list[Any]:
    names = {spec["mixer"], *(p["mixer"] for p in spec.values() if isinstance(p, dict) and "mixer" in p)}
    return [pytest.mark.skip(reason=f"{sorted(names)} not registered")] if not names <= {*MIXERS, *_presets()} else []


def _presets() -> set[str]:
    from hf_recattn.modeling.registry import PRESETS

    return set(PRESETS)


@pytest.mark.parametrize("spec", [pytest.param(s, marks=_present(s), id=str(s)) for s in BOUNDED_SPECS])
def test_layers_that_need_positions(spec: dict[str, Any]) -> None:
    config = _config({"mixer": "sliding_window", "window": 4}, attention_overrides={"1": spec})
    assert config.length_limit() == LIMIT
    need = config.position_need()
    assert need is not None and need.startswith("layer 1 (")  # the layer at fault, not layer 0 (a window)
    assert "RoPE" in need


@pytest.mark.parametrize("spec", [pytest.param(s, marks=_present(s), id=str(s)) for s in UNBOUNDED_SPECS])
def test_layers_that_need_no_positions(spec: dict[str, Any]) -> None:
    config = _config(spec)
    assert config.position_need() is None and config.length_limit() is None


def test_the_reason_names_the_option_and_the_part() -> None:
    sinks = _config({"mixer": "hybrid", "window": 4, "sink_tokens": 2})
    assert sinks.position_need() == ("layer 0 (hybrid): option 'sink_tokens'=2 keeps exact softmax keys at any "
                                     "distance back, compared through RoPE")
    nested = _config({"mixer": "retrieval_heads", "heads": [],
                      "others": {"mixer": "hybrid", "window": 4, "far": "none", "sink_tokens": 1}})
    assert nested.position_need().startswith("layer 0 (retrieval_heads): its others part (hybrid): option "
                                             "'sink_tokens'")
    heads = _config({"mixer": "retrieval_heads", "heads": [1], "others": {"mixer": "sliding_window", "window": 4}})
    assert "KV heads [1]" in heads.position_need()


@pytest.mark.parametrize("family", sorted(MIXERS))
def test_no_family_needs_positions_without_rope(family: str) -> None:
    """Every registered family answers for its default spec; with rope off none needs positions (the rule is about
    RoPE's angles), and its parts are asked with the layer's rope (a hybrid's far part reads the same q and k)."""
    spec = MIXERS[family].validate({"mixer": family}, "test")
    position_need(spec, "test")  # answers without error
    assert position_need({**spec, "rope": False}, "test") is None


def test_a_rope_that_follows_the_length_needs_positions() -> None:
    """Dynamic NTK rescales every rotation by the sequence length: the window's logits change past the context."""
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    config = _config({"mixer": "sliding_window", "window": 4}, rope_parameters=dynamic)
    assert config.length_limit() == LIMIT and "rope_type 'dynamic'" in config.position_need()
    no_rope = _config({"mixer": "sliding_window", "window": 4, "rope": False}, rope_parameters=dynamic)
    assert no_rope.length_limit() is None
    static = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert _config({"mixer": "sliding_window", "window": 4}, rope_parameters=static).length_limit() is None


def test_length_limit_follows_the_specs() -> None:
    config = _config({"mixer": "sliding_window", "window": 4})
    assert config.length_limit() is None
    config.attention_overrides = {"0": {"mixer": "softmax"}}
    assert config.length_limit() == LIMIT and config.position_need().startswith("layer 0 (softmax)")


# ----- a student that needs no positions, past the limit ------------------------------------------------------
def _model(case: Case, **config: Any) -> RecAttnForCausalLM:
    model = tiny_model(case, max_positions=LIMIT)
    for name, value in config.items():
        setattr(model.config, name, value)
    return model


@torch.no_grad()
def test_forward_and_chunked_prefill_past_the_limit() -> None:
    model = _model(UNBOUNDED)
    assert model.length_limit() is None and model.position_need() is None
    ids = torch.randint(1, 64, (2, 3 * LIMIT))
    want = model(ids, use_cache=False).logits  # the parallel forms over all 96 tokens
    cache, parts = model.new_cache(), []
    for start, stop in ((0, 20), (20, 45), (45, 46), (46, 3 * LIMIT)):  # pieces that cross the limit
        parts.append(model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 3 * LIMIT
    assert (torch.cat(parts, dim=1) - want).abs().max() <= 1e-4
    model.config.prefill_block_size = 16  # one prompt run into a cache in blocks of 16
    blocked = model(ids, use_cache=True).logits
    assert (blocked - want).abs().max() <= 1e-4
    # the positions really reach past the limit: the window's rotations there differ from those below it
    cos, _ = model.model.rotary_emb(torch.zeros(1, 1, 32), torch.tensor([[3 * LIMIT - 1]]))
    low, _ = model.model.rotary_emb(torch.zeros(1, 1, 32), torch.tensor([[LIMIT - 1]]))
    assert (cos - low).abs().max() > 1e-2


@torch.no_grad()
def test_greedy_generate_past_the_limit_matches_no_cache() -> None:
    model = _model(UNBOUNDED)
    ids, mask = left_padded_batch((10, 12, 7))
    kwargs = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=2 * LIMIT, do_sample=False)
    cached = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, use_cache=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    assert cached.sequences.shape[1] == ids.shape[1] + 2 * LIMIT > 2 * LIMIT
    assert torch.equal(cached.sequences, plain.sequences)
    assert (torch.stack(cached.logits) - torch.stack(plain.logits)).abs().max() <= 1e-4


@torch.no_grad()
def test_default_max_length_is_not_cut_at_the_limit() -> None:
    """transformers cuts its default max_length (20 new tokens) at max_position_embeddings and warns past it;
    neither applies to a model that needs no positions."""
    model = _model(UNBOUNDED)
    prompt = torch.randint(1, 64, (1, LIMIT + 8))
    assert model.generate(prompt, pad_token_id=PAD).shape[1] == LIMIT + 8 + 20
    assert _warned_beyond(model) == [None]
    assert _warned_beyond(_model(Case("softmax", {"mixer": "softmax"}))) == [LIMIT]


def _warned_beyond(model: RecAttnForCausalLM) -> list[int | None]:
    """The length past which generate()'s max-length criterion warns (transformers: max_position_embeddings)."""
    config = GenerationConfig(max_length=100)
    config._eos_token_tensor = None  # what generate() prepares before it builds the criteria
    criteria = model._get_stopping_criteria(config, StoppingCriteriaList())
    return [c.max_position_embeddings for c in criteria if isinstance(c, MaxLengthCriteria)]


# ----- a model that needs positions refuses, naming the layer -----------------------------------------------
@torch.no_grad()
def test_a_model_that_needs_positions_refuses_naming_the_layer() -> None:
    case = Case("window+softmax", {"mixer": "sliding_window", "window": 4}, {"1": {"mixer": "softmax"}})
    model = _model(case)
    assert model.length_limit() == LIMIT and model.position_need().startswith("layer 1 (softmax)")
    ids = torch.randint(1, 64, (1, LIMIT - 4))
    assert model.generate(ids, max_new_tokens=4, pad_token_id=PAD).shape[1] == LIMIT  # up to the limit: fine
    with pytest.raises(ValueError, match=r"lower max_new_tokens to at most 4 \(layer 1 \(softmax\): its exact"):
        model.generate(ids, max_new_tokens=5, pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"prompt has 33 tokens .* \(layer 1 \(softmax\)"):
        model.generate(torch.randint(1, 64, (1, LIMIT + 1)), max_new_tokens=1, pad_token_id=PAD)
    cache = model.new_cache()
    model(torch.randint(1, 64, (1, LIMIT)), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"32 cached \+ 1 new tokens exceed max_position_embeddings=32.*layer 1"):
        model(torch.randint(1, 64, (1, 1)), past_key_values=cache, use_cache=True)


# ----- what checked the limit: probes, decode stats, training blocks, the tokenizer ---------------------------
class IdsTokenizer:
    """Documents written as token ids ("5 17 3 ..."), for the tiny models' vocabulary."""

    def __call__(self, texts: list[str], **kwargs: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [[int(x) for x in text.split()] for text in texts]}


def test_probes_run_past_the_limit_only_for_students_that_need_no_positions() -> None:
    unbounded, bounded = _model(UNBOUNDED), _model(Case("softmax", {"mixer": "softmax"}))
    assert max_positions(unbounded) is None and max_positions(bounded) == LIMIT
    docs = [" ".join(str(i) for i in torch.randint(1, 64, (3 * LIMIT,)).tolist())]
    long = heldout.long_perplexity(unbounded, IdsTokenizer(), docs, lengths=(2 * LIMIT,), blocks=1)
    assert long["skipped"] == {} and long["blocks"] == {str(2 * LIMIT): 1} and long["perplexity"][str(2 * LIMIT)] > 1
    assert heldout.long_perplexity(bounded, IdsTokenizer(), docs, lengths=(2 * LIMIT,))["skipped"] == {
        str(2 * LIMIT): f"beyond max_position_embeddings {LIMIT}"}
    stats = decode_stats(unbounded, context_length=2 * LIMIT, steps=3)
    assert stats["context_length"] == 2 * LIMIT == stats["requested_context_length"]
    assert decode_stats(bounded, context_length=2 * LIMIT, steps=3)["context_length"] == LIMIT - 3


def test_training_block_size_and_tokenizer_follow_the_limit() -> None:
    unbounded = _config({"mixer": "hybrid", "window": 4})
    assert block_size(4 * LIMIT, "run.yaml", unbounded, 512) == 4 * LIMIT
    assert block_size(None, "run.yaml", unbounded, 512) == 512  # the default, not cut at the teacher's context
    bounded = _config({"mixer": "hybrid", "window": 4}, attention_overrides={"1": {"mixer": "softmax"}})
    assert block_size(None, "run.yaml", bounded, 512) == LIMIT
    with pytest.raises(ValueError, match=r"run.yaml: block_size 64 is above the model's max_position_embeddings 32 "
                                         r"\(layer 1 \(softmax\)"):
        block_size(2 * LIMIT, "run.yaml", bounded, 512)
    assert tokenizer_max_length(bounded.length_limit()) == LIMIT
    assert tokenizer_max_length(unbounded.length_limit()) >= 10**30  # transformers' "unbounded"
