"""scripts/cache_oracle.py: a hybrid's cache decisions overridden by prompt position (the needle, a spread sample)."""

from __future__ import annotations

import pytest
import torch
from mixer_checks import tiny_perturbed_model
from script_modules import load_script

from hf_recattn.modeling.cache_scores import far_recall
from hf_recattn.modeling.hybrid_options import with_hybrid_options

oracle = load_script("scripts", "cache_oracle")
contents = load_script("scripts", "cache_contents")

WINDOW, SINKS, SLOTS = 3, 1, 4
FAR_PARTS = {
    "linear (leaving keys)": {"mixer": "linear", "feature_map": "hedgehog"},
    "gated delta (arriving tokens)": {"mixer": "delta", "rule": "gated"},
}


def _model(far: dict, score: str = "far") -> torch.nn.Module:
    hybrid = {"mixer": "hybrid", "window": WINDOW, "sink_tokens": SINKS, "far": far, "combine": "sum"}
    return with_hybrid_options(tiny_perturbed_model(hybrid), {"cache_slots": SLOTS, "cache_score": score}).eval()


def _prompt(decided: int) -> list[int]:
    """Distinct token ids: the sinks, ``decided`` tokens that have left the window and been decided, the window."""
    return torch.randperm(61, generator=torch.Generator().manual_seed(1))[: SINKS + decided + WINDOW].tolist()


def _cached(model: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    return contents.cached_positions(model, ids)


SCORED = {f"{name}, {score}": (far, score) for name, far in FAR_PARTS.items() for score in ("far", "novelty")}


@pytest.mark.parametrize(("far", "score"), SCORED.values(), ids=SCORED.keys())
def test_the_needle_stays_cached_in_every_head(far: dict, score: str) -> None:
    """The override wraps whichever score the layer uses (``cache_score``)."""
    ids = _prompt(5 * WINDOW)
    needle = range(SINKS + 2, SINKS + 2 + SLOTS)  # left the window early: every later decision must keep it
    plain = _cached(_model(far, score), ids)
    assert any(set(row.tolist()) != set(needle) for rows in plain.values() for row in rows)  # not kept by itself
    model = _model(far, score)
    oracle.override_cache_decisions(model, "needle", needle)
    for rows in _cached(model, ids).values():
        for row in rows:
            assert sorted(row.tolist()) == list(needle)


def test_only_the_layers_named_are_overridden() -> None:
    ids = _prompt(5 * WINDOW)
    needle = range(SINKS + 2, SINKS + 2 + SLOTS)
    far = FAR_PARTS["linear (leaving keys)"]
    plain = _cached(_model(far), ids)
    model = _model(far)
    oracle.override_cache_decisions(model, "needle", needle, layers=[1])
    found = _cached(model, ids)
    assert torch.equal(found[0], plain[0])
    assert all(sorted(row.tolist()) == list(needle) for row in found[1])


@pytest.mark.parametrize("far", FAR_PARTS.values(), ids=FAR_PARTS.keys())
def test_the_spread_sample_is_the_top_priorities_of_every_decided_position(far: dict) -> None:
    ids = _prompt(6 * WINDOW)
    decided = torch.arange(SINKS, SINKS + 6 * WINDOW)
    expected = sorted(decided[oracle.spread_priority(decided).topk(SLOTS).indices].tolist())
    model = _model(far)
    oracle.override_cache_decisions(model, "spread", range(0))
    for rows in _cached(model, ids).values():
        for row in rows:
            assert sorted(row.tolist()) == expected


def test_needle_and_spread_keep_the_needle_then_the_spread() -> None:
    positions = torch.tensor([[0, 5, 6, 7, 9, -1]])
    own = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.0, 7.0]])
    score = oracle.position_score("needle+spread", range(5, 7))(positions, own)
    order = score.argsort(descending=True)[0].tolist()
    assert set(order[:2]) == {1, 2}  # the needle first
    assert score[0, 5] == 7.0  # an untraced pair keeps its own score
    assert torch.allclose(score[0, [0, 3, 4]].double(), oracle.spread_priority(torch.tensor([0, 7, 9])), atol=1e-6)


def test_spread_priorities_cover_a_prefix_evenly() -> None:
    positions = torch.arange(1000)
    top = positions[oracle.spread_priority(positions).topk(50).indices].sort().values
    gaps = top.diff()
    assert gaps.max() <= 3 * 1000 / 50  # no long stretch left out (a random sample of 50 leaves gaps near 130)


def test_a_key_is_traced_to_its_position_and_an_unknown_one_to_minus_one() -> None:
    recorded = 30.0 + torch.randn(2, 40, 64)  # past 25 rows, where cdist's matrix-product form loses 1e-5
    keys = torch.stack([recorded[:, 35], recorded[:, 2], torch.full((2, 64), 9.0)], dim=1)
    assert oracle.key_positions(keys, recorded).tolist() == [[35, 2, -1], [35, 2, -1]]


def test_far_off_and_bad_input() -> None:
    model = _model(FAR_PARTS["linear (leaving keys)"])
    oracle.switch_far_off(model)
    assert all((m.mix_logit == 30.0).all() for m in oracle.hybrid_mixers(model))
    with pytest.raises(ValueError, match="--keep: unknown 'oracle'"):
        oracle.position_score("oracle", range(0))
    without = with_hybrid_options(model, {"cache_slots": 0})
    with pytest.raises(ValueError, match="no hybrid layer has an exact cache"):
        oracle.override_cache_decisions(without, "needle", range(0))
    with pytest.raises(ValueError, match=r"--layers: \[2\] are not among the 2 cached hybrid layers"):
        oracle.override_cache_decisions(model, "needle", range(0), [0, 2])
    oracle.override_cache_decisions(model, "needle", range(0))
    with pytest.raises(ValueError, match="one prompt at a time"):
        model(torch.tensor([_prompt(3 * WINDOW)] * 2))


def test_a_trial_plants_the_key_traces_its_needle_and_leaves_the_model_as_it_was() -> None:
    from tiny_lm import tiny_tokenizer

    from hf_recattn import RecAttnConfig, RecAttnForCausalLM

    tok = tiny_tokenizer()
    hybrid = {"mixer": "hybrid", "window": 8, "sink_tokens": 2, "cache_slots": 8, "combine": "sum",
              "far": {"mixer": "delta", "rule": "gated"}}
    torch.manual_seed(0)
    model = RecAttnForCausalLM(RecAttnConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attention=hybrid)).eval()
    before = [m.mix_logit.clone() for m in oracle.hybrid_mixers(model)]
    args = oracle.argparse.Namespace(keep="needle+spread", layers=None, far_off=True, new_tokens=3)
    row = oracle.trial(model, tok, 240, "12345", 0.5, args)
    ids, _ = oracle.passkey_ids(tok, 240, "12345", 0.5)
    needle = tok.decode(ids[row["needle"][0] : row["needle"][1]])
    assert "12345" in needle.replace(" ", "") and row["back"] == 240 - row["needle"][0]
    assert row["correct"] == ("12345" in row["answer"].replace(" ", ""))
    assert all(torch.equal(b, m.mix_logit) for b, m in zip(before, oracle.hybrid_mixers(model), strict=True))
    assert all(m.cache_score is far_recall for m in oracle.hybrid_mixers(model))  # the overrides went to a copy
