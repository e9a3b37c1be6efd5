"""The conversion report's hybrid parts: window-only and far-only models built from a trained hybrid."""

from __future__ import annotations

import copy

import pytest
import torch
from mixer_checks import tiny_perturbed_model

from hf_recattn.modeling.variants import variant_models


@pytest.mark.parametrize("sinks", [0, 2])
def test_window_only_is_the_hybrid_with_the_far_part_shut(sinks: int) -> None:
    """Shutting the far part (window share g -> 1) leaves softmax over the window (and the sinks): the
    window-only variant must compute exactly that, sinks included; far-only keeps the trained far mixer."""
    model = tiny_perturbed_model({"mixer": "hybrid", "window": 3, "sink_tokens": sinks,
                  "far": {"mixer": "linear", "feature_map": "hedgehog"}})
    variants = variant_models(model)
    shut = copy.deepcopy(model)
    with torch.no_grad():
        for layer in shut.model.layers:
            layer.self_attn.mixer.mix_logit.fill_(60.0)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = shut(input_ids=ids, attention_mask=mask).logits
        got = variants["window-only"](input_ids=ids, attention_mask=mask).logits
        hybrid = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-5
    assert (got - hybrid)[real].abs().max() > 1e-3  # the far part did matter in the hybrid
    far = variants["far-only"].model.layers[0].self_attn.mixer
    trained = model.model.layers[0].self_attn.mixer.far
    assert torch.equal(far.feature_map.q_weight, trained.feature_map.q_weight)


def test_retrieval_heads_stay_exact_in_both_variants() -> None:
    """Beside retrieval heads, the variants take the hybrid's parts apart the same way: window-only is the far part
    shut (the retrieval heads untouched), far-only keeps the trained far mixer of the other heads."""
    hybrid = {"mixer": "hybrid", "window": 3, "sink_tokens": 2, "far": {"mixer": "linear", "feature_map": "hedgehog"}}
    model = tiny_perturbed_model({"mixer": "retrieval_heads", "heads": [1], "others": hybrid})
    variants = variant_models(model)
    assert variants["far-only"].config.layer_spec(0)["others"]["mixer"] == "linear"
    assert variants["window-only"].config.layer_spec(0)["heads"] == [1]
    shut = copy.deepcopy(model)
    with torch.no_grad():
        for layer in shut.model.layers:
            layer.self_attn.mixer.rest.mix_logit.fill_(60.0)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = shut(input_ids=ids).logits
        got = variants["window-only"](input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    far = variants["far-only"].model.layers[0].self_attn.mixer.rest
    trained = model.model.layers[0].self_attn.mixer.rest.far
    assert torch.equal(far.feature_map.q_weight, trained.feature_map.q_weight)
