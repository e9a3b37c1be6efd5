"""The heinsen mixer (Heinsen, arXiv:2404.05843): log-space sums, signed values, extreme logits, every form vs
float64."""

from __future__ import annotations

import pytest
import torch
from mixer_steps import left_padded, run_chunked, run_steps
from reference_recurrent_softmax import cache_mismatch, heinsen_attention, real_rows, rel_err

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.modeling.ops_heinsen import chunk_log_weights

H, HKV, D, C = 4, 2, 8, 16
PAD = 3


def make(**options: object):
    return build_mixer(validate_spec({"mixer": "heinsen", **options}, "layer 1"), MixerShape(C, H, HKV, D, 1))


def data(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0, bound: float | None = None):
    """Gaussian q, k (or uniform in [-bound, bound]) and signed values."""
    gen = torch.Generator().manual_seed(seed)
    if bound is None:
        q = torch.randn(2, H, seq_len, D, generator=gen, dtype=torch.float64)
        k = torch.randn(2, HKV, seq_len, D, generator=gen, dtype=torch.float64)
    else:
        q = (torch.rand(2, H, seq_len, D, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        k = (torch.rand(2, HKV, seq_len, D, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    v = torch.randn(2, HKV, seq_len, D, generator=gen, dtype=torch.float64)
    x = torch.randn(2, seq_len, C, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), x.to(dtype)




@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.35])
def test_parallel_matches_reference(causal: bool, padded: bool, scale: float) -> None:
    mixer = make(causal=causal, scale=scale)
    q, k, v, x = data(10)
    mask = left_padded(10) if padded else None
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    assert out.shape == (2, 10, H, D)
    assert rel_err(real_rows(out, mask), heinsen_attention(q, k, v, mask, causal, scale)) < 1e-5


@pytest.mark.parametrize("bound", [20.0, 80.0])
def test_extreme_logits_stay_finite_and_exact_in_fp32(bound: float) -> None:
    """q and k entries up to +-bound: exp overflows fp32 beyond 88, sums of exp(q + k) far earlier."""
    q, k, v, x = data(16, bound=bound, seed=4)
    mask = left_padded(16)
    inputs = MixerInputs(x, mask)
    expected = heinsen_attention(q, k, v, mask)
    mixer = make(chunk_size=5)
    forms = {
        "parallel": mixer.parallel(q, k, v, inputs),
        "chunked": mixer.chunked(q, k, v, inputs, mixer.init_state(2, q.device, q.dtype))[0],
        "steps": run_steps(mixer, q, k, v, x, mask)[0],
    }
    # log-weights reach ~2 * bound; fp32 spacing there (1.5e-5 at 160) bounds the attainable accuracy
    tol = 1e-5 if bound <= 20 else 2e-5
    for name, out in forms.items():
        assert torch.isfinite(out).all(), name
        assert rel_err(real_rows(out, mask), expected) < tol, name
    bidirectional = make(causal=False).parallel(q, k, v, inputs)
    assert torch.isfinite(bidirectional).all()
    assert rel_err(real_rows(bidirectional, mask), heinsen_attention(q, k, v, mask, causal=False)) < tol


def test_extreme_logits_have_finite_gradients() -> None:
    q, k, v, x = data(12, bound=80.0, seed=5)
    v[:, :, 2] = 0.0  # exact zeros: log 0 on both signed parts
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mixer = make(chunk_size=5)
    inputs = MixerInputs(x, left_padded(12))
    for form in ("parallel", "chunked"):
        for t in leaves:
            t.grad = None
        if form == "parallel":
            out = mixer.parallel(*leaves, inputs)
        else:
            out = mixer.chunked(*leaves, inputs, mixer.init_state(2, q.device, q.dtype))[0]
        out.square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves), form


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(causal: bool) -> None:
    q, k, v, x = data(7, dtype=torch.float64, seed=2)
    v[0, 0, 3] = 0.0
    mask = left_padded(7)
    probe = torch.randn(2, 7, H, D, dtype=torch.float64)
    mixer = make(causal=causal, chunk_size=3)
    fns = [
        lambda a, b, c: mixer.parallel(a, b, c, MixerInputs(x, mask)),
        lambda a, b, c: heinsen_attention(a, b, c, mask, causal),
    ]
    if causal:
        fns.append(
            lambda a, b, c: mixer.chunked(
                a, b, c, MixerInputs(x, mask), mixer.init_state(2, a.device, a.dtype)
            )[0]
        )
    grads = []
    for fn in fns:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (real_rows(fn(*leaves), mask) * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    for other in grads[:1] + grads[2:]:
        for got, want in zip(other, grads[1], strict=True):
            assert rel_err(got, want) < 1e-9


@pytest.mark.parametrize("values", ["negative", "positive", "zeros", "mixed"])
def test_values_of_any_sign(values: str) -> None:
    q, k, v, x = data(9, seed=6)
    v = {"negative": -v.abs(), "positive": v.abs(), "zeros": torch.zeros_like(v), "mixed": v}[values]
    mixer = make(chunk_size=4)
    inputs = MixerInputs(x)
    out = mixer.parallel(q, k, v, inputs)
    assert torch.allclose(out, heinsen_attention(q, k, v).float(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(mixer.parallel(q, k, -v, inputs), -out, atol=1e-6)  # odd in v
    stepped, _ = run_steps(mixer, q, k, v, x, torch.ones(2, 9, dtype=torch.bool))
    assert torch.allclose(stepped, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [12, 13])
def test_chunked_and_steps_match_parallel(seq_len: int) -> None:
    mixer = make(chunk_size=4)
    q, k, v, x = data(seq_len, seed=7)
    mask = left_padded(seq_len)
    inputs = MixerInputs(x, mask)
    parallel = real_rows(mixer.parallel(q, k, v, inputs), mask)
    chunked, chunk_state = run_chunked(mixer, q, k, v, x, mask)
    stepped, step_state = run_steps(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(chunked, mask), parallel) < 1e-5
    assert rel_err(real_rows(stepped, mask), parallel) < 1e-5
    assert rel_err(real_rows(mixer(q, k, v, inputs)[0], mask), parallel) < 1e-5  # forward picks chunked
    for name in ("hz", "mean"):
        assert torch.allclose(chunk_state[name], step_state[name], rtol=1e-5, atol=1e-4)


def test_state_is_log_normalizer_and_relative_value_sums_of_fixed_size() -> None:
    mixer = make()
    q, k, v, x = data(6, dtype=torch.float64, seed=8)
    mask = left_padded(6)
    _, state = run_steps(mixer, q, k, v, x, mask)
    assert {n: tuple(t.shape) for n, t in state.items()} == {"hz": (2, HKV, D), "mean": (2, HKV, D, D)}
    assert mixer.state_size(10) == mixer.state_size(10**6) == HKV * (D * D + D)
    # H^Z = log sum over real keys of exp(k), M = sum exp(k - H^Z) v; row 1 skips its 3 padded keys
    for b, first in ((0, 0), (1, PAD)):
        ks, vs = k[b, :, first:], v[b, :, first:]
        hz = torch.logsumexp(ks, dim=1)
        assert torch.allclose(state["hz"][b], hz)
        assert torch.allclose(state["mean"][b], torch.einsum("hsd,hse->hde", (ks - hz[:, None]).exp(), vs))


def test_chunk_weights_take_the_exact_form_where_the_product_would_underflow() -> None:
    """Pairs whose factored sum is below 1e-30 switch the chunk to the all-pairs log-sum-exp; both agree
    where the product is safe."""
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 1, 2, 4, D, generator=gen), torch.randn(1, 1, 4, D, generator=gen)
    visible = torch.ones(4, 4, dtype=torch.bool).tril()
    exact = torch.logsumexp(q[..., :, None, :] + k[:, :, None, None], dim=-1)
    assert torch.allclose(chunk_log_weights(q, k[:, :, None], visible), exact, rtol=1e-6, atol=1e-5)
    q[..., 0, 0], q[..., 0, 1:] = 0.0, -200.0  # query 0 lives in dimension 0 ...
    k[..., 0, 0], k[..., 0, 1:] = -200.0, 0.0  # ... where key 0 has nothing: its one visible sum is exp(-200)
    exact = torch.logsumexp(q[..., :, None, :] + k[:, :, None, None], dim=-1)
    got = chunk_log_weights(q, k[:, :, None], visible)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[..., 0, 0], exact[..., 0, 0])
    assert torch.allclose(got, exact, rtol=1e-6, atol=1e-5)


def test_bidirectional_has_no_recurrent_form() -> None:
    mixer = make(causal=False)
    q, k, v, x = data(5)
    with pytest.raises(ValueError, match=r"layer 1 \(heinsen\): causal=False has no step form"):
        mixer.step(
            q[:, :, :1],
            k[:, :, :1],
            v[:, :, :1],
            MixerInputs(x[:, :1]),
            mixer.init_state(2, q.device, q.dtype),
        )
    with pytest.raises(ValueError, match="no chunked form"):
        mixer.chunked(q, k, v, MixerInputs(x), mixer.init_state(2, q.device, q.dtype))


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ({"scale": 0.0}, r"layer 1: option 'scale' must be > 0"),
        ({"chunk_size": 0}, r"layer 1: option 'chunk_size' must be >= 1"),
        ({"order": 2}, r"layer 1: unknown option\(s\) \['order'\]"),
    ],
)
def test_bad_specs(spec: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_spec({"mixer": "heinsen", **spec}, "layer 1")


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_model_cache_matches_full_forward(chunk_size: int) -> None:
    assert cache_mismatch({"mixer": "heinsen", "chunk_size": chunk_size}) < 1e-4
