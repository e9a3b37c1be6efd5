"""The exact cache's one-pass block (modeling/hybrid_cache_newest.py, ``ExactCacheForms._newest_pass``): where the
decisions keep the newest pairs (``cache_score: recent``, or a block whose decisions evict nothing) and there is no
far part, a block runs as one masked softmax instead of one span per decision.

Checked against the span-by-span form of the same layer (``newest_pass = False``), which tests/test_hybrid_cache.py
checks against its float64 per-token reference: outputs of the parallel and chunked forms, the state after the
chunks (cache keys, values, scales, positions, masks) and float64 gradients, with sinks, left padding, the clamp and
the cache as int8 / int4 codes; that the one pass runs exactly where it applies (and not where a score evicts or a
far part takes the evicted pairs); the bookkeeping on a hand-made timing; and the float64 reference itself for
``recent`` without a far part, forms and gradients. Tolerances: float64 within 1e-10 relative (outputs, states) and
1e-9 (gradients); fp32 against the reference within 1e-5.
"""

from __future__ import annotations

from typing import Any

import mixer_checks as checks
import pytest
import torch
from generation_cases import one_thread
from mixer_checks import PAD, SHAPE
from mixer_steps import left_padded, run_chunked
from reference import real_rows, rel_err
from test_hybrid_cache import FP32, GRAD, make, reference_of

from hf_recattn import RecAttnConfig
from hf_recattn.modeling.hybrid_cache import NEVER, block_timing
from hf_recattn.modeling.hybrid_cache_newest import newest_after, newest_visible
from hf_recattn.modeling.hybrid_cached import ExactCacheForms
from hf_recattn.modeling.mixer_base import MixerInputs
from hf_recattn.modeling.mixers import build_mixer, validate_spec

