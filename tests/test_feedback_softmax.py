"""DeltaFormer and PaTH (the softmax families fed back from DeltaNet in Su's text) against float64 references.

tests/reference_feedback.py computes DeltaFormer's u_t token by token from its recursive definition and PaTH's
logits from explicit [D, D] Householder products per query-key pair (no triangular solve, no UT transform, no
block). Shapes use GQA (4 query heads on 2 key heads); PaTH runs with blocks smaller than the sequence.
Tolerances: fp32 mixer vs float64 reference ``REL_FP32`` (1e-5, relative to the largest reference value); float64
gradients of q, k, v, the layer input and every parameter ``REL_GRAD`` (1e-8); fp32 forms (cached prefill, steps,
prefill in pieces, padded rows alone) vs the fp32 parallel form ``REL_FORMS`` (1e-5).
"""

from __future__ import annotations

import mixer_checks as checks
import pytest
import torch
from mixer_checks import BATCH, PAD, SHAPE
from mixer_steps import left_padded
from reference import real_rows, rel_err, softmax_attention
from reference_feedback import deltaformer_reference, path_reference

from hf_recattn.modeling.mixer_base import MixerInputs
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
#: (family, options): DeltaFormer with and without the write strength, PaTH in blocks of 4 and 3 and in one block
CASES = [
    ("softmax_delta", {"write_strength": "none"}),
    ("softmax_delta", {"write_strength": "sigmoid", "key_scale": 0.7}),
    ("softmax_householder", {"chunk_size": 4}),
    ("softmax_householder", {"chunk_size": 3, "rope": False}),
    ("softmax_householder", {"chunk_size": 64}),
]
CASE_IDS = ["softmax_delta", "deltaformer-sigmoid", "path-c4", "path-c3", "path-c64"]


def make_mixer(family: str, options: dict, dtype=torch.float32):
    """A mixer with every parameter moved to random values (PaTH's b spread over (0, 2))."""
    mixer = build_mixer(validate_spec({"mixer": family, **options}, "test"), SHAPE)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, param in sorted(mixer.named_parameters()):
            param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    return mixer.to(dtype)


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return checks.random_inputs(SHAPE, seq_len, dtype, seed)


def reference(mixer, q, k, v, x, mask, initial=None, live: bool = False):
    """The family's reference with the mixer's parameters (live ones keep autograd, for gradient checks)."""

    def get(name: str):
        value = getattr(mixer, name, None)
        return value if value is None or live else value.detach().double()

    if mixer.name == "softmax_delta":
        return deltaformer_reference(q, k, v, x, mask, mixer.scale, mixer.key_scale, get("beta_weight"),
                                     get("beta_bias"), initial)
    return path_reference(q, k, v, x, mask, mixer.scale, get("w_weight"), get("beta_weight"), get("beta_bias"),
                          mixer.eps, initial)


def random_cache(mixer, length: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    cache = {name: torch.randn(BATCH, SHAPE.num_kv_heads, length, SHAPE.head_dim, generator=gen).to(dtype)
             for name in mixer.init_state(1, torch.device("cpu"), dtype) if name != "stamp"}
    if mixer.name == "softmax_householder":  # the keys are carried to the last cached token
        cache["stamp"] = torch.zeros(BATCH, 1, length, dtype=dtype)
        cache["stamp"][:, :, -1] = 1.0
    return cache


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("family,options", CASES, ids=CASE_IDS)
def test_parallel_matches_reference(family: str, options: dict, padded: bool) -> None:
    seq_len = 10
    mixer = make_mixer(family, options)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    expected, _ = reference(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32


@pytest.mark.parametrize("family,options", CASES, ids=CASE_IDS)
def test_gradients_match_reference(family: str, options: dict) -> None:
    """float64: gradients of q, k, v, the layer input and every parameter, left-padded batch."""
    seq_len = 7
    mixer = make_mixer(family, options, torch.float64)
    names = dict(mixer.named_parameters())
    checks.assert_gradients_match(mixer, lambda qkvx, mask: reference(mixer, *qkvx, mask, live=True)[0], seq_len,
                                  REL_GRAD, unused=() if names else {"x"})  # seed DeltaFormer reads no x
    expected_params = {"softmax_delta": {"beta_bias", "beta_weight"} if options.get("write_strength") == "sigmoid"
                       else set(), "softmax_householder": {"beta_bias", "beta_weight", "w_weight"}}[family]
    assert set(names) == expected_params


@pytest.mark.parametrize("family,options", CASES, ids=CASE_IDS)
def test_prefill_and_steps_match_parallel(family: str, options: dict) -> None:
    """Left padding longer than a block: a fresh chunked prefill, token steps, a cached prefill + steps and a
    prefill in three pieces give the parallel outputs and the same cache."""
    seq_len = 11
    mixer = make_mixer(family, options)
    inputs = q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, 6)
    parallel, chunk_state = checks.assert_forms_agree(mixer, inputs, mask, REL_FORMS)
    parallel = real_rows(parallel, mask)
    for name in chunk_state:
        assert chunk_state[name].shape[2] == seq_len
    outs, state = [], None
    for lo, hi in ((0, 4), (4, 9), (9, 11)):
        inputs = MixerInputs(x[:, lo:hi], mask[:, :hi], lo)
        out, state = mixer(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], inputs, state, use_cache=True)
        outs.append(out)
    assert rel_err(real_rows(torch.cat(outs, dim=1), mask), parallel) <= REL_FORMS
    for name in chunk_state:
        assert rel_err(state[name], chunk_state[name]) <= REL_FORMS, name


