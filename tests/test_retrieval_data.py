"""Stage 2's retrieval-shaped blocks: exact length, the answer weighted where the answer is, facts that are really
hidden earlier in the block (beyond the recipe's window when asked), the three kinds in turn in the training
templates' words, deterministic, never the head search's prompts; even mixing. The opt-in ``needles`` kind: the
needle tasks in the ``needles`` training templates' words and values (never the held-out ones), every answer
weighted and equal to the values planted, distances from next to the question to nearly the block's length,
beyond the window when asked; the default kinds' blocks unchanged (also pinned in test_prompt_pins.py); a bad kind
refused. (That no block shows the probes' wording or held-out text is tested in test_templates.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from distill_fixtures import tiny_recipe_dict, tiny_texts, tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_recattn.conversion.recipe import load_recipe, recipe_from_dict
from hf_recattn.conversion.retrieval_data import (
    mix_blocks,
    recipe_window,
    retrieval_blocks,
    retrieval_prompt,
    with_retrieval_blocks,
)
from hf_recattn.conversion.retrieval_heads import recall_objective
from hf_recattn.prompting.haystack import Haystack
from hf_recattn.prompting.needles import NEEDLE_TASKS, needle_template, needle_training_prompt
from hf_recattn.prompting.templates import templates, word_list


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


# ----- the needles kind ---------------------------------------------------------------------------
NEEDLES = ("needles",)


@pytest.fixture(scope="module")
def prose() -> tuple[list[str], PreTrainedTokenizerFast]:
    """Training texts and a byte-level BPE that also knows the needle wording and words: decoding gives text back."""
    texts = tiny_texts(80, seed=4)
    wording = [text for split in ("heldout", "train") for t in templates("needles", split) for text in t.parts.values()]
    words = [" ".join(word_list(split)) for split in ("heldout", "train")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + wording + words, trainer=trainer)
    return texts, PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def _pieces(split: str) -> list[str]:
    """The fixed text of every ``split`` needles template, pieces of 10 characters or more."""
    return [p.strip() for t in templates("needles", split) for p in t.pieces() if len(p.strip()) >= 10]


def test_needle_blocks_state_their_facts_in_training_words_and_weight_the_answers(prose: tuple) -> None:
    texts, tok = prose
    ids, weights = retrieval_blocks(tok, texts, 21, 1024, answer_weight=9.0, seed=5, kinds=NEEDLES)
    assert ids.shape == weights.shape == (21, 1024)
    haystack, train_words = Haystack(tok, texts), set(word_list("train"))
    facts, asked = set(), set()
    for i in range(21):
        prompt = retrieval_prompt(tok, haystack, 1024, i, 5, kinds=NEEDLES)
        row = ids[i].tolist()
        assert row == prompt.ids()[0].tolist()
        spans = prompt.answer_spans()
        assert (weights[i] == 9.0).nonzero().flatten().tolist() == [p for span in spans for p in span]
        assert float(weights[i].sum()) == 1024 + 8.0 * sum(len(span) for span in spans)
        planted = {}
        for fact, at in zip(prompt.facts, prompt.positions, strict=True):
            assert row[at:at + len(fact.planted)] == list(fact.planted)  # each fact where the prompt says it is
            sentence = tok.decode(list(fact.planted))
            assert fact.name in sentence
            planted.setdefault(fact.name, []).append(sentence)
        text = tok.decode(row)
        assert [p for p in _pieces("heldout") if p in text] == []  # never the probe's wording
        assert any(p in text for p in _pieces("train"))
        for q, span in zip(prompt.queries, spans, strict=True):
            fact = prompt.facts[q]
            answer = tok.decode(row[span.start:span.stop]).strip()
            values = re.split(r", | and ", answer) if len(planted[fact.name]) > 1 else [answer]  # multi_value
            assert all(any(v in s for s in planted[fact.name]) for v in values), (answer, planted[fact.name])
            assert span.start > max(prompt.positions)  # asked after every fact
            asked.add(len(prompt.queries))
            assert all(v.isdigit() or set(v.split()) <= train_words for v in values)  # training words only
        facts.add(len(prompt.facts))
    assert facts >= {1, 4} and asked >= {1, 4}  # single facts, distractors or several values, keys asked in turn
    again, _ = retrieval_blocks(tok, texts, 21, 1024, answer_weight=9.0, seed=5, kinds=NEEDLES)
    assert torch.equal(ids, again)


def test_every_needle_task_teacher_forced(prose: tuple) -> None:
    """Each task in the words of its first training template: the queries of the probe's layout, each followed by
    its value(s) and a full stop; multi_value's answer lists every value in the order planted."""
    texts, tok = prose
    for task in NEEDLE_TASKS:
        template = needle_template(task, "train")
        prompt = needle_training_prompt(tok, texts, task, 700, seed=task)
        assert prompt.length == 700 and prompt.ids().shape == (1, 700)
        keys = {f.name for f in prompt.facts}
        expected = {"multi_key": (4, 4, 1), "multi_query": (4, 4, 4)}.get(task, (1, 1, 1))
        if task == "multi_value":
            assert len(keys) == 1 and len(prompt.facts) in (3, 4) and len(prompt.queries) == 1
            values = [tok.decode(list(f.planted)).split()[-1].rstrip(".") for f in prompt.facts]
            assert prompt.facts[prompt.queries[0]].value == ", ".join(values[:-1]) + " and " + values[-1]
        else:
            assert (len(keys), len(prompt.facts), len(prompt.queries)) == expected, task
        for q in prompt.queries:
            fact = prompt.facts[q]
            plural = "_all" if task == "multi_value" else ""
            asked = template.fill("question" + plural, key=fact.name) + template.fill("answer" + plural, key=fact.name)
            assert tok.decode(list(fact.ids)) == f"{asked} {fact.value}."
    with pytest.raises(ValueError, match="form 'word'"):
        needle_training_prompt(tok, texts, "single_word", 700, template=needle_template("single_number", "train"))


