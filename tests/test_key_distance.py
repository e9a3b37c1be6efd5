"""The hybrid's ``distant_positions: clamp`` (modeling/key_distance.py): sinks and exact cache slots more than D tokens
back scored as if exactly D back. Every form (parallel, chunked, token steps, cached prefill + steps; left padding)
against the float64 reference of tests/reference_key_distance.py at D = 8, under the default rotary and a scaled,
partial one; the cache's positions following its keys through evictions; within D the model equal, bit for bit, to
``absolute``; generation with and without the cache equal; the length limit lifted; a saved model reloaded with its
clamp; bad specs refused.

Tolerances: float64 forms within 1e-10 relative of each other and 1e-7 of the reference (the layer turns keys back
by its rotary's own frequencies, float32 numbers, where the reference takes them exact); fp32 generation logits
within 1e-4 (as tests/test_hybrid_cache.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mixer_checks as checks
import pytest
import reference_key_distance as ref
import torch
from generation_cases import Case, one_thread, tiny_model
from mixer_checks import PAD, SHAPE
from mixer_steps import left_padded, run_chunked
from reference import real_rows, rel_err
from test_hybrid_cache import assert_cached_generation_equals_uncached

from hf_recattn import RecAttnConfig
from hf_recattn.modeling.hybrid_options import with_hybrid_options
from hf_recattn.modeling.mixers import build_mixer, validate_spec

LIMIT, SEQ, WINDOW = 8, 24, 3
ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, ref.frequencies(SHAPE.head_dim, 10000.0)),
    "linear, partial": ({"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0, "partial_rotary_factor": 0.5},
                        ref.frequencies(SHAPE.head_dim, 100.0, partial=0.5, factor=2.0)),
}
#: a window with sinks; an exact cache large enough never to evict (every real key stays an exact softmax key)
LAYERS = {
    "sinks": ({"sink_tokens": 2}, lambda mask: ref.sinks_and_window(mask, 2, WINDOW)),
    "cache, sinks": ({"sink_tokens": 2, "cache_slots": SEQ, "cache_score": "novelty"}, ref.every_real_key),
    "cache": ({"cache_slots": SEQ, "cache_score": "novelty"}, ref.every_real_key),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def config(rope: dict[str, Any] | None = None, positions: int = LIMIT + 1) -> RecAttnConfig:
    """A config for SHAPE (its layer index included) whose rotary the mixer reads: D = max_position_embeddings - 1."""
    return RecAttnConfig(vocab_size=61, hidden_size=SHAPE.hidden_size, num_attention_heads=SHAPE.num_heads,
                         num_key_value_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, num_hidden_layers=6,
                         max_position_embeddings=positions, rope_parameters=rope)


def hybrid(options: dict[str, Any], **more: Any) -> dict[str, Any]:
    return validate_spec({"mixer": "hybrid", "window": WINDOW, "far": "none", "chunk_size": 5,
                          "distant_positions": "clamp", **options, **more}, "test")


def rotated_inputs(theta: list[float], mask: torch.Tensor, seed: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """float64 (q, k, v, x) with q and k rotated at each token's position (its real index), and the un-rotated
    q0, k0 with the positions."""
    q0, k0, v, x = checks.random_inputs(SHAPE, mask.shape[1], torch.float64, seed=seed)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    return (ref.rotate(q0, positions, theta), ref.rotate(k0, positions, theta), v, x), (q0, k0, positions)


@pytest.mark.parametrize("rope", ROPES, ids=list(ROPES))
@pytest.mark.parametrize("layer", LAYERS, ids=list(LAYERS))
def test_every_form_matches_the_reference(rope: str, layer: str) -> None:
    """Parallel, chunked (chunks of 5), token steps and a prefill of 5 + steps over 24 tokens, the second row
    left-padded by 3: the reference's outputs at D = 8, which differ from unclamped attention (the clamp acts)."""
    rope_parameters, theta = ROPES[rope]
    options, visibility = LAYERS[layer]
    mixer = build_mixer(hybrid(options), SHAPE, config(rope_parameters)).double()
    mask = left_padded(SEQ, PAD)
    inputs, (q0, k0, positions) = rotated_inputs(theta, mask)
    parallel, _ = checks.assert_forms_agree(mixer, inputs, mask, 1e-10)
    expected = ref.clamped_attention(q0, k0, inputs[2], positions, theta, LIMIT, visibility(mask))
    assert rel_err(real_rows(parallel, mask), real_rows(expected, mask)) <= 1e-7
    unclamped = ref.clamped_attention(q0, k0, inputs[2], positions, theta, SEQ, visibility(mask))
    assert rel_err(real_rows(unclamped, mask), real_rows(expected, mask)) > 1e-2


