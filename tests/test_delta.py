"""The delta-rule mixer (DeltaNet, Gated DeltaNet, Comba, DeltaProduct) against the float64 reference.

tests/reference_delta.py updates one state per key head token by token, in Su's values x keys form, with
the convolution, activations, norms, gates and output gate written out per vector; no triangular solve, no chunk,
no cumulative sum. Every combination of rule x short convolution x output gate x Householder steps is checked.
Tolerances: fp32 mixer vs float64 reference ``REL_FP32``; float64 gradients (q, k, v, the layer input and every
parameter) ``REL_GRAD``; fp32 chunked / steps / prefill vs fp32 parallel ``REL_FORMS``.
"""

from __future__ import annotations

import itertools
import math

import mixer_checks as checks
import pytest
import torch
from mixer_checks import HIDDEN, PAD, SHAPE
from mixer_steps import left_padded, run_chunked, run_steps
from reference import phi_elu, phi_hedgehog, real_rows, rel_err
from reference_delta import DeltaParams, delta_reference

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.modeling.triangular import unit_lower_solve

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
#: (rule, conv_size, output_gate, householder_steps, feature_map): every combination of the first four, plus
#: feature maps on q / k
COMBOS = [(*c, "identity") for c in itertools.product(("delta", "gated", "comba"), (0, 3), (False, True), (1, 2))]
COMBOS += [("gated", 3, False, 1, "hedgehog"), ("comba", 0, True, 2, "elu"), ("delta", 3, True, 2, "hedgehog")]
COMBO_IDS = [f"{r}-conv{c}-{'gate' if g else 'nogate'}-n{n}-{f}" for r, c, g, n, f in COMBOS]


def make_mixer(rule: str, conv_size: int, output_gate: bool, steps: int, feature_map: str = "identity",
               dtype=torch.float32, **options):
    """A delta mixer with every parameter moved off its initial value (decays strong enough to matter)."""
    spec = validate_spec({"mixer": "delta", "rule": rule, "conv_size": conv_size, "output_gate": output_gate,
                          "output_norm": output_gate or options.pop("output_norm", False),
                          "householder_steps": steps, "feature_map": feature_map, "init": "convert",
                          "half_life_min": 2.0, "half_life_max": 8.0, **options}, "test")
    mixer = build_mixer(spec, SHAPE)
    checks.perturb_parameters(mixer)
    return mixer.to(dtype)


def params_of(mixer) -> DeltaParams:
    """The mixer's parameters as plain float64 tensors for the reference."""
    spec, gates = mixer.spec, mixer.gates

    def get(module, name):
        value = getattr(module, name, None)
        return None if value is None else value.detach().double()

    fmap = mixer.feature_map
    phi = None
    if spec["feature_map"] == "hedgehog":
        def phi(x, head, is_query):
            return phi_hedgehog(x, (fmap.q_weight if is_query else fmap.k_weight)[head].detach().double())
    elif spec["feature_map"] == "elu":
        def phi(x, head, is_query):
            return phi_elu(x)
    return DeltaParams(
        rule=spec["rule"], heads=SHAPE.num_heads, kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
        steps=spec["householder_steps"], conv={n: c.weight.detach().double() for n, c in mixer.convs.items()},
        activation=spec["activation"] == "silu", qk_norm=spec["qk_norm"] == "l2",
        negative_eigenvalues=spec["negative_eigenvalues"], scale=mixer.scale,
        beta_weight=get(gates, "beta_weight"), beta_bias=get(gates, "beta_bias"),
        decay_weight=get(gates, "decay_weight"), dt_bias=get(gates, "dt_bias"), A_log=get(gates, "A_log"),
        extra_kv_weight=get(mixer, "extra_kv_weight"),
        norm_gain=None if mixer.output_norm is None else mixer.output_norm.weight.detach().double(),
        gate_weight=get(mixer, "gate_weight"), eps=spec["eps"], causal=spec["causal"], feature_map=phi,
    )


