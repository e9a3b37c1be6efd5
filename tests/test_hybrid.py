"""The hybrid mixer: window softmax + linear / taylor far part, both combine rules, every form vs float64."""

from __future__ import annotations

import math

import pytest
import torch
from mixer_steps import left_padded, run_chunked, run_steps
from reference_recurrent_softmax import (
    cache_mismatch,
    hybrid_attention,
    linear_kernel,
    real_rows,
    rel_err,
    softmax_attention,
    taylor_kernel,
)

from hf_recattn.modeling.configuration import RecAttnConfig
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.state_size import state_size_report

H, HKV, D, C = 4, 2, 8, 16
PAD = 3

FARS = {
    "linear-elu": {"mixer": "linear", "feature_map": "elu"},
    "linear-hedgehog": {"mixer": "linear", "feature_map": "hedgehog"},
    "linear-relu-l2": {"mixer": "linear", "feature_map": "relu", "normalize": "l2"},
    "taylor2-exact": {"mixer": "taylor", "order": 2},
    "taylor3-l2": {"mixer": "taylor", "order": 3, "denominator": "l2"},
}
CASES = [
    ("linear-elu", "shared"),
    ("linear-hedgehog", "shared"),
    ("linear-elu", "sum"),
    ("linear-relu-l2", "sum"),
    ("taylor2-exact", "shared"),
    ("taylor3-l2", "sum"),
]


def make(far: str, combine: str, dtype: torch.dtype = torch.float32, **options: object):
    far_spec = "none" if far == "none" else FARS[far]
    spec = validate_spec({"mixer": "hybrid", "far": far_spec, "combine": combine, **options}, "layer 2")
    mixer = build_mixer(spec, MixerShape(C, H, HKV, D, 2)).to(dtype)
    with torch.no_grad():  # a different window share per head, and non-trivial output-norm gains
        mixer.mix_logit.copy_(torch.tensor([-1.0, 0.0, 0.7, 2.0], dtype=dtype))
        norm = getattr(mixer.far, "output_norm", None) if mixer.far is not None else None
        if norm is not None:
            norm.weight.add_(
                0.3 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
            )
    return mixer


def reference(mixer, q, k, v, mask):
    far = mixer.far
    if far is None:
        share = torch.sigmoid(mixer.mix_logit.detach().double())
        return hybrid_attention(q, k, v, mixer.window, None, share, mask=mask, sinks=mixer.sink_tokens)
    if far.name == "linear":
        kernel, finish = (
            linear_kernel(far.spec["feature_map"]),
            ("linear" if far.spec["normalize"] == "denominator" else far.spec["normalize"]),
        )
    else:
        kernel, finish = taylor_kernel(far.spec["order"], D**-0.5), far.spec["denominator"]
    gain = None if getattr(far, "output_norm", None) is None else far.output_norm.weight.detach()
    return hybrid_attention(
        q,
        k,
        v,
        mixer.window,
        kernel,
        torch.sigmoid(mixer.mix_logit.detach().double()),
        mixer.combine,
        finish,
        mask,
        gain,
        far.spec["eps"],
        mixer.sink_tokens,
    )