FP64 = 1e-10
SEQ = 23
#: layers whose decisions keep the newest pairs: (options, whether a block's decisions evict); windows of 2-3,
#: chunks of 5, 2-4 slots over 23 tokens: the recent caches fill and evict, the large ones never fill
NEWEST: dict[str, dict[str, Any]] = {
    "recent": {"cache_score": "recent", "cache_slots": 3},
    "recent, sinks, int8": {"cache_score": "recent", "cache_slots": 4, "sink_tokens": 1, "cache_dtype": "int8"},
    "recent, sinks, int4, clamp": {"cache_score": "recent", "cache_slots": 2, "sink_tokens": 2, "cache_dtype": "int4",
                                   "distant_positions": "clamp", "clamp_distance": 6},
    "keydiff, never full": {"cache_score": "keydiff", "cache_slots": SEQ, "sink_tokens": 1},
    "novelty, never full, int4, clamp": {"cache_score": "novelty", "cache_slots": SEQ, "cache_dtype": "int4",
                                         "distant_positions": "clamp", "clamp_distance": 6},
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def layer(options: dict[str, Any], far: Any = "none", window: int = 3) -> Any:
    """A float64 hybrid with the cache and these options over ``far``, chunks of 5, its parameters perturbed; a
    config for the clamp's rotary."""
    spec = validate_spec({"mixer": "hybrid", "window": window, "far": far, "chunk_size": 5, **options}, "layer 5")
    config = RecAttnConfig(vocab_size=61, hidden_size=SHAPE.hidden_size, num_attention_heads=SHAPE.num_heads,
                           num_key_value_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim, num_hidden_layers=6,
                           max_position_embeddings=64)
    mixer = build_mixer(spec, SHAPE, config).double()
    checks.perturb_parameters(mixer, scale=0.3)
    return mixer


def both_ways(mixer: Any, run: Any) -> tuple[Any, Any]:
    """``run(mixer)`` in one pass and span by span."""
    one = run(mixer)
    mixer.newest_pass = False
    try:
        return one, run(mixer)
    finally:
        del mixer.newest_pass


def forms(mixer: Any, inputs: tuple[torch.Tensor, ...], mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The parallel outputs, the chunked outputs and the chunked form's final state (sorted by name)."""
    q, k, v, x = inputs
    parallel = mixer.parallel(q, k, v, MixerInputs(x, mask))
    chunked, state = run_chunked(mixer, q, k, v, x, mask)
    return (parallel, chunked, *(state[name] for name in sorted(state)))


def count_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of one-pass blocks (one entry per call)."""
    calls: list[int] = []
    original = ExactCacheForms._newest_pass

    def spy(self: Any, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(ExactCacheForms, "_newest_pass", spy)
    return calls


@pytest.mark.parametrize("name", NEWEST, ids=list(NEWEST))
def test_one_pass_equals_span_by_span(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs of both forms and every entry of the state after the chunks agree within 1e-10 (float64, the second
    row left-padded), and the one pass ran in every block; the recent caches evicted (their cache is full and holds
    none of the first tokens), the large ones did not."""
    mixer = layer(NEWEST[name])
    inputs = checks.random_inputs(SHAPE, SEQ, torch.float64, seed=3)
    mask = left_padded(SEQ, PAD)
    calls = count_passes(monkeypatch)
    with torch.no_grad():
        one, spans = both_ways(mixer, lambda m: forms(m, inputs, mask))
    assert len(calls) == 1 + -(-SEQ // 5)  # the parallel block and every chunk
    for a, b in zip(one, spans, strict=True):
        if a.is_floating_point():
            assert rel_err(a, b) < FP64
        else:
            assert torch.equal(a, b)
    state = run_chunked(mixer, *inputs, mask)[1]
    slots = NEWEST[name]["cache_slots"]
    assert bool(state["cmask"].all()) == (slots < SEQ)


@pytest.mark.parametrize("name", ["recent, sinks, int4, clamp", "keydiff, never full"])
def test_one_pass_gradients_equal_span_by_span(name: str) -> None:
    """float64 gradients of q, k and v through the parallel and the chunked form (codes: straight through their
    rounding) agree within 1e-9."""
    mixer = layer(NEWEST[name])
    mask = left_padded(SEQ, PAD)

    def gradients(m: Any) -> list[torch.Tensor]:
        q, k, v, x = (t.requires_grad_() for t in checks.random_inputs(SHAPE, SEQ, torch.float64, seed=5))
        out = m.parallel(q, k, v, MixerInputs(x, mask)) + run_chunked(m, q, k, v, x, mask)[0]
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        (out * weights * mask[:, :, None, None]).sum().backward()  # the real rows ([B, T, H, D])
        return [q.grad, k.grad, v.grad]

    one, spans = both_ways(mixer, gradients)
    for a, b in zip(one, spans, strict=True):
        assert a.abs().sum() > 0 and rel_err(a, b) < GRAD


def test_a_cache_that_never_fills_trains_alike_under_every_score_without_a_far_part() -> None:
    """Slots for every token: no decision evicts, so the scores that need no far part (keydiff, keydiff_span,
    novelty, recent) give the same outputs of both forms and the same float64 gradients, in one pass and span by
    span (why a recipe that only changes such a score trains as its parent when no training block fills the cache)."""
    mask = left_padded(SEQ, PAD)

    def run(m: Any) -> list[torch.Tensor]:
        q, k, v, x = (t.requires_grad_() for t in checks.random_inputs(SHAPE, SEQ, torch.float64, seed=7))
        out = m.parallel(q, k, v, MixerInputs(x, mask)) + run_chunked(m, q, k, v, x, mask)[0]
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (out * weights * mask[:, :, None, None]).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    first = layer({"cache_score": "keydiff", "cache_slots": SEQ, "sink_tokens": 1})
    expected = run(first)
    for score in ("keydiff_span", "novelty", "recent"):
        mixer = layer({"cache_score": score, "cache_slots": SEQ, "sink_tokens": 1})
        mixer.load_state_dict(first.state_dict())
        for got in both_ways(mixer, run):
            for a, b in zip(got, expected, strict=True):
                assert rel_err(a, b) < FP64


@pytest.mark.parametrize(("options", "far", "form"), [
    ({"cache_score": "keydiff", "cache_slots": 3}, "none", "parallel"),  # one block of 23 tokens: a score evicts
    ({"cache_score": "recent", "cache_slots": 3}, {"mixer": "linear", "feature_map": "elu"}, "parallel"),
    ({"cache_score": "recent", "cache_slots": 3}, {"mixer": "linear", "feature_map": "elu"}, "chunked"),
])
def test_the_spans_run_where_the_decisions_do_not_keep_the_newest(options: dict[str, Any], far: Any, form: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose decisions a score other than ``recent`` makes and that evicts, or a far part that takes the
    evicted pairs: span by span (a chunk of keydiff's that evicts nothing may still run in one pass)."""
    mixer = layer(options, far=far)
    inputs = checks.random_inputs(SHAPE, SEQ, torch.float64, seed=3)
    calls = count_passes(monkeypatch)
    with torch.no_grad():
        checks.outputs_of(mixer, form, inputs, left_padded(SEQ, PAD))
    assert not calls


def test_newest_bookkeeping_on_a_hand_made_block() -> None:
    """Window 1, 2 slots, a cache holding one pair, a block of 5 real tokens after a window token: the tokens leave
    one per query, each decided at once; query j sees the newest two decided, and the cache after the block holds
    the last two that left (U indices 1, 2, 3 left at queries 0, 1, 2; 4 and 5 are still inside)."""
    pmask, wmask = torch.zeros(1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool)
    timing = block_timing(pmask, wmask, torch.ones(1, 5, dtype=torch.bool), 1)
    cmask = torch.tensor([[True, False]])
    assert timing.rank.tolist() == [[NEVER, 1, 2, 3, 4, 5, NEVER]]
    old, new = newest_visible(timing, cmask, 1, 2)
    assert old[0, 0, 0].tolist() == [[True, False], [True, False], [False, False], [False, False], [False, False]]
    assert new[0, 0, 0].int().tolist() == [[0] * 7, [0, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0],
                                           [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0]]
    index, mask = newest_after(timing, cmask, 1, 2)
    assert mask.tolist() == [[True, True]] and (index - 2).tolist() == [[4, 5]]  # candidates: 2 slots, then U


@pytest.mark.parametrize("dtype", ["model", "int8"])
@pytest.mark.parametrize("sinks", [0, 1])
def test_recent_without_a_far_part_matches_the_reference(sinks: int, dtype: str) -> None:
    """fp32 parallel and chunked forms within 1e-5 of the float64 reference of tests/test_hybrid_cache.py, and
    float64 gradients within 1e-9 (the model's pairs; int8's rounding has no gradient of its own to compare)."""
    mixer = make("none", sink_tokens=sinks, cache_score="recent", cache_dtype=dtype)
    inputs = checks.random_inputs(SHAPE, 14, seed=7)
    mask = left_padded(14, PAD)
    with torch.no_grad():
        expected = reference_of(mixer)(inputs, mask)
        for form in ("parallel", "chunked"):
            assert rel_err(real_rows(checks.outputs_of(mixer, form, inputs, mask), mask), expected) < FP32, form
    if dtype == "model":
        grads = make("none", torch.float64, window=2, slots=2, sink_tokens=sinks, cache_score="recent")
        checks.assert_gradients_match(grads, reference_of(grads), 11, GRAD, unused=("x", "mix_logit"))
