"""The hybrid's exact cache held as int8 (``cache_dtype: int8``, modeling/cache_precision.py): every form against the
float64 per-token reference of test_hybrid_cache.py, which rounds a pair to int8 once, when a decision first scores
it (``int8_held``): fp32 forms there (``test_options_match_the_reference``), float64 forms and gradients here;
decisions bit for bit across forms; the codes never rounded twice; the state's bytes; generation; bad specs.
Tolerances as there: fp32 within 1e-5 relative, float64 within 1e-10, float64 gradients within 1e-9.
"""

from __future__ import annotations

import mixer_checks as checks
import pytest
import torch
from generation_cases import Case, one_thread, tiny_model
from mixer_checks import SHAPE
from mixer_steps import left_padded, run_steps
from test_hybrid_cache import (
    GRAD,
    MODEL_SPECS,
    assert_cached_generation_equals_uncached,
    assert_chunks_end_as_steps,
    assert_float64_forms_match,
    make,
    reference_of,
)

from hf_recattn.model_card import state_table
from hf_recattn.modeling.cache_precision import codes_of, dequantize, quantize, round_trip, slot_elements
from hf_recattn.modeling.hybrid_options import with_hybrid_options
from hf_recattn.state_size import exact_cache_bytes, state_size_report

HK, D = SHAPE.num_kv_heads, SHAPE.head_dim
INT8 = {"cache_dtype": "int8"}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


@pytest.mark.parametrize(("far", "score"), [("linear-elu", "far"), ("delta", "novelty"), ("none", "keydiff")])
def test_int8_float64_forms_match_the_reference_closely(far: str, score: str) -> None:
    assert_float64_forms_match(make(far, torch.float64, window=2, slots=3, sink_tokens=1, cache_score=score, **INT8),
                               seed=22)


@pytest.mark.parametrize(("far", "score"), [("linear-hedgehog", "far"), ("delta", "novelty"), ("none", "keydiff")])
@pytest.mark.parametrize("form", ["parallel", "chunked"])
def test_int8_gradients_pass_straight_through(far: str, score: str, form: str) -> None:
    """float64 gradients of q, k, v, x and every parameter through either training form equal the reference's,
    whose rounding passes gradients straight through: a cached key or value still learns, also when it was cached
    in an earlier chunk (the state between chunks then carries the cache as its queries read it, not as codes)."""
    mixer = make(far, torch.float64, window=2, slots=2, sink_tokens=1, cache_score=score, **INT8)
    unused = {"delta": (), "none": ("x", "mix_logit")}.get(far, ("x",))
    checks.assert_gradients_match(mixer, reference_of(mixer), 11, GRAD, form=form, unused=unused)


