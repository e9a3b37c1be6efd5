"""scripts/masked_teacher.py: the teacher's attention masked to a kept set, and the set a hybrid cache shows."""

from __future__ import annotations

import argparse

import pytest
import torch
from script_modules import load_script
from tiny_lm import save_tiny_teacher

from hf_recattn import from_teacher

oracle = load_script("scripts", "cache_oracle")
masked = load_script("scripts", "masked_teacher")

SINKS, WINDOW, SPREAD = 2, 4, 3


def _args(**changes: object) -> argparse.Namespace:
    values = {"sinks": SINKS, "window": WINDOW, "spread": SPREAD, "recent": 5, "fraction": 0.2, "seed": 0}
    return argparse.Namespace(**{**values, **changes})


@pytest.mark.parametrize("far", [{"mixer": "linear", "feature_map": "hedgehog"}, {"mixer": "delta", "rule": "gated"}],
                         ids=["linear far part", "gated delta far part"])
def test_the_cache_mask_is_what_the_hybrid_cache_shows(tmp_path, far: dict) -> None:  # noqa: ANN001
    """The teacher under the ``cache`` mask gives the logits of its hybrid conversion (far part off) whose cache
    keeps the needle, then the spread sample: the mask reproduces the cache's timing and contents exactly."""
    teacher = save_tiny_teacher(tmp_path / "teacher")
    needle = range(9, 12)
    hybrid = {"mixer": "hybrid", "window": WINDOW, "sink_tokens": SINKS, "far": far, "combine": "sum",
              "cache_slots": SPREAD + len(needle)}
    student = from_teacher(teacher, hybrid).eval()
    oracle.switch_far_off(student)
    oracle.override_cache_decisions(student, "needle+spread", needle)
    ids = torch.randint(5, 100, (1, 37), generator=torch.Generator().manual_seed(0))
    teacher.config._attn_implementation = "eager"
    visible = masked.visible_mask("cache", ids.shape[1], needle, _args())
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        expected = teacher(ids, attention_mask=bias).logits
        got = student(ids).logits
    assert (~visible).sum() > 300  # the mask hides most of the prompt from its late queries
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        unmasked = teacher(ids).logits
    assert (unmasked - expected).abs().max() > 1e-2  # the cache is not the full context


def test_cache_visibility_by_hand() -> None:
    """Window 4, 2 sinks, needle at 9..11, 6 slots: what query 20 sees."""
    visible = masked.cache_visible(21, range(9, 12), _args())[20]
    # left by query 20: positions 2..16 (15 tokens); one leaves at 20, so 14 count: 3 decisions of 4 -> 2..13 decided
    decided = torch.arange(2, 14)
    top = decided[oracle.spread_priority(decided).add(4.0 * ((decided >= 9) & (decided < 12))).topk(6).indices]
    expected = torch.zeros(21, dtype=torch.bool)
    expected[:2] = True
    expected[14:21] = True  # pending (14..16), the window (17..19) and the query
    expected[top] = True
    assert torch.equal(visible, expected)
    assert visible[9:12].all()


def test_fixed_sets() -> None:
    length, needle = 40, range(20, 23)
    spread = masked.kept_columns("spread", length, needle, _args())
    candidates = torch.arange(SINKS, length)
    chosen = set(candidates[oracle.spread_priority(candidates).topk(SPREAD).indices].tolist())
    assert set(spread.nonzero().flatten().tolist()) == {0, 1, 20, 21, 22} | chosen
    random = masked.kept_columns("random", length, needle, _args())
    assert torch.equal(random, masked.kept_columns("random", length, needle, _args()))  # seeded
    assert not torch.equal(random, masked.kept_columns("random", length, needle, _args(seed=1)))
    visible = masked.visible_mask("needle", length, needle, _args())
    assert torch.equal(visible[39].nonzero().flatten(), torch.tensor([0, 1, 20, 21, 22, 35, 36, 37, 38, 39]))
    assert torch.equal(masked.visible_mask("full", 5, needle, _args()), torch.ones(5, 5, dtype=torch.bool).tril())
