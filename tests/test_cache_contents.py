"""scripts/cache_contents.py: tracing a hybrid's cached pairs back to their prompt positions."""

from __future__ import annotations

import torch
from mixer_checks import tiny_perturbed_model
from script_modules import load_script

from hf_recattn.modeling.hybrid_options import with_hybrid_options

contents = load_script("scripts", "cache_contents")

WINDOW, SINKS = 3, 1
HYBRID = {"mixer": "hybrid", "window": WINDOW, "sink_tokens": SINKS,
          "far": {"mixer": "linear", "feature_map": "hedgehog"}}


def _prompt(decided: int) -> list[int]:
    """Distinct token ids (so that no two tokens share a value in the first layer): the sinks, ``decided`` tokens
    that have left the window and been decided, the window."""
    return torch.randperm(61, generator=torch.Generator().manual_seed(0))[: SINKS + decided + WINDOW].tolist()


def test_a_cache_that_evicts_nothing_holds_every_decided_token_in_order() -> None:
    model = with_hybrid_options(tiny_perturbed_model(HYBRID), {"cache_slots": 4 * WINDOW}).eval()
    found = contents.cached_positions(model, _prompt(3 * WINDOW))
    assert sorted(found) == [0, 1]
    decided = torch.arange(SINKS, SINKS + 3 * WINDOW)
    for positions in found.values():
        for row in positions:
            assert torch.equal(row[: 3 * WINDOW], decided)
            assert (row[3 * WINDOW :] == -1).all()  # empty slots


def test_a_full_cache_holds_distinct_decided_tokens_and_counts_the_needle() -> None:
    model = with_hybrid_options(tiny_perturbed_model(HYBRID), {"cache_slots": 2}).eval()
    found = contents.cached_positions(model, _prompt(4 * WINDOW))
    for positions in found.values():
        for row in positions:
            assert row.unique().numel() == 2
            assert ((row >= SINKS) & (row < SINKS + 4 * WINDOW)).all()
    rows = contents.summary(found, range(SINKS, SINKS + 4 * WINDOW))
    assert all(h["needle"] == h["cached"] == 2 for heads in rows.values() for h in heads)
    assert contents.summary(found, range(0, SINKS))[0][0]["needle"] == 0  # a sink is never a cached pair