def params_live(mixer) -> DeltaParams:
    """As params_of, but the live (differentiable) parameters, for gradient checks."""
    p = params_of(mixer)
    for field_name, module, name in (("beta_weight", mixer.gates, "beta_weight"),
                                     ("beta_bias", mixer.gates, "beta_bias"),
                                     ("decay_weight", mixer.gates, "decay_weight"),
                                     ("dt_bias", mixer.gates, "dt_bias"), ("A_log", mixer.gates, "A_log"),
                                     ("extra_kv_weight", mixer, "extra_kv_weight"),
                                     ("gate_weight", mixer, "gate_weight")):
        setattr(p, field_name, getattr(module, name, None))
    p.conv = {n: c.weight for n, c in mixer.convs.items()}
    p.norm_gain = None if mixer.output_norm is None else mixer.output_norm.weight
    if mixer.spec["feature_map"] == "hedgehog":
        fmap = mixer.feature_map

        def phi(x, head, is_query):
            return phi_hedgehog(x, (fmap.q_weight if is_query else fmap.k_weight)[head])

        p.feature_map = phi
    return p


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return checks.random_inputs(SHAPE, seq_len, dtype, seed)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("rule,conv,gate,steps,fmap", COMBOS, ids=COMBO_IDS)
def test_parallel_matches_reference(rule: str, conv: int, gate: bool, steps: int, fmap: str, padded: bool) -> None:
    seq_len = 10
    mixer = make_mixer(rule, conv, gate, steps, fmap)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    expected, _ = delta_reference(q, k, v, x, mask, params_of(mixer))
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32


@pytest.mark.parametrize("rule,conv,gate,steps,fmap", COMBOS, ids=COMBO_IDS)
def test_gradients_match_reference(rule: str, conv: int, gate: bool, steps: int, fmap: str) -> None:
    """float64: gradients of q, k, v, the layer input and every parameter, left-padded batch."""
    seq_len = 6
    mixer = make_mixer(rule, conv, gate, steps, fmap, torch.float64)
    checks.assert_gradients_match(mixer, lambda qkvx, mask: delta_reference(*qkvx, mask, params_live(mixer))[0],
                                  seq_len, REL_GRAD)
    names = dict(mixer.named_parameters())
    assert (rule == "delta") == ("gates.A_log" not in names)
    assert (steps > 1) == ("extra_kv_weight" in names)


@pytest.mark.parametrize("rule,conv,gate,steps,fmap", COMBOS, ids=COMBO_IDS)
def test_chunked_steps_and_prefill_match_parallel(rule: str, conv: int, gate: bool, steps: int, fmap: str) -> None:
    """Left padding longer than a chunk; chunked, token steps and a cached prefill + steps agree."""
    seq_len = 11
    mixer = make_mixer(rule, conv, gate, steps, fmap, chunk_size=4)
    checks.assert_forms_agree(mixer, make_inputs(seq_len), left_padded(seq_len, 6), REL_FORMS, whole_rows={"chunked"})


@pytest.mark.parametrize("rule,conv,gate,steps,fmap", COMBOS, ids=COMBO_IDS)
def test_initial_state_matches_reference(rule: str, conv: int, gate: bool, steps: int, fmap: str) -> None:
    """From a random state (S and the convolution buffers), chunked and stepped forms against the reference,
    outputs and final states; the reference is fed the same state."""
    seq_len = 9
    mixer = make_mixer(rule, conv, gate, steps, fmap, chunk_size=4)
    inputs = q, k, v, x = make_inputs(seq_len, seed=2)
    state = checks.random_state(mixer)
    expected, expected_state = delta_reference(q, k, v, x, None, params_of(mixer), initial=state)
    checks.assert_continues_from_state(mixer, inputs, state, expected, expected_state, REL_FP32)


@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_left_padding_changes_nothing(rule: str) -> None:
    """A left-padded row gives the outputs and state (S and convolution buffers) of the same tokens alone."""
    mixer = make_mixer(rule, 3, True, 2, chunk_size=4)
    checks.assert_left_padding_changes_nothing(mixer, make_inputs(9), PAD, REL_FORMS)


def test_padded_step_leaves_state_untouched() -> None:
    mixer = make_mixer("comba", 3, True, 2)
    checks.assert_padded_step_keeps_state(mixer, make_inputs(1), checks.random_state(mixer))


