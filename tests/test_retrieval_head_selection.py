"""Choosing retrieval heads on a model and building the model that keeps them exact."""

from __future__ import annotations

import pytest
import torch

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.conversion.retrieval_data import retrieval_prompt
from hf_recattn.conversion.retrieval_heads import (
    _Blend,
    recall_objective,
    select_retrieval_heads,
    with_retrieval_heads,
)
from hf_recattn.evaluation.recall import Fact, RecallPrompt
from hf_recattn.evaluation.templates import templates
from hf_recattn.prompting.haystack import Haystack
from hf_recattn.prompting.templates import word_list

VOCAB = 40
HYBRID = {"mixer": "hybrid", "window": 3, "sink_tokens": 1, "far": {"mixer": "linear", "feature_map": "hedgehog"}}


def tiny(attention: dict | list = HYBRID, layers: int = 2) -> RecAttnForCausalLM:
    torch.manual_seed(0)
    config = RecAttnConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=layers,
                           num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
                           attention=attention)
    model = RecAttnForCausalLM(config).eval()
    with torch.no_grad():  # per-head parameters that differ between heads
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.add_(0.5 * torch.randn_like(p))
    return model


def prompt(seed: int) -> RecallPrompt:
    """A fact (tokens 5..8 then its answer) early in a random context, asked again at the end."""
    gen = torch.Generator().manual_seed(seed)
    filler = torch.randint(10, VOCAB, (20,), generator=gen).tolist()
    fact = Fact("x", "1", prefix=(5, 6, 7, 8), answer=(int(torch.randint(10, VOCAB, (1,), generator=gen)),),
                suffix=(9,))
    context = (1, *filler[:4], *fact.ids, *filler[4:])
    return RecallPrompt(context, (fact,), (5,), (0,))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))


def blended_logits(model: RecAttnForCausalLM, heads: dict[int, list[int]]) -> torch.Tensor:
    """Logits with the selection's blend at a = 1 on ``heads`` and 0 elsewhere."""
    alpha = torch.zeros(len(model.model.layers), 3)
    for layer, kv in heads.items():
        alpha[layer, kv] = 1.0
    originals = [layer.self_attn.mixer for layer in model.model.layers]
    try:
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.mixer = _Blend(originals[i], alpha, i)
        return model(input_ids=ids(), use_cache=False).logits
    finally:
        for layer, mixer in zip(model.model.layers, originals, strict=True):
            layer.self_attn.mixer = mixer


@pytest.mark.parametrize("heads", [{0: [1]}, {0: [0, 2], 1: [1]}])
def test_the_built_model_is_the_blend_it_was_chosen_with(heads: dict[int, list[int]]) -> None:
    """Keeping heads exact in the built model = the selection's blend at a = 1 on them: the parts' weights were
    split by head correctly (the hedgehog maps per query and KV head, the window share per query head)."""
    model = tiny()
    built = with_retrieval_heads(model, heads).eval()
    with torch.no_grad():
        want = blended_logits(model, heads)
        got = built(input_ids=ids()).logits
        plain = model(input_ids=ids()).logits
    assert (got - want).abs().max() < 1e-5
    assert (got - plain).abs().max() > 1e-3  # the exact heads changed the outputs
    assert built.config.layer_spec(0)["mixer"] == "retrieval_heads"
    assert built.config.layer_spec(0)["others"]["mixer"] == "hybrid"


def test_no_heads_changes_nothing() -> None:
    model = tiny()
    built = with_retrieval_heads(model, {})
    with torch.no_grad():
        assert torch.equal(built(input_ids=ids()).logits, model(input_ids=ids()).logits)