def test_cached_positions_follow_their_keys_through_evictions() -> None:
    """A cache of 2 slots over 40 tokens (decisions every 3 real tokens, a gated delta far part): every form agrees,
    and each filled slot's position is that of the token whose key it holds (the padded row's shifted by its
    padding), as are the pending buffer's and the window's."""
    mixer = build_mixer(hybrid({"sink_tokens": 1, "cache_slots": 2, "combine": "sum",
                                "far": {"mixer": "delta", "rule": "gated"}}), SHAPE, config()).double()
    checks.perturb_parameters(mixer)
    seq, pad = 40, 5
    mask = left_padded(seq, pad)
    inputs, (_, _, positions) = rotated_inputs(ROPES["default"][1], mask, seed=4)
    with torch.no_grad():
        checks.assert_forms_agree(mixer, inputs, mask, 1e-10)
        _, state = run_chunked(mixer, *inputs, mask)
    k = inputs[1]
    for b in range(2):
        offset = pad if b else 0
        for name, mask_name in (("c", "cmask"), ("p", "pmask"), ("w", "wmask")):
            for slot in state[mask_name][b].nonzero().flatten().tolist():
                for h in range(SHAPE.num_kv_heads):
                    pos = state[f"{name}pos"][b, h, slot] if name == "c" else state[f"{name}pos"][b, slot]
                    assert positions[b, int(pos) + offset] == pos
                    assert torch.equal(state[f"{name}k"][b, h, slot], k[b, h, int(pos) + offset]), (name, b, slot)
    # both rows' caches full, with keys that left the window long after the first decisions: evictions happened
    assert bool(state["cmask"].all()) and int(state["cpos"].max()) > 2 * LIMIT


MODEL = {"mixer": "hybrid", "window": 3, "sink_tokens": 1, "cache_slots": 2, "combine": "sum",
         "far": {"mixer": "delta", "rule": "gated"}}


def test_within_the_distance_the_model_is_the_absolute_one_bit_for_bit() -> None:
    """Up to D + 1 tokens (no key farther than D) the clamped model's logits, uncached and through the cache
    token by token, equal the absolute model's exactly; one token more and they differ."""
    absolute = checks.tiny_perturbed_model(MODEL)
    clamped = with_hybrid_options(absolute, {"distant_positions": "clamp", "clamp_distance": LIMIT})
    ids = torch.randint(1, 61, (2, LIMIT + 2), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(absolute(ids[:, : LIMIT + 1]).logits, clamped(ids[:, : LIMIT + 1]).logits)
        steps = []
        for model in (absolute, clamped):
            cache = model.new_cache()
            steps.append(torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                                    for t in range(LIMIT + 1)], dim=1))
        assert torch.equal(steps[0], steps[1])
        a, c = absolute(ids).logits, clamped(ids).logits
    assert torch.equal(a[:, : LIMIT + 1], c[:, : LIMIT + 1]) and not torch.allclose(a[:, -1], c[:, -1])


GENERATION = {
    "sinks, linear far part": {"mixer": "hybrid", "window": 2, "sink_tokens": 2, "distant_positions": "clamp",
                               "clamp_distance": 4, "far": {"mixer": "linear", "feature_map": "hedgehog"}},
    "sinks, cache, delta": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "combine": "sum", "sink_tokens": 1,
                            "far": {"mixer": "delta"}, "cache_score": "novelty", "distant_positions": "clamp",
                            "clamp_distance": 4},
    "cache, no far part": {"mixer": "hybrid", "window": 2, "cache_slots": 3, "far": "none", "sink_tokens": 1,
                           "cache_score": "novelty", "distant_positions": "clamp", "clamp_distance": 5},
}


