"""Kimi Delta Attention (the ``kda`` mixer, preset ``kimi_linear``) against the float64 per-token reference
(tests/reference_kda.py) and against fla's ``naive_recurrent_kda`` (when fla is installed).

The reference applies (I - b k k^T) Diag(a) S + b k v^T with explicit matrices token by token: no cumulative sums,
no chunks, no triangular solve. Tolerances (relative to the largest entry): fp32 mixer vs float64 reference
``REL_FP32`` (1e-5); float64 gradients of q, k, v, the layer input and every parameter ``REL_GRAD`` (1e-8); fp32
chunked / steps / prefill + steps vs fp32 parallel ``REL_FORMS`` (1e-5); float64 step vs fla's float32 recurrence
``REL_FLA`` (1e-5); fp32 chunked vs fp32 steps under decays down to e^-60 per token ``REL_STRONG`` (1e-4, see that
test). Models: greedy tokens with the cache equal those without it exactly, logits within 1e-4.
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
import torch.nn.functional as F
from generation_cases import (
    Case,
    assert_generates_through_the_cache_and_reloads,
    one_thread,
    tiny_model,
)
from mixer_checks import HIDDEN, PAD, SHAPE
from mixer_steps import left_padded
from reference import phi_hedgehog, real_rows, rel_err
from reference_kda import KdaParams, kda_reference
from reference_recurrent_softmax import hybrid_attention

from hf_recattn.modeling.mixer_base import MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.modeling.ops_kda import kda_chunked, kda_parallel, kda_step

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
REL_FLA = 1e-5
REL_STRONG = 1e-4
#: (init, conv_size, output_gate, feature_map)
CASES = [("scratch", 3, True, "identity"), ("convert", 0, False, "identity"), ("convert", 2, True, "hedgehog")]
CASE_IDS = [f"{i}-conv{c}-{'gate' if g else 'nogate'}-{f}" for i, c, g, f in CASES]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def make_mixer(init_kind: str, conv: int, gate: bool, fmap: str = "identity", dtype=torch.float32, **options):
    """A mixer initialized as the model would, then every parameter moved off its initial value."""
    options = {"init": init_kind, "conv_size": conv, "output_gate": gate, "output_norm": gate, "feature_map": fmap,
               "decay_rank": 3, "half_life_min": 1.5, "half_life_max": 6.0, **options}
    mixer = build_mixer(validate_spec({"mixer": "kda", **options}, "test"), SHAPE).to(dtype)
    checks.init_every_module(mixer)
    checks.perturb_parameters(mixer, dtype=dtype)
    return mixer


def params_of(mixer, live: bool = False) -> KdaParams:
    """The mixer's parameters for the reference: float64 copies, or the live tensors (gradient checks)."""

    def get(param):
        return param if live else param.detach().double()

    phi = None
    if mixer.spec["feature_map"] == "hedgehog":
        fmap = mixer.feature_map

        def phi(x, head, is_query):
            return phi_hedgehog(x, get(fmap.q_weight if is_query else fmap.k_weight)[head])

    return KdaParams(
        heads=SHAPE.num_heads, kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
        decay_down=get(mixer.decay_down), decay_up=get(mixer.decay_up), dt_bias=get(mixer.dt_bias),
        A_log=get(mixer.A_log), beta_weight=get(mixer.beta_weight), beta_bias=get(mixer.beta_bias),
        conv={n: get(c.weight) for n, c in mixer.convs.items()}, activation=mixer.spec["activation"] == "silu",
        qk_norm=mixer.spec["qk_norm"] == "l2", scale=mixer.scale,
        norm_gain=None if mixer.output_norm is None else get(mixer.output_norm.weight),
        gate_weight=get(mixer.gate_weight) if mixer.has_output_gate else None, eps=mixer.spec["eps"],
        feature_map=phi,
    )


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return checks.random_inputs(SHAPE, seq_len, dtype, seed)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("init_kind,conv,gate,fmap", CASES, ids=CASE_IDS)
def test_forms_match_reference(init_kind: str, conv: int, gate: bool, fmap: str, padded: bool) -> None:
    """Parallel and chunked (chunks of 4 over 11 tokens) against the reference, left padding longer than a chunk."""
    seq_len = 11
    mixer = make_mixer(init_kind, conv, gate, fmap, chunk_size=4)
    q, k, v, x = inputs = make_inputs(seq_len)
    mask = left_padded(seq_len, 6) if padded else None
    expected, _ = kda_reference(q, k, v, x, mask, params_of(mixer))
    for form in ("parallel", "chunked"):
        out = checks.outputs_of(mixer, form, inputs, mask)
        assert rel_err(real_rows(out, mask), expected) <= REL_FP32, form


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("init_kind,conv,gate,fmap", CASES, ids=CASE_IDS)
def test_gradients_match_reference(init_kind: str, conv: int, gate: bool, fmap: str, form: str) -> None:
    """float64: gradients of q, k, v, the layer input and every parameter, left-padded batch."""
    mixer = make_mixer(init_kind, conv, gate, fmap, torch.float64, chunk_size=4)
    checks.assert_gradients_match(mixer, lambda qkvx, mask: kda_reference(*qkvx, mask, params_of(mixer, True))[0],
                                  9, REL_GRAD, form)


