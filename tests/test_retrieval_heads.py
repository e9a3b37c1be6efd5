"""Retrieval heads: exact softmax on the listed KV heads, another mixer on the rest, against float64 references.

The reference composes two independent per-token references by head: full softmax for the query heads of the
listed KV heads, the hybrid (window, sinks, optional linear far part) for the others.
"""

from __future__ import annotations

import pytest
import torch
from mixer_checks import (
    PAD,
    SHAPE,
    assert_forms_agree,
    assert_gradients_match,
    assert_specs_rejected,
    perturb_parameters,
    random_inputs,
)
from mixer_steps import left_padded, run_chunked, run_steps
from reference_recurrent_softmax import hybrid_attention, linear_kernel, real_rows, rel_err, softmax_attention

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.cache import RecAttnCache
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

GROUPS = SHAPE.groups
OTHERS = {
    "window+sinks": {"mixer": "hybrid", "window": 3, "sink_tokens": 2, "far": "none"},
    "hybrid-elu": {"mixer": "hybrid", "window": 3, "far": {"mixer": "linear", "feature_map": "elu"}},
}


def make(heads: list[int], others: str, dtype: torch.dtype = torch.float32):
    spec = validate_spec({"mixer": "retrieval_heads", "heads": heads, "others": OTHERS[others]}, "layer 5")
    mixer = build_mixer(spec, SHAPE).to(dtype)
    perturb_parameters(mixer, scale=1.0, dtype=dtype)  # a different window share per head
    return mixer


