"""ALiBi and FoX forgetting in the softmax and sliding_window mixers, against tests/reference_forget.py.

Tolerances: fp32 forms vs the float64 reference ``REL_FP32`` (relative to the largest output); float64
gradients (q, k, v, the layer input and the FoX gate parameters) vs the reference's autograd ``REL_GRAD``
(``REL_GRAD_EAGER`` for eager, whose softmax runs in float32); a FoX model converted from a tiny Llama vs the
teacher's fp32 logits: max abs ``ATOL_CONVERT`` (the issue's 1e-4).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mixer_checks import assert_gradients_match, random_inputs
from mixer_steps import left_padded
from reference import real_rows, rel_err
from reference_forget import alibi_log_forget, forget_softmax_attention, fox_log_forget

from hf_recattn import from_teacher
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixer_softmax import FOX_LOSSLESS_BIAS, alibi_slopes
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 2e-5
REL_GRAD = 1e-8
REL_GRAD_EAGER = 1e-6
ATOL_CONVERT = 1e-4

BATCH, HIDDEN, PAD = 2, 32, 3
SHAPE = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=2)
IMPLS = ("eager", "sdpa")
FORGETS = ("alibi", "fox")
#: (mixer, window): window 3 is shorter than the sequences and the prefill pieces below
WINDOWS = [("softmax", None), ("sliding_window", 3)]
WINDOW_IDS = ["softmax", "window3"]


def make_mixer(name: str, window: int | None, forget: str, impl: str = "sdpa", **options: object):
    spec = {"mixer": name, "forget": forget, **options}
    if window is not None:
        spec["window"] = window
    config = SimpleNamespace(_attn_implementation=impl, attention_dropout=0.0)
    mixer = build_mixer(validate_spec(spec, "test"), SHAPE, config)
    if forget == "fox":  # a gate that really forgets and depends on the input
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            mixer.fox_weight.copy_(2 * torch.randn(mixer.fox_weight.shape, generator=gen))
            mixer.fox_bias.copy_(torch.tensor([0.0, 1.0, 2.0, 4.0]))
    return mixer


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return random_inputs(SHAPE, seq_len, dtype, seed, q_scale=2.0)


def piece(x: torch.Tensor, mask: torch.Tensor | None, start: int, stop: int) -> MixerInputs:
    return MixerInputs(
        hidden_states=x[:, start:stop],
        padding_mask=None if mask is None else mask[:, :stop],
        past_length=start,
    )


def expected(mixer, q, k, v, x, mask, window):  # noqa: ANN001, ANN201
    if mixer.forget == "alibi":
        log_f = alibi_log_forget(alibi_slopes(SHAPE.num_heads), BATCH, q.shape[2])
    else:
        log_f = fox_log_forget(x, mixer.fox_weight, mixer.fox_bias)
    return forget_softmax_attention(q, k, v, log_f, mask, window)


def test_alibi_slopes_follow_the_paper_schedule() -> None:
    assert alibi_slopes(4) == [2**-2, 2**-4, 2**-6, 2**-8]
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    # not a power of two: the 4-head slopes, then every other slope of the 8-head schedule
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("forget", FORGETS)
@pytest.mark.parametrize("name,window", WINDOWS, ids=WINDOW_IDS)
def test_parallel_matches_reference(name: str, window: int | None, forget: str, impl: str, padded: bool) -> None:
    seq_len = 9
    mixer = make_mixer(name, window, forget, impl)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    out = mixer.parallel(q, k, v, piece(x, mask, 0, seq_len))
    want = expected(mixer, q, k, v, x, mask, window)
    assert rel_err(real_rows(out, mask), want) <= REL_FP32
    assert torch.isfinite(out).all()
    plain = forget_softmax_attention(q, k, v, torch.zeros(BATCH, SHAPE.num_heads, seq_len), mask, window)
    assert rel_err(want, plain) > 1e-2  # the forget factors matter in this test


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("forget", FORGETS)
@pytest.mark.parametrize("name,window", WINDOWS, ids=WINDOW_IDS)
def test_prefill_then_steps_match_reference(
    name: str, window: int | None, forget: str, impl: str, padded: bool
) -> None:
    """forward() with a cache: prefill 5, then 4 (padding spans both), then single steps."""
    seq_len = 12
    mixer = make_mixer(name, window, forget, impl)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, 6) if padded else None
    state, outs, past = None, [], 0
    for n in (5, 4, 1, 1, 1):
        sl = slice(past, past + n)
        o, state = mixer(q[:, :, sl], k[:, :, sl], v[:, :, sl], piece(x, mask, past, past + n), state, True)
        outs.append(o)
        past += n
    assert state["forget"].shape == (BATCH, SHAPE.num_heads, seq_len if window is None else window - 1)
    assert state["forget"].dtype == torch.float32 and state["forget"][..., -1].abs().max() == 0
    want = expected(mixer, q, k, v, x, mask, window)
    assert rel_err(real_rows(torch.cat(outs, dim=1), mask), want) <= REL_FP32


@pytest.mark.parametrize("forget", FORGETS)
@pytest.mark.parametrize("name,window", WINDOWS, ids=WINDOW_IDS)
def test_token_by_token_and_after_a_crop(name: str, window: int | None, forget: str) -> None:
    """Steps from an empty state; then the state cut back to 5 tokens (as a cache crop does) continues right."""
    seq_len = 8
    mixer = make_mixer(name, window, forget, "sdpa")
    q, k, v, x = make_inputs(seq_len)
    state, outs = mixer.init_state(BATCH, q.device, q.dtype), []
    snapshot = None
    for t in range(seq_len):
        o, state = mixer.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], piece(x, None, t, t + 1),
                              state)
        outs.append(o)
        if t == 6:
            snapshot = state
    want = expected(mixer, q, k, v, x, None, window)
    assert rel_err(torch.cat(outs, dim=1), want) <= REL_FP32
    if window is None:  # crop 7 -> 5 tokens on axis 2 of every tensor, then redo tokens 5..7
        state = {name_: t[:, :, :5] for name_, t in snapshot.items()}
        redo = []
        for t in range(5, seq_len):
            o, state = mixer.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                  piece(x, None, t, t + 1), state)
            redo.append(o)
        assert rel_err(torch.cat(redo, dim=1), want[:, 5:]) <= REL_FP32


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("forget", FORGETS)
@pytest.mark.parametrize("name,window", WINDOWS, ids=WINDOW_IDS)
def test_gradients_match_reference(name: str, window: int | None, forget: str, impl: str) -> None:
    seq_len = 6
    mixer = make_mixer(name, window, forget, impl).double()
    tol = REL_GRAD if impl == "sdpa" else REL_GRAD_EAGER
    unused = () if forget == "fox" else {"x"}  # only FoX's gate reads the layer input
    got = assert_gradients_match(mixer, lambda qkvx, mask: expected(mixer, *qkvx, mask, window), seq_len, tol,
                                 unused=unused, q_scale=2.0)
    assert set(got) == {"q", "k", "v", "x"} | ({"fox_bias", "fox_weight"} if forget == "fox" else set())
    if forget == "fox":  # padded tokens feed no gate: their inputs get no gradient
        assert got["x"][1, :PAD].abs().max() == 0 and got["x"][1, PAD:].abs().max() > 0


def test_padded_tokens_add_no_forget_factor() -> None:
    """A left-padded row equals the same tokens unpadded, whatever the padded tokens' inputs are."""
    seq_len = 9
    mixer = make_mixer("softmax", None, "fox")
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD)
    out = mixer.parallel(q, k, v, piece(x, mask, 0, seq_len))
    x2 = x.clone()
    x2[1, :PAD] = 100.0  # would close every gate (f -> 0) if padded tokens counted
    assert rel_err(mixer.parallel(q, k, v, piece(x2, mask, 0, seq_len))[1, PAD:], out[1, PAD:]) == 0
    alone = mixer.parallel(q[1:, :, PAD:], k[1:, :, PAD:], v[1:, :, PAD:], MixerInputs(x[1:, PAD:]))
    assert rel_err(alone[0], out[1, PAD:]) <= 1e-6


