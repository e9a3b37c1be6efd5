"""Stage 2's retrieval-shaped blocks: exact length, the answer weighted where the answer is, facts that are really
hidden earlier in the block (beyond the recipe's window when asked), the three kinds in turn in the training
templates' words, deterministic, never the head search's prompts; even mixing. (That they never show the probes'
wording or held-out text is tested in test_templates.py.)"""

from __future__ import annotations

import pytest
import torch
from distill_fixtures import tiny_texts, tiny_tokenizer

from hf_recattn.conversion.recipe import load_recipe, recipe_from_dict
from hf_recattn.conversion.retrieval_data import mix_blocks, recipe_window, retrieval_blocks, retrieval_prompt
from hf_recattn.conversion.retrieval_heads import recall_objective
from hf_recattn.evaluation.recall import Haystack
from hf_recattn.evaluation.templates import templates, word_list


@pytest.fixture(scope="module")
def texts_and_tokenizer() -> tuple[list[str], object]:
    texts = tiny_texts()
    return texts, tiny_tokenizer(texts)


def test_blocks_weight_exactly_the_answers(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    ids, weights = retrieval_blocks(tokenizer, texts, 6, 512, answer_weight=30.0, seed=2)
    assert ids.shape == weights.shape == (6, 512)
    haystack = Haystack(tokenizer, texts)
    for i in range(6):
        prompt = retrieval_prompt(tokenizer, haystack, 512, i, seed=2)
        assert ids[i].tolist() == prompt.ids()[0].tolist()
        answers = [p for span in prompt.answer_spans() for p in span]
        assert (weights[i] == 30.0).nonzero().flatten().tolist() == answers
        assert bool((weights[i][[p for p in range(512) if p not in answers]] == 1.0).all())
        row = ids[i].tolist()
        for fact, at in zip(prompt.facts, prompt.positions, strict=True):  # each answer is hidden earlier
            answer = list(fact.answer)
            assert any(row[s:s + len(answer)] == answer for s in range(at, at + 40))
            assert at + len(answer) < answers[0]
        kind = ("passkey", "codes", "words")[i % 3]  # the kinds in turn
        if kind == "passkey":
            assert len(prompt.facts) == 1 and prompt.facts[0].name in {t.name for t in templates(kind, "train")}
        else:
            values = {f.value for f in prompt.facts}
            assert len(values) in (1, 2, 4)
            assert values <= set(word_list("train")) if kind == "words" else all(v.isdigit() for v in values)
    again, _ = retrieval_blocks(tokenizer, texts, 6, 512, answer_weight=30.0, seed=2)
    assert torch.equal(ids, again)
    other, _ = retrieval_blocks(tokenizer, texts, 6, 512, answer_weight=30.0, seed=3)
    assert not torch.equal(ids, other)


def test_blocks_are_not_the_head_search_prompts(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    ids, _ = retrieval_blocks(tokenizer, texts, 4, 512, seed=0)
    chosen_on = {tuple(p.ids()[0].tolist()) for p in recall_objective(tokenizer, texts, 512, prompts=2, seed=0)}
    assert not chosen_on & {tuple(row) for row in ids.tolist()}


def _text_after_facts(prompt: object) -> int:
    """Tokens from the end of the last planted fact to the end of the context (text, then the question)."""
    return min(len(prompt.context) - at - len(f.planted)  # type: ignore[attr-defined]
               for f, at in zip(prompt.facts, prompt.positions, strict=True))  # type: ignore[attr-defined]


def test_facts_stay_beyond_the_window_when_the_block_allows(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    haystack = Haystack(tokenizer, texts)
    questions = [t.parts.get("intro") or t.parts["question"] for k in ("passkey", "codes", "words")
                 for t in templates(k, "train")]
    shortest = min(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions)
    window = 100
    free = [_text_after_facts(retrieval_prompt(tokenizer, haystack, 512, i, 0)) for i in range(24)]
    assert min(free) < window + shortest  # without the option some fact sits closer to its question
    beyond = [retrieval_prompt(tokenizer, haystack, 512, i, 0, min_distance=window) for i in range(24)]
    assert min(_text_after_facts(p) for p in beyond) >= window + shortest
    assert all(p.length == 512 for p in beyond)
    cramped = retrieval_prompt(tokenizer, haystack, 512, 0, 0, min_distance=2000)  # no room: placed as usual
    assert cramped == retrieval_prompt(tokenizer, haystack, 512, 0, 0)
    ids, _ = retrieval_blocks(tokenizer, texts, 3, 512, min_distance=window)
    assert ids.tolist() == [p.ids()[0].tolist() for p in beyond[:3]]


def test_the_window_of_a_recipe() -> None:
    assert recipe_window(load_recipe("hybrid-w64-sink4-hedgehog-retrieval")) == 64
    assert recipe_window(load_recipe("linear-hedgehog")) == 0
    hybrid = {"mixer": "hybrid", "window": 32, "far": {"mixer": "linear", "feature_map": "hedgehog"}}
    mixed = recipe_from_dict({"attention": [hybrid, "softmax"],
                              "attention_overrides": {"1": {"mixer": "sliding_window", "window": 128}}})
    assert recipe_window(mixed) == 128


def test_bad_settings_are_named(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    with pytest.raises(ValueError, match="block_size 16"):
        retrieval_blocks(tokenizer, texts, 2, 16)
    with pytest.raises(ValueError, match="answer_weight"):
        retrieval_blocks(tokenizer, texts, 2, 512, answer_weight=0.0)


def test_mix_spreads_the_extra_blocks_evenly() -> None:
    text = torch.arange(6 * 4).view(6, 4)
    extra = -torch.arange(1, 3 * 4 + 1).view(3, 4)
    extra_weights = torch.full((3, 4), 7.0)
    blocks, weights = mix_blocks(text, extra, extra_weights)
    assert blocks.shape == (9, 4) and weights.shape == (9, 4)
    is_extra = [bool((row < 0).all()) for row in blocks]
    assert [i for i, e in enumerate(is_extra) if e] == [1, 4, 7]
    assert torch.equal(blocks[[i for i, e in enumerate(is_extra) if not e]], text)  # text blocks keep their order
    assert torch.equal(blocks[[1, 4, 7]], extra)
    assert bool((weights[[1, 4, 7]] == 7.0).all()) and float(weights.sum()) == 6 * 4 + 3 * 4 * 7
    with pytest.raises(ValueError, match="differ"):
        mix_blocks(text, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5))