@pytest.mark.parametrize("far", ["linear-hedgehog", "delta"])
def test_int8_decisions_equal_across_forms_and_chunk_sizes(far: str) -> None:
    """Chunks of any size and token steps end in the same codes, scales, mask, pending buffer and window, bit for
    bit; the one-token step's shortcut equals the general block over 40 tokens."""
    mixer = make(far, window=3, slots=2, **INT8)
    assert_chunks_end_as_steps(mixer, seed=23, sizes=(1, 3, 5, 17))
    with torch.no_grad():
        general = make(far, window=3, slots=2, **INT8)
        general.load_state_dict(mixer.state_dict())
        general.step = lambda q, k, v, inputs, state: general._block(  # type: ignore[method-assign]
            q, k, v, inputs, state, general._far_step)
        q, k, v, x = checks.random_inputs(SHAPE, 40, seed=24)
        mask = left_padded(40, 5)
        fast, fast_state = run_steps(mixer, q, k, v, x, mask)
        slow, slow_state = run_steps(general, q, k, v, x, mask)
    assert torch.equal(fast, slow)
    for name in fast_state:
        assert torch.equal(fast_state[name], slow_state[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_held_pair_keeps_its_codes(dtype: torch.dtype) -> None:
    """The codes of a rounded vector, read back from what the forms carry, are the codes it was rounded to (so a pair
    that stays cached through many decisions is never rounded again); a zero vector stays zero; the rounding error
    is at most half a step of the vector's scale."""
    x = torch.randn(3, 2, 50, 16, dtype=torch.float64).to(dtype) * torch.logspace(-3, 3, 50)[:, None].to(dtype)
    x[0, 0, 0] = 0
    codes, scale = quantize(x)
    held, scale_again = round_trip(x)
    assert torch.equal(scale, scale_again) and codes.dtype == torch.int8
    assert codes.abs().amax(-1).flatten()[1:].eq(127).all()  # the largest magnitude maps to 127
    assert torch.equal(codes_of(held, scale), codes)
    assert torch.equal(dequantize(codes_of(held, scale), scale, dtype), held)
    assert not held[0, 0, 0].any()
    step = scale.to(torch.float64)
    assert ((held.double() - x.double()).abs() <= step / 2 + x.double().abs() * 2 ** -7).all()


def test_int8_state_counts_its_bytes() -> None:
    """The state holds int8 codes and a scale per cached key and value; state_size counts the cache's keys and values
    at their bytes over four (a quarter of float32's elements plus the scales), the rest as before, and that is the
    state's real size in bytes (masks at four bytes, as everywhere) over four."""
    slots = 6
    mixer, plain = make("linear-elu", window=3, slots=slots, sink_tokens=2, **INT8), make(
        "linear-elu", window=3, slots=slots, sink_tokens=2)
    cache_bytes = 2 * HK * slots * (D + 4)
    assert slot_elements(HK, D, slots, "int8") == cache_bytes // 4
    assert mixer.state_size(7) == mixer.state_size(10**6) == plain.state_size(1) - 2 * HK * D * slots + cache_bytes // 4
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert state["ck"].dtype == state["cv"].dtype == torch.int8
    assert state["cks"].dtype == state["cvs"].dtype == torch.float32
    real_bytes = sum(t.numel() * (4 if t.dtype == torch.bool else t.element_size()) for t in state.values())
    assert real_bytes == 4 * mixer.state_size(1)
    assert mixer.int8_bytes() == cache_bytes and plain.int8_bytes() == 0


@pytest.mark.parametrize("bytes_per_element", [2, 4])
def test_reported_bytes_count_int8_codes_at_one_byte(bytes_per_element: int) -> None:
    """The state-size report (cards, zoo, ``hf-recattn state-size``) counts a model's floating-point elements at the
    width asked for and its int8 codes and scales at their own bytes: at bf16's two bytes an int8 cache is half its
    bf16 size, not the quarter that its float32 element count would make it."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    int8 = with_hybrid_options(model, INT8)
    rows, plain_rows = state_size_report(int8.config, 64), state_size_report(model.config, 64)
    config = model.config
    slots = MODEL_SPECS["delta-novelty"]["cache_slots"]
    cache_bytes = 2 * config.num_key_value_heads * slots * (config.head_dim + 4)
    for row, plain in zip(rows, plain_rows, strict=True):
        assert row.int8_bytes == cache_bytes and plain.int8_bytes == 0
        float_slots = 2 * config.num_key_value_heads * slots * config.head_dim
        expected = plain.state_bytes(bytes_per_element) - float_slots * bytes_per_element + cache_bytes
        assert row.state_bytes(bytes_per_element) == expected
        assert plain.state_bytes(bytes_per_element) == plain.state_elements * bytes_per_element


def test_a_trained_model_runs_with_an_int8_cache() -> None:
    """``cache_dtype`` adds no weights: a model trained as computed takes it as an option; its cache then holds int8,
    its exact-cache bytes fall to about a quarter, and greedy generation through the cache equals the full forward's."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    int8 = with_hybrid_options(model, INT8)
    assert int8.config.layer_spec(0)["cache_dtype"] == "int8"
    ratio = exact_cache_bytes(int8.config, 64, 4) / exact_cache_bytes(model.config, 64, 4)
    assert 0.6 < ratio < 1.0  # the pending buffer (as computed) and masks stay; only the slots shrink
    assert_cached_generation_equals_uncached(int8)
    ids = torch.randint(1, 60, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert not torch.equal(int8(ids).logits, model(ids).logits)  # the int8 cache is really read


def test_bad_cache_dtype_names_layer_and_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "hybrid", "cache_dtype": "int8"}, "layer 2",
         r"layer 2: option 'cache_dtype'='int8' sets how the exact cache holds its pairs, which is off "
         r"\(cache_slots: 0\)"),
        ({"mixer": "hybrid", "cache_slots": 2, "cache_dtype": "int4"}, "layer 2",
         r"layer 2: option 'cache_dtype' must be one of \['model', 'int8'\], got 'int4'"),
    ])



def test_the_card_says_the_cache_is_int8() -> None:
    """The model card's state table names how the exact cache holds its pairs, and its bytes shrink with int8."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    plain, int8 = state_table(model.config), state_table(with_hybrid_options(model, INT8).config)
    assert "int8 codes with a float32 scale per key and per value" in int8
    assert "int8" not in plain and plain != int8