def test_default_fox_starts_as_plain_softmax_and_is_trainable() -> None:
    seq_len = 9
    config = SimpleNamespace(_attn_implementation="sdpa", attention_dropout=0.0)
    fox = build_mixer(validate_spec({"mixer": "softmax", "forget": "fox"}, "t"), SHAPE, config)
    plain = build_mixer(validate_spec({"mixer": "softmax"}, "t"), SHAPE, config)
    assert torch.equal(fox.fox_bias.detach(), torch.full((4,), FOX_LOSSLESS_BIAS))
    assert fox.fox_weight.abs().max() == 0
    assert torch.sigmoid(torch.tensor(FOX_LOSSLESS_BIAS)) == 1.0  # f = 1 exactly in fp32
    q, k, v, x = make_inputs(seq_len)
    out = fox.parallel(q, k, v, piece(x, None, 0, seq_len))
    assert rel_err(out, plain.parallel(q, k, v, piece(x, None, 0, seq_len))) <= 1e-6
    out.square().sum().backward()
    assert fox.fox_bias.grad.abs().max() > 0 and fox.fox_weight.grad.abs().max() > 0


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fox_converts_a_llama_losslessly(impl: str, padded: bool) -> None:
    from test_from_teacher import batch, llama, max_diff_real

    teacher = llama(impl)
    x, mask = batch(padded, length=16)
    with torch.no_grad():
        want = teacher(x, attention_mask=mask).logits
        for spec in ({"mixer": "softmax", "forget": "fox"}, {"mixer": "sliding_window", "window": 64,
                                                             "forget": "fox"}):
            student = from_teacher(teacher, attention=spec)
            assert max_diff_real(student(x, attention_mask=mask).logits, want, mask) <= ATOL_CONVERT
        alibi = from_teacher(teacher, attention={"mixer": "softmax", "forget": "alibi"})
        assert max_diff_real(alibi(x, attention_mask=mask).logits, want, mask) > 1e-3  # ALiBi changes logits


