"""Linear attention (every feature map x every normalize) against the float64 reference in tests/reference.py.

Tolerances: fp32 mixer vs float64 reference ``REL_FP32`` (relative to the largest output); float64 gradients
vs the reference's autograd gradients ``REL_GRAD``; fp32 chunked / step / prefill vs fp32 parallel
``REL_FORMS``.
"""

from __future__ import annotations

import pytest
import torch
from reference import linear_attention, real_rows, rel_err

from hf_recattn.modeling.feature_maps import FeatureMap
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

FEATURE_MAPS = ("identity", "elu", "relu", "cosine", "exp", "hedgehog", "taylor2")
NORMALIZES = ("denominator", "l2", "rms", "layernorm")
REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5

BATCH, HIDDEN = 2, 32
SHAPE = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=3)
PAD = 3  # left padding of the second row


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Tiny tensors: extra threads only add synchronization (very slow on a busy 2-core machine)."""
    torch.set_num_threads(1)


def make_mixer(feature_map: str, normalize: str, dtype: torch.dtype = torch.float32, **options: object):
    """A linear mixer whose learnable parameters are moved away from their (symmetric) initial values."""
    spec = validate_spec(
        {"mixer": "linear", "feature_map": feature_map, "normalize": normalize, **options}, "test"
    )
    mixer = build_mixer(spec, SHAPE)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
            assert name in {
                "feature_map.log_temperature",
                "feature_map.q_weight",
                "feature_map.k_weight",
                "output_norm.weight",
            }, name
    return mixer.to(dtype)


#: maps whose kernel can be negative: the plain denominator sum can cross zero (ill-conditioned, not a bug)
SIGNED_MAPS = ("identity", "cosine")


def make_qkv(
    feature_map: str,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    normalize: str = "denominator",
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SHAPE.num_heads, seq_len, SHAPE.head_dim, generator=gen)
    k = torch.randn(BATCH, SHAPE.num_kv_heads, seq_len, SHAPE.head_dim, generator=gen)
    v = torch.randn(BATCH, SHAPE.num_kv_heads, seq_len, SHAPE.head_dim, generator=gen)
    if (
        feature_map in SIGNED_MAPS and normalize == "denominator"
    ):  # keep q.k > 0: a well-conditioned denominator
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return q.to(dtype), k.to(dtype), v.to(dtype)


def left_padding(seq_len: int, pad: int = PAD) -> torch.Tensor:
    mask = torch.ones(BATCH, seq_len, dtype=torch.bool)
    mask[1, :pad] = False
    return mask


def inputs_for(seq_len: int, mask: torch.Tensor | None, past: int = 0, dtype=torch.float32) -> MixerInputs:
    """Mixer inputs for tokens past..past+seq_len; ``mask`` covers all tokens so far."""
    return MixerInputs(
        hidden_states=torch.zeros(BATCH, seq_len, HIDDEN, dtype=dtype),
        padding_mask=None if mask is None else mask[:, : past + seq_len],
        past_length=past,
    )


def reference(mixer, q, k, v, mask, causal: bool = True) -> torch.Tensor:
    fm = mixer.feature_map
    params = {
        name: getattr(fm, name) for name in ("log_temperature", "q_weight", "k_weight") if hasattr(fm, name)
    }
    gain = mixer.output_norm.weight if mixer.output_norm is not None else None
    return linear_attention(
        q,
        k,
        v,
        mixer.spec["feature_map"],
        params,
        mask,
        causal,
        mixer.spec["normalize"],
        mixer.spec["eps"],
        gain,
    )


# ----- values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("normalize", NORMALIZES)
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_parallel_matches_reference(feature_map: str, normalize: str, causal: bool, padded: bool) -> None:
    seq_len = 9
    mixer = make_mixer(feature_map, normalize, causal=causal)
    q, k, v = make_qkv(feature_map, seq_len, normalize=normalize)
    mask = left_padding(seq_len) if padded else None
    out = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    assert out.shape == (BATCH, seq_len, SHAPE.num_heads, SHAPE.head_dim) and out.dtype == torch.float32
    with torch.no_grad():
        expected = reference(mixer, q, k, v, mask, causal)
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_padding_changes_nothing_for_real_tokens(feature_map: str) -> None:
    """A left-padded row gives the same outputs and state as the same tokens without padding."""
    seq_len = 7
    mixer = make_mixer(feature_map, "denominator")
    q, k, v = make_qkv(feature_map, seq_len)
    mask = left_padding(seq_len)
    out, state = mixer.chunked(q, k, v, inputs_for(seq_len, mask), mixer.init_state(BATCH, q.device, q.dtype))
    tail = slice(PAD, None)
    alone, alone_state = mixer.chunked(
        q[1:, :, tail],
        k[1:, :, tail],
        v[1:, :, tail],
        MixerInputs(torch.zeros(1, seq_len - PAD, HIDDEN)),
        mixer.init_state(1, q.device, q.dtype),
    )
    assert rel_err(out[1:, tail], alone) <= REL_FORMS
    for name in state:
        assert rel_err(state[name][1:], alone_state[name]) <= REL_FORMS


def test_output_is_a_real_function_of_the_map() -> None:
    """Sanity for the test itself: different feature maps / normalizations give different outputs."""
    q, k, v = make_qkv("elu", 6)
    outs = [
        make_mixer(fm, nm).parallel(q, k, v, inputs_for(6, None))
        for fm, nm in [("elu", "denominator"), ("relu", "denominator"), ("elu", "rms"), ("taylor2", "l2")]
    ]
    for i in range(len(outs)):
        for j in range(i):
            assert rel_err(outs[i], outs[j]) > 1e-3


# ----- gradients ---------------------------------------------------------------------------------------
def _grads(fn, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = fn()
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    return list(torch.autograd.grad((out * weights).sum(), tensors, allow_unused=False))


@pytest.mark.parametrize(
    "feature_map,normalize,causal",
    [(fm, nm, True) for fm in FEATURE_MAPS for nm in NORMALIZES]
    + [(fm, "denominator", False) for fm in FEATURE_MAPS]
    + [("hedgehog", "layernorm", False), ("cosine", "l2", False)],
)
def test_gradients_match_reference(feature_map: str, normalize: str, causal: bool) -> None:
    """float64 mixer vs float64 reference: grads of q, k, v and every mixer parameter (left-padded batch)."""
    seq_len = 7
    mixer = make_mixer(feature_map, normalize, torch.float64, causal=causal)
    q, k, v = (t.requires_grad_() for t in make_qkv(feature_map, seq_len, torch.float64, normalize=normalize))
    mask = left_padding(seq_len)
    params = [p for _, p in sorted(mixer.named_parameters())]
    tensors = [q, k, v, *params]
    got = _grads(
        lambda: real_rows(mixer.parallel(q, k, v, inputs_for(seq_len, mask, dtype=torch.float64)), mask),
        tensors,
    )
    want = _grads(lambda: real_rows(reference(mixer, q, k, v, mask, causal), mask), tensors)
    names = ["q", "k", "v", *(n for n, _ in sorted(mixer.named_parameters()))]
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) <= REL_GRAD, name
    # padded keys and values receive no gradient at all
    assert got[1][1, :, :PAD].abs().max() == 0 and got[2][1, :, :PAD].abs().max() == 0


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_chunked_gradients_match_parallel(feature_map: str) -> None:
    """float64: the chunked form (chunks of 3, a ragged last one, left padding) has the parallel form's gradients
    for q, k, v and every mixer parameter."""
    seq_len = 8
    mixer = make_mixer(feature_map, "denominator", torch.float64, chunk_size=3)
    q, k, v = make_qkv(feature_map, seq_len, torch.float64)
    mask = left_padding(seq_len)
    tensors = [q, k, v, *(p for _, p in sorted(mixer.named_parameters()))]
    for t in tensors[:3]:
        t.requires_grad_()
    hidden = torch.randn(BATCH, seq_len, HIDDEN, dtype=torch.float64)
    inputs = MixerInputs(hidden_states=hidden, padding_mask=mask)
    chunked = _grads(
        lambda: real_rows(mixer.chunked(q, k, v, inputs, mixer.init_state(BATCH, q.device, q.dtype))[0], mask),
        tensors,
    )
    parallel = _grads(lambda: real_rows(mixer.parallel(q, k, v, inputs), mask), tensors)
    for got, want in zip(chunked, parallel, strict=True):
        assert rel_err(got, want) <= REL_GRAD


# ----- forms: chunked, step, prefill + steps -----------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("seq_len", [8, 11], ids=["multiple", "ragged"])
@pytest.mark.parametrize("normalize", NORMALIZES)
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_chunked_matches_parallel(feature_map: str, normalize: str, seq_len: int, padded: bool) -> None:
    mixer = make_mixer(feature_map, normalize, chunk_size=4)
    q, k, v = make_qkv(feature_map, seq_len, normalize=normalize)
    mask = left_padding(seq_len) if padded else None
    parallel = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    chunked, state = mixer.chunked(
        q, k, v, inputs_for(seq_len, mask), mixer.init_state(BATCH, q.device, q.dtype)
    )
    assert rel_err(chunked, parallel) <= REL_FORMS
    # dispatch without a cache picks the chunked form for long sequences; the result is the same function
    dispatched, none = mixer(q, k, v, inputs_for(seq_len, mask))
    assert none is None and rel_err(dispatched, parallel) <= REL_FORMS
    f = mixer.feature_map.out_dim
    assert state["S"].shape == (BATCH, SHAPE.num_kv_heads, f, SHAPE.head_dim)
    assert state["z"].shape == (BATCH, SHAPE.num_kv_heads, f)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("normalize", NORMALIZES)
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_steps_match_parallel(feature_map: str, normalize: str, padded: bool) -> None:
    seq_len = 9
    mixer = make_mixer(feature_map, normalize, chunk_size=4)
    q, k, v = make_qkv(feature_map, seq_len, normalize=normalize)
    mask = left_padding(seq_len) if padded else None
    parallel = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    state = mixer.init_state(BATCH, q.device, q.dtype)
    outs = []
    for t in range(seq_len):
        o, state = mixer.step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], inputs_for(1, mask, past=t), state
        )
        outs.append(o)
    assert rel_err(torch.cat(outs, dim=1), parallel) <= REL_FORMS
    assert state["S"].numel() == mixer.state_size(seq_len) * BATCH - state["z"].numel()


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("normalize", ["denominator", "rms"])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_prefill_in_chunks_then_steps(feature_map: str, normalize: str, padded: bool) -> None:
    """Prefill 5 tokens (chunk 4: ragged), then 4 (a full chunk), then 3 single steps, through forward()."""
    seq_len = 12
    mixer = make_mixer(feature_map, normalize, chunk_size=4)
    q, k, v = make_qkv(feature_map, seq_len, normalize=normalize)
    mask = left_padding(seq_len, pad=6) if padded else None  # padding spans the first two prefill pieces
    parallel = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    state, outs, past = None, [], 0
    for n in (5, 4, 1, 1, 1):
        piece = slice(past, past + n)
        o, state = mixer(
            q[:, :, piece],
            k[:, :, piece],
            v[:, :, piece],
            inputs_for(n, mask, past=past),
            state=state,
            use_cache=True,
        )
        outs.append(o)
        past += n
    assert rel_err(torch.cat(outs, dim=1), parallel) <= REL_FORMS


def test_bidirectional_has_no_recurrent_form() -> None:
    mixer = make_mixer("elu", "denominator", causal=False, chunk_size=2)
    q, k, v = make_qkv("elu", 5)
    # long sequence without a cache: still the bidirectional parallel form (the last token sees the first)
    out, _ = mixer(q, k, v, inputs_for(5, None))
    assert rel_err(out, mixer.parallel(q, k, v, inputs_for(5, None))) == 0
    # a fresh sequence with a cache (a training forward with use_cache=True): the same, and no state to keep
    cached, state = mixer(q, k, v, inputs_for(5, None), state=None, use_cache=True)
    assert state is None and rel_err(cached, out) == 0
    # continuing a sequence is impossible: a clear error, never a silent restart
    with pytest.raises(ValueError, match=r"layer 3.*causal=False has no recurrent form"):
        mixer(q[:, :, :1], k[:, :, :1], v[:, :, :1], inputs_for(1, None, past=5), state=None, use_cache=True)
    state = mixer.init_state(BATCH, q.device, q.dtype)
    for form in (mixer.chunked, mixer.step):
        with pytest.raises(ValueError, match=r"layer 3.*causal=False"):
            form(q, k, v, inputs_for(5, None), state)


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_state_is_fixed_size(feature_map: str) -> None:
    mixer = make_mixer(feature_map, "denominator")
    d = SHAPE.head_dim
    f = {"hedgehog": 2 * d, "taylor2": 1 + d + d * (d + 1) // 2}.get(feature_map, d)
    assert mixer.state_size(10) == mixer.state_size(10_000) == SHAPE.num_kv_heads * f * (d + 1)
    state = mixer.init_state(3, torch.device("cpu"), torch.float32)
    assert sum(t.numel() for t in state.values()) == 3 * mixer.state_size(1)


@pytest.mark.parametrize("normalize", NORMALIZES)
def test_exp_map_is_stable_for_large_inputs(normalize: str) -> None:
    """Queries up to ~300 (exp overflows fp32 at 89), keys past the clamp (40): finite, as the reference."""
    seq_len = 6
    mixer = make_mixer("exp", normalize)
    q, k, v = make_qkv("exp", seq_len)
    q, k = 80.0 * q, 30.0 * k
    assert q.abs().max() > 89 and k.max() > 40
    out = mixer.parallel(q, k, v, inputs_for(seq_len, None))
    assert torch.isfinite(out).all()
    expected = reference(mixer, q, k, v, None)
    assert rel_err(out, expected) <= REL_FP32
    steps, state = [], mixer.init_state(BATCH, q.device, q.dtype)
    for t in range(seq_len):
        o, state = mixer.step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], inputs_for(1, None, t), state
        )
        steps.append(o)
    assert rel_err(torch.cat(steps, dim=1), out) <= REL_FORMS


def test_taylor2_features_are_the_same_from_slices_and_from_gathers() -> None:
    """Many rows build taylor2's features from contiguous slices, a decode step's few rows by two gathers; both
    give phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d)."""
    d = 8
    feature_map = FeatureMap("taylor2", MixerShape(32, 4, 2, d, 0))
    x = torch.randn(2, 2, 20, d, dtype=torch.float64)
    many = feature_map(x, is_query=False)
    few = torch.cat([feature_map(x[:, :, i : i + 1], is_query=False) for i in range(20)], dim=2)
    torch.testing.assert_close(many, few, rtol=0, atol=1e-15)
    s = (x[:, :, :1] * x).sum(-1) / d**0.5
    torch.testing.assert_close((many[:, :, :1] * many).sum(-1), 1 + s + s**2 / 2)

