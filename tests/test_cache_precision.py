"""The hybrid's exact cache held as integer codes (``cache_dtype: int8``, ``int4``, ``int4g16`` or ``k8v4g16``,
modeling/cache_precision.py): every form against the float64 per-token reference of test_hybrid_cache.py, which
rounds a pair once, when a decision first scores it (``PAIR_HOLDS``, written there): fp32 forms there
(``test_options_match_the_reference``), float64 forms and gradients here; decisions bit for bit across forms; the
codes never rounded twice, int4's packed two per byte with a scale per 32 dimensions (int4g16: a float16 scale per
16; k8v4g16: keys as int8, values as int4g16); the state's bytes; generation; bad specs. Tolerances as there: fp32
within 1e-5 relative, float64 within 1e-10, float64 gradients within 1e-9.
"""

from __future__ import annotations

import mixer_checks as checks
import pytest
import torch
from generation_cases import Case, one_thread, tiny_model
from mixer_checks import PAD, SHAPE
from mixer_steps import left_padded, run_steps
from test_hybrid_cache import (
    GRAD,
    HOLDS,
    MODEL_SPECS,
    assert_cached_generation_equals_uncached,
    assert_chunks_end_as_steps,
    assert_float64_forms_match,
    make,
    reference_of,
)

from hf_recattn.model_card import state_table
from hf_recattn.modeling.cache_precision import CODE_FORMATS, pair_codes, slot_elements
from hf_recattn.modeling.hybrid_cached import slice_inputs
from hf_recattn.modeling.hybrid_options import with_hybrid_options
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.registry import build_mixer, validate_spec
from hf_recattn.state_size import exact_cache_bytes, state_size_report