def data(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(2, H, seq_len, D, generator=gen, dtype=torch.float64)
    k = scale * torch.randn(2, HKV, seq_len, D, generator=gen, dtype=torch.float64)
    v = torch.randn(2, HKV, seq_len, D, generator=gen, dtype=torch.float64)
    x = torch.randn(2, seq_len, C, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), x.to(dtype)




def assert_gradients_match_reference(mixer, q, k, v, x, mask) -> None:
    """float64 gradients of q, k, v through the parallel and chunked forms equal the reference's (< 1e-9)."""
    probe = torch.randn(2, q.shape[2], H, D, dtype=torch.float64)
    fns = [
        lambda a, b, c: mixer.parallel(a, b, c, MixerInputs(x, mask)),
        lambda a, b, c: run_chunked(mixer, a, b, c, x, mask)[0],
        lambda a, b, c: reference(mixer, a, b, c, mask),
    ]
    grads = []
    for fn in fns:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (real_rows(fn(*leaves), mask) * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    for form in grads[:2]:
        for got, want in zip(form, grads[2], strict=True):
            assert rel_err(got, want) < 1e-9


@pytest.mark.parametrize("far, combine", CASES)
@pytest.mark.parametrize("window", [1, 3, 20])
def test_parallel_matches_reference(far: str, combine: str, window: int) -> None:
    mixer = make(far, combine, window=window)
    q, k, v, x = data(11)
    mask = left_padded(11)
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    assert out.shape == (2, 11, H, D)
    assert rel_err(real_rows(out, mask), reference(mixer, q, k, v, mask)) < 1e-5


@pytest.mark.parametrize("far, combine", [CASES[0], CASES[4], CASES[5]])
def test_gradients_match_reference(far: str, combine: str) -> None:
    mixer = make(far, combine, dtype=torch.float64, window=2, chunk_size=3)
    q, k, v, x = data(7, dtype=torch.float64)
    mask = left_padded(7)
    assert_gradients_match_reference(mixer, q, k, v, x, mask)


@pytest.mark.parametrize("far, combine", CASES)
@pytest.mark.parametrize("window", [3, 6])
@pytest.mark.parametrize("seq_len", [12, 13])
def test_chunked_and_steps_match_parallel(far: str, combine: str, window: int, seq_len: int) -> None:
    mixer = make(far, combine, window=window, chunk_size=4)
    q, k, v, x = data(seq_len, seed=1)
    mask = left_padded(seq_len)
    inputs = MixerInputs(x, mask)
    parallel = real_rows(mixer.parallel(q, k, v, inputs), mask)
    chunked, _ = mixer.chunked(q, k, v, inputs, mixer.init_state(2, q.device, q.dtype))
    stepped, _ = run_steps(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(chunked, mask), parallel) < 1e-5
    assert rel_err(real_rows(stepped, mask), parallel) < 1e-5
    assert rel_err(real_rows(mixer(q, k, v, inputs)[0], mask), parallel) < 1e-5  # forward picks chunked


@pytest.mark.parametrize("far, combine", [CASES[1], CASES[4]])
def test_prefill_then_steps(far: str, combine: str) -> None:
    mixer = make(far, combine, window=4, chunk_size=3)
    q, k, v, x = data(12, seed=2)
    mask = left_padded(12)
    pre, state = mixer(
        q[:, :, :7], k[:, :, :7], v[:, :, :7], MixerInputs(x[:, :7], mask[:, :7]), use_cache=True
    )
    rest, _ = run_steps(mixer, q, k, v, x, mask, state=state, start=7)
    got = torch.cat([pre, rest], dim=1)
    assert rel_err(real_rows(got, mask), reference(mixer, q, k, v, mask)) < 1e-5


def test_a_token_enters_the_far_state_when_it_leaves_the_window() -> None:
    window, seq_len = 4, 10
    mixer = make("linear-elu", "shared", dtype=torch.float64, window=window)
    q, k, v, x = data(seq_len, dtype=torch.float64, seed=3)
    mask = left_padded(seq_len)
    _, state = run_steps(mixer, q, k, v, x, mask)
    assert torch.equal(state["wk"], k[:, :, -window:]) and torch.equal(state["wv"], v[:, :, -window:])
    assert state["wmask"].all()
    phi = torch.nn.functional.elu(k) + 1
    for b, first in ((0, 0), (1, PAD)):  # far = real tokens 0 .. T-1-W
        left = slice(first, seq_len - window)
        assert torch.allclose(state["far.S"][b], torch.einsum("hsf,hse->hfe", phi[b, :, left], v[b, :, left]))
        assert torch.allclose(state["far.z"][b], phi[b, :, left].sum(1))
    fixed = {name: tuple(t.shape) for name, t in state.items()}
    _, later = run_steps(mixer, q, k, v, x, mask, state=state, start=seq_len - 3)
    assert {name: tuple(t.shape) for name, t in later.items()} == fixed
    assert mixer.state_size(5) == mixer.state_size(10**6) == 2 * HKV * D * window + window + HKV * D * (D + 1)


def test_without_far_tokens_it_is_softmax() -> None:
    q, k, v, x = data(10, seed=4)
    mask = left_padded(10)
    mixer = make("linear-elu", "shared", window=10)
    assert (
        rel_err(
            real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask), softmax_attention(q, k, v, mask)
        )
        < 1e-5
    )


def test_taylor_far_part_with_a_shared_denominator_approaches_softmax() -> None:
    """At g = 1/2 the shared rule is softmax with exp replaced by T_N on far keys (good to convert)."""
    q, k, v, x = data(16, seed=5, scale=0.8)
    expected = softmax_attention(q, k, v)
    errors = {}
    for order in (2, 6, 10):
        spec = {"mixer": "hybrid", "window": 3, "far": {"mixer": "taylor", "order": order}}
        mixer = build_mixer(validate_spec(spec, "layer 0"), MixerShape(C, H, HKV, D, 0))
        errors[order] = rel_err(mixer.parallel(q, k, v, MixerInputs(x)), expected)
    assert errors[2] > errors[6] > errors[10] and errors[10] < 1e-4, errors


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ({"window": 0}, r"layer 2: option 'window' must be >= 1"),
        (
            {"far": {"mixer": "softmax"}},
            r"layer 2: option 'far' must be a linear or taylor or delta( or \w+)* spec, got mixer 'softmax'",
        ),
        ({"far": "sliding_window"}, r"layer 2: option 'far' must be a linear or taylor or delta( or \w+)* spec"),
        ({"far": {"mixer": "bogus"}}, r"layer 2: option 'far': unknown mixer 'bogus'"),
        (
            {"far": {"mixer": "linear", "colour": 1}},
            r"layer 2: option 'far': unknown option\(s\) \['colour'\]",
        ),
        (
            {"far": {"mixer": "taylor", "order": 3}},
            r"layer 2: option 'far': option 'denominator'='exact' needs an even",
        ),
        (
            {"far": {"mixer": "taylor", "order": "exp"}},
            r"layer 2: option 'far' a taylor far mixer needs a finite order",
        ),
        (
            {"far": {"mixer": "linear", "causal": False}},
            r"layer 2: option 'far' the far mixer must be causal",
        ),
        (
            {"far": {"mixer": "linear", "feature_map": "identity"}},
            r"layer 2: option 'far' combine='shared' needs",
        ),
        ({"far": {"mixer": "taylor", "denominator": "l2"}}, r"layer 2: option 'far' combine='shared' needs"),
        ({"far": 3}, r"layer 2: option 'far' must be dict or str"),
        ({"mix_init": 1.0}, r"layer 2: option 'mix_init' must be in \(0, 1\)"),
        ({"combine": "max"}, r"layer 2: option 'combine' must be one of"),
    ],
)
def test_bad_specs_name_layer_and_option(spec: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_spec({"mixer": "hybrid", **spec}, "layer 2")


def test_far_taylor_over_budget_is_an_error() -> None:
    spec = validate_spec(
        {"mixer": "hybrid", "far": {"mixer": "taylor", "order": 4, "state_budget": 500}}, "layer 2"
    )
    with pytest.raises(ValueError, match=r"layer 2: option 'order'=4 needs .* above option 'state_budget'"):
        build_mixer(spec, MixerShape(C, H, HKV, D, 2))


def test_validated_spec_is_plain_and_reloads() -> None:
    spec = validate_spec({"mixer": "hybrid", "far": "taylor", "window": 8}, "layer 0")
    assert spec["far"]["mixer"] == "taylor" and spec["far"]["order"] == 2
    assert validate_spec(spec, "layer 0") == spec  # idempotent, so a saved config loads unchanged


@pytest.mark.parametrize(
    "spec",
    [
        {"mixer": "hybrid", "window": 3, "chunk_size": 4},
        {"mixer": "hybrid", "window": 4, "far": {"mixer": "taylor", "order": 2}, "chunk_size": 64},
        {
            "mixer": "hybrid",
            "window": 2,
            "far": {"mixer": "taylor", "order": 2, "denominator": "rms"},
            "combine": "sum",
            "chunk_size": 3,
        },
    ],
    ids=["linear-shared", "taylor-shared", "taylor-sum"],
)
def test_model_cache_matches_full_forward(spec: dict) -> None:
    assert cache_mismatch(spec) < 1e-4


def test_state_size_report_covers_the_new_mixers() -> None:
    specs = [
        {"mixer": "taylor", "order": 2},
        {"mixer": "taylor", "order": "exp", "denominator": "l2"},
        {"mixer": "heinsen"},
        {"mixer": "hybrid", "window": 16, "far": {"mixer": "linear", "feature_map": "elu"}},
    ]
    config = RecAttnConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention=specs,
    )
    rows = state_size_report(config, 1000)
    d, hk, kv_per_token = 32, 2, 2 * 2 * 32
    taylor2 = hk * math.comb(d + 2, 2) * (d + 1)
    heinsen = hk * (d * d + d)
    hybrid = 2 * hk * d * 16 + 16 + hk * d * (d + 1)
    assert [(r.mixer, r.kind, r.state_elements) for r in rows] == [
        ("taylor", "recurrent", taylor2),
        ("taylor", "kv", kv_per_token * 1000),
        ("heinsen", "recurrent", heinsen),
        ("hybrid", "window", hybrid),
    ]
    assert [r.break_even_context for r in rows] == [
        math.ceil(taylor2 / kv_per_token),
        None,
        math.ceil(heinsen / kv_per_token),
        math.ceil(hybrid / kv_per_token),
    ]


