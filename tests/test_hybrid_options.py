"""A trained hybrid evaluated with changed options and the same weights (modeling/hybrid_options.py), and the
``hf-recattn eval --hybrid-option`` parsing."""

from __future__ import annotations

import pytest
import torch
from mixer_checks import tiny_perturbed_model

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.cli.evaluate import hybrid_options
from hf_recattn.modeling.hybrid_options import with_hybrid_options
from hf_recattn.state_size import state_size_report

HYBRID = {"mixer": "hybrid", "window": 3, "sink_tokens": 1, "far": {"mixer": "linear", "feature_map": "hedgehog"}}


def ids() -> torch.Tensor:
    return torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))


def test_the_cache_added_after_training_is_the_model_built_with_it() -> None:
    """The changed model holds the trained weights unchanged and computes what a model built with the cache and
    given those weights computes; the cache changes the output of long enough sequences."""
    model = tiny_perturbed_model(HYBRID)
    cached = with_hybrid_options(model, {"cache_slots": 4})
    assert not cached.training
    assert [s["cache_slots"] for s in cached.config.layer_specs()] == [4, 4]
    assert model.config.layer_spec(0)["cache_slots"] == 0  # the model given is left as it was
    trained = model.state_dict()
    for key, value in cached.state_dict().items():
        assert torch.equal(value, trained[key]), key
    built = RecAttnForCausalLM(RecAttnConfig(**{**model.config.to_dict(),
                                                "attention": {**HYBRID, "cache_slots": 4}})).eval()
    built.load_state_dict(trained)
    with torch.no_grad():
        got, want, plain = (m(input_ids=ids()).logits for m in (cached, built, model))
    assert torch.equal(got, want)
    assert (got - plain).abs().max() > 1e-4
    bigger = sum(r.state_elements for r in state_size_report(cached.config, 1024))
    assert bigger > sum(r.state_elements for r in state_size_report(model.config, 1024))


def test_the_changed_model_holds_the_same_tensors_not_copies() -> None:
    """No second copy of the weights: every parameter of the changed model is the trained model's tensor (the same
    storage), its buffers are real tensors made for its own config, and the model given still computes as before."""
    model = tiny_perturbed_model(HYBRID)
    with torch.no_grad():
        before = model(input_ids=ids()).logits
    cached = with_hybrid_options(model, {"cache_slots": 4, "cache_dtype": "int8"})
    trained = dict(model.named_parameters())
    assert all(p.data_ptr() == trained[name].data_ptr() for name, p in cached.named_parameters())
    assert not any(b.is_meta for b in cached.buffers())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids()).logits, before)


def test_only_the_hybrid_layers_change_nested_ones_included() -> None:
    """A softmax layer stays as it was; a hybrid inside retrieval heads' ``others`` takes the options too."""
    nested = {"mixer": "retrieval_heads", "heads": [1], "others": HYBRID}
    model = tiny_perturbed_model(nested, overrides={"0": {"mixer": "softmax"}})
    specs = with_hybrid_options(model, {"cache_slots": 2}).config.layer_specs()
    assert specs[0] == model.config.layer_spec(0)
    assert specs[1]["others"]["cache_slots"] == 2
    assert specs[1]["heads"] == [1]


def test_options_on_chosen_layers_only() -> None:
    """``layers``: the hybrids of those layers take the options (nested ones included), the others stay as they
    were; an index out of range or a choice without a hybrid is refused, naming the layers."""
    nested = {"mixer": "retrieval_heads", "heads": [1], "others": HYBRID}
    model = tiny_perturbed_model(HYBRID, overrides={"1": nested})
    specs = with_hybrid_options(model, {"window": 5}, layers=[1]).config.layer_specs()
    assert specs[0] == model.config.layer_spec(0) and specs[0]["window"] == 3
    assert specs[1]["others"]["window"] == 5 and specs[1]["heads"] == [1]
    assert [s["window"] for s in with_hybrid_options(model, {"window": 5}).config.layer_specs()[:1]] == [5]
    with pytest.raises(ValueError, match=r"layers \[2\] out of range; the model has layers 0-1"):
        with_hybrid_options(model, {"window": 5}, layers=[0, 2])
    mixed = tiny_perturbed_model(HYBRID, overrides={"0": {"mixer": "softmax"}})
    with pytest.raises(ValueError, match=r"no hybrid layer among layers \[0\]"):
        with_hybrid_options(mixed, {"window": 5}, layers=[0])


@pytest.mark.parametrize(("attention", "options", "message"), [
    (HYBRID, {"slots": 4}, r"hybrid options \['slots'\]: unknown"),
    ({"mixer": "softmax"}, {"cache_slots": 4}, "no hybrid layer"),
    (HYBRID, {"far": "none"}, "change the parameters"),
    (HYBRID, {"cache_slots": -1}, "layer 0.*cache_slots"),
])
def test_refused_changes_say_why(attention: dict, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        with_hybrid_options(tiny_perturbed_model(attention), options)


def test_cli_pairs_are_read_as_json() -> None:
    assert hybrid_options(["cache_slots=64", "combine=sum"]) == {"cache_slots": 64, "combine": "sum"}
    assert hybrid_options(None) == {}
    with pytest.raises(ValueError, match="--hybrid-option: expected KEY=VALUE"):
        hybrid_options(["cache_slots"])