@pytest.mark.parametrize("chunk_size,seq_len", [(4, 11), (20, 45)], ids=["small-chunks", "sub-chunks"])
def test_chunked_steps_and_prefill_match_parallel(chunk_size: int, seq_len: int) -> None:
    """Chunked, token steps and a cached prefill + steps give the parallel outputs and the same final states
    (chunks of 20 run the two-level scores over sub-chunks of 8 with a ragged end)."""
    mixer = make_mixer("scratch", 3, True, chunk_size=chunk_size)
    checks.assert_forms_agree(mixer, make_inputs(seq_len), left_padded(seq_len, 6), REL_FORMS, whole_rows={"chunked"})


def test_continues_from_a_state_and_padding_leaves_it() -> None:
    """From a random state (S and the convolution inputs), chunks and steps give the reference's outputs and final
    state; left padding changes nothing; a padded step leaves its row's state untouched."""
    mixer = make_mixer("convert", 3, True, chunk_size=4)
    inputs = q, k, v, x = make_inputs(9, seed=2)
    state = checks.random_state(mixer)
    expected, expected_state = kda_reference(q, k, v, x, None, params_of(mixer), initial=state)
    checks.assert_continues_from_state(mixer, inputs, state, expected, expected_state, REL_FP32)
    checks.assert_left_padding_changes_nothing(mixer, make_inputs(9), PAD, REL_FORMS)
    checks.assert_padded_step_keeps_state(mixer, make_inputs(1), checks.random_state(mixer))