# ----- attention sinks: the first N real tokens stay softmax keys, far="none" -------------------------------
SINK_CASES = [
    ("linear-hedgehog", "shared", 1),
    ("linear-elu", "sum", 2),
    ("taylor2-exact", "shared", 2),
    ("none", "shared", 1),
    ("none", "sum", 3),
]


@pytest.mark.parametrize("far, combine, sinks", SINK_CASES)
@pytest.mark.parametrize("window", [1, 3])
def test_sinks_parallel_matches_reference(far: str, combine: str, sinks: int, window: int) -> None:
    mixer = make(far, combine, window=window, sink_tokens=sinks)
    q, k, v, x = data(11, seed=5)
    mask = left_padded(11)
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    assert rel_err(real_rows(out, mask), reference(mixer, q, k, v, mask)) < 1e-5
    # the sinks matter once they have left the window: without them, later queries differ
    plain = make(far, combine, window=window)
    late = slice(PAD + sinks + window, None)
    assert rel_err(plain.parallel(q, k, v, MixerInputs(x, mask))[:, late], out[:, late]) > 1e-3


@pytest.mark.parametrize("far, combine, sinks", SINK_CASES)
def test_sinks_chunked_steps_and_prefill_match_parallel(far: str, combine: str, sinks: int) -> None:
    """Chunks of 2 with 5 padding tokens: the sinks arrive in the third chunk, after all-padding chunks."""
    seq_len = 12
    mixer = make(far, combine, window=3, chunk_size=2, sink_tokens=sinks)
    q, k, v, x = data(seq_len, seed=6)
    mask = left_padded(seq_len, pad=5)
    inputs = MixerInputs(x, mask)
    parallel = real_rows(mixer.parallel(q, k, v, inputs), mask)
    chunked, chunk_state = run_chunked(mixer, q, k, v, x, mask)
    stepped, step_state = run_steps(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(chunked, mask), parallel) < 1e-5
    assert rel_err(real_rows(stepped, mask), parallel) < 1e-5
    for name in ("sk", "sv", "smask", "wk", "wv", "wmask"):
        assert torch.equal(chunk_state[name], step_state[name]), name
    assert chunk_state["smask"].sum(1).tolist() == [sinks, sinks]
    # the kept sinks are the first real keys of each row, in order
    assert torch.equal(chunk_state["sk"][0], k[0, :, :sinks])
    assert torch.equal(chunk_state["sk"][1], k[1, :, 5 : 5 + sinks])
    pre, state = mixer(q[:, :, :7], k[:, :, :7], v[:, :, :7], MixerInputs(x[:, :7], mask[:, :7]), use_cache=True)
    rest, _ = run_steps(mixer, q, k, v, x, mask, state=state, start=7)
    assert rel_err(real_rows(torch.cat([pre, rest], dim=1), mask), parallel) < 1e-5