HK, D = SHAPE.num_kv_heads, SHAPE.head_dim
INT8 = {"cache_dtype": "int8"}
INT4 = {"cache_dtype": "int4"}
INT4G16 = {"cache_dtype": "int4g16"}
K8V4G16 = {"cache_dtype": "k8v4g16"}
#: the bytes of one coded vector of SHAPE's 8 dimensions: int8's 8 codes, int4's 4 bytes of codes; one scale each
#: (int4g16's of 2 bytes)
VECTOR_BYTES = {"int8": D + 4, "int4": D // 2 + 4, "int4g16": D // 2 + 2}
#: the bytes of one coded key and its value
PAIR_BYTES = {**{name: 2 * size for name, size in VECTOR_BYTES.items()},
              "k8v4g16": VECTOR_BYTES["int8"] + VECTOR_BYTES["int4g16"]}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


@pytest.mark.parametrize(("far", "score", "codes"), [("linear-elu", "far", INT8), ("delta", "novelty", INT8),
                                                     ("none", "keydiff", INT8), ("linear-elu", "far", INT4),
                                                     ("none", "keydiff", INT4), ("delta", "novelty", INT4G16),
                                                     ("none", "keydiff", INT4G16), ("delta", "far", K8V4G16),
                                                     ("none", "keydiff", K8V4G16)])
def test_coded_float64_forms_match_the_reference_closely(far: str, score: str, codes: dict[str, str]) -> None:
    assert_float64_forms_match(make(far, torch.float64, window=2, slots=3, sink_tokens=1, cache_score=score, **codes),
                               seed=22)


@pytest.mark.parametrize(("far", "score", "codes"), [("linear-hedgehog", "far", INT8), ("delta", "novelty", INT8),
                                                     ("none", "keydiff", INT8), ("delta", "novelty", INT4),
                                                     ("none", "keydiff", INT4G16)])
@pytest.mark.parametrize("form", ["parallel", "chunked"])
def test_coded_gradients_pass_straight_through(far: str, score: str, codes: dict[str, str], form: str) -> None:
    """float64 gradients of q, k, v, x and every parameter through either training form equal the reference's,
    whose rounding passes gradients straight through: a cached key or value still learns, also when it was cached
    in an earlier chunk (the state between chunks then carries the cache as its queries read it, not as codes)."""
    mixer = make(far, torch.float64, window=2, slots=2, sink_tokens=1, cache_score=score, **codes)
    unused = {"delta": (), "none": ("x", "mix_logit")}.get(far, ("x",))
    checks.assert_gradients_match(mixer, reference_of(mixer), 11, GRAD, form=form, unused=unused)


@pytest.mark.parametrize(("far", "codes"), [("linear-hedgehog", INT8), ("delta", INT8), ("delta", INT4)])
def test_coded_decisions_equal_across_forms_and_chunk_sizes(far: str, codes: dict[str, str]) -> None:
    """Chunks of any size and token steps end in the same codes, scales, mask, pending buffer and window, bit for
    bit; the one-token step's shortcut equals the general block over 40 tokens."""
    mixer = make(far, window=3, slots=2, **codes)
    assert_chunks_end_as_steps(mixer, seed=23, sizes=(1, 3, 5, 17))
    with torch.no_grad():
        general = make(far, window=3, slots=2, **codes)
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


@pytest.mark.parametrize("codes", [INT8, INT4, INT4G16, K8V4G16])
def test_a_call_codes_its_cache_once(codes: dict[str, str]) -> None:
    """Within one chunked call the cache passes from chunk to chunk as its codes give it and is coded after the last
    chunk: the outputs and the final state equal, bit for bit, those of one call per chunk (the cache coded after
    each), over 23 left-padded tokens in chunks of 5 (a cache of 4 slots that fills and evicts), and the state
    leaves the call as codes."""
    mixer = make("none", window=3, slots=4, sink_tokens=1, cache_score="keydiff", **codes)
    mixer.chunk_size = 5
    q, k, v, x = checks.random_inputs(SHAPE, 23, seed=31)
    inputs = MixerInputs(x, left_padded(23, PAD))
    with torch.no_grad():
        whole, whole_state = mixer.chunked(q, k, v, inputs, mixer.init_state(q.shape[0], q.device, q.dtype))
        state, outs = mixer.init_state(q.shape[0], q.device, q.dtype), []
        for start in range(0, 23, 5):
            part = slice(start, start + 5)
            out, state = mixer.chunked(q[:, :, part], k[:, :, part], v[:, :, part],
                                       slice_inputs(inputs, start, min(start + 5, 23)), state)
            outs.append(out)
    assert torch.equal(whole, torch.cat(outs, dim=1))
    assert whole_state.keys() == state.keys()
    for name in whole_state:
        assert torch.equal(whole_state[name], state[name]), name
    assert not whole_state["ck"].is_floating_point() and not whole_state["cv"].is_floating_point()
    assert bool(whole_state["cmask"].all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("cache_dtype", "dims"), [("int8", 16), ("int4", 16), ("int4", 96), ("int4g16", 16),
                                                   ("int4g16", 96)])
def test_a_held_pair_keeps_its_codes(dtype: torch.dtype, cache_dtype: str, dims: int) -> None:
    """What the forms carry is the test's own rounding (``HOLDS``: int4 with a scale per 32 dimensions, three for 96;
    int4g16 with a float16 one per 16, six for 96, stored as float16 without loss);
    the stored codes read back from it are the codes it was rounded to (so a pair that stays cached through many
    decisions is never rounded again), in a byte each for int8 and two to a byte for int4; a zero vector stays zero;
    the error is at most half a step of its group's scale."""
    codes_format = CODE_FORMATS[cache_dtype]
    x = torch.randn(3, 2, 50, dims, dtype=torch.float64).to(dtype) * torch.logspace(-3, 3, 50)[:, None].to(dtype)
    x[0, 0, 0] = 0
    codes, scale = codes_format.quantize(x)
    held, scale_again = codes_format.round_trip(x)
    assert torch.equal(scale, scale_again)
    assert codes.dtype == codes_format.codes_dtype and codes.element_size() == 1
    assert codes.shape[-1] == dims * codes_format.bits // 8 and scale.shape[-1] == codes_format.groups(dims)
    assert scale.shape[-1] == {"int8": 1, "int4": -(-dims // 32), "int4g16": dims // 16}[cache_dtype]
    assert torch.equal(codes_format.stored_scales(scale).to(scale.dtype), scale)
    wide = x.to(scale.dtype)  # bf16 vectors are rounded at their scales' float32
    expected = torch.stack([HOLDS[cache_dtype](row) for row in wide.reshape(-1, dims)]).reshape(x.shape).to(dtype)
    assert torch.equal(held, expected)
    assert torch.equal(codes_format.codes_of(held, scale), codes)
    assert torch.equal(codes_format.dequantize(codes_format.codes_of(held, scale), scale, dtype), held)
    assert not held[0, 0, 0].any()
    step = scale.to(torch.float64).repeat_interleave(dims // scale.shape[-1], dim=-1)
    assert ((held.double() - x.double()).abs() <= step / 2 + x.double().abs() * 2 ** -7).all()


@pytest.mark.parametrize("codes", [INT8, INT4, INT4G16, K8V4G16])
def test_coded_state_counts_its_bytes(codes: dict[str, str]) -> None:
    """The state holds the codes and the scales of each cached key and value; state_size counts the cache's keys and
    values at their bytes over four, the rest as before, and that is the state's real size in bytes (masks at four
    bytes, as everywhere) over four."""
    slots = 6
    mixer, plain = make("linear-elu", window=3, slots=slots, sink_tokens=2, **codes), make(
        "linear-elu", window=3, slots=slots, sink_tokens=2)
    cache_bytes = HK * slots * PAIR_BYTES[codes["cache_dtype"]]
    assert slot_elements(HK, D, slots, codes["cache_dtype"]) == cache_bytes // 4
    assert mixer.state_size(7) == mixer.state_size(10**6) == plain.state_size(1) - 2 * HK * D * slots + cache_bytes // 4
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    pair = pair_codes(codes["cache_dtype"])
    assert (state["ck"].dtype, state["cv"].dtype) == (pair.keys.codes_dtype, pair.values.codes_dtype)
    assert state["ck"].shape[-1] == pair.keys.stored_dims(D) and state["cv"].shape[-1] == pair.values.stored_dims(D)
    assert state["cks"].dtype == (torch.float16 if codes == INT4G16 else torch.float32)
    assert state["cvs"].dtype == (torch.float16 if codes in (INT4G16, K8V4G16) else torch.float32)
    real_bytes = sum(t.numel() * (4 if t.dtype == torch.bool else t.element_size()) for t in state.values())
    assert real_bytes == 4 * mixer.state_size(1)
    assert mixer.code_bytes() == cache_bytes and plain.code_bytes() == 0


@pytest.mark.parametrize("bytes_per_element", [2, 4])
@pytest.mark.parametrize("codes", [INT8, INT4, INT4G16, K8V4G16])
def test_reported_bytes_count_codes_at_their_bytes(bytes_per_element: int, codes: dict[str, str]) -> None:
    """The state-size report (cards, zoo, ``hf-recattn state-size``) counts a model's floating-point elements at the
    width asked for and its codes and scales at their own bytes: at bf16's two bytes an int8 cache is half its bf16
    size, not the quarter that its float32 element count would make it."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    coded = with_hybrid_options(model, codes)
    rows, plain_rows = state_size_report(coded.config, 64), state_size_report(model.config, 64)
    config = model.config
    slots = MODEL_SPECS["delta-novelty"]["cache_slots"]
    cache_bytes = config.num_key_value_heads * slots * PAIR_BYTES[codes["cache_dtype"]]
    for row, plain in zip(rows, plain_rows, strict=True):
        assert row.code_bytes == cache_bytes and plain.code_bytes == 0
        float_slots = 2 * config.num_key_value_heads * slots * config.head_dim
        expected = plain.state_bytes(bytes_per_element) - float_slots * bytes_per_element + cache_bytes
        assert row.state_bytes(bytes_per_element) == expected
        assert plain.state_bytes(bytes_per_element) == plain.state_elements * bytes_per_element


@pytest.mark.parametrize("codes", [INT8, INT4, INT4G16, K8V4G16])
def test_a_trained_model_runs_with_a_coded_cache(codes: dict[str, str]) -> None:
    """``cache_dtype`` adds no weights: a model trained as computed takes it as an option; its cache then holds codes,
    its exact-cache bytes fall, and greedy generation through the cache equals the full forward's."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    coded = with_hybrid_options(model, codes)
    assert coded.config.layer_spec(0)["cache_dtype"] == codes["cache_dtype"]
    ratio = exact_cache_bytes(coded.config, 64, 4) / exact_cache_bytes(model.config, 64, 4)
    assert 0.5 < ratio < 1.0  # the pending buffer (as computed) and masks stay; only the slots shrink
    assert_cached_generation_equals_uncached(coded)
    ids = torch.randint(1, 60, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert not torch.equal(coded(ids).logits, model(ids).logits)  # the codes are really read


def test_int4_holds_more_pairs_per_byte_than_int8() -> None:
    """At 64 dimensions (SmolLM2's heads) an int4 pair takes 80 bytes (32 + 32 bytes of codes, four scales), int8's
    136 and float32's 512; at 256 (Gemma 3's) 320, 520 and 2,048. int4g16's twice as many float16 scales take
    int4's bytes; k8v4g16's int8 key and int4g16 value 108 and 420."""
    names = ("int4", "int4g16", "k8v4g16", "int8")
    assert [pair_codes(d).pair_bytes(64) for d in names] == [80, 80, 108, 136]
    assert [pair_codes(d).pair_bytes(256) for d in names] == [320, 320, 420, 520]


def test_bad_cache_dtype_names_layer_and_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "hybrid", "cache_dtype": "int8"}, "layer 2",
         r"layer 2: option 'cache_dtype'='int8' sets how the exact cache holds its pairs, which is off "
         r"\(cache_slots: 0\)"),
        ({"mixer": "hybrid", "cache_slots": 2, "cache_dtype": "int2"}, "layer 2",
         r"layer 2: option 'cache_dtype' must be one of \['model', 'int8', 'int4', 'int4g16', 'k8v4g16'\], "
         r"got 'int2'"),
    ])
    spec = validate_spec({"mixer": "hybrid", "far": "none", "cache_slots": 2, "cache_score": "keydiff", **INT4},
                         "layer 3")
    with pytest.raises(ValueError, match=r"layer 3: option 'cache_dtype'='int4' packs 2 codes per byte with a scale "
                                         r"per 32 dimensions, which head_dim 48 does not divide into"):
        build_mixer(spec, MixerShape(hidden_size=96, num_heads=2, num_kv_heads=1, head_dim=48, layer_idx=3))
    spec = validate_spec({**spec, **INT4G16}, "layer 3")
    with pytest.raises(ValueError, match=r"layer 3: option 'cache_dtype'='int4g16' packs 2 codes per byte with a "
                                         r"scale per 16 dimensions, which head_dim 24 does not divide into"):
        build_mixer(spec, MixerShape(hidden_size=48, num_heads=2, num_kv_heads=1, head_dim=24, layer_idx=3))
    spec = validate_spec({**spec, **K8V4G16}, "layer 3")
    with pytest.raises(ValueError, match=r"layer 3: option 'cache_dtype'='k8v4g16' packs 2 codes per byte with a "
                                         r"scale per 16 dimensions, which head_dim 24 does not divide into \(its "
                                         r"values' codes\)"):
        build_mixer(spec, MixerShape(hidden_size=48, num_heads=2, num_kv_heads=1, head_dim=24, layer_idx=3))


@pytest.mark.parametrize(("codes", "words"), [
    (INT8, "int8 codes with a float32 scale per key and per value"),
    (INT4, "int4 codes (two per byte) with a float32 scale per 32 dimensions"),
    (INT4G16, "int4 codes (two per byte) with a float16 scale per 16 dimensions"),
    (K8V4G16, "int8 codes with a float32 scale per key, int4 codes (two per byte) with a float16 scale per 16 "
              "dimensions of each value"),
])
def test_the_card_says_how_the_cache_is_coded(codes: dict[str, str], words: str) -> None:
    """The model card's state table names how the exact cache holds its pairs, and its bytes shrink with the codes."""
    model = tiny_model(Case("delta-novelty", MODEL_SPECS["delta-novelty"]))
    plain, coded = state_table(model.config), state_table(with_hybrid_options(model, codes).config)
    assert words in coded
    assert "codes" not in plain and plain != coded