def test_strong_decays_over_long_sequences_stay_finite() -> None:
    """Decays of up to e^-60 per token and channel over 300 tokens: every exponent the chunked form takes is <= 0,
    so outputs and state are finite, and the chunked form agrees with steps within ``REL_STRONG`` (the cumulative
    log decay reaches about -700 inside a chunk of 64, where fp32 resolves the differences of two of them only to
    about 1e-4; steps form no cumulative sums)."""
    gen = torch.Generator().manual_seed(0)
    b, hk, g, t, d = 1, 2, 2, 300, 8
    q, v = torch.randn(b, hk, g, t, d, generator=gen), torch.randn(b, hk, t, d, generator=gen)
    k = F.normalize(torch.randn(b, hk, t, d, generator=gen), dim=-1)
    log_a, beta = -60.0 * torch.rand(b, hk, t, d, generator=gen) ** 4, torch.rand(b, hk, t, generator=gen)
    out, state = kda_chunked(q, k, v, log_a, beta, torch.zeros(b, hk, d, d), chunk_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    S, steps = torch.zeros(b, hk, d, d), []
    for i in range(t):
        o, S = kda_step(q[..., i : i + 1, :], k[:, :, i : i + 1], v[:, :, i : i + 1], log_a[:, :, i : i + 1],
                        beta[..., i : i + 1], S)
        steps.append(o)
    assert rel_err(out, torch.cat(steps, dim=3)) <= REL_STRONG and rel_err(state, S) <= REL_STRONG


def test_step_equals_fla_naive_recurrent_kda() -> None:
    """Conventions: our ops (step, chunked, parallel) equal fla's ``naive_recurrent_kda`` (state [K, V], gate g =
    log a per key channel, beta per head, q scaled by us) from a random initial state, outputs and final state."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    gen = torch.Generator().manual_seed(1)
    b, hk, g, t, d, e = 2, 2, 2, 13, 8, 6
    q = torch.randn(b, hk, g, t, d, generator=gen, dtype=torch.float64) * d**-0.5
    k = F.normalize(torch.randn(b, hk, t, d, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(b, hk, t, e, generator=gen, dtype=torch.float64)
    log_a = -torch.rand(b, hk, t, d, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, hk, t, generator=gen, dtype=torch.float64)
    s0 = torch.randn(b, hk, d, e, generator=gen, dtype=torch.float64)
    S, steps = s0.clone(), []
    for i in range(t):
        o, S = kda_step(q[..., i : i + 1, :], k[:, :, i : i + 1], v[:, :, i : i + 1], log_a[:, :, i : i + 1],
                        beta[..., i : i + 1], S)
        steps.append(o)
    stepped = torch.cat(steps, dim=3)
    for j in range(g):  # fla reads one query per state: each query head of the group on its own
        want, want_state = naive.naive_recurrent_kda(
            q[:, :, j].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), log_a.transpose(1, 2),
            beta.transpose(1, 2), scale=1.0, initial_state=s0, output_final_state=True,
        )
        assert rel_err(stepped[:, :, j].transpose(1, 2), want.double()) <= REL_FLA
        assert rel_err(S, want_state.double()) <= REL_FLA
    for out, final in (kda_chunked(q, k, v, log_a, beta, s0, chunk_size=4), kda_parallel(q, k, v, log_a, beta, s0)):
        assert rel_err(out, stepped) <= 1e-12 and rel_err(final, S) <= 1e-12


def test_gqa_equals_repeated_key_heads() -> None:
    """Two query heads on one key head read the same state: the op equals each query head on a copy of it."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 2, 7, 4, generator=gen)
    k = F.normalize(torch.randn(1, 1, 7, 4, generator=gen), dim=-1)
    v, log_a, beta = torch.randn(1, 1, 7, 3, generator=gen), -torch.rand(1, 1, 7, 4, generator=gen), torch.rand(1, 1, 7)
    grouped, _ = kda_parallel(q, k, v, log_a, beta)
    apart, _ = kda_parallel(q.transpose(1, 2), *(x.expand(1, 2, *x.shape[2:]) for x in (k, v, log_a, beta)))
    assert rel_err(grouped, apart.transpose(1, 2)) <= REL_FORMS


def test_convert_and_scratch_init() -> None:
    """convert: identity convolutions, input-independent decay (W_up = 0), A = 1, each head's channels at half-lives
    log-uniform from half_life_min to half_life_max, b = beta_init; scratch: A in [1, 16], dt in [1e-3, 0.1]."""
    spec = validate_spec({"mixer": "kda", "init": "convert", "half_life_min": 4, "half_life_max": 64,
                          "beta_init": 0.25}, "t")
    shape = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=3, layer_idx=0)
    mixer = build_mixer(spec, shape)
    checks.init_every_module(mixer, scramble=True)
    assert mixer.decay_up.abs().max() == 0 and mixer.beta_weight.abs().max() == 0 and mixer.A_log.abs().max() == 0
    assert mixer.decay_down.abs().max() > 0  # the decay can learn to read the input
    assert torch.allclose(torch.sigmoid(mixer.beta_bias), torch.full((2,), 0.25))
    lives = math.log(0.5) / (-F.softplus(mixer.dt_bias.double()))
    assert torch.allclose(lives, torch.tensor([4.0, 16.0, 64.0] * 2, dtype=torch.float64), rtol=1e-4)
    for conv in mixer.convs.values():
        assert torch.equal(conv.weight[:, -1], torch.ones(conv.channels)) and conv.weight[:, :-1].abs().max() == 0
    scratch = build_mixer(validate_spec("kimi_linear", "t"), MixerShape(64, 8, 8, 16, 0))
    checks.init_every_module(scratch)
    A, dt = scratch.A_log.exp(), F.softplus(scratch.dt_bias)
    assert 1.0 <= A.min() and A.max() <= 16.0
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001 and dt.max() / dt.min() > 10
    assert scratch.decay_up.shape == (8 * 16, 16)  # rank head_dim by default