@pytest.mark.parametrize("far, combine, sinks", [SINK_CASES[0], SINK_CASES[3]])
def test_sinks_gradients_match_reference(far: str, combine: str, sinks: int) -> None:
    mixer = make(far, combine, dtype=torch.float64, window=2, chunk_size=3, sink_tokens=sinks)
    q, k, v, x = data(8, dtype=torch.float64, seed=7)
    mask = left_padded(8)
    assert_gradients_match_reference(mixer, q, k, v, x, mask)


def test_sinks_and_far_none_state_size() -> None:
    shape = MixerShape(C, H, HKV, D, 0)
    for spec, far_size in (({"far": "none"}, 0), ({}, None)):
        plain = build_mixer(validate_spec({"mixer": "hybrid", "window": 5, **spec}, "t"), shape)
        sunk = build_mixer(validate_spec({"mixer": "hybrid", "window": 5, "sink_tokens": 2, **spec}, "t"), shape)
        assert sunk.state_size(100) - plain.state_size(100) == 2 * (2 * HKV * D + 1)
        assert sunk.state_size(100) == sunk.state_size(10_000)
        state = sunk.init_state(3, torch.device("cpu"), torch.float32)
        assert sum(t.numel() for t in state.values()) == 3 * sunk.state_size(1)
        if far_size == 0:
            assert sunk.far is None and plain.state_size(7) == 2 * HKV * D * 5 + 5


