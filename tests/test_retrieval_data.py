"""Stage 2's retrieval-shaped blocks: exact length, the answer weighted where the answer is, facts that are really
hidden earlier in the block, deterministic, never the probes' or the head search's prompts; even mixing."""

from __future__ import annotations

import pytest
import torch
from distill_fixtures import tiny_texts, tiny_tokenizer

from hf_recattn.conversion.retrieval_data import mix_blocks, retrieval_blocks, retrieval_prompt
from hf_recattn.conversion.retrieval_heads import recall_objective
from hf_recattn.evaluation.recall import Haystack


@pytest.fixture(scope="module")
def texts_and_tokenizer() -> tuple[list[str], object]:
    texts = tiny_texts()
    return texts, tiny_tokenizer(texts)


def test_blocks_weight_exactly_the_answers(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    ids, weights = retrieval_blocks(tokenizer, texts, 4, 512, answer_weight=30.0, seed=2)
    assert ids.shape == weights.shape == (4, 512)
    haystack = Haystack(tokenizer, texts)
    for i in range(4):
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
    assert len(prompt.facts) >= 1 and i % 2 == 1  # the set alternates: the last one is a recall prompt
    again, _ = retrieval_blocks(tokenizer, texts, 4, 512, answer_weight=30.0, seed=2)
    assert torch.equal(ids, again)
    other, _ = retrieval_blocks(tokenizer, texts, 4, 512, answer_weight=30.0, seed=3)
    assert not torch.equal(ids, other)


def test_blocks_are_not_the_head_search_prompts(texts_and_tokenizer: tuple[list[str], object]) -> None:
    texts, tokenizer = texts_and_tokenizer
    ids, _ = retrieval_blocks(tokenizer, texts, 4, 512, seed=0)
    chosen_on = {tuple(p.ids()[0].tolist()) for p in recall_objective(tokenizer, texts, 512, prompts=2, seed=0)}
    assert not chosen_on & {tuple(row) for row in ids.tolist()}


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