def reference(mixer, inputs, mask: torch.Tensor) -> torch.Tensor:
    """Per query head: softmax over every earlier key when its KV head is listed, else the hybrid's reference on
    the remaining heads alone."""
    q, k, v, _ = inputs
    heads = mixer.spec["heads"]
    rest = [h for h in range(SHAPE.num_kv_heads) if h not in heads]
    q_rest = [h for h in range(SHAPE.num_heads) if h // GROUPS in rest]
    others = mixer.rest
    kernel = None if others.far is None else linear_kernel(others.far.spec["feature_map"])
    share = torch.sigmoid(others.mix_logit.detach().double())
    near_far = hybrid_attention(q[:, q_rest], k[:, rest], v[:, rest], others.window, kernel, share, mask=mask,
                                sinks=others.sink_tokens)
    out = softmax_attention(q, k, v, mask)
    return out.index_copy(2, torch.tensor(q_rest), near_far)


@pytest.mark.parametrize("others", list(OTHERS))
@pytest.mark.parametrize("heads", [[0], [1]])
def test_parallel_matches_reference(heads: list[int], others: str) -> None:
    """fp32 against the float64 reference: < 1e-5 relative."""
    mixer = make(heads, others)
    inputs = random_inputs(SHAPE, 11)
    mask = left_padded(11, PAD)
    out = mixer.parallel(*inputs[:3], MixerInputs(inputs[3], mask))
    assert out.shape == (2, 11, SHAPE.num_heads, SHAPE.head_dim)
    assert rel_err(real_rows(out, mask), reference(mixer, inputs, mask)) < 1e-5


@pytest.mark.parametrize("others", list(OTHERS))
def test_chunked_steps_and_prefill_match_parallel(others: str) -> None:
    mixer = make([1], others)
    inputs = random_inputs(SHAPE, 13, seed=1)
    assert_forms_agree(mixer, inputs, left_padded(13, PAD), rel=1e-5)


def test_gradients_match_reference() -> None:
    """float64 gradients of q, k and v through both parts: < 1e-9 relative (the window share has no far part to
    weigh here, so no parameter takes part)."""
    mixer = make([0], "window+sinks", torch.float64)
    assert_gradients_match(mixer, lambda inputs, mask: reference(mixer, inputs, mask), 8, rel=1e-9,
                           unused=("x", "rest.mix_logit"))


def test_left_padding_changes_nothing() -> None:
    """A row padded on the left gives its real tokens' outputs and state (the kept keys: its real ones)."""
    mixer = make([0], "hybrid-elu", torch.float64)
    q, k, v, x = random_inputs(SHAPE, 9, torch.float64, seed=2)
    out, state = run_chunked(mixer, q, k, v, x, left_padded(9, PAD))
    real = slice(PAD, None)
    alone, alone_state = run_chunked(mixer, q[1:, :, real], k[1:, :, real], v[1:, :, real], x[1:, real],
                                     torch.ones(1, 9 - PAD, dtype=torch.bool))
    assert rel_err(out[1:, real], alone) < 1e-12
    for name, held in state.items():
        row = held[1:, :, PAD:] if name.startswith("full.") else held[1:]
        assert rel_err(row, alone_state[name]) < 1e-12, name


def test_only_the_listed_heads_keep_every_key() -> None:
    """The state: the listed KV heads' keys and values for every token (they grow), the others' fixed window."""
    mixer = make([1], "window+sinks", torch.float64)
    q, k, v, x = random_inputs(SHAPE, 10, torch.float64, seed=3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    _, state = run_steps(mixer, q, k, v, x, mask)
    assert torch.equal(state["full.k"], k[:, 1:2]) and torch.equal(state["full.v"], v[:, 1:2])
    assert torch.equal(state["rest.wk"], k[:, :1, -3:])  # the window holds the other head's last 3 keys
    assert mixer.state_kind == "kv"
    per_token = 2 * SHAPE.head_dim  # one KV head's key and value
    window = 2 * SHAPE.head_dim * (3 + 2) + 3 + 2  # one KV head's window and sinks, with their masks
    assert mixer.state_size(100) == 100 * per_token + window
    assert mixer.state_size(1000) - mixer.state_size(100) == 900 * per_token


def test_without_heads_it_is_the_other_mixer() -> None:
    spec = validate_spec({"mixer": "retrieval_heads", "heads": [], "others": OTHERS["hybrid-elu"]}, "layer 5")
    mixer = build_mixer(spec, SHAPE)
    plain = build_mixer(validate_spec(OTHERS["hybrid-elu"], "layer 5"), SHAPE)
    plain.load_state_dict({name.removeprefix("rest."): p for name, p in mixer.state_dict().items()})
    q, k, v, x = random_inputs(SHAPE, 7)
    assert torch.equal(mixer.parallel(q, k, v, MixerInputs(x)), plain.parallel(q, k, v, MixerInputs(x)))
    assert mixer.state_kind == plain.state_kind == "window"


def test_bad_specs_name_the_option() -> None:
    assert_specs_rejected([
        ({"mixer": "retrieval_heads", "heads": [0, 0]}, "layer 3", r"layer 3: option 'heads' lists a KV head twice"),
        ({"mixer": "retrieval_heads", "heads": [-1]}, "layer 3", r"option 'heads' takes KV head indices"),
        ({"mixer": "retrieval_heads", "heads": ["0"]}, "layer 3", r"option 'heads' takes KV head indices"),
        ({"mixer": "retrieval_heads", "others": {"mixer": "retrieval_heads"}}, "layer 3",
         r"option 'others' cannot be another 'retrieval_heads'"),
        ({"mixer": "retrieval_heads", "others": {"mixer": "nope"}}, "layer 3", r"layer 3: option 'others': unknown"),
    ])
    for heads, pattern in (([2], r"names KV head 2, but the layer has 2 KV heads"),
                           ([0, 1], r"lists every KV head; use mixer 'softmax'")):
        spec = validate_spec({"mixer": "retrieval_heads", "heads": heads}, "layer 5")
        with pytest.raises(ValueError, match=rf"layer 5 \(retrieval_heads\): option 'heads' {pattern}"):
            build_mixer(spec, SHAPE)


def test_a_cache_holding_windows_refuses_to_crop() -> None:
    """Part of the state (the window) has dropped tokens: crop must refuse rather than cut the window."""
    config = RecAttnConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           attention={"mixer": "retrieval_heads", "heads": [0],
                                      "others": {"mixer": "sliding_window", "window": 3}})
    model = RecAttnForCausalLM(config).eval()
    cache = RecAttnCache.for_model(model.model)
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None], past_key_values=cache, use_cache=True)
    assert cache.kinds == ["kv"] and not cache.layers[0].is_croppable
    with pytest.raises(ValueError, match="layer 0: cannot crop"):
        cache.crop(-2)
    assert cache.get_seq_length() == 8


def test_shape_of_the_parts() -> None:
    mixer = build_mixer(validate_spec({"mixer": "retrieval_heads", "heads": [2]}, "layer 1"),
                        MixerShape(hidden_size=24, num_heads=9, num_kv_heads=3, head_dim=4, layer_idx=1))
    assert (mixer.full.shape.num_heads, mixer.full.shape.num_kv_heads) == (3, 1)
    assert (mixer.rest.shape.num_heads, mixer.rest.shape.num_kv_heads) == (6, 2)
    assert mixer.heads == {"full": ([6, 7, 8], [2]), "rest": ([0, 1, 2, 3, 4, 5], [0, 1])}


