"""The taylor mixer (Mongaras & Larson, arXiv:2507.23632): every form against float64 per-token references, packing,
limits, errors."""

from __future__ import annotations

import math

import pytest
import torch
from mixer_steps import left_padded, run_steps
from reference_recurrent_softmax import (
    cache_mismatch,
    real_rows,
    rel_err,
    softmax_attention,
    taylor_attention,
)

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.modeling.ops_taylor import packed_dim, packed_powers, taylor_poly

H, HKV, D, C = 4, 2, 8, 16  # query heads, kv heads, head dim, hidden size
PAD = 3


def make(spec: dict, dtype: torch.dtype = torch.float32, randomize: bool = True, d: int = D):
    """A validated taylor mixer; learnable parts (gate, gains, temperatures) moved off their defaults."""
    mixer = build_mixer(validate_spec({"mixer": "taylor", **spec}, "layer 0"), MixerShape(C, H, HKV, d, 0))
    mixer = mixer.to(dtype)
    if randomize:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in mixer.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return mixer


def data(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0, d: int = D):
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(2, H, seq_len, d, generator=gen, dtype=torch.float64)
    k = scale * torch.randn(2, HKV, seq_len, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, HKV, seq_len, d, generator=gen, dtype=torch.float64)
    x = torch.randn(2, seq_len, C, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), x.to(dtype)



def reference(mixer, q, k, v, x, mask, causal=True):
    """The float64 reference with the mixer's own learnable values (gate logits, gains, temperatures)."""
    spec = mixer.spec
    gate_logits = None
    if mixer.gate_proj is not None:
        w, b = mixer.gate_proj.weight.double(), mixer.gate_proj.bias.double()
        gate_logits = x.double() @ w.T + b
    fm = mixer.feature_map
    return taylor_attention(
        q,
        k,
        v,
        spec["order"],
        spec["denominator"],
        mask=mask,
        causal=causal,
        scale=spec["scale"],
        feature_map=spec["feature_map"],
        log_temperature=None if mixer.log_temperature is None else mixer.log_temperature.detach(),
        cosine_log_temperature=fm.log_temperature.detach()
        if fm is not None and fm.kind == "cosine"
        else None,
        gate_logits=gate_logits,
        gate_clamp=mixer.gate_clamp,
        norm_gain=None if mixer.output_norm is None else mixer.output_norm.weight.detach(),
        eps=spec["eps"],
    )


CASES = [
    {"order": 1, "denominator": "none"},
    {"order": 2, "denominator": "exact"},
    {"order": 3, "denominator": "l2"},
    {"order": 4, "denominator": "exact"},
    {"order": 2, "denominator": "rms"},
    {"order": 3, "denominator": "layernorm"},
    {"order": 2, "denominator": "gate"},
    {"order": 3, "denominator": "gate", "gate_clamp": 1.5},
    {"order": "exp", "denominator": "exact"},
    {"order": "exp", "denominator": "gate", "gate_clamp": 0.5},
    {"order": "exp", "denominator": "l2"},
    {"order": 2, "denominator": "exact", "feature_map": "elu", "learn_temperature": True},
    {"order": 3, "denominator": "rms", "feature_map": "relu"},
    {"order": 2, "denominator": "exact", "feature_map": "cosine", "scale": 2.0},
]


# ----- parallel form against the reference --------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("causal", [True, False])
def test_parallel_matches_reference(case: dict, causal: bool) -> None:
    mixer = make({**case, "causal": causal})
    q, k, v, x = data(9, scale=1.5)
    mask = left_padded(9)
    out = mixer.parallel(q, k, v, MixerInputs(x, mask))
    expected = reference(mixer, q, k, v, x, mask, causal)
    assert out.shape == (2, 9, H, D)
    assert rel_err(real_rows(out, mask), expected) < 1e-5