def test_the_built_model_saves_and_generates(tmp_path) -> None:  # noqa: ANN001
    built = with_retrieval_heads(tiny(), {1: [2]}).eval()
    built.save_pretrained(tmp_path)
    loaded = RecAttnForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids()).logits, built(input_ids=ids()).logits)
        a = built.generate(ids()[:1], max_new_tokens=6, do_sample=False)
        b = loaded.generate(ids()[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_a_bounded_retrieval_spec_takes_its_heads_rows_and_stays_exact_while_it_fits(tmp_path) -> None:  # noqa: ANN001
    """With a window longer than the input, the bounded retrieval heads give the exact-softmax model's logits; the
    retrieval part's window share is the layer's row for those heads; the model saves, reloads and generates the
    same through its constant-size cache."""
    model = tiny()
    bounded = {"mixer": "hybrid", "window": 32, "sink_tokens": 1, "far": "none"}
    built = with_retrieval_heads(model, {0: [1]}, bounded).eval()
    exact = with_retrieval_heads(model, {0: [1]}).eval()
    mixer = built.model.layers[0].self_attn.mixer
    assert torch.equal(mixer.full.mix_logit, model.model.layers[0].self_attn.mixer.mix_logit[2:4])
    assert built.config.layer_spec(0)["retrieval"]["window"] == 32
    with torch.no_grad():
        assert (built(input_ids=ids()).logits - exact(input_ids=ids()).logits).abs().max() < 1e-5
    built.save_pretrained(tmp_path)
    loaded = RecAttnForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        a = built.generate(ids()[:1], max_new_tokens=6, do_sample=False)
        b = loaded.generate(ids()[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_a_layer_whose_every_kv_head_is_listed_runs_the_retrieval_spec_whole() -> None:
    """Every KV head of layer 0 listed: the layer is exact softmax (the selection's blend at a = 1 on all its heads)
    or, with a bounded spec, that spec with the layer's own mixing weights (exact while the input fits)."""
    model = tiny()
    everything = {0: [0, 1, 2], 1: [1]}
    exact = with_retrieval_heads(model, everything).eval()
    assert exact.config.layer_spec(0)["mixer"] == "softmax"
    assert exact.config.layer_spec(1)["mixer"] == "retrieval_heads"
    bounded = with_retrieval_heads(model, everything, {"mixer": "hybrid", "window": 32, "sink_tokens": 1,
                                                       "far": "none"}).eval()
    assert bounded.config.layer_spec(0)["window"] == 32
    assert torch.equal(bounded.model.layers[0].self_attn.mixer.mix_logit,
                       model.model.layers[0].self_attn.mixer.mix_logit)
    with torch.no_grad():
        want = blended_logits(model, everything)
        assert (exact(input_ids=ids()).logits - want).abs().max() < 1e-5
        assert (bounded(input_ids=ids()).logits - want).abs().max() < 1e-5


def test_a_retrieval_spec_with_parameters_the_layer_lacks_is_refused() -> None:
    window_only = {"mixer": "hybrid", "window": 3, "sink_tokens": 1, "far": "none"}
    with pytest.raises(ValueError, match=r"layer 0: the retrieval spec's hybrid mixer has a parameter 'far\."):
        with_retrieval_heads(tiny(window_only), {0: [1]}, HYBRID)


def test_selection_stays_within_budget_and_restores_the_model() -> None:
    model = tiny()
    before = [layer.self_attn.mixer for layer in model.model.layers]
    with torch.no_grad():
        logits = model(input_ids=ids()).logits
    lines: list[str] = []
    selection = select_retrieval_heads(model, [prompt(0), prompt(1)], max_heads=2, log=lines.append)
    assert 1 <= selection.count <= 2 and len(lines) >= 1
    assert all(0 <= h < 3 for heads in selection.heads.values() for h in heads)
    assert [layer.self_attn.mixer for layer in model.model.layers] == before
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids()).logits, logits)
    again = select_retrieval_heads(model, [prompt(0), prompt(1)], max_heads=2, log=lines.append)
    assert again.heads == selection.heads  # deterministic


def test_the_first_head_is_the_one_whose_gradient_is_largest() -> None:
    """Round 0 adds the head with the largest d(score)/d(a); checked against a finite difference of the blend."""
    model = tiny()
    prompts = [prompt(2)]
    selection = select_retrieval_heads(model, prompts, max_heads=1, prune=False, log=lambda _: None)
    (layer, (head,)), = selection.heads.items()

    def score(a: torch.Tensor) -> float:
        originals = [m.self_attn.mixer for m in model.model.layers]
        try:
            for i, block in enumerate(model.model.layers):
                block.self_attn.mixer = _Blend(originals[i], a, i)
            ids_ = prompts[0].ids()
            spans = [p for span in prompts[0].answer_spans() for p in span]
            with torch.no_grad():
                logp = model(input_ids=ids_, use_cache=False).logits[0, [p - 1 for p in spans]].log_softmax(-1)
            return logp.gather(1, ids_[0, spans][:, None]).mean().item()
        finally:
            for block, mixer in zip(model.model.layers, originals, strict=True):
                block.self_attn.mixer = mixer

    eps = 1e-3
    base = score(torch.zeros(2, 3))
    slopes = torch.zeros(2, 3)
    for i in range(2):
        for h in range(3):
            a = torch.zeros(2, 3)
            a[i, h] = eps
            slopes[i, h] = (score(a) - base) / eps
    assert divmod(int(slopes.argmax()), 3) == (layer, head)


def test_bad_requests_are_refused() -> None:
    model = tiny()
    with pytest.raises(ValueError, match="max_heads=7 exceeds the model's 6 KV heads"):
        select_retrieval_heads(model, [prompt(0)], max_heads=7)
    with pytest.raises(ValueError, match="retrieval heads: layer 5 does not exist"):
        with_retrieval_heads(model, {5: [0]})
    built = with_retrieval_heads(model, {0: [0]})
    with pytest.raises(ValueError, match="layer 0 already keeps retrieval heads"):
        with_retrieval_heads(built, {0: [1]})


def test_the_objective_hides_numbers_and_facts_in_the_texts() -> None:
    """Alternating secret-number and recall prompts of exactly the asked length; each answer is the value hidden
    earlier in its context, the numbers at spread depths."""
    from distill_fixtures import tiny_texts, tiny_tokenizer

    texts = tiny_texts()
    tokenizer = tiny_tokenizer(texts)
    prompts = recall_objective(tokenizer, texts, 300, prompts=2, seed=4)
    assert len(prompts) == 4
    for i, p in enumerate(prompts):
        ids = p.ids()[0].tolist()
        assert len(ids) == 300
        (span,) = p.answer_spans()
        answer = ids[span.start:span.stop]
        assert tuple(answer) == p.facts[0].answer
        hidden = p.positions[0]
        assert any(ids[s:s + len(answer)] == answer for s in range(hidden, hidden + 40))
        if i % 2 == 0:  # the whole needle sentence sits where the prompt says
            sentence = templates("passkey", "train")[0].fill("fact", value=p.facts[0].value)
            needle = tokenizer(sentence, add_special_tokens=False)["input_ids"]
            assert ids[hidden:hidden + len(needle)] == needle
    depths = [p.depths()[0] for p in prompts[::2]]
    assert depths[0] < 0.5 < depths[1]
    assert recall_objective(tokenizer, texts, 300, prompts=2, seed=4)[0].ids().tolist() == prompts[0].ids().tolist()


def test_the_objective_takes_the_kinds_asked_for_in_turn() -> None:
    """``kinds``: ``prompts`` of each kind, in turn, each the training block of that kind and index: word-valued
    facts (``words``) as well as numbers."""
    from distill_fixtures import tiny_texts, tiny_tokenizer

    texts = tiny_texts()
    tokenizer = tiny_tokenizer(texts)
    kinds = ("words", "passkey")
    prompts = recall_objective(tokenizer, texts, 1024, prompts=2, seed=4, kinds=kinds)
    assert len(prompts) == 4
    haystack = Haystack(tokenizer, texts)
    for index, p in enumerate(prompts):
        assert p.ids().tolist() == retrieval_prompt(tokenizer, haystack, 1024, index, 4, kinds=kinds).ids().tolist()
    words = set(word_list("train"))
    assert all(fact.value in words for p in prompts[::2] for fact in p.facts)
    assert all(fact.value.isdigit() for p in prompts[1::2] for fact in p.facts)