@pytest.mark.parametrize("forget,per_token_extra", [("none", 0), ("alibi", 4), ("fox", 4)])
def test_state_size_counts_one_float_per_cached_key_and_head(forget: str, per_token_extra: int) -> None:
    kv = 2 * SHAPE.num_kv_heads * SHAPE.head_dim
    full = make_mixer("softmax", None, forget)
    window = make_mixer("sliding_window", 3, forget)
    assert full.state_size(100) == 100 * (kv + per_token_extra)
    assert window.state_size(100) == 2 * (kv + per_token_extra)
    state = full.init_state(BATCH, torch.device("cpu"), torch.bfloat16)
    assert ("forget" in state) is (forget != "none")
    if forget != "none":
        assert state["forget"].dtype == torch.float32  # never bf16: it is a running sum


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"mixer": "softmax", "forget": "alibi", "alibi_slopes": [0.5, -0.1, 0.2, 0.1]}, r"layer 7: .*'alibi_slopes'"),
        ({"mixer": "softmax", "forget": "alibi", "alibi_slopes": [0.5, "x", 0.2, 0.1]}, r"layer 7: .*'alibi_slopes'"),
        ({"mixer": "softmax", "forget": "alibi", "alibi_slopes": [float("inf")] * 4}, r"layer 7: .*'alibi_slopes'"),
        ({"mixer": "softmax", "forget": "fox", "alibi_slopes": [0.5] * 4}, r"layer 7: option 'alibi_slopes' needs"),
        ({"mixer": "softmax", "fox_bias_init": 3.0}, r"layer 7: option 'fox_bias_init' needs forget='fox'"),
        ({"mixer": "sliding_window", "forget": "fox", "fox_bias_init": float("nan")}, r"layer 7: .*'fox_bias_init'"),
        ({"mixer": "softmax", "forget": "xpos"}, r"layer 7: option 'forget' must be one of"),
        ({"mixer": "softmax", "forget": True}, r"layer 7: option 'forget' must be str"),
        ({"mixer": "linear", "forget": "fox"}, r"layer 7: unknown option\(s\) \['forget'\] for mixer 'linear'"),
        ({"mixer": "hybrid", "forget": "alibi"}, r"layer 7: unknown option\(s\) \['forget'\] for mixer 'hybrid'"),
    ],
)
def test_bad_specs_name_layer_and_option(spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_spec(spec, "layer 7")


def test_wrong_number_of_slopes_names_the_layer() -> None:
    spec = validate_spec({"mixer": "softmax", "forget": "alibi", "alibi_slopes": [0.5, 0.25]}, "layer 2")
    with pytest.raises(ValueError, match=r"layer 2 \(softmax\): option 'alibi_slopes' has 2 slopes for 4"):
        build_mixer(spec, SHAPE, None)


def test_explicit_slopes_are_used() -> None:
    seq_len = 6
    slopes = [0.0, 0.3, 1.0, 2.5]
    mixer = make_mixer("softmax", None, "alibi", alibi_slopes=slopes)
    q, k, v, x = make_inputs(seq_len)
    want = forget_softmax_attention(q, k, v, alibi_log_forget(slopes, BATCH, seq_len))
    assert rel_err(mixer.parallel(q, k, v, piece(x, None, 0, seq_len)), want) <= REL_FP32


@pytest.mark.slow
def test_fox_converts_the_embedded_teacher_losslessly() -> None:
    from hf_recattn.conversion.teacher import load_teacher

    model, tokenizer = load_teacher("embedded")
    ids = tokenizer("The key idea of attention is that every token looks back at " * 16, return_tensors="pt")
    ids = ids.input_ids[:, :256]
    student = from_teacher(model, {"mixer": "softmax", "forget": "fox"})
    with torch.no_grad():
        diff = (student(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= ATOL_CONVERT, diff