@pytest.mark.parametrize("name", GENERATION, ids=list(GENERATION))
def test_cached_generation_equals_uncached(name: str) -> None:
    """Left-padded rows of 6, 8 and 9 tokens and 8 new ones, D of 4-5: greedy tokens with the cache equal the
    uncached ones, logits within 1e-4 of the full forward's."""
    assert_cached_generation_equals_uncached(tiny_model(Case(name, GENERATION[name])))


def test_the_clamp_lifts_the_length_limit() -> None:
    """Sinks and an exact cache bound a model at max_position_embeddings; clamped they do not (unless another layer
    needs positions), and the model generates past it."""
    spec = {"mixer": "hybrid", "window": 2, "sink_tokens": 1, "cache_slots": 2, "far": {"mixer": "delta"},
            "combine": "sum"}
    absolute = tiny_model(Case("absolute", spec), max_positions=12)
    clamped = with_hybrid_options(absolute, {"distant_positions": "clamp"})
    assert absolute.length_limit() == 12 and clamped.length_limit() is None
    assert clamped.model.layers[0].self_attn.mixer.distance.limit == 11
    ids = torch.randint(1, 61, (1, 10), generator=torch.Generator().manual_seed(0))
    out = clamped.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 30
    with pytest.raises(ValueError, match="max_position_embeddings=12"):
        absolute.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    mixed = RecAttnConfig(**{**clamped.config.to_dict(), "attention_overrides": {"1": {"mixer": "softmax"}}})
    assert mixed.length_limit() == 12


def test_a_saved_clamped_model_loads_with_its_frequencies(tmp_path: Path) -> None:
    """``from_pretrained`` builds the layers on the meta device: the clamp's rotary frequencies, which are no weights,
    must come back real and the reloaded model give the saved one's logits, past the clamp distance included."""
    spec = {"mixer": "hybrid", "window": 2, "sink_tokens": 1, "cache_slots": 2, "far": "none",
            "cache_score": "keydiff", "distant_positions": "clamp", "clamp_distance": 4}
    model = tiny_model(Case("clamped", spec)).eval()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert loaded.model.layers[0].self_attn.mixer.distance.inv_freq.device.type == "cpu"
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("options", "pattern"), [
    ({"clamp_distance": 8}, "option 'clamp_distance'=8 needs distant_positions='clamp'"),
    ({"distant_positions": "clamp", "clamp_distance": 1}, "'clamp_distance'=1 is below the 2 tokens back"),
    ({"distant_positions": "clamp", "clamp_distance": 4, "cache_slots": 2, "cache_score": "novelty"},
     "'clamp_distance'=4 is below the 5 tokens back that the window and the pending buffer"),
    ({"distant_positions": "nearest"}, "option 'distant_positions' must be one of"),
    ({"distant_positions": "clamp", "clamp_distance": 0}, "option 'clamp_distance' must be >= 1"),
])
def test_bad_specs_are_refused(options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate_spec({"mixer": "hybrid", "window": 3, "far": "none", "sink_tokens": 1, **options}, "layer 2")


def test_bad_settings_are_refused_at_build() -> None:
    """D past max_position_embeddings - 1, a rotary whose frequencies follow the length, no config: the layer named."""
    spec = hybrid({"sink_tokens": 1}, clamp_distance=LIMIT + 1)
    with pytest.raises(ValueError, match="layer 5: option 'clamp_distance'=9 is past max_position_embeddings - 1 = 8"):
        build_mixer(spec, SHAPE, config())
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="layer 5: .*rope_type 'dynamic'"):
        build_mixer(hybrid({"sink_tokens": 1}), SHAPE, config(dynamic))
    with pytest.raises(ValueError, match="layer 5: .*needs the model's config"):
        build_mixer(hybrid({"sink_tokens": 1}), SHAPE, None)
    assert build_mixer(hybrid({"sink_tokens": 1}, rope=False), SHAPE, None).distance is None


def test_absolute_is_the_default_and_keeps_the_state() -> None:
    """Without the option the layer is as before: no clamp, no positions in its state, its need for positions."""
    spec = validate_spec({"mixer": "hybrid", "window": 3, "far": "none", "sink_tokens": 1, "cache_slots": 2,
                          "cache_score": "novelty"}, "test")
    mixer = build_mixer(spec, SHAPE, config(positions=64))
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert mixer.distance is None and not any(name.endswith("pos") for name in state)