@pytest.mark.parametrize("family,options", CASES, ids=CASE_IDS)
def test_from_a_cache_matches_reference(family: str, options: dict) -> None:
    """From a random cache of 4 tokens (keys and u's / carried keys and values): prefill and steps against the
    reference fed the same cache, outputs and final caches."""
    seq_len = 6
    mixer = make_mixer(family, options)
    inputs = q, k, v, x = make_inputs(seq_len, seed=2)
    cache = random_cache(mixer, 4)
    expected, expected_cache = reference(mixer, q, k, v, x, None, initial=cache)
    checks.assert_continues_from_state(mixer, inputs, cache, expected, expected_cache, REL_FP32, past=4)


@pytest.mark.parametrize("family,options", CASES[1:3], ids=CASE_IDS[1:3])
def test_left_padding_changes_nothing(family: str, options: dict) -> None:
    """A left-padded row gives the outputs of the same tokens alone (padded tokens neither seen nor applied)."""
    mixer = make_mixer(family, options)
    # the cached real tokens (axis 2) are those of the row alone
    checks.assert_left_padding_changes_nothing(mixer, make_inputs(9), PAD, REL_FORMS, cache_axis=2)


@pytest.mark.parametrize("family", ["softmax_delta", "softmax_householder"])
def test_no_feedback_is_softmax(family: str) -> None:
    """b -> 0 (DeltaFormer's write strength, PaTH's Householders) gives plain softmax attention; Su's text
    DeltaFormer (b = 1) and PaTH at b ~ 1 do not."""
    seq_len = 8
    options = {"write_strength": "sigmoid"} if family == "softmax_delta" else {"chunk_size": 4}
    mixer = make_mixer(family, options)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD)
    plain = softmax_attention(q, k, v, mask)
    with torch.no_grad():
        mixer.beta_weight.zero_()
        mixer.beta_bias.fill_(-60.0)
    assert rel_err(real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask), real_rows(plain, mask)) <= 1e-5
    with torch.no_grad():
        mixer.beta_bias.fill_(0.0)
    if family == "softmax_delta":
        mixer = make_mixer(family, {})
    changed = real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask)
    assert rel_err(changed, real_rows(plain, mask)) > 1e-2


def test_path_reflections_are_orthogonal_rope_like() -> None:
    """b = 2 (reflections, Su's eqs. 31-33): R_{i,j} = R_i R_j^T with R_i = H_i ... H_1 orthogonal, so the
    logits are those of plain softmax on R_i^T q_i and R_j^T k_j (an absolute, RoPE-like encoding)."""
    seq_len = 7
    mixer = make_mixer("softmax_householder", {"chunk_size": 3, "eps": 0.0}, torch.float64)  # exactly unit w
    with torch.no_grad():
        mixer.beta_weight.zero_()
        mixer.beta_bias.fill_(80.0)  # 2 sigmoid(80) = 2 in float64
    q, k, v, x = make_inputs(seq_len, torch.float64)
    w, b = mixer.householders(MixerInputs(x))
    assert torch.allclose(b, torch.full_like(b, 2.0))
    eye = torch.eye(SHAPE.head_dim, dtype=torch.float64)
    qa, ka = q.clone(), k.clone()
    for bi in range(BATCH):
        for hk in range(SHAPE.num_kv_heads):
            r = eye
            for t in range(seq_len):
                r = (eye - 2.0 * torch.outer(w[bi, hk, t], w[bi, hk, t])) @ r  # R_t = H_t ... H_1
                ka[bi, hk, t] = r.T @ k[bi, hk, t]
                for h in range(2 * hk, 2 * hk + 2):
                    qa[bi, h, t] = r.T @ q[bi, h, t]
    want = softmax_attention(qa, ka, v)
    assert rel_err(mixer.parallel(q, k, v, MixerInputs(x)), want) <= 1e-10