def test_needle_distances_reach_the_block_length_and_stay_beyond_the_window(prose: tuple) -> None:
    texts, tok = prose
    haystack, window = Haystack(tok, texts), 200
    free = [retrieval_prompt(tok, haystack, 1024, i, 1, kinds=NEEDLES) for i in range(28)]
    beyond = [retrieval_prompt(tok, haystack, 1024, i, 1, min_distance=window, kinds=NEEDLES) for i in range(28)]
    far = [max(len(p.context) - at for at in p.positions) for p in free]  # the farthest fact from the question
    assert min(_text_after_facts(p) for p in free) < window  # without the option some fact sits close to its question
    assert max(far) > 0.75 * 1024  # and some near the start of the block
    assert min(_text_after_facts(p) for p in beyond) >= window  # with it, every fact beyond the window
    assert all(p.length == 1024 for p in free + beyond)


def test_default_kinds_keep_their_blocks_and_mix_with_needles(texts_and_tokenizer: tuple) -> None:
    texts, tokenizer = texts_and_tokenizer
    default, weights = retrieval_blocks(tokenizer, texts, 6, 512, answer_weight=3.0, seed=2)
    spelled, spelled_weights = retrieval_blocks(tokenizer, texts, 6, 512, answer_weight=3.0, seed=2,
                                                kinds=("passkey", "codes", "words"))
    assert torch.equal(default, spelled) and torch.equal(weights, spelled_weights)
    mixed, _ = retrieval_blocks(tokenizer, texts, 8, 512, answer_weight=3.0, seed=2,
                                kinds=("passkey", "codes", "words", "needles"))
    assert torch.equal(mixed[:3], default[:3])  # a block's kind and seed depend on its index alone
    assert not any(torch.equal(mixed[3], row) for row in default)
    recipe = recipe_from_dict(tiny_recipe_dict(stage2={"retrieval_share": 0.5, "block_size": 512, "tokens": 2048}))
    plain = torch.zeros(12, 512, dtype=torch.long)
    blocks, block_weights, _ = with_retrieval_blocks(plain, recipe, "stage2", tokenizer, texts, lambda _: None)
    extra = blocks[(blocks != 0).any(1)]
    assert torch.equal(extra, retrieval_blocks(tokenizer, texts, 6, 512, seed=recipe.seed)[0])
    assert block_weights is not None


def test_a_needle_task_named_as_kind_builds_that_task_every_time(prose: tuple) -> None:
    """``multi_key`` as a kind: every block the asked fact among 3 distractors of other keys, never the most recent
    one, in the training templates' words; the other kinds' blocks at their indices unchanged."""
    texts, tok = prose
    haystack = Haystack(tok, texts)
    for i in range(6):
        prompt = retrieval_prompt(tok, haystack, 1024, i, 3, kinds=("multi_key",))
        assert len(prompt.facts) == 4 and len({f.name for f in prompt.facts}) == 4 and len(prompt.queries) == 1
        (asked,) = prompt.queries
        assert prompt.positions[asked] < max(prompt.positions)  # a distractor comes after the asked fact
        text = tok.decode(prompt.ids()[0].tolist())
        assert [p for p in _pieces("heldout") if p in text] == [] and any(p in text for p in _pieces("train"))
    drawn = [len(retrieval_prompt(tok, haystack, 1024, i, 3, kinds=NEEDLES).facts) for i in range(6)]
    assert drawn != [4] * 6  # the needles kind draws other tasks as well
    both, _ = retrieval_blocks(tok, texts, 4, 1024, seed=3, kinds=("passkey", "multi_key"))
    alone, _ = retrieval_blocks(tok, texts, 4, 1024, seed=3, kinds=("passkey",))
    assert torch.equal(both[0::2], alone[0::2]) and not torch.equal(both[1], alone[1])


def test_a_bad_kind_is_refused(texts_and_tokenizer: tuple) -> None:
    texts, tokenizer = texts_and_tokenizer
    for kinds in (("needle",), ()):
        with pytest.raises(ValueError, match=r"kinds must be some of \['passkey', 'codes', 'words', 'needles', "
                                             r"'single_number', .*'multi_key'"):
            retrieval_blocks(tokenizer, texts, 2, 512, kinds=kinds)


@pytest.mark.parametrize("section", ["stage1", "stage2"])
def test_both_stages_take_the_kinds_of_their_recipe(prose: tuple, section: str) -> None:
    texts, tok = prose
    settings = {"retrieval_share": 0.25, "retrieval_kinds": ["needles"], "block_size": 1024, "tokens": 8192}
    recipe = recipe_from_dict(tiny_recipe_dict(**{section: settings}))
    said: list[str] = []
    plain = torch.zeros(8, 1024, dtype=torch.long)
    blocks, _, _ = with_retrieval_blocks(plain, recipe, section, tok, texts, said.append)
    extra = blocks[(blocks != 0).any(1)]
    want, _ = retrieval_blocks(tok, texts, 2, 1024, seed=recipe.seed, min_distance=recipe_window(recipe),
                               kinds=NEEDLES)
    assert torch.equal(extra, want) and "2 of 8 blocks hide facts in training text" in said[0] and "needles" in said[0]