# ----- a bounded mixer on the retrieval heads (option ``retrieval``) ------------------------------------------
WINDOW_ON_RETRIEVAL = {"mixer": "hybrid", "window": 4, "sink_tokens": 2, "far": "none"}
CACHE_ON_RETRIEVAL = {"mixer": "hybrid", "window": 2, "sink_tokens": 1, "far": "none", "cache_slots": 2,
                      "cache_score": "keydiff"}


def make_bounded(retrieval: dict, others: str = "hybrid-elu", dtype: torch.dtype = torch.float32):
    spec = validate_spec({"mixer": "retrieval_heads", "heads": [1], "others": OTHERS[others],
                          "retrieval": retrieval}, "layer 5")
    mixer = build_mixer(spec, SHAPE).to(dtype)
    perturb_parameters(mixer, scale=1.0, dtype=dtype)
    return mixer


def test_a_bounded_retrieval_part_matches_reference() -> None:
    """The listed heads see a window of 4 and 2 sinks (the hybrid reference without a far part), the others their
    hybrid: fp32 against float64, < 1e-5 relative."""
    mixer = make_bounded(WINDOW_ON_RETRIEVAL)
    q, k, v, x = inputs = random_inputs(SHAPE, 12, seed=4)
    mask = left_padded(12, PAD)
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    others = mixer.rest
    share = torch.sigmoid(others.mix_logit.detach().double())
    rest = hybrid_attention(q[:, :GROUPS], k[:, :1], v[:, :1], others.window, linear_kernel("elu"), share, mask=mask)
    listed = hybrid_attention(q[:, GROUPS:], k[:, 1:], v[:, 1:], 4, None, torch.ones(GROUPS), mask=mask, sinks=2)
    assert rel_err(real_rows(out, mask), torch.cat([rest, listed], dim=2)) < 1e-5
    assert rel_err(real_rows(out, mask), reference(make([1], "hybrid-elu"), inputs, mask)) > 1e-2  # not exact


@pytest.mark.parametrize("retrieval", [WINDOW_ON_RETRIEVAL, CACHE_ON_RETRIEVAL], ids=["window", "keydiff-cache"])
def test_a_bounded_retrieval_part_agrees_in_every_form(retrieval: dict) -> None:
    mixer = make_bounded(retrieval)
    assert_forms_agree(mixer, random_inputs(SHAPE, 13, seed=5), left_padded(13, PAD), rel=1e-5)


def test_a_bounded_retrieval_part_keeps_memory_constant() -> None:
    """The state stops growing (kind "window"), and while the context fits the listed heads' window the layer is
    the exact-softmax one to rounding."""
    bounded = make_bounded({**WINDOW_ON_RETRIEVAL, "window": 16})
    assert bounded.state_kind == "window"
    assert bounded.state_size(100) == bounded.state_size(100_000)
    exact = make([1], "hybrid-elu")
    exact.rest.load_state_dict(bounded.rest.state_dict())
    q, k, v, x = random_inputs(SHAPE, 12, seed=6)
    assert rel_err(bounded.parallel(q, k, v, MixerInputs(x)), exact.parallel(q, k, v, MixerInputs(x))) < 1e-6


def test_bad_retrieval_specs_name_the_option() -> None:
    assert_specs_rejected([
        ({"mixer": "retrieval_heads", "heads": [0], "retrieval": {"mixer": "retrieval_heads"}}, "layer 3",
         r"option 'retrieval' cannot be another 'retrieval_heads'"),
        ({"mixer": "retrieval_heads", "heads": [0], "retrieval": {"mixer": "linear", "causal": False}}, "layer 3",
         r"option 'retrieval' must be causal"),
        ({"mixer": "retrieval_heads", "heads": [0], "retrieval": {"mixer": "nope"}}, "layer 3",
         r"layer 3: option 'retrieval': unknown"),
    ])


def test_position_need_follows_the_retrieval_part() -> None:
    """Exact softmax over the context needs positions; a plain window does not; sinks kept at any distance do."""
    from hf_recattn.modeling.registry import position_need

    def need(retrieval: dict | None) -> str | None:
        return position_need(validate_spec({"mixer": "retrieval_heads", "heads": [0], "retrieval": retrieval,
                                            "others": OTHERS["window+sinks"] | {"sink_tokens": 0}}, "layer 1"),
                             "layer 1")

    assert "exact softmax over every earlier key" in need(None)
    assert need({"mixer": "hybrid", "window": 8, "far": "none", "sink_tokens": 0}) is None
    assert "retrieval part" in need(WINDOW_ON_RETRIEVAL)