def test_convert_init() -> None:
    """init=convert starts with b = beta_init for every token (w_b = 0); scratch draws N(0, initializer_range)."""
    from transformers import initialization as init

    for family, scale in (("softmax_delta", 1.0), ("softmax_householder", 2.0)):
        options = {"write_strength": "sigmoid"} if family == "softmax_delta" else {}
        spec = validate_spec({"mixer": family, "init": "convert", "beta_init": 0.05, **options}, "t")
        mixer = build_mixer(spec, SHAPE)
        for param in mixer.parameters():
            param.data.normal_()
        mixer.init_parameters(init)
        assert mixer.beta_weight.abs().max() == 0
        assert torch.allclose(scale * torch.sigmoid(mixer.beta_bias), torch.full((2,), 0.05))
        scratch = build_mixer(validate_spec({"mixer": family, **options}, "t"), SHAPE)
        scratch.init_parameters(init)
        assert 0 < scratch.beta_weight.std() < 0.1 and scratch.beta_bias.abs().max() == 0
    assert not list(build_mixer(validate_spec("softmax_delta", "t"), SHAPE).parameters())


@pytest.mark.parametrize("family", ["softmax_delta", "softmax_householder"])
def test_state_size_counts_the_cache(family: str) -> None:
    mixer = make_mixer(family, {})
    q, k, v, x = make_inputs(5)
    _, state = mixer(q, k, v, MixerInputs(x), use_cache=True)
    held = sum(t[:1].numel() for t in state.values())
    per_token = 2 * 2 * 8 + (1 if family == "softmax_householder" else 0)  # keys and u's / values (+ PaTH's stamp)
    assert mixer.state_kind == "kv" and held == mixer.state_size(5) == per_token * 5
    assert mixer.state_size(1000) == 200 * mixer.state_size(5)


def test_crop_is_exact_for_deltaformer_and_refused_for_path() -> None:
    """DeltaFormer's cached keys and u's of earlier tokens do not depend on later ones: a cropped cache continues
    exactly. PaTH's cached keys carry every later Householder: the next forward refuses a cropped cache."""
    from hf_recattn.modeling.cache import MixerStateLayer

    q, k, v, x = make_inputs(8)
    for family in ("softmax_delta", "softmax_householder"):
        mixer = make_mixer(family, {"chunk_size": 4} if family == "softmax_householder" else {})
        layer = MixerStateLayer("kv", 5)
        layer.update(mixer(q[:, :, :7], k[:, :, :7], v[:, :, :7], MixerInputs(x[:, :7]), use_cache=True)[1], 7)
        layer.crop(-2)
        one = (q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], MixerInputs(x[:, 7:], None, 5))
        if family == "softmax_householder":
            with pytest.raises(ValueError, match=r"layer 5 \(path\): the cache was cropped"):
                mixer.step(*one, layer.state)
            continue
        got, _ = mixer.step(*one, layer.state)
        _, fresh = mixer(q[:, :, :5], k[:, :, :5], v[:, :, :5], MixerInputs(x[:, :5]), use_cache=True)
        assert rel_err(got, mixer.step(*one, fresh)[0]) <= REL_FORMS


def test_presets() -> None:
    seed = validate_spec("deltaformer", "t")
    assert seed["mixer"] == "softmax_delta" and seed["write_strength"] == "none" and seed["rope"]
    path = validate_spec("path", "t")
    assert path["mixer"] == "softmax_householder" and path["rope"] is False
    assert validate_spec("softmax_householder", "t")["rope"] is True  # the family keeps RoPE underneath by default


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        *(({"mixer": family, "causal": False}, "layer 3", rf"layer 3: option 'causal' must be True \({family} has no")
          for family in ("softmax_delta", "softmax_householder")),
        ({"mixer": "softmax_delta", "beta_init": 1.0}, "layer 1", r"layer 1: option 'beta_init' must be in \(0, 1\)"),
        ({"mixer": "softmax_householder", "beta_init": 2.0}, "layer 1",
         r"layer 1: option 'beta_init' must be in \(0, 2\)"),
        ({"mixer": "softmax_delta", "write_strength": "tanh"}, "layer 2",
         r"layer 2: option 'write_strength' must be one of"),
        ({"mixer": "softmax_householder", "chunk_size": 0}, "layer 2", r"layer 2: option 'chunk_size' must be >= 1"),
    ])
