"""The teacher's retrieval heads: attention its answering queries put on the planted value, per KV head."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_recattn.conversion.teacher_heads import copy_scores, top_heads
from hf_recattn.evaluation.recall import Fact, RecallPrompt

VOCAB = 40


def teacher() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def prompt(planted: bool = True) -> RecallPrompt:
    """A fact with a 2-token answer planted at 6, asked at the end; ``planted=False``: the value is not in the
    text (the answer differs)."""
    fact = Fact("x", "1", prefix=(5, 6), answer=(30, 31), suffix=(9,))
    body = [11, 12, 13, 14, 15, 16, *fact.ids, 17, 18, 19, 20, 21, 22]
    if not planted:
        body[8:10] = [32, 33]
    return RecallPrompt((1, *body), (fact,), (7,), (0,))


def test_scores_are_the_attention_on_the_value_by_kv_head() -> None:
    """Against the eager attention weights read directly (float64 sums): the query before each answer token,
    its weight on the value's two tokens, mean over answers and the KV head's query heads."""
    model = teacher()
    p = prompt()
    scores = copy_scores(model, [p])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        weights = model(input_ids=p.ids(), output_attentions=True).attentions
    value = [p.context.index(30), p.context.index(30) + 1]
    (span,) = p.answer_spans()
    expected = torch.zeros(2, 2, dtype=torch.float64)
    for layer, w in enumerate(weights):
        for head in range(4):
            mass = sum(float(w[0, head, t - 1, value].double().sum()) for t in span) / len(span)
            expected[layer, head // 2] += mass / 2
    assert torch.allclose(scores.double(), expected, atol=1e-6)
    assert scores.shape == (2, 2) and (scores > 0).all()


def test_the_attention_implementation_is_restored() -> None:
    model = teacher()
    model.set_attn_implementation("sdpa")
    copy_scores(model, [prompt()])
    assert model.config._attn_implementation == "sdpa"


def test_a_value_missing_from_the_text_is_refused() -> None:
    with pytest.raises(ValueError, match="no prompt holds its answer verbatim"):
        copy_scores(teacher(), [prompt(planted=False)])


def test_top_heads_takes_the_highest_by_layer() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.2], [0.5, 0.0, 0.7]])
    assert top_heads(scores, 3) == {0: [1], 1: [0, 2]}
    with pytest.raises(ValueError, match=r"count must be in 1..6"):
        top_heads(scores, 7)


def test_progress_is_told_after_every_prompt() -> None:
    lines: list[str] = []
    copy_scores(teacher(), [prompt(), prompt()], log=lines.append)
    length = prompt().length
    assert lines == [f"scored 1 of 2 prompts ({length} tokens)", f"scored 2 of 2 prompts ({length} tokens)"]