@pytest.mark.parametrize("far, combine, sinks", [*SINK_CASES, ("linear-elu", "sum", 0), ("taylor2-exact", "shared", 0)])
def test_one_token_step_is_the_general_block(far: str, combine: str, sinks: int) -> None:
    """The decode step's shortcut (one token, sinks settled) computes what the general block computes for it: the
    same window and sink buffers, outputs and far states within float32 rounding; it is taken once sinks settle."""
    seq_len = 12
    mixer = make(far, combine, window=3, sink_tokens=sinks)
    q, k, v, x = data(seq_len, seed=8)
    mask = left_padded(seq_len, pad=5)
    general = make(far, combine, window=3, sink_tokens=sinks)
    general.load_state_dict(mixer.state_dict())
    general._step_one = lambda *args: pytest.fail("the general block must not take the shortcut")  # type: ignore
    general.step = lambda q, k, v, inputs, state: general._block(q, k, v, inputs, state, general._far_step)  # type: ignore
    taken = []
    shortcut = mixer._step_one
    mixer._step_one = lambda *args: taken.append(1) or shortcut(*args)  # type: ignore
    with torch.no_grad():
        fast, fast_state = run_steps(mixer, q, k, v, x, mask)
        slow, slow_state = run_steps(general, q, k, v, x, mask)
    assert len(taken) >= seq_len - 5 - sinks  # every step after the last sink of the padded row
    assert rel_err(real_rows(fast, mask), real_rows(slow, mask).double()) < 1e-6
    assert fast_state.keys() == slow_state.keys()
    for name in fast_state:
        if name.startswith("far."):
            assert torch.allclose(fast_state[name], slow_state[name], rtol=1e-6, atol=1e-6), name
        else:
            assert torch.equal(fast_state[name], slow_state[name]), name