def test_preset_and_state_size() -> None:
    spec = validate_spec("kimi_linear", "t")
    assert spec["mixer"] == "kda" and not spec["rope"] and spec["conv_size"] == 4
    mixer = make_mixer("scratch", 3, True)
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert mixer.state_size(10) == mixer.state_size(10**6) == sum(t.numel() for t in state.values())
    hk, h, d = SHAPE.num_kv_heads, SHAPE.num_heads, SHAPE.head_dim
    assert mixer.state_size(1) == hk * d * d + 2 * (h * d + 2 * hk * d)
    assert make_mixer("convert", 0, False, "hedgehog").state_size(1) == hk * 2 * d * d
    assert set(mixer.input_weights()) == {"decay_down", "beta", "output_gate"}


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "kda", "causal": False}, "layer 3", r"layer 3: option 'causal' must be True for kda"),
        ({"mixer": "kda", "decay_rank": 0}, "layer 1", r"layer 1: option 'decay_rank' must be >= 1"),
        ({"mixer": "kda", "output_norm": False}, "layer 0", r"option 'output_gate' needs output_norm=True"),
        ({"mixer": "kda", "beta_init": 1.0}, "layer 0", r"option 'beta_init' must be in \(0, 1\)"),
        ({"mixer": "kda", "half_life_min": 9.0, "half_life_max": 8.0}, "layer 2", r"layer 2: option 'half_life_min'"),
    ])


@pytest.mark.parametrize("attention", [
    {"mixer": "kimi_linear", "chunk_size": 4}, {"mixer": "kda", "init": "convert", "chunk_size": 4},
    {"mixer": "hybrid", "window": 3, "combine": "sum", "chunk_size": 4, "far": {"mixer": "kda", "chunk_size": 4}},
], ids=["preset", "convert", "hybrid-far"])
def test_model_generates_through_the_cache_and_reloads(attention, tmp_path) -> None:
    """Greedy decoding with the cache gives the tokens and logits of the full forward, left-padded batch; save /
    load gives the same logits (generation_cases.assert_generates_through_the_cache_and_reloads)."""
    assert_generates_through_the_cache_and_reloads(tiny_model(Case("kda", attention)), tmp_path)


def test_hybrid_with_kda_far_part() -> None:
    """``{"mixer": "hybrid", "combine": "sum", "far": {"mixer": "kda"}}``: the forms agree, and values and float64
    gradients match g * the window reference + (1 - g) * the KDA reference."""
    spec = {"mixer": "hybrid", "window": 4, "combine": "sum",
            "far": {"mixer": "kda", "decay_rank": 3, "conv_size": 2, "chunk_size": 5}}
    hybrid = build_mixer(validate_spec(spec, "layer 1"), SHAPE)
    checks.init_every_module(hybrid)
    checks.perturb_parameters(hybrid)

    def reference(inputs, mask, live: bool = False):
        q, k, v, x = inputs
        share = torch.sigmoid(hybrid.mix_logit if live else hybrid.mix_logit.detach()).double()[:, None]
        near = hybrid_attention(q, k, v, 4, None, share[:, 0].detach(), mask=mask)
        far, _ = kda_reference(q, k, v, x, mask, params_of(hybrid.far, live))
        return real_rows(share * near + (1 - share) * far, mask)

    inputs, mask = make_inputs(13), left_padded(13, PAD)
    parallel, state = checks.assert_forms_agree(hybrid, inputs, mask, REL_FORMS)
    assert rel_err(real_rows(parallel, mask), reference(inputs, mask)) <= REL_FP32
    assert {"far.S", "far.conv_k"} <= set(state)
    hybrid = hybrid.double()
    checks.assert_gradients_match(hybrid, lambda qkvx, m: reference(qkvx, m, live=True), 9, REL_GRAD)
