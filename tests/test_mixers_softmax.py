"""softmax and sliding_window mixers (eager and sdpa) against the float64 reference in tests/reference.py.

Tolerances: fp32 mixer vs float64 reference ``REL_FP32`` (relative to the largest output); float64 gradients
vs the reference's autograd gradients ``REL_GRAD`` (``REL_GRAD_EAGER`` for eager); fp32 chunked / step /
prefill vs fp32 parallel ``REL_FORMS``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reference import real_rows, rel_err, softmax_attention

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
#: transformers' eager attention computes the softmax in float32 even for float64 inputs
REL_GRAD_EAGER = 1e-6
REL_FORMS = 1e-5

BATCH, HIDDEN = 2, 32
SHAPE = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=2)
PAD = 3
IMPLS = ("eager", "sdpa")
#: (mixer, window); window 3 is shorter than every prefill piece below, 1 sees only the current token
SPECS = [("softmax", None), ("sliding_window", 3), ("sliding_window", 1), ("sliding_window", 64)]
SPEC_IDS = ["softmax", "window3", "window1", "window64"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Tiny tensors: extra threads only add synchronization (very slow on a busy 2-core machine)."""
    torch.set_num_threads(1)


def make_mixer(name: str, window: int | None, impl: str):
    spec = {"mixer": name} if window is None else {"mixer": name, "window": window}
    config = SimpleNamespace(_attn_implementation=impl, attention_dropout=0.0)
    return build_mixer(validate_spec(spec, "test"), SHAPE, config)


def make_qkv(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(BATCH, SHAPE.num_heads, seq_len, SHAPE.head_dim, generator=gen)  # peaky attention
    k = torch.randn(BATCH, SHAPE.num_kv_heads, seq_len, SHAPE.head_dim, generator=gen)
    v = torch.randn(BATCH, SHAPE.num_kv_heads, seq_len, SHAPE.head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def left_padding(seq_len: int, pad: int = PAD) -> torch.Tensor:
    mask = torch.ones(BATCH, seq_len, dtype=torch.bool)
    mask[1, :pad] = False
    return mask


def inputs_for(seq_len: int, mask: torch.Tensor | None, past: int = 0, dtype=torch.float32) -> MixerInputs:
    return MixerInputs(
        hidden_states=torch.zeros(BATCH, seq_len, HIDDEN, dtype=dtype),
        padding_mask=None if mask is None else mask[:, : past + seq_len],
        past_length=past,
    )


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,window", SPECS, ids=SPEC_IDS)
def test_parallel_matches_reference(name: str, window: int | None, impl: str, padded: bool) -> None:
    seq_len = 9
    mixer = make_mixer(name, window, impl)
    q, k, v = make_qkv(seq_len)
    mask = left_padding(seq_len) if padded else None
    out = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    assert out.shape == (BATCH, seq_len, SHAPE.num_heads, SHAPE.head_dim)
    expected = softmax_attention(q, k, v, mask, window)
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32
    assert torch.isfinite(out).all()  # padded query rows too (sdpa gives NaN for a row that sees nothing)


def test_window_really_limits_attention() -> None:
    """Sanity for the test itself: a window changes the output, a window >= T does not."""
    q, k, v = make_qkv(9)
    full = make_mixer("softmax", None, "sdpa").parallel(q, k, v, inputs_for(9, None))
    assert (
        rel_err(make_mixer("sliding_window", 3, "sdpa").parallel(q, k, v, inputs_for(9, None)), full) > 1e-2
    )
    assert (
        rel_err(make_mixer("sliding_window", 9, "sdpa").parallel(q, k, v, inputs_for(9, None)), full)
        <= REL_FORMS
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,window", SPECS[:2], ids=SPEC_IDS[:2])
def test_gradients_match_reference(name: str, window: int | None, impl: str) -> None:
    seq_len = 7
    mixer = make_mixer(name, window, impl)
    q, k, v = (t.requires_grad_() for t in make_qkv(seq_len, torch.float64))
    mask = left_padding(seq_len)
    weights = torch.randn(BATCH, seq_len, SHAPE.num_heads, SHAPE.head_dim, dtype=torch.float64)

    def grads(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad((real_rows(out, mask) * weights).sum(), (q, k, v))

    got = grads(mixer.parallel(q, k, v, inputs_for(seq_len, mask, dtype=torch.float64)))
    want = grads(softmax_attention(q, k, v, mask, window))
    tol = REL_GRAD if impl == "sdpa" else REL_GRAD_EAGER
    for name_, g, w in zip("qkv", got, want, strict=True):
        assert rel_err(g, w) <= tol, name_
    assert got[1][1, :, :PAD].abs().max() == 0 and got[2][1, :, :PAD].abs().max() == 0


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,window", SPECS, ids=SPEC_IDS)
def test_steps_match_parallel(name: str, window: int | None, impl: str, padded: bool) -> None:
    seq_len = 8
    mixer = make_mixer(name, window, impl)
    q, k, v = make_qkv(seq_len)
    mask = left_padding(seq_len) if padded else None
    parallel = mixer.parallel(q, k, v, inputs_for(seq_len, mask))
    state, outs = mixer.init_state(BATCH, q.device, q.dtype), []
    for t in range(seq_len):
        o, state = mixer.step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], inputs_for(1, mask, past=t), state
        )
        outs.append(o)
        kept = state["k"].shape[2]
        assert kept == (t + 1 if window is None else min(t + 1, window - 1))
    assert rel_err(real_rows(torch.cat(outs, dim=1), mask), real_rows(parallel, mask)) <= REL_FORMS


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,window", SPECS, ids=SPEC_IDS)
def test_prefill_in_chunks_then_steps(name: str, window: int | None, impl: str, padded: bool) -> None:
    """forward() with a state: prefill 5, then 4, then single steps; padding spans the first two pieces."""
    seq_len = 12
    mixer = make_mixer(name, window, impl)
    q, k, v = make_qkv(seq_len)
    mask = left_padding(seq_len, pad=6) if padded else None
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
    got = torch.cat(outs, dim=1)
    assert rel_err(real_rows(got, mask), real_rows(parallel, mask)) <= REL_FORMS
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("name,window", SPECS, ids=SPEC_IDS)
def test_state_size(name: str, window: int | None) -> None:
    mixer = make_mixer(name, window, "sdpa")
    per_token = 2 * SHAPE.num_kv_heads * SHAPE.head_dim
    if window is None:
        assert mixer.state_kind == "kv" and mixer.state_size(1000) == 1000 * per_token
    else:
        assert mixer.state_kind == "window"
        assert mixer.state_size(10_000) == mixer.state_size(100_000) == (window - 1) * per_token


def test_unsupported_attention_implementation_is_an_error() -> None:
    mixer = make_mixer("softmax", None, "flash_attention_2")
    q, k, v = make_qkv(4)
    with pytest.raises(ValueError, match=r"layer 2.*flash_attention_2"):
        mixer.parallel(q, k, v, inputs_for(4, None))


@pytest.mark.parametrize("window", [0, -1])
def test_window_must_be_positive(window: int) -> None:
    with pytest.raises(ValueError, match=r"layer 5: option 'window'"):
        validate_spec({"mixer": "sliding_window", "window": window}, "layer 5")