def test_bidirectional_delta_reads_the_final_state() -> None:
    mixer = make_mixer("delta", 0, False, 1, causal=False)
    q, k, v, x = make_inputs(8)
    mask = left_padded(8, PAD)
    out = mixer(q, k, v, MixerInputs(x, mask))[0]
    expected, _ = delta_reference(q, k, v, x, mask, params_of(mixer))
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32
    with pytest.raises(ValueError, match="causal=False has no step form"):
        mixer.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], MixerInputs(x[:, :1]), mixer.init_state(2, q.device, q.dtype))


def test_rules_differ() -> None:
    """The three rules, the negative eigenvalues and the extra Householder steps each change the function."""
    q, k, v, x = make_inputs(8)
    outs = {}
    for rule in ("delta", "gated", "comba"):
        outs[rule] = make_mixer(rule, 3, True, 1).parallel(q, k, v, MixerInputs(x))
    outs["neg"] = make_mixer("gated", 3, True, 1, negative_eigenvalues=True).parallel(q, k, v, MixerInputs(x))
    outs["n2"] = make_mixer("gated", 3, True, 2).parallel(q, k, v, MixerInputs(x))
    for a, b in itertools.combinations(outs, 2):
        assert rel_err(outs[a], outs[b]) > 1e-3, (a, b)


def test_convert_init() -> None:
    """init=convert: identity convolution, input-independent gates, b = beta_init, decay half-lives spread
    log-uniformly from half_life_min to half_life_max; extra Householder keys zero. ``_init_weights`` (via
    transformers.initialization) restores it."""
    spec = validate_spec({"mixer": "delta", "init": "convert", "half_life_min": 4, "half_life_max": 64,
                          "beta_init": 0.25, "householder_steps": 2, "negative_eigenvalues": True}, "t")
    shape = MixerShape(hidden_size=HIDDEN, num_heads=6, num_kv_heads=3, head_dim=8, layer_idx=0)
    mixer = build_mixer(spec, shape)
    checks.init_every_module(mixer, scramble=True)
    gates = mixer.gates
    assert gates.beta_weight.abs().max() == 0 and gates.decay_weight.abs().max() == 0
    assert mixer.extra_kv_weight.abs().max() == 0
    assert torch.allclose(2 * torch.sigmoid(gates.beta_bias), torch.full((6,), 0.25))
    log_a = -gates.A_log.exp() * torch.nn.functional.softplus(gates.dt_bias)
    lives = math.log(0.5) / log_a.double()
    assert torch.allclose(lives, torch.tensor([4.0, 16.0, 64.0], dtype=torch.float64), rtol=1e-4)
    for conv in mixer.convs.values():
        assert torch.equal(conv.weight[:, -1], torch.ones(conv.channels)) and conv.weight[:, :-1].abs().max() == 0


def test_scratch_init_is_the_published_one() -> None:
    shape = MixerShape(hidden_size=64, num_heads=64, num_kv_heads=64, head_dim=4, layer_idx=0)
    mixer = build_mixer(validate_spec({"mixer": "delta"}, "t"), shape)
    checks.init_every_module(mixer)
    A = mixer.gates.A_log.exp()
    dt = torch.nn.functional.softplus(mixer.gates.dt_bias)
    assert 0 < A.min() and A.max() <= 16 and A.std() > 2  # U(0, 16)
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001 and dt.max() / dt.min() > 10  # log-U(1e-3, 0.1)
    conv = mixer.convs["conv_k"].weight
    assert conv.abs().max() <= 0.5 + 1e-6 and conv.std() > 0.1  # U(+-1/sqrt(4))


