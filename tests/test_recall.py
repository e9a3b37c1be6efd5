"""Recall probes: the passkey's depth grid and multi-query associative recall on natural text.

Prompt builders are checked token by token (exact lengths, every planted fact where the prompt says it is,
queries only of planted names). Scoring is checked with models whose answers are known: a copier that repeats
what followed the longest earlier match of its input (100%), a constant (0%), and a passkey oracle that only
finds keys early in the context (per-depth accuracy). On tiny random models, the cached teacher-forced scores
must equal the argmax of one plain forward (exact token equality, float32) and the greedy answers must equal
``generate``'s. Accuracies are exact fractions.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_lm import save_tiny_teacher, tiny_dims, tiny_tokenizer

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, from_teacher
from hf_recattn import evaluation as ev
from hf_recattn.cli import main
from hf_recattn.data.corpus import token_blocks
from hf_recattn.evaluation import (
    RecallSizes,
    comparison_table,
    evaluate,
    passkey,
    passkey_probe,
    passkey_prompt,
    probe_template,
)
from hf_recattn.evaluation import distance as distance_module
from hf_recattn.evaluation.recall import (
    Haystack,
    associative_recall_probe,
    greedy_answers,
    recall_prompt,
    teacher_forced_answers,
    texts_from_blocks,
)
from hf_recattn.evaluation.templates import word_list
from hf_recattn.model_card import build_model_card
from hf_recattn.modeling.cache import CACHE_NAME

# natural-looking documents in the tiny tokenizer's alphabet (lower case, digits, punctuation, a few capitals)
TEXTS = [
    "The river runs past the old mill and on toward the town. Birds sing in the hedges in the morning. "
    "A hash table maps keys to values, and the road climbs through the hills.\nWhat is the pass key? "
    "The quick brown fox jumps over the lazy dog. " * 2,
    "Write a short poem about the sea. The sea is wide and the boats are small! Remember the old road. "
    "The town has a mill, a river and a bridge.\nBirds sing. The fields turn gold in late summer. " * 2,
    "A table of values: keys map to values. The fox runs to the river, and the dog sleeps by the mill. " * 3,
]


def _tiny_model(spec: object = "softmax", max_positions: int = 2048) -> RecAttnForCausalLM:
    torch.manual_seed(0)
    dims = dict(tiny_dims(len(tiny_tokenizer())), max_position_embeddings=max_positions)
    return RecAttnForCausalLM(RecAttnConfig(**dims, attention=spec)).eval()


def _find(needle: list[int] | tuple[int, ...], ids: list[int]) -> list[int]:
    """Every offset where ``needle`` occurs in ``ids``."""
    n = len(needle)
    return [i for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) == tuple(needle)]


class CopyLM(torch.nn.Module):
    """Predicts the token that followed the latest earlier occurrence of the longest suffix (up to ``span``
    tokens) of what it has read: it recalls every planted code exactly. Its cache is the list of ids read."""

    def __init__(self, vocab: int, span: int = 24, max_positions: int = 4096) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the probes a device
        self.vocab, self.span = vocab, span
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_positions)

    def _next(self, history: list[int], t: int) -> int:
        best, best_len = 0, 0
        for j in range(t - 1, -1, -1):  # latest first: ties keep the latest occurrence
            length = 0
            while length < self.span and j - length >= 0 and history[j - length] == history[t - length]:
                length += 1
            if length > best_len:
                best, best_len = history[j + 1], length
        return best

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0,
                **kwargs: Any) -> SimpleNamespace:
        history = list(kwargs.get(CACHE_NAME) or []) + input_ids[0].tolist()  # the cache, under transformers' name
        keep = input_ids.shape[1] if logits_to_keep == 0 else logits_to_keep
        positions = range(len(history) - keep, len(history))
        logits = torch.zeros(1, keep, self.vocab)
        for row, t in enumerate(positions):
            logits[0, row, self._next(history, t)] = 1.0
        return SimpleNamespace(logits=logits, **{CACHE_NAME: history})

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> SimpleNamespace:
        """Greedy decoding as ``generate()`` returns it, never stopping early: each prediction read before the next;
        the cache holds every token but the last."""
        history = input_ids[0].tolist()
        for _ in range(max_new_tokens):
            history.append(self._next(history, len(history) - 1))
        return SimpleNamespace(sequences=torch.tensor([history]), **{CACHE_NAME: history[:-1]})


class ConstantLM(CopyLM):
    """Always predicts the same token (never a digit of a code)."""

    def __init__(self, vocab: int, token: int) -> None:
        super().__init__(vocab)
        self.token = token

    def _next(self, history: list[int], t: int) -> int:
        return self.token


# ----- passkey at fixed depths --------------------------------------------------------------------
def test_passkey_prompt_is_exact_and_places_the_key_at_each_depth() -> None:
    tok = tiny_tokenizer()
    needle = tok("\n\nThe pass key is 24680. Remember it. 24680 is the pass key.\n\n",
                 add_special_tokens=False)["input_ids"]
    longest = max(len(p) for p in ev.token_pieces(tok, ev.sentence_pieces(probe_template("passkey").parts["filler"])))
    for length in (512, 1024):
        for depth in ev.PASSKEY_DEPTHS:
            ids = passkey_prompt(tok, length, "24680", depth)[0].tolist()
            assert len(ids) == length
            (at,) = _find(needle, ids)
            assert abs(at - depth * length) <= longest  # the sentence start nearest to the depth
            assert tok.decode(ids).count("24680") == 2 and tok.decode(ids).endswith("The pass key is")
    with pytest.raises(ValueError, match="no room for filler"):
        passkey_prompt(tok, 40, "24680", 0.5)
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tok, 512, "24680", 1.5)


def test_passkey_accuracy_by_depth_is_a_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tiny_tokenizer()
    model = _tiny_model()

    def early_only(model, tokenizer, ids, max_new_tokens, **kwargs):  # noqa: ANN001, ANN003, ANN202
        text = tokenizer.decode(ids[0])
        key = re.search(r"\d{5}", text)
        seen = key.group(0) if key.start() / len(text) < 0.3 else "00000"  # loses keys past the first 30%
        return ev.Continuation(torch.tensor(tokenizer(f" {seen}.", add_special_tokens=False)["input_ids"]), None)

    monkeypatch.setattr(passkey, "greedy_continuation", early_only)
    result = passkey_probe(model, tok, context_lengths=(512, 1024, 4096), trials=6, seed=4)
    assert result["skipped"] == [4096]  # beyond max_position_embeddings
    assert result["accuracy_by_depth"] == {n: {"0.1": 1.0, "0.5": 0.0, "0.9": 0.0} for n in ("512", "1024")}
    assert result["accuracy"] == {"512": 1 / 3, "1024": 1 / 3} and result["mean_accuracy"] == pytest.approx(1 / 3)
    rows = result["answers"]["1024"]
    assert [r["depth"] for r in rows] == [0.1, 0.5, 0.9] * 2 and {r["tokens"] for r in rows} == {1024 - 8}
    assert len({r["key"] for r in rows}) == 6
    assert all(abs(r["needle_at"] / r["tokens"] - r["depth"]) < 0.1 for r in rows)
    assert passkey_probe(model, tok, (512, 1024), trials=6, seed=4)["answers"] == result["answers"]  # seeded
    assert passkey_probe(model, tok, (512,), trials=6, seed=5)["answers"]["512"] != result["answers"]["512"]
    with pytest.raises(ValueError, match="depths"):
        passkey_probe(model, tok, (512,), depths=(0.5, 2.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        passkey_probe(model, tok, (8,))


# ----- associative recall prompts -----------------------------------------------------------------
def test_fill_and_plant_cut_at_piece_starts() -> None:
    ids, starts = ev.fill_tokens([[1, 2, 3], [4, 5], [6, 7, 8], [9]], 6)
    assert ids == [3, 4, 5, 6, 7, 8] and starts == [0, 1, 3]  # the first piece loses its start, the last is whole
    assert ev.fill_tokens([[1, 2]], 5) == ([1, 2], [0])  # the pieces ran out
    body, offsets = ev.plant(list(range(10)), [0, 4, 8], [[-1], [-2, -2]], [0.3, 0.35])
    assert body == [0, 1, 2, 3, -1, 4, 5, 6, 7, -2, -2, 8, 9] and offsets == [4, 9]  # the second goes later
    body, offsets = ev.plant([7, 7], [0], [[-1], [-2], [-3]], [0.0, 0.0, 1.0])  # too few starts: any token
    assert body == [-1, 7, -2, 7, -3] and offsets == [0, 2, 4]
    with pytest.raises(ValueError, match="non-decreasing"):
        ev.plant([1, 2], [0], [[-1], [-2]], [0.9, 0.1])
    assert ev.plant(list(range(10)), [0, 4, 8], [[-1]], [0.9], reserve=5) == ([0, 1, 2, 3, -1, *range(4, 10)], [4])
    assert ev.plant(list(range(10)), [0, 4, 8], [[-1]], [0.9], reserve=10) == ev.plant(list(range(10)), [0, 4, 8],
                                                                                        [[-1]], [0.9])  # no room
    assert ev.sentence_pieces("One. Two!\nThree\n\nFour? 5") == ["One.", " Two!", "\nThree", "\n\nFour?", " 5"]
    assert ev.sentence_pieces("Copy it (e.g. a file). It works.") == ["Copy it (e.g. a file).", " It works."]
    assert ev.sentence_pieces("a wrapped\nline. End\n\n\nnext") == ["a wrapped\nline.", " End", "\n\n\nnext"]


@pytest.mark.parametrize(("length", "pairs"), [(256, 1), (512, 4), (1024, 16)])
def test_recall_prompt_plants_every_pair_once_at_spread_depths(length: int, pairs: int) -> None:
    tok = tiny_tokenizer()
    prompt = recall_prompt(tok, TEXTS, length, pairs, seed=3)
    ids = prompt.ids()[0].tolist()
    context = list(prompt.context)
    assert len(ids) == prompt.length == length
    names = [f.name for f in prompt.facts]
    values = [f.value for f in prompt.facts]
    assert len(set(names)) == pairs and len({f.prefix for f in prompt.facts}) == pairs  # distinct as tokens too
    assert len(set(values)) == pairs and all(re.fullmatch(r"[1-9]\d{3}", v) for v in values)
    assert len(prompt.queries) == min(pairs, 8) == len(set(prompt.queries))
    assert pairs < 4 or list(prompt.queries) != sorted(prompt.queries)  # asked in a random order
    assert set(prompt.queries) <= set(range(pairs))
    words = probe_template("codes").parts
    head = len(tok(words["head"])["input_ids"])  # the text the facts are planted in starts after the head
    filler = len(context) - head - len(tok(words["intro"], add_special_tokens=False)["input_ids"])
    filler -= sum(len(f.ids) for f in prompt.facts)
    longest = max(len(p) for text in TEXTS for p in ev.token_pieces(tok, ev.sentence_pieces(text))) + 4
    before = 0
    for i, (fact, at) in enumerate(zip(prompt.facts, prompt.positions, strict=True)):
        assert _find(fact.ids, context) == [at]  # planted exactly once, where the prompt says
        assert tok.decode(list(fact.answer)).strip() == fact.value
        in_filler = (at - before - head) / filler  # the fact's depth in the text it was planted in
        assert (i + 0.2) / pairs - longest / filler - 0.05 <= in_filler <= (i + 0.8) / pairs + longest / filler
        before += len(fact.ids)
    assert list(prompt.positions) == sorted(prompt.positions)
    for q, span in zip(prompt.queries, prompt.answer_spans(), strict=True):  # queries repeat planted facts
        fact = prompt.facts[q]
        assert tuple(ids[span.start - len(fact.prefix) : span.stop]) == fact.prefix + fact.answer
        assert span.start >= len(context)
    assert prompt == recall_prompt(tok, TEXTS, length, pairs, seed=3)  # the same seed, the same prompt
    assert prompt != recall_prompt(tok, TEXTS, length, pairs, seed=4)


def test_recall_text_comes_from_the_documents() -> None:
    tok = tiny_tokenizer()
    prompt = recall_prompt(tok, TEXTS, 1024, 4, seed=0)
    text = tok.decode(list(prompt.context)).replace("<unk>", " ")  # line breaks are unknown to the tokenizer
    for fact in prompt.facts:
        text = text.replace(tok.decode(list(fact.ids)), " ")
    sentences = [s.strip() for s in re.split(r"(?<=[.!?:])\s", text) if len(s.strip()) > 30]
    sources = " ".join(" ".join(t.split()) for t in TEXTS)
    unknown = [s for s in sentences if " ".join(s.split()) not in sources]
    assert len(sentences) > 20 and unknown == ["The text below mentions the codes of a few people.",
                                               "The codes mentioned in the text above:"]
    docs = texts_from_blocks(tok, token_blocks(tok, TEXTS, 32))
    assert len(docs) >= 2 and all(" ".join(d.split())[:60] in sources for d in docs)
    with pytest.raises(ValueError, match="too short"):
        recall_prompt(tok, TEXTS, 200, 16)
    with pytest.raises(ValueError, match="non-empty"):
        Haystack(tok, ["", "  "])


# ----- associative recall scoring ------------------------------------------------------------------
@pytest.mark.parametrize("scoring", ["teacher_forced", "greedy"])
def test_recall_scoring_copier_gets_all_and_constant_gets_none(scoring: str) -> None:
    tok = tiny_tokenizer()
    kwargs = dict(context_lengths=(256, 512), pairs=(1, 4, 16), trials=2, seed=1, scoring=scoring)
    with pytest.raises(ValueError, match="too short"):
        associative_recall_probe(CopyLM(len(tok)), tok, TEXTS, **kwargs)
    kwargs["context_lengths"] = (768, 1024)
    perfect = associative_recall_probe(CopyLM(len(tok)), tok, TEXTS, **kwargs)
    cells = {n: {"1": 1.0, "4": 1.0, "16": 1.0} for n in ("768", "1024")}
    assert perfect["accuracy"] == cells and perfect["mean_accuracy"] == 1.0 and perfect["skipped"] == []
    assert perfect["accuracy_by_pairs"] == {"1": 1.0, "4": 1.0, "16": 1.0} and perfect["scoring"] == scoring
    rows = perfect["answers"]["1024"]["16"]
    assert len(rows) == 2 and all(len(r["queries"]) == 8 and len(r["facts"]) == 16 for r in rows)
    assert all(q["answer"] == q["value"] for r in rows for q in r["queries"])
    none = associative_recall_probe(ConstantLM(len(tok), tok.eos_token_id), tok, TEXTS, **kwargs)
    assert none["accuracy"] == {n: {"1": 0.0, "4": 0.0, "16": 0.0} for n in ("768", "1024")}
    assert none["mean_accuracy"] == 0.0
    assert [[r["facts"] for r in none["answers"][n]["4"]] for n in ("768", "1024")] == [
        [r["facts"] for r in perfect["answers"][n]["4"]] for n in ("768", "1024")]  # the same prompts for both


class NearCopyLM(CopyLM):
    """A CopyLM that looks back at most ``reach`` tokens: it recalls the facts planted late, not the early ones."""

    def __init__(self, vocab: int, reach: int) -> None:
        super().__init__(vocab)
        self.reach = reach

    def _next(self, history: list[int], t: int) -> int:
        start = max(t - self.reach, 0)
        return CopyLM._next(self, history[start:], t - start)


def test_recall_metric_module_reproduces_the_greedy_probe() -> None:
    import evaluate

    from hf_recattn.metrics import path

    tok = tiny_tokenizer()
    probe = associative_recall_probe(NearCopyLM(len(tok), reach=400), tok, TEXTS, context_lengths=(768, 1024),
                                     pairs=(1, 4, 16), trials=2, seed=1, scoring="greedy")
    assert 0.0 < probe["mean_accuracy"] < 1.0  # some queries fail: the metric must tell them apart
    queries = [(q["answer"], q["value"], int(n), int(pairs)) for n, cells in probe["answers"].items()
               for pairs, rows in cells.items() for row in rows for q in row["queries"]]
    answers, codes, lengths, pair_counts = map(list, zip(*queries, strict=True))
    metric = evaluate.load(path("associative_recall_accuracy")).compute(
        predictions=answers, references=codes, context_lengths=lengths, pairs=pair_counts)
    assert metric["accuracy"] == probe["accuracy"]
    assert metric["mean_accuracy"] == pytest.approx(probe["mean_accuracy"])


def test_recall_probe_rejects_bad_input() -> None:
    tok = tiny_tokenizer()
    model = CopyLM(len(tok))
    with pytest.raises(ValueError, match="scoring"):
        associative_recall_probe(model, tok, TEXTS, (512,), scoring="beam")
    with pytest.raises(ValueError, match="pair counts"):
        associative_recall_probe(model, tok, TEXTS, (512,), pairs=(0,))
    with pytest.raises(ValueError, match="trials"):
        associative_recall_probe(model, tok, TEXTS, (512,), trials=0)
    skipped = associative_recall_probe(CopyLM(len(tok), max_positions=300), tok, [], (512,))  # no text needed
    assert skipped["skipped"] == [512] and skipped["accuracy"] == {} and skipped["mean_accuracy"] is None


@pytest.mark.parametrize("spec", ["softmax", {"mixer": "linear", "feature_map": "elu"},
                                  {"mixer": "hybrid", "window": 3}, "llama"])
def test_cached_scoring_matches_a_plain_forward_on_real_models(spec: object) -> None:
    tok = tiny_tokenizer()
    if spec == "llama":  # a transformers teacher, with its own DynamicCache
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**dict(tiny_dims(len(tok)), max_position_embeddings=1024))).eval()
    else:
        model = _tiny_model(spec, max_positions=1024)
    prompt = recall_prompt(tok, TEXTS, 384, 4, seed=2)
    ids = prompt.ids()
    with torch.no_grad():
        argmax = model(input_ids=ids, use_cache=False).logits[0].argmax(-1).tolist()
    plain = [[argmax[p - 1] for p in span] for span in prompt.answer_spans()]
    assert teacher_forced_answers(model, prompt) == plain
    greedy = greedy_answers(model, tok, prompt)
    first = prompt.facts[prompt.queries[0]]
    start = torch.tensor([list(prompt.context) + list(first.prefix)])
    out = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=len(first.answer),
                         min_new_tokens=len(first.answer), do_sample=False, pad_token_id=tok.pad_token_id)
    assert greedy[0] == out[0, start.shape[1]:].tolist() and greedy[0][0] == plain[0][0]
    assert [len(g) for g in greedy] == [len(prompt.facts[q].answer) for q in prompt.queries]
    sequence, uncached = list(prompt.context), []  # every query: the same answers without any cache
    for q in prompt.queries:
        fact = prompt.facts[q]
        sequence += fact.prefix
        new: list[int] = []
        for _ in fact.answer:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([sequence + new]), use_cache=False).logits
            new.append(int(logits[0, -1].argmax()))
        uncached.append(new)
        sequence += [*new, *fact.suffix]
    assert greedy == uncached


def test_recall_probe_runs_a_real_model_end_to_end() -> None:
    tok = tiny_tokenizer()
    # a softmax layer needs positions, so 2048 is beyond the model (a linear one alone would run it)
    model = _tiny_model([{"mixer": "linear", "feature_map": "elu"}, {"mixer": "softmax"}], max_positions=1024)
    model.train()
    blocks = token_blocks(tok, TEXTS * 4, 64)
    result = associative_recall_probe(model, tok, blocks, (512, 2048), pairs=(1, 4), trials=2, scoring="greedy")
    assert model.training  # restored
    assert set(result) == {"accuracy", "mean_accuracy", "accuracy_by_pairs", "pairs", "trials", "max_queries",
                           "scoring", "skipped", "answers"}
    assert result["skipped"] == [2048] and set(result["accuracy"]) == {"512"}
    assert set(result["accuracy"]["512"]) == {"1", "4"}
    assert result["accuracy"]["512"]["1"] in (0.0, 0.5, 1.0) and result["accuracy"]["512"]["4"] * 8 % 1 == 0
    assert 0.0 <= result["mean_accuracy"] <= 1.0
    assert json.loads(json.dumps(result)) == result  # JSON-ready for the report


# ----- recall at fixed distances ------------------------------------------------------------------
@pytest.mark.parametrize("distance", [0, 37, 300])
def test_distance_prompt_puts_exactly_d_tokens_between_the_fact_and_the_question(distance: int) -> None:
    tok = tiny_tokenizer()
    words = probe_template("words")
    prompt = ev.distance_prompt(tok, TEXTS, distance, seed=5)
    (fact,), (at,) = prompt.facts, prompt.positions
    head = len(tok(words.parts["head"])["input_ids"])
    intro = tok(words.parts["intro"], add_special_tokens=False)["input_ids"]
    assert at == head + distance_module.LEAD and _find(fact.planted, list(prompt.context)) == [at]
    assert len(prompt.context) - len(intro) - (at + len(fact.planted)) == distance
    assert list(prompt.context[-len(intro):]) == intro and prompt.queries == (0,)
    assert fact.value in word_list("heldout") and tok.decode(list(fact.answer)).strip() == fact.value
    assert prompt.length == head + distance_module.LEAD + len(fact.planted) + distance + len(intro) + len(fact.ids)
    assert prompt == ev.distance_prompt(tok, TEXTS, distance, seed=5) != ev.distance_prompt(tok, TEXTS, distance, 6)
    with pytest.raises(ValueError, match="distance"):
        ev.distance_prompt(tok, TEXTS, -1)


def test_distance_probe_finds_how_far_back_a_fact_comes_through() -> None:
    tok = tiny_tokenizer()
    perfect = ev.distance_recall_probe(CopyLM(len(tok)), tok, TEXTS, (50, 300, 1000), trials=2, seed=1)
    assert perfect["accuracy"] == {"50": 1.0, "300": 1.0, "1000": 1.0} and perfect["mean_accuracy"] == 1.0
    assert perfect["skipped"] == {} and perfect["distances"] == [50, 300, 1000] and perfect["trials"] == 2
    rows = perfect["answers"]["300"]
    assert len(rows) == 2 and all(r["queries"][0]["answer"] == r["queries"][0]["value"] for r in rows)
    near = ev.distance_recall_probe(NearCopyLM(len(tok), reach=400), tok, TEXTS, (50, 300, 1000), trials=2, seed=1)
    assert near["accuracy"] == {"50": 1.0, "300": 1.0, "1000": 0.0} and near["mean_accuracy"] == pytest.approx(2 / 3)
    assert [r["facts"] for r in near["answers"]["1000"]] == [r["facts"] for r in perfect["answers"]["1000"]]
    short = ev.distance_recall_probe(CopyLM(len(tok), max_positions=600), tok, TEXTS, (50, 1000), trials=1)
    assert set(short["accuracy"]) == {"50"} and set(short["skipped"]) == {"1000"}
    assert re.fullmatch(r"its prompts take up to \d+ tokens, beyond max_position_embeddings 600",
                        short["skipped"]["1000"])
    blocks = token_blocks(tok, TEXTS * 4, 64)
    from_blocks = ev.distance_recall_probe(CopyLM(len(tok)), tok, blocks, (50,), trials=1)
    assert from_blocks["accuracy"] == {"50": 1.0}
    with pytest.raises(ValueError, match="trials"):
        ev.distance_recall_probe(CopyLM(len(tok)), tok, TEXTS, (50,), trials=0)
    with pytest.raises(ValueError, match="distances"):
        ev.distance_recall_probe(CopyLM(len(tok)), tok, TEXTS, ())


# ----- evaluate, the table, the card, the command ---------------------------------------------------
def test_evaluate_quick_runs_both_probes_and_the_card_shows_them(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = _tiny_model({"mixer": "linear", "feature_map": "elu"})
    blocks = token_blocks(tok, TEXTS * 4, 32)
    sizes = dataclasses.replace(RecallSizes.for_mode(True), needle_prompts=1, needle_haystacks=("heldout",))
    report = evaluate(model, tok, blocks, quick=True, recall_texts=TEXTS, sizes=sizes)  # 1 needle prompt per cell
    assert set(report["passkey"]["accuracy_by_depth"]) == {"1024"}
    assert set(report["passkey"]["accuracy_by_depth"]["1024"]) == {"0.1", "0.5", "0.9"}
    recall = report["associative_recall"]
    assert set(recall["accuracy"]) == {"1024"} and set(recall["accuracy"]["1024"]) == {"1", "4", "16"}
    assert recall["trials"] == 1
    small = RecallSizes(passkey_lengths=(256,), passkey_trials=3, recall_lengths=(256,), recall_pairs=(2,),
                        recall_trials=1, needle_tasks=("single_word",), needle_lengths=(1024,), needle_prompts=1,
                        needle_haystacks=("heldout",))
    from_blocks = evaluate(model, tok, blocks, quick=True, sizes=small)  # the facts go into the blocks' text
    assert set(from_blocks["associative_recall"]["accuracy"]) == {"256"}
    with pytest.raises(ValueError, match="recall_pairs"):
        RecallSizes(recall_pairs=(0,))
    with pytest.raises(ValueError, match="distances"):
        RecallSizes(distances=())
    with pytest.raises(ValueError, match="long_blocks"):
        RecallSizes(long_blocks=0)
    assert RecallSizes().distances == (100, 1000, 4000, 16000) and RecallSizes().long_lengths == (4096, 8192, 16384)

    student = {**report, "associative_recall": {**recall, "mean_accuracy": 0.25,
                                                "accuracy": {"1024": {"1": 0.5, "4": 0.25, "16": 0.0}}}}
    teacher = {"perplexity": report["perplexity"], "passkey": {"mean_accuracy": 1.0},
               "associative_recall": {"mean_accuracy": 1.0}}
    table = comparison_table({"teacher": teacher, "tiny": student}).splitlines()
    assert table[0].startswith("| model | perplexity | × teacher | passkey (synthetic) | needles (held-out) | recall |")
    assert table[2].startswith("| teacher |") and "| 100% | - | 100% |" in table[2] and "| 25% |" in table[3]
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    card = build_model_card(folder, "org/tiny", report={"teacher": "org/teacher", "student": student,
                                                        "comparison": {"teacher": teacher, "tiny": student}})
    metrics = {r.metric_type: r for r in card.data.eval_results}
    assert {"perplexity", "passkey_accuracy", "associative_recall_accuracy"} <= set(metrics)
    assert metrics["associative_recall_accuracy"].metric_value == 0.25
    assert "1024 tokens; 1, 4, 16 pairs" in metrics["associative_recall_accuracy"].metric_name
    text = str(card)
    assert "1024 tokens: 1 pairs 50%, 4 pairs 25%, 16 pairs 0%" in text
    assert "Synthetic passkey accuracy of this model by context: 1024 tokens:" in text
    assert "Synthetic passkey accuracy by depth of the key" in text and "0.5:" in text
    assert metrics["needle_accuracy_heldout"].metric_value == round(student["needles"]["accuracy"]["heldout"], 4)
    assert "Recall of facts stated once in natural text" in text
    assert "Associative recall answers 25% of queries" in text


def test_eval_command_recall_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    teacher = save_tiny_teacher(tmp_path / "teacher")
    from_teacher(teacher, "softmax").save_pretrained(tmp_path / "student")
    tiny_tokenizer().save_pretrained(tmp_path / "student")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(TEXTS * 8):
        (docs / f"{i:02d}.txt").write_text(f"{text} {i}")
    args = ["eval", str(tmp_path / "student"), "--corpus", str(docs), "--tokens", "64", "--block-size", "32",
            "--quick", "--teacher", str(tmp_path / "teacher"), "--passkey-lengths", "128", "200",
            "--passkey-depths", "0.25", "0.75", "--passkey-trials", "2", "--recall-lengths", "200", "1024",
            "--recall-pairs", "1", "2", "--recall-trials", "1", "--distances", "20", "400", "--distance-trials", "1",
            "--long-lengths", "48", "512", "--long-blocks", "2"]
    assert main(args) == 0
    assert "| passkey (synthetic) | recall |" in capsys.readouterr().out
    results = json.loads((tmp_path / "student" / "eval.json").read_text())["results"]
    for row in results.values():
        assert row["passkey"]["accuracy_by_depth"].keys() == {"128", "200"}
        assert row["passkey"]["depths"] == [0.25, 0.75]
        assert row["associative_recall"]["skipped"] == [1024]  # beyond max_position_embeddings=256
        assert set(row["associative_recall"]["accuracy"]["200"]) == {"1", "2"}
        by_distance = row["recall_by_distance"]
        assert set(by_distance["accuracy"]) == {"20"} and set(by_distance["skipped"]) == {"400"}
        assert row["long_perplexity"]["blocks"] == {"48": 2}
        assert row["long_perplexity"]["skipped"] == {"512": "beyond max_position_embeddings 256"}
    teacher_facts = results["teacher"]["associative_recall"]["answers"]["200"]["2"][0]["facts"]
    assert teacher_facts == results["student"]["associative_recall"]["answers"]["200"]["2"][0]["facts"]
    assert main([*args[:2], "--recall-pairs", "0"]) == 2
    assert "--recall-pairs" in capsys.readouterr().err
    assert main([*args[:2], "--distance-trials", "0"]) == 2
    assert "--distance-trials" in capsys.readouterr().err


# ----- the embedded teacher (opt-in) ---------------------------------------------------------------
@pytest.mark.slow
def test_embedded_teacher_recalls_planted_codes() -> None:
    from hf_recattn.conversion.teacher import load_teacher
    from hf_recattn.data.corpus import load_texts, split_heldout

    torch.set_num_threads(2)
    model, tok = load_teacher()
    _, heldout = split_heldout(load_texts())
    result = associative_recall_probe(model, tok, heldout, (1024,), pairs=(1, 4), trials=2)
    assert result["accuracy"]["1024"]["1"] == 1.0 and result["accuracy"]["1024"]["4"] >= 0.5, result["accuracy"]
    passkey = passkey_probe(model, tok, (1024,), trials=3)
    assert passkey["accuracy_by_depth"] == {"1024": {"0.1": 1.0, "0.5": 1.0, "0.9": 1.0}}, passkey["answers"]
