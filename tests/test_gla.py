"""Gated linear attention (the ``gated_linear`` mixer) against the float64 per-token reference
(tests/reference_gated_linear.py).

The reference keeps one state per key head and applies the gate, the write, the read, the RMSNorm and the swish
gate token by token; no cumulative sums, no chunks, no pairwise decays. Tolerances: fp32 mixer vs float64 reference
``REL_FP32`` (1e-5, relative to the largest entry); float64 gradients of q, k, v, the layer input and every
parameter ``REL_GRAD`` (1e-8); fp32 chunked / steps / prefill + steps vs fp32 parallel ``REL_FORMS`` (1e-5).
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
from mixer_checks import BATCH, HIDDEN, PAD, SHAPE
from mixer_steps import left_padded, run_chunked, run_steps
from reference import real_rows, rel_err
from reference_gated_linear import GLAParams, gla_reference

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
#: (output_norm, output_gate, init)
CASES = [(True, True, "scratch"), (False, False, "convert"), (True, False, "convert"), (False, True, "scratch")]
CASE_IDS = [f"{'norm' if n else 'nonorm'}-{'gate' if g else 'nogate'}-{i}" for n, g, i in CASES]


def make_mixer(norm: bool = True, gate: bool = True, init_kind: str = "scratch", dtype=torch.float32, **options):
    """A GLA mixer initialized as the model would, then every parameter moved off its initial value; the gate
    bias pulled down so that gates are strong (alpha well below 1) within a dozen tokens."""
    from transformers import initialization as init

    spec = validate_spec({"mixer": "gated_linear", "output_norm": norm, "output_gate": gate, "init": init_kind,
                          "gate_temperature": 4.0, "half_life_min": 1.5, "half_life_max": 6.0, **options}, "test")
    mixer = build_mixer(spec, SHAPE)
    mixer.init_parameters(init)
    checks.perturb_parameters(mixer)
    with torch.no_grad():
        mixer.gate_bias.sub_(1.0)
    return mixer.to(dtype)


def params_of(mixer, live: bool = False) -> GLAParams:
    def get(param):
        if param is None:
            return None
        return param if live else param.detach().double()

    return GLAParams(
        heads=SHAPE.num_heads, kv_heads=SHAPE.num_kv_heads, gate_down=get(mixer.gate_down), gate_up=get(mixer.gate_up),
        gate_bias=get(mixer.gate_bias), temperature=mixer.spec["gate_temperature"], scale=SHAPE.head_dim**-0.5,
        norm_gain=None if mixer.output_norm is None else get(mixer.output_norm.weight),
        gate_weight=get(getattr(mixer, "gate_weight", None)), eps=mixer.spec["eps"],
    )


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return checks.random_inputs(SHAPE, seq_len, dtype, seed)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("norm,gate,init_kind", CASES, ids=CASE_IDS)
def test_parallel_and_chunked_match_reference(norm: bool, gate: bool, init_kind: str, padded: bool) -> None:
    seq_len = 10
    mixer = make_mixer(norm, gate, init_kind, chunk_size=4)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    expected, final = gla_reference(q, k, v, x, mask, params_of(mixer))
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32
    chunked, state = mixer.chunked(q, k, v, MixerInputs(x, mask), mixer.init_state(BATCH, q.device, q.dtype))
    assert rel_err(real_rows(chunked, mask), expected) <= REL_FP32
    assert rel_err(state["S"], final) <= REL_FP32
    # the gates matter: with alpha = 1 (a huge temperature) the function changes
    flat = build_mixer({**mixer.spec, "gate_temperature": 1e9}, SHAPE)
    flat.load_state_dict(mixer.state_dict())
    assert rel_err(real_rows(flat.parallel(q, k, v, MixerInputs(x, mask)), mask), expected) > 1e-2


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("norm,gate,init_kind", CASES[:2], ids=CASE_IDS[:2])
def test_gradients_match_reference(norm: bool, gate: bool, init_kind: str, form: str) -> None:
    """float64: gradients of q, k, v, the layer input and every parameter, left-padded batch."""
    seq_len = 7
    mixer = make_mixer(norm, gate, init_kind, torch.float64, chunk_size=3)
    checks.assert_gradients_match(mixer, lambda qkvx, mask: gla_reference(*qkvx, mask, params_of(mixer, True))[0],
                                  seq_len, REL_GRAD, form)
    names = dict(mixer.named_parameters())
    assert {"gate_down", "gate_up", "gate_bias"} <= set(names)
    assert gate == ("gate_weight" in names) and norm == ("output_norm.weight" in names)


@pytest.mark.parametrize("chunk_size,seq_len", [(4, 11), (20, 45)], ids=["small-chunks", "sub-chunks"])
def test_chunked_steps_and_prefill_match_parallel(chunk_size: int, seq_len: int) -> None:
    """Left padding longer than a chunk; chunks of 20 hold a 16-token secondary chunk and a ragged one."""
    mixer = make_mixer(chunk_size=chunk_size)
    inputs = q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, 6)
    parallel, chunk_state = checks.assert_forms_agree(mixer, inputs, mask, REL_FORMS)
    assert set(chunk_state) == {"S"}
    # forward() without a cache takes the chunked form for sequences longer than a chunk
    auto, _ = mixer(q, k, v, MixerInputs(x, mask))
    assert rel_err(real_rows(auto, mask), real_rows(parallel, mask)) <= REL_FORMS


def test_initial_state_matches_reference() -> None:
    seq_len = 9
    mixer = make_mixer(chunk_size=4)
    inputs = q, k, v, x = make_inputs(seq_len, seed=2)
    state = checks.random_state(mixer)
    expected, final = gla_reference(q, k, v, x, None, params_of(mixer), initial=state["S"].clone())
    checks.assert_continues_from_state(mixer, inputs, state, expected, {"S": final}, REL_FP32)


def test_left_padding_changes_nothing() -> None:
    checks.assert_left_padding_changes_nothing(make_mixer(chunk_size=4), make_inputs(9), PAD, REL_FORMS)


def test_padded_step_leaves_state_untouched() -> None:
    mixer = make_mixer()
    checks.assert_padded_step_keeps_state(mixer, make_inputs(1), checks.random_state(mixer))


def test_strong_gates_over_long_sequences_stay_finite() -> None:
    """log alpha near -40 per token (cumulative -16,000 over 400 tokens; exp(40 * 16) overflows even float64):
    no overflow in any form or gradient, and the chunked form still equals the steps."""
    seq_len = 400
    mixer = make_mixer(chunk_size=64, gate_temperature=1.0)
    with torch.no_grad():
        mixer.gate_bias.fill_(-40.0)
    q, k, v, x = (t.requires_grad_() for t in make_inputs(seq_len))
    mask = torch.ones(BATCH, seq_len, dtype=torch.bool)
    chunked, state = run_chunked(mixer, q, k, v, x, mask)
    assert torch.isfinite(chunked).all() and torch.isfinite(state["S"]).all()
    grads = torch.autograd.grad(chunked.square().sum(), [q, k, v, x, *mixer.parameters()])
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        stepped, step_state = run_steps(mixer, q[..., -70:, :], k[..., -70:, :], v[..., -70:, :], x[:, -70:],
                                        mask[:, -70:])
        tail, _ = run_chunked(mixer, q[..., -70:, :], k[..., -70:, :], v[..., -70:, :], x[:, -70:], mask[:, -70:])
        short = mixer.parallel(q[..., :40, :], k[..., :40, :], v[..., :40, :], MixerInputs(x[:, :40]))
    assert rel_err(tail, stepped) <= REL_FORMS
    assert torch.isfinite(short).all() and rel_err(chunked[:, :40], short) <= REL_FORMS


def test_convert_and_scratch_init() -> None:
    """convert: W2 = 0 and each head's key dims at half-lives log-uniform from half_life_min to half_life_max;
    scratch: xavier-uniform (gain 2^-2.5) low-rank maps and output gate, zero bias."""
    from transformers import initialization as init

    shape = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=3, layer_idx=0)
    spec = validate_spec({"mixer": "gated_linear", "init": "convert", "half_life_min": 4, "half_life_max": 64}, "t")
    mixer = build_mixer(spec, shape)
    for param in mixer.parameters():
        param.data.normal_()
    mixer.init_parameters(init)
    assert mixer.gate_up.abs().max() == 0 and mixer.gate_down.abs().max() > 0
    log_a = torch.nn.functional.logsigmoid(mixer.gate_bias.double()) / 16.0
    lives = (math.log(0.5) / log_a).view(2, 3)
    assert torch.allclose(lives, torch.tensor([[4.0, 16.0, 64.0]] * 2, dtype=torch.float64), rtol=1e-4)
    scratch = build_mixer(validate_spec({"mixer": "gated_linear"}, "t"), SHAPE)
    scratch.init_parameters(init)
    assert scratch.gate_bias.abs().max() == 0
    for param in (scratch.gate_down, scratch.gate_up, scratch.gate_weight):
        bound = 2**-2.5 * math.sqrt(6.0 / sum(param.shape))
        assert 0 < param.abs().max() <= bound and param.std() > bound / 4
    assert scratch.spec["gate_rank"] == 16 and scratch.spec["gate_temperature"] == 16


def test_presets() -> None:
    """gla: the family's paper defaults without RoPE; retnet: linear with the fixed decay, no feature map."""
    gla = validate_spec("gla", "t")
    assert gla == {**validate_spec({"mixer": "gated_linear"}, "t"), "rope": False}
    retnet = validate_spec("retnet", "t")
    assert (retnet["mixer"], retnet["decay"], retnet["feature_map"], retnet["normalize"]) == (
        "linear", "retnet", "identity", "layernorm")
    assert retnet["gamma_min"] == 1 - 2**-5 and retnet["gamma_max"] is None and retnet["rope"] is True


def test_state_size_counts_the_state() -> None:
    mixer = make_mixer()
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert mixer.state_size(1) == mixer.state_size(10**6) == state["S"].numel() == 2 * 8 * 8


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "gated_linear", "causal": False}, "layer 3", r"layer 3: option 'causal' must be True for gla"),
        ({"mixer": "gated_linear", "gate_temperature": 0.0}, "layer 1",
         r"layer 1: option 'gate_temperature' must be > 0"),
        ({"mixer": "gated_linear", "gate_rank": 0}, "layer 1", r"layer 1: option 'gate_rank' must be >= 1"),
        ({"mixer": "gated_linear", "half_life_min": 9, "half_life_max": 3}, "layer 0",
         r"layer 0: option 'half_life_min' \(9.0\) is above 'half_life_max'"),
        ({"mixer": "gated_linear", "feature_map": "elu"}, "layer 2", r"layer 2: unknown option\(s\) \['feature_map'\]"),
    ])