@pytest.mark.parametrize(
    "case",
    [CASES[1], CASES[2], CASES[6], CASES[8], CASES[11]],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_gradients_match_reference(case: dict) -> None:
    mixer = make(case, dtype=torch.float64)
    q, k, v, x = data(6, dtype=torch.float64)
    mask = left_padded(6)
    probe = torch.randn(2, 6, H, D, dtype=torch.float64)
    grads = []
    for fn in (
        lambda a, b, c: mixer.parallel(a, b, c, MixerInputs(x, mask)),
        lambda a, b, c: reference(mixer, a, b, c, x, mask),
    ):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (real_rows(fn(*leaves), mask) * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        assert rel_err(got, want) < 1e-9


# ----- recurrent and chunked forms ----------------------------------------------------------------------
RECURRENT = [CASES[0], CASES[1], CASES[2], CASES[6], CASES[7], CASES[11], CASES[8]]



@pytest.mark.parametrize("case", RECURRENT, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_chunked_gradients_match_parallel(case: dict) -> None:
    """float64: the chunked form (several chunks, a ragged last one, left padding) has the parallel form's
    gradients for q, k, v and every mixer parameter."""
    mixer = make({**case, "chunk_size": 4}, dtype=torch.float64)
    q, k, v, x = data(11, dtype=torch.float64)
    mask = left_padded(11)
    probe = torch.randn(2, 11, H, D, dtype=torch.float64)
    params = [p for _, p in sorted(mixer.named_parameters())]
    grads = []
    for form in ("parallel", "chunked"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        inputs = MixerInputs(x, mask)
        if form == "parallel":
            out = mixer.parallel(*leaves, inputs)
        else:
            out = mixer.chunked(*leaves, inputs, mixer.init_state(2, q.device, q.dtype))[0]
        grads.append(torch.autograd.grad((real_rows(out, mask) * probe).sum(), [*leaves, *params]))
    for got, want in zip(*grads, strict=True):
        assert rel_err(got, want) < 1e-9


@pytest.mark.parametrize("case", RECURRENT, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_steps_match_parallel(case: dict) -> None:
    mixer = make(case)
    q, k, v, x = data(10)
    mask = left_padded(10)
    stepped, state = run_steps(mixer, q, k, v, x, mask)
    parallel = mixer.parallel(q, k, v, MixerInputs(x, mask))
    assert rel_err(real_rows(stepped, mask), real_rows(parallel, mask)) < 1e-5
    if case["order"] != "exp":  # padded tokens never reached the state
        assert set(state) == {"S"} | ({"z"} if case["denominator"] == "exact" else set()) | (
            {"n"} if case["denominator"] == "gate" else set()
        )
        if "n" in state:
            assert state["n"].tolist() == [[10.0, 10.0], [10.0 - PAD, 10.0 - PAD]]


@pytest.mark.parametrize("case", RECURRENT, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("seq_len", [12, 13])
def test_chunked_matches_parallel(case: dict, seq_len: int) -> None:
    mixer = make({**case, "chunk_size": 4})
    q, k, v, x = data(seq_len)
    mask = left_padded(seq_len)
    inputs = MixerInputs(x, mask)
    chunked, _ = mixer.chunked(q, k, v, inputs, mixer.init_state(2, q.device, q.dtype))
    assert rel_err(real_rows(chunked, mask), real_rows(mixer.parallel(q, k, v, inputs), mask)) < 1e-5
    # no cache and T > chunk_size: forward takes the chunked path (or parallel for a KV-cache layer)
    assert rel_err(real_rows(mixer(q, k, v, inputs)[0], mask), real_rows(chunked, mask)) < 1e-5


@pytest.mark.parametrize(
    "case", [CASES[1], CASES[7], CASES[9]], ids=lambda c: "-".join(str(v) for v in c.values())
)
def test_prefill_then_steps(case: dict) -> None:
    mixer = make({**case, "chunk_size": 3})
    q, k, v, x = data(11)
    mask = left_padded(11)
    pre, state = mixer(
        q[:, :, :7], k[:, :, :7], v[:, :, :7], MixerInputs(x[:, :7], mask[:, :7]), use_cache=True
    )
    rest, _ = run_steps(mixer, q, k, v, x, mask, state=state, start=7)
    got = torch.cat([pre, rest], dim=1)
    assert rel_err(real_rows(got, mask), reference(mixer, q, k, v, x, mask)) < 1e-5


# ----- packing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [5, 40], ids=["few-rows", "many-rows"])  # packing tables / contiguous slices
@pytest.mark.parametrize("d", [1, 3, 8])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_packed_powers_give_the_taylor_kernel(d: int, order: int, rows: int) -> None:
    q, k = torch.randn(rows, d, dtype=torch.float64), torch.randn(rows, d, dtype=torch.float64)
    fq, fk = packed_powers(q, order), packed_powers(k, order)
    assert fq.shape[-1] == packed_dim(d, order) == sum(math.comb(d + n - 1, n) for n in range(order + 1))
    dot = (q * k).sum(-1)
    direct = sum(dot**n / math.factorial(n) for n in range(order + 1))
    assert torch.allclose((fq * fk).sum(-1), direct, rtol=1e-12, atol=1e-12)
    # and order by order: the block of degree n alone gives (q.k)^n / n!
    lo = packed_dim(d, order - 1)
    assert torch.allclose(
        (fq[:, lo:] * fk[:, lo:]).sum(-1), dot**order / math.factorial(order), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("order", [1, 2])
def test_packed_powers_are_the_same_from_slices_and_from_tables(order: int) -> None:
    """Many rows are built from contiguous slices, a decode step's few rows by the packing tables: same entries."""
    x = torch.randn(2, 20, 8, dtype=torch.float64)
    one_row_at_a_time = torch.cat([packed_powers(x[:, i : i + 1], order) for i in range(20)], dim=1)
    torch.testing.assert_close(packed_powers(x, order), one_row_at_a_time, rtol=0, atol=1e-15)


def test_state_is_packed_and_sized() -> None:
    for order, den in [(1, "l2"), (2, "exact"), (3, "gate")]:
        mixer = make({"order": order, "denominator": den}, d=16)
        state = mixer.init_state(3, torch.device("cpu"), torch.float32)
        p = math.comb(16 + order, order)
        assert state["S"].shape == (3, HKV, p, 16)
        assert p < sum(16**n for n in range(order + 1)) or order == 1  # fewer than the Kronecker d^n entries
        expected = HKV * (p * (16 + (den == "exact")) + (den == "gate"))
        assert mixer.state_size(10) == mixer.state_size(10_000) == expected
        assert sum(t[0].numel() for t in state.values()) == expected
        assert mixer.state_kind == "recurrent"


# ----- properties of the series --------------------------------------------------------------------------
def test_even_orders_are_positive_odd_orders_are_not() -> None:
    x = torch.linspace(-40, 40, 80_001, dtype=torch.float64)
    minima = {n: float(taylor_poly(x, n).min()) for n in range(1, 9)}
    for n in (2, 4, 6, 8):
        assert minima[n] > 0
    assert minima[2] == pytest.approx(0.5, abs=1e-6)
    assert minima[4] == pytest.approx(0.2706, abs=1e-3)
    assert minima[6] == pytest.approx(0.1493, abs=1e-3)
    for n in (1, 3, 5, 7):
        assert minima[n] < 0


@pytest.mark.parametrize("order", [2, 4, 6])
def test_even_order_exact_output_is_a_convex_combination(order: int) -> None:
    """Huge negative and positive logits: weights stay positive, so outputs stay within the values' range."""
    mixer = make({"order": order, "denominator": "exact"}, randomize=False)
    q, k, v, x = data(12, scale=4.0)
    out = mixer.parallel(q, k, v, MixerInputs(x))  # |x| up to ~50
    vmax = v.amax(dim=2).repeat_interleave(H // HKV, dim=1)  # [B, H, E]
    vmin = v.amin(dim=2).repeat_interleave(H // HKV, dim=1)
    assert torch.isfinite(out).all()
    assert (out <= vmax[:, None] + 1e-4).all() and (out >= vmin[:, None] - 1e-4).all()


def test_order_sweep_approaches_softmax() -> None:
    q, k, v, x = data(24, dtype=torch.float64, seed=3)
    logits = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(2, dim=1)) * D**-0.5
    q = q * (3.0 / logits.abs().max())  # |s q.k| <= 3
    expected = softmax_attention(q, k, v)
    errors = {}
    for order in (2, 4, 6, 8, 10, 12):
        mixer = make({"order": order, "denominator": "exact"}, randomize=False)
        errors[order] = rel_err(
            mixer.parallel(q.float(), k.float(), v.float(), MixerInputs(x.float())), expected
        )
    values = list(errors.values())
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), errors
    assert errors[2] > 1e-2 and errors[12] < 1e-3, errors


def test_exp_exact_is_softmax_even_with_large_logits() -> None:
    mixer = make({"order": "exp", "denominator": "exact"}, randomize=False)
    for scale in (1.0, 6.0):  # logits up to ~100 at scale 6
        q, k, v, x = data(10, scale=scale)
        mask = left_padded(10)
        out = mixer.parallel(q, k, v, MixerInputs(x, mask))
        assert torch.isfinite(out).all()
        assert rel_err(real_rows(out, mask), softmax_attention(q, k, v, mask)) < 1e-5


def test_gate_clamp_bounds_the_logits() -> None:
    q, k, v, x = data(8, scale=5.0)
    for order in ("exp", 4):
        mixer = make({"order": order, "denominator": "gate", "gate_clamp": 2.0})
        out = mixer.parallel(q, k, v, MixerInputs(x))
        assert torch.isfinite(out).all()
        # every weight is at most T(2) <= e^2, gate <= 1, and there are t keys: |o| <= e^2 max|v|
        assert float(out.detach().abs().max()) <= math.exp(2.0) * float(v.abs().max()) + 1e-5
        assert rel_err(out, reference(mixer, q, k, v, x, None)) < 1e-5


# ----- KV-cache layers ---------------------------------------------------------------------------------
def test_exp_and_over_budget_layers_keep_a_kv_cache() -> None:
    exp = make({"order": "exp", "denominator": "l2"})
    assert exp.state_kind == "kv" and exp.state_size(100) == 2 * HKV * D * 100
    small = make({"order": 4, "denominator": "exact", "state_budget": 100})
    assert small.state_kind == "kv" and small.state_size(7) == 2 * HKV * D * 7
    assert small.init_state(1, torch.device("cpu"), torch.float32)["k"].shape == (1, HKV, 0, D)
    big = make({"order": 4, "denominator": "exact"})
    assert big.state_kind == "recurrent"
    forced = make({"order": 2, "cache": "kv"})
    assert forced.state_kind == "kv"
    q, k, v, x = data(9)
    mask = left_padded(9)
    for m in (small, forced):  # the same function whichever state it keeps
        twin = make({**m.spec, "cache": "recurrent", "state_budget": 1 << 24}, randomize=False)
        twin.load_state_dict(m.state_dict())
        stepped, state = run_steps(m, q, k, v, x, mask)
        assert state["k"].shape == (2, HKV, 9, D)
        assert (
            rel_err(real_rows(stepped, mask), real_rows(twin.parallel(q, k, v, MixerInputs(x, mask)), mask))
            < 1e-5
        )


# ----- bidirectional -----------------------------------------------------------------------------------
def test_bidirectional_sees_the_future_and_has_no_recurrent_form() -> None:
    mixer = make({"order": 2, "causal": False})
    q, k, v, x = data(8)
    full = mixer.parallel(q, k, v, MixerInputs(x))
    changed = v.clone()
    changed[:, :, -1] += 1.0
    assert not torch.allclose(mixer.parallel(q, k, changed, MixerInputs(x))[:, 0], full[:, 0])
    out, _ = mixer(q, k, v, MixerInputs(x))  # forward without a cache stays parallel, even past chunk_size
    assert torch.equal(out, full)
    state = mixer.init_state(2, q.device, q.dtype)
    with pytest.raises(ValueError, match=r"layer 0 \(taylor\): causal=False has no step form"):
        mixer.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], MixerInputs(x[:, :1]), state)


# ----- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, pattern",
    [
        (
            {"order": 3, "denominator": "exact"},
            r"layer 3: option 'denominator'='exact' needs an even 'order'",
        ),
        ({"order": 1}, r"layer 3: option 'denominator'='exact' needs an even 'order'"),
        ({"order": 0}, r"layer 3: option 'order' must be >= 1"),
        ({"order": "cubic"}, r"layer 3: option 'order' must be int or 'exp'"),
        ({"order": 2.0}, r"layer 3: option 'order' must be int or 'exp'"),
        ({"denominator": "softmax"}, r"layer 3: option 'denominator' must be one of"),
        ({"feature_map": "hedgehog"}, r"layer 3: option 'feature_map' must be one of"),
        (
            {"order": "exp", "cache": "recurrent"},
            r"layer 3: option 'cache'='recurrent' needs a finite 'order'",
        ),
        ({"gate_clamp": -1.0}, r"layer 3: option 'gate_clamp' must be > 0"),
        ({"scale": 0.0}, r"layer 3: option 'scale' must be > 0"),
        ({"window": 4}, r"layer 3: unknown option\(s\) \['window'\]"),
    ],
)
def test_bad_specs_name_layer_and_option(spec: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_spec({"mixer": "taylor", **spec}, "layer 3")


def test_order_over_budget_with_recurrent_cache_is_an_error() -> None:
    spec = validate_spec(
        {"mixer": "taylor", "order": 4, "cache": "recurrent", "state_budget": 1_000}, "layer 2"
    )
    with pytest.raises(ValueError, match=r"layer 2: option 'order'=4 needs .* above option 'state_budget'"):
        build_mixer(spec, MixerShape(C, H, HKV, D, 2))


# ----- inside a model ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        {"mixer": "taylor", "order": 2, "chunk_size": 4},
        {"mixer": "taylor", "order": 3, "denominator": "gate", "chunk_size": 64},
        {"mixer": "taylor", "order": 2, "denominator": "l2", "feature_map": "elu", "chunk_size": 3},
        {"mixer": "taylor", "order": "exp", "denominator": "rms"},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_model_cache_matches_full_forward(spec: dict) -> None:
    assert cache_mismatch(spec) < 1e-4
