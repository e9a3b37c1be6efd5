"""Decayed / gated linear attention and the learned sink (``linear`` with ``decay``, ``sink``) against the
float64 reference.

The reference (tests/reference.py) weighs key s at query t by kappa(q_t, k_s) times the product of the forget
factors g_{s+1} ... g_t, each computed one token at a time; no cumulative sums, no chunks, no state. The sink
is one more key/value pair that every query sees, with weight e^w kappa(q_t, k*), never decayed. RetNet's fixed
factors (``decay: retnet``) come from tests/reference_gated_linear.py's ``retnet_gammas``, written from the formula.
Tolerances: fp32 mixer vs float64 reference ``REL_FP32``; float64 gradients (q, k, v, the layer input and
every parameter) vs the reference's ``REL_GRAD``; fp32 chunked / steps / prefill vs fp32 parallel
``REL_FORMS``.
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
from mixer_checks import HIDDEN, PAD, SHAPE
from mixer_steps import left_padded
from reference import forget_factors, linear_attention, real_rows, rel_err
from reference_gated_linear import retnet_forget, retnet_gammas

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
#: (decay, feature_map, normalize, sink)
CASES = [("learned", "elu", "denominator", False), ("gated", "hedgehog", "denominator", False),
         ("gated", "elu", "l2", False), ("learned", "hedgehog", "rms", False),
         ("gated", "hedgehog", "denominator", True), ("none", "hedgehog", "denominator", True),
         ("none", "elu", "layernorm", True), ("retnet", "identity", "layernorm", False),
         ("retnet", "elu", "denominator", True)]
#: strong RetNet factors for the tests (the defaults, 1 - 2^-5 and 1 - 2^-6, barely decay within a dozen tokens)
RETNET_TEST_GAMMAS = {"gamma_min": 0.5, "gamma_max": 0.9}
CASE_IDS = [f"{d}-{f}-{n}{'-sink' if s else ''}" for d, f, n, s in CASES]


def make_mixer(decay: str, feature_map: str, normalize: str, sink: bool = False, dtype=torch.float32, **options):
    """A decayed linear mixer with every parameter moved off its initial value; half-lives 1.5 and 6 tokens
    (RetNet: factors 0.5 and 0.9), so the decay is strong enough to matter within a dozen tokens."""
    if decay == "retnet":
        options = {**RETNET_TEST_GAMMAS, **options}
    spec = validate_spec({"mixer": "linear", "decay": decay, "feature_map": feature_map, "normalize": normalize,
                          "sink": sink, "half_life_min": 1.5, "half_life_max": 6.0, **options}, "test")
    mixer = build_mixer(spec, SHAPE)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            scale = 0.3 if name != "decay.bias" else 0.1
            param.add_(scale * torch.randn(param.shape, generator=gen))
    mixer = mixer.to(dtype)
    if decay == "retnet":  # the buffer was computed in the default dtype: recompute it in this one
        from transformers import initialization as init

        mixer.decay.init_parameters(init)
    return mixer


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return checks.random_inputs(SHAPE, seq_len, dtype, seed)


def reference(mixer, q, k, v, x, mask) -> torch.Tensor:
    fm = mixer.feature_map
    params = {name: getattr(fm, name) for name in ("q_weight", "k_weight") if hasattr(fm, name)}
    gain = mixer.output_norm.weight if mixer.output_norm is not None else None
    if mixer.decay is None:
        forget = None
    elif mixer.spec["decay"] == "retnet":
        gammas = retnet_gammas(mixer.shape.num_kv_heads, mixer.spec["gamma_min"], mixer.spec["gamma_max"])
        forget = retnet_forget(x.shape[0], x.shape[1], gammas)
    else:
        forget = forget_factors(x, mixer.decay.bias, getattr(mixer.decay, "weight", None))
    sink = None if mixer.sink is None else (mixer.sink.key, mixer.sink.value, mixer.sink.log_weight)
    return linear_attention(q, k, v, mixer.spec["feature_map"], params, mask, True, mixer.spec["normalize"],
                            mixer.spec["eps"], gain, forget, sink)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("decay,feature_map,normalize,sink", CASES, ids=CASE_IDS)
def test_parallel_matches_reference(decay: str, feature_map: str, normalize: str, sink: bool, padded: bool) -> None:
    seq_len = 10
    mixer = make_mixer(decay, feature_map, normalize, sink)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    with torch.no_grad():
        expected = reference(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32
    # the decay and the sink matter: the same weights without them give another function
    plain = build_mixer(validate_spec({**mixer.spec, "decay": "none", "sink": False}, "test"), SHAPE)
    plain.load_state_dict({n: p for n, p in mixer.state_dict().items() if not n.startswith(("decay.", "sink."))})
    assert rel_err(real_rows(plain.parallel(q, k, v, MixerInputs(x, mask)), mask), expected) > 1e-2


@pytest.mark.parametrize("decay,feature_map,normalize,sink", CASES, ids=CASE_IDS)
def test_attention_weights_mix_the_values_into_the_output(decay: str, feature_map: str, normalize: str,
                                                          sink: bool) -> None:
    """``attention_weights`` (what stage 1's attention KL matches): causal, non-negative rows that, applied to the
    values, with the rest of each row's mass on the sink's value, give the float64 reference's output (eps = 0,
    so a row and the sink's share sum to 1; 1e-10). None where an output norm replaces the denominator."""
    mixer = make_mixer(decay, feature_map, normalize, sink, torch.float64, eps=0.0)
    q, k, v, x = make_inputs(10, torch.float64)
    weights = mixer.attention_weights(q, k, MixerInputs(x))
    if normalize != "denominator":
        assert weights is None
        return
    groups = SHAPE.num_heads // SHAPE.num_kv_heads
    out = weights @ v.repeat_interleave(groups, dim=1)  # [B, H, T, E]
    rest = 1 - weights.sum(-1, keepdim=True)
    if sink:
        out = out + rest * mixer.sink.value.repeat_interleave(groups, dim=0)[None, :, None, :]
        assert (rest > 1e-3).all()  # the sink takes a share
    else:
        assert rest.abs().max() < 1e-12
    assert (weights >= 0).all() and (weights.triu(1) == 0).all()
    with torch.no_grad():
        expected = reference(mixer, q, k, v, x, None)
    assert rel_err(out.transpose(1, 2).detach(), expected) <= 1e-10


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("decay,feature_map,normalize,sink", CASES, ids=CASE_IDS)
def test_gradients_match_reference(decay: str, feature_map: str, normalize: str, sink: bool, form: str) -> None:
    """float64: gradients of q, k, v, the layer input (gates) and every parameter, left-padded batch; the chunked
    form in chunks of 3 (a ragged last one)."""
    seq_len = 7
    mixer = make_mixer(decay, feature_map, normalize, sink, torch.float64, chunk_size=3)
    unused = () if decay == "gated" else {"x"}  # only a gate reads the layer input
    checks.assert_gradients_match(mixer, lambda qkvx, mask: reference(mixer, *qkvx, mask), seq_len, REL_GRAD,
                                  form=form, unused=unused)
    names = dict(mixer.named_parameters())
    assert (decay in ("none", "retnet") or "decay.bias" in names) and (decay != "gated" or "decay.weight" in names)
    assert decay != "retnet" or not any(name.startswith("decay.") for name in names)  # no parameters
    assert not sink or {"sink.key", "sink.value", "sink.log_weight"} <= set(names)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("decay,feature_map,normalize,sink", CASES, ids=CASE_IDS)
def test_chunked_steps_and_prefill_match_parallel(decay: str, feature_map: str, normalize: str, sink: bool,
                                                  padded: bool) -> None:
    seq_len = 11
    mixer = make_mixer(decay, feature_map, normalize, sink, chunk_size=4)
    mask = left_padded(seq_len, 6 if padded else 0)
    # the prefill of 5 tokens (a ragged chunk, padding inside) goes through forward() with a cache
    _, state = checks.assert_forms_agree(mixer, make_inputs(seq_len), mask, REL_FORMS, whole_rows=checks.FORMS)
    assert {"S", "z"} <= set(state)


@pytest.mark.parametrize("decay", ["learned", "gated", "retnet"])
def test_left_padding_changes_nothing(decay: str) -> None:
    """A left-padded row gives the outputs and state of the same tokens alone."""
    mixer = make_mixer(decay, "elu", "denominator", chunk_size=4)
    checks.assert_left_padding_changes_nothing(mixer, make_inputs(9), PAD, REL_FORMS)


def test_initial_half_lives_and_gate() -> None:
    """Fresh layers: g^h = 1/2 at half-lives spread log-uniformly from half_life_min to half_life_max, the
    gate weights zero (a gated layer starts as a learned one); the state keeps its size."""
    spec = validate_spec({"mixer": "linear", "decay": "gated", "half_life_min": 4, "half_life_max": 64}, "t")
    shape = MixerShape(hidden_size=HIDDEN, num_heads=6, num_kv_heads=3, head_dim=8, layer_idx=0)
    mixer = build_mixer(spec, shape)
    g = torch.sigmoid(mixer.decay.bias.double())
    lives = math.log(0.5) / torch.log(g)
    assert torch.allclose(lives, torch.tensor([4.0, 16.0, 64.0], dtype=torch.float64), rtol=1e-5)
    assert mixer.decay.weight.abs().max() == 0
    plain = build_mixer(validate_spec({"mixer": "linear"}, "t"), shape)
    assert mixer.state_size(10) == mixer.state_size(10_000) == plain.state_size(10)
    # the model's weight init (transformers' _init_weights) leaves the same values
    from transformers import initialization as init

    mixer.decay.weight.data.normal_()
    mixer.decay.init_parameters(init)
    assert mixer.decay.weight.abs().max() == 0
    assert torch.allclose(torch.sigmoid(mixer.decay.bias.double()), g)


def test_retnet_schedule() -> None:
    """Defaults: RetNet's gamma_h = 1 - 2^(-5 - h) over the key heads; gamma_min / gamma_max spread 1 - gamma
    geometrically; one key head takes gamma_min. A non-persistent buffer: not in the state dict, not a parameter,
    refilled by the model's weight init (from_pretrained leaves such buffers unset)."""
    from transformers import initialization as init

    def gammas(kv_heads: int, **options) -> list[float]:
        shape = MixerShape(hidden_size=HIDDEN, num_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=8, layer_idx=0)
        mixer = build_mixer(validate_spec({"mixer": "linear", "decay": "retnet", **options}, "t"), shape).double()
        assert not list(mixer.decay.parameters()) and "decay.log_gamma" not in mixer.state_dict()
        mixer.decay.log_gamma.zero_()
        mixer.decay.init_parameters(init)
        return mixer.decay.log_gamma.exp().tolist()

    assert gammas(4) == pytest.approx([1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8], rel=1e-14)
    assert gammas(4) == pytest.approx(retnet_gammas(4), rel=1e-14)
    assert gammas(3, gamma_min=0.5, gamma_max=0.875) == pytest.approx([0.5, 0.75, 0.875], rel=1e-14)
    assert gammas(1, gamma_min=0.9, gamma_max=0.99) == pytest.approx([0.9], rel=1e-14)


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        *(({"mixer": "linear", "decay": "retnet", name: value}, "layer 3",
           rf"layer 3: option '{name}' must be in \(0, 1\)")
          for name, value in (("gamma_min", 1.0), ("gamma_min", 0.0), ("gamma_max", 1.5), ("gamma_max", -0.1))),
        ({"mixer": "linear", "decay": "retnet", "gamma_min": 0.99, "gamma_max": 0.9}, "layer 3",
         r"layer 3: option 'gamma_min' \(0.99\) is above 'gamma_max' \(0.9\)"),
        ({"mixer": "linear", "decay": "retnet", "causal": False}, "layer 2", r"layer 2.*'decay' needs causal=True"),
        ({"mixer": "linear", "decay": "learned", "causal": False}, "layer 2", r"layer 2.*'decay' needs causal=True"),
        ({"mixer": "linear", "decay": "gated", "half_life_min": 9, "half_life_max": 3}, "layer 0",
         r"'half_life_min' \(9.0\) is above 'half_life_max' \(3.0\)"),
        ({"mixer": "linear", "decay": "exponential"}, "layer 0", r"option 'decay' must be one of"),
        ({"mixer": "hybrid", "far": {"mixer": "linear", "decay": "learned"}}, "layer 1",
         r"option 'far' a linear far mixer cannot decay"),
        ({"mixer": "hybrid", "far": {"mixer": "linear", "sink": True}}, "layer 1",
         r"option 'far' a linear far mixer cannot have a sink"),
    ])


def test_fresh_sink_is_a_zero_value_key() -> None:
    """At init the sink only adds weight to the denominator: with v* = 0 it pulls outputs toward zero."""
    q, k, v, x = make_inputs(6)
    spec = validate_spec({"mixer": "linear", "feature_map": "elu"}, "t")
    plain = build_mixer(spec, SHAPE)
    sunk = build_mixer({**spec, "sink": True}, SHAPE)
    assert sunk.sink.value.abs().max() == 0 and sunk.sink.log_weight.abs().max() == 0
    a, b = plain.parallel(q, k, v, MixerInputs(x)), sunk.parallel(q, k, v, MixerInputs(x))
    ratio = b.norm(dim=-1) / a.norm(dim=-1)
    assert (ratio < 1).all() and (ratio > 0.1).all()