def test_state_size_counts_every_buffer() -> None:
    mixer = make_mixer("gated", 3, True, 2)
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert mixer.state_size(10) == mixer.state_size(10**6) == sum(t.numel() for t in state.values())
    hk, h, d = SHAPE.num_kv_heads, SHAPE.num_heads, SHAPE.head_dim
    assert mixer.state_size(1) == hk * d * d + 2 * (h * d + 2 * 2 * hk * d)


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "delta", "rule": "mesa"}, "layer 3", r"layer 3: option 'rule' must be one of"),
        ({"mixer": "delta", "householder_steps": 0}, "layer 3", r"layer 3: option 'householder_steps' must be >= 1"),
        ({"mixer": "delta", "conv_size": -1}, "layer 1", r"layer 1: option 'conv_size' must be >= 0"),
        ({"mixer": "delta", "causal": False}, "layer 0", r"layer 0: option 'causal' must be True with rule 'gated'"),
        ({"mixer": "delta", "rule": "comba", "causal": False}, "layer 0",
         r"layer 0: option 'causal' must be True with rule 'comba'"),
        ({"mixer": "delta", "output_norm": False}, "layer 0", r"option 'output_gate' needs output_norm=True"),
        ({"mixer": "delta", "beta_init": 1.0}, "layer 0", r"option 'beta_init' must be in \(0, 1\)"),
    ])


# ----- a delta far part in the hybrid: g softmax(window + sinks) + (1 - g) delta over every token ------------
@pytest.mark.parametrize("sinks", [0, 2])
def test_hybrid_with_delta_far_matches_reference(sinks: int) -> None:
    """The delta far part reads every token as it arrives; forms agree, values and float64 gradients match
    g * softmax over the window and sinks (tests/reference_recurrent_softmax.py) + (1 - g) * the delta reference."""
    from reference_recurrent_softmax import hybrid_attention

    far = {"mixer": "delta", "rule": "gated", "conv_size": 3, "householder_steps": 2, "init": "convert",
           "half_life_min": 2.0, "half_life_max": 8.0}
    spec = validate_spec({"mixer": "hybrid", "window": 3, "sink_tokens": sinks, "combine": "sum", "far": far,
                          "chunk_size": 4}, "layer 5")
    mixer = build_mixer(spec, SHAPE).double()
    checks.perturb_parameters(mixer, dtype=torch.float64)
    seq_len = 11
    q, k, v, x = (t.requires_grad_() for t in make_inputs(seq_len, torch.float64, seed=4))
    mask = left_padded(seq_len, PAD)
    share = torch.sigmoid(mixer.mix_logit)
    near = hybrid_attention(q, k, v, 3, None, share.detach(), mask=mask, sinks=sinks)
    far_out, _ = delta_reference(q, k, v, x, mask, params_live(mixer.far))
    expected = real_rows(share[:, None] * near + (1 - share[:, None]) * far_out, mask)
    out = real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask)
    assert rel_err(out, expected) <= REL_FP32
    chunked, chunk_state = run_chunked(mixer, q, k, v, x, mask)
    stepped, step_state = run_steps(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(chunked, mask), out) <= REL_FORMS
    assert rel_err(real_rows(stepped, mask), out) <= REL_FORMS
    assert {"far.S", "far.conv_k"} <= set(chunk_state)
    for name in chunk_state:
        assert rel_err(chunk_state[name].double(), step_state[name].double()) <= REL_FORMS, name
    tensors = [q, k, v, x, *mixer.parameters()]
    got = torch.autograd.grad(out.sum(), tensors)
    want = torch.autograd.grad(expected.sum(), tensors)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= REL_GRAD


def test_hybrid_delta_far_needs_sum() -> None:
    with pytest.raises(ValueError, match=r"layer 4: option 'far' a delta far mixer needs combine='sum'"):
        validate_spec({"mixer": "hybrid", "far": {"mixer": "delta"}}, "layer 4")


def test_unit_lower_solve_reads_only_the_strict_lower_part_and_solves_half_precision_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    lower, rhs = torch.randn(2, 6, 6, generator=gen, dtype=torch.float64), torch.randn(2, 6, 3, generator=gen,
                                                                                       dtype=torch.float64)
    expected = torch.linalg.solve(torch.eye(6, dtype=torch.float64) + lower.tril(-1), rhs)
    torch.testing.assert_close(unit_lower_solve(lower, rhs), expected)
    half = unit_lower_solve(lower.bfloat16(), rhs.bfloat16())
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, unit_lower_solve(lower.bfloat16().float(), rhs.bfloat16().float()).bfloat16())
