"""Needles in natural text (evaluation/needles.py): prompts token by token, the train / held-out split of their
wording, scoring with models whose answers are known, the Wilson interval, skipped lengths, the template checks,
and the probe through ``evaluate``, the table and ``hf-recattn eval``.

The prompt checks decode with a small byte-level BPE (text round-trips exactly). The known models stand in for
``greedy_continuation``: a reader that finds the asked key's facts in the decoded prompt (every query right) and
one that repeats the most recent 7-digit number (never right on multi_key, whose asked fact always has a
distractor after it). A tiny random model checks that answering through the cache equals answering from scratch.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_lm import save_tiny_teacher, tiny_dims, tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.cli import main
from hf_recattn.evaluation import (
    NEEDLE_TASKS,
    Continuation,
    RecallSizes,
    comparison_table,
    evaluate,
    greedy_continuation,
    natural_haystacks,
    needle_answered,
    needle_probe,
    needle_prompt,
    wilson_interval,
)
from hf_recattn.evaluation import needles as needles_module
from hf_recattn.evaluation.needles import lay_documents, needle_answers, needle_template
from hf_recattn.evaluation.recall import Haystack
from hf_recattn.evaluation.templates import TemplateError, read_templates, templates, word_list

_PROSE = ("lamp street morning evening quiet river stone market letter paper table chair winter summer mountain "
          "road field orchard cottage village station clock bell tower hill gate fence roof").split()  # no value word
KEY_SLOT, VALUE_SLOT = "KEYSLOT", "VALUESLOT"


def _documents(n: int, seed: int, sentences: int = 8) -> list[str]:
    """Prose-like documents whose every sentence names its document and place (``d3s5``): no sentence twice."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        lines = [" ".join(rng.choice(_PROSE) for _ in range(rng.randint(6, 10))).capitalize() + f" d{seed}x{d}s{s}."
                 for s in range(sentences)]
        docs.append(" ".join(lines[: sentences // 2]) + "\n\n" + " ".join(lines[sentences // 2 :]))
    return docs


HELDOUT, OOD = _documents(12, seed=1, sentences=16), _documents(6, seed=2, sentences=24)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A byte-level BPE over the documents, the needle wording and the word lists: decoding gives the text back."""
    wording = [text for split in ("heldout", "train") for t in templates("needles", split) for text in t.parts.values()]
    words = [" ".join(word_list(split)) for split in ("heldout", "train")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(HELDOUT + OOD + wording + words, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def _text(tokenizer: Any, ids: Any) -> str:
    return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


def _find(needle: tuple[int, ...], ids: tuple[int, ...]) -> list[int]:
    return [i for i in range(len(ids) - len(needle) + 1) if ids[i : i + len(needle)] == needle]


# ----- prompts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("length", [900, 1500])
def test_prompts_have_the_asked_length_and_each_needle_once(tok: Any, task: str, length: int) -> None:
    prompt = needle_prompt(tok, HELDOUT, task, length, seed=f"t:{task}", depth=0.4)
    assert prompt.length == length
    assert len(prompt.context) == length - sum(len(q.ids) + q.max_new_tokens for q in prompt.queries)
    for needle, position in zip(prompt.needles, prompt.positions, strict=True):
        assert _find(needle.ids, prompt.context) == [position], needle  # planted once, where the prompt says
    assert list(prompt.positions) == sorted(prompt.positions) and not prompt.repeated
    keys, values = [n.key for n in prompt.needles], [n.value for n in prompt.needles]
    assert len(set(values)) == len(values)  # distractors and extra values differ from the asked one
    expected = {"multi_key": (4, 4, 1), "multi_query": (4, 4, 4), "multi_value": (1, len(values), 1)}
    assert (len(set(keys)), len(values), len(prompt.queries)) == expected.get(task, (1, 1, 1))
    asked = {v for q in prompt.queries for v in q.values}
    assert asked == {n.value for n in prompt.needles if n.asked}
    if task == "multi_key":
        assert prompt.needles[-1].asked is False  # a distractor after the asked fact: recency never answers
    if task == "multi_value":
        assert len(values) in (3, 4) and len(prompt.queries[0].values) == len(values)
    form = needle_template(task).parts["form"]
    pattern = {"number": r"\d{7}", "paraphrase": r"\d{4}", "word": r"[a-z]+", "phrase": r"[a-z]+ [a-z]+ [a-z]+"}[form]
    assert all(re.fullmatch(pattern, v) for v in values)
    if form in ("word", "phrase"):
        assert set(" ".join(values).split()) <= set(word_list("heldout"))
    text = _text(tok, prompt.context)
    assert text.count(needle_template(task).parts["head"]) == 1


def test_prompts_are_seeded_and_spread(tok: Any) -> None:
    first = needle_prompt(tok, HELDOUT, "multi_key", 900, seed=3, depth=0.5)
    assert first == needle_prompt(tok, Haystack(tok, HELDOUT), "multi_key", 900, seed=3, depth=0.5)
    assert first != needle_prompt(tok, HELDOUT, "multi_key", 900, seed=4, depth=0.5)
    depths = [needle_prompt(tok, HELDOUT, "single_number", 900, seed=t, depth=d).depths()[0]
              for t, d in enumerate((0.05, 0.5, 0.95))]
    assert depths[0] < 0.15 and 0.4 < depths[1] < 0.6 and depths[2] > 0.85, depths
    with pytest.raises(ValueError, match="too short for multi_query"):
        needle_prompt(tok, HELDOUT, "multi_query", 200)
    with pytest.raises(ValueError, match="unknown needle task 'needle'"):
        needle_prompt(tok, HELDOUT, "needle", 900)


def test_documents_are_laid_whole_and_repeat_only_when_the_text_runs_out(tok: Any) -> None:
    haystack = Haystack(tok, HELDOUT)
    ids, starts, laid = lay_documents(haystack, 5, 700)
    text = _text(tok, ids)
    assert len(ids) == 700 and starts[0] == 0 and 1 < laid < len(HELDOUT)
    sentences = re.findall(r"d1x(\d+)s\d+", text)  # the document of every sentence laid, in order
    assert [int(d) for d in dict.fromkeys(sentences)] == [(5 + k) % 12 for k in range(laid)]
    assert len(re.findall(r"d1x\d+s\d+", text)) == len(set(re.findall(r"d1x\d+s\d+", text)))
    long = needle_prompt(tok, OOD, "single_number", 4000, seed=0)  # the 6 documents hold fewer tokens
    repeated = re.findall(r"d2x\d+s\d+", _text(tok, long.context))
    assert long.repeated and long.documents > len(OOD) and len(repeated) > len(set(repeated))


def test_heldout_wording_and_words_never_appear_in_the_train_split(tok: Any) -> None:
    heldout, train = templates("needles", "heldout"), templates("needles", "train")
    assert {t.parts["form"] for t in heldout} == {t.parts["form"] for t in train} == {"number", "word", "phrase",
                                                                                      "paraphrase"}
    pieces = [p.strip() for t in heldout for p in t.pieces() if len(p.strip()) >= 10]
    train_pieces = [p.strip() for t in train for p in t.pieces() if len(p.strip()) >= 10]
    train_text = "\x00".join(text for t in train for text in t.parts.values())
    assert pieces and not [p for p in pieces if p in train_text]
    assert not [w for w in word_list("heldout") if re.search(rf"\b{w}\b", train_text)]
    for task in NEEDLE_TASKS:  # the prompts of each split show only their own split's wording and words
        trained = _text(tok, needle_prompt(tok, HELDOUT, task, 1200, seed=task, split="train").context)
        probed = _text(tok, needle_prompt(tok, HELDOUT, task, 1200, seed=task).context)
        assert not [p for p in pieces if p in trained] and not [p for p in train_pieces if p in probed]
        assert not [w for w in word_list("heldout") if re.search(rf"\b{w}\b", trained)]
        assert not [w for w in word_list("train") if re.search(rf"\b{w}\b", probed)]
    assert any(p in _text(tok, needle_prompt(tok, HELDOUT, "multi_key", 1200, split="train").context)
               for p in train_pieces)  # so that the checks above can fail


# ----- scoring ------------------------------------------------------------------------------------
def test_answers_are_matched_whole_with_whitespace_and_case_normalized() -> None:
    assert needle_answered(" 1234567.\n\nThe", ["1234567"])
    assert not needle_answered(" 12345678", ["1234567"]) and not needle_answered(" 7123456", ["1234567"])
    assert needle_answered(': "Walrus".', ["walrus"]) and not needle_answered(" walruses", ["walrus"])
    assert needle_answered(" Velvet  quilt\nacorn.", ["velvet quilt acorn"])
    assert not needle_answered(" velvet acorn quilt", ["velvet quilt acorn"])
    assert needle_answered(" 1111111, 2222222 and 3333333", ["3333333", "1111111", "2222222"])
    assert not needle_answered(" 1111111, 2222222", ["1111111", "2222222", "3333333"])


def test_wilson_interval_against_hand_computed_values() -> None:
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.716738, half 1.96 * sqrt(0.025604) / 1.38416 = 0.226581
    assert wilson_interval(8, 10) == pytest.approx((0.490157, 0.943319), abs=1e-6)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.161130), abs=1e-6)  # 2 * 0.09604 / 1.19208
    assert wilson_interval(20, 20) == pytest.approx((0.838870, 1.0), abs=1e-6)
    with pytest.raises(ValueError, match="wilson_interval"):
        wilson_interval(3, 0)
    with pytest.raises(ValueError, match="wilson_interval"):
        wilson_interval(5, 4)


class Stub(torch.nn.Module):
    """No model at all: ``greedy_continuation`` is replaced; the probe only reads its positions and device."""

    def __init__(self, max_positions: int = 4096) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=max_positions)


def _reader(text: str) -> str:
    """The answer a perfect reader gives: the values of every fact about the key the prompt's last question asks."""
    for template in templates("needles", "heldout"):
        for part in ("answer", "answer_all"):
            if part not in template.parts:
                continue
            asked = re.search(re.escape(template.fill(part, key=KEY_SLOT)).replace(KEY_SLOT, r"(\w+)") + "$", text)
            if asked:
                fact = re.escape(template.fill("fact", key=asked.group(1), value=VALUE_SLOT))
                return " " + ", ".join(re.findall(fact.replace(VALUE_SLOT, r"([\w ]+?)"), text)) + "."
    raise AssertionError(f"no question at the end of {text[-200:]!r}")


def _fake(answer: Any) -> Any:
    def continuation(model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, cache: Any = None,
                     stop_at_eos: bool = True) -> Continuation:
        tokens = tokenizer(answer(_text(tokenizer, ids[0].tolist())), add_special_tokens=False)["input_ids"]
        return Continuation(torch.tensor(tokens[:max_new_tokens], dtype=torch.long), None)

    return continuation


def test_a_reader_scores_everything_and_recency_nothing_on_multi_key(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    haystacks = {"heldout": HELDOUT, "ood": OOD}
    monkeypatch.setattr(needles_module, "greedy_continuation", _fake(_reader))
    read = needle_probe(Stub(), tok, haystacks, lengths=(1200,), prompts=3, progress="reader")
    assert read["accuracy"] == {"heldout": 1.0, "ood": 1.0} and read["skipped"] == []
    cell = read["cells"]["multi_query"]["ood"]["1200"]
    assert cell == {"accuracy": 1.0, "correct": 12, "n": 12, "interval": pytest.approx([0.7575, 1.0], abs=1e-4),
                    "prompts": 3, "repeated": 0}
    assert read["haystacks"] == {"heldout": 12, "ood": 6}
    depths = [[n["depth"] for n in row["needles"]][0] for row in read["answers"]["single_word"]["heldout"]["1200"]]
    assert depths == sorted(depths) and depths[0] < 0.3 and depths[-1] > 0.7  # prompt t near (t + 0.5) / 3

    latest = _fake(lambda text: " " + re.findall(r"\d{7}", text)[-1] + ".")
    monkeypatch.setattr(needles_module, "greedy_continuation", latest)
    recent = needle_probe(Stub(), tok, haystacks, tasks=("multi_key", "single_number"), lengths=(1200,), prompts=5)
    assert recent["cells"]["multi_key"]["heldout"]["1200"]["accuracy"] == 0.0
    assert recent["cells"]["multi_key"]["ood"]["1200"]["interval"] == pytest.approx([0.0, 0.4345], abs=1e-4)
    assert recent["cells"]["single_number"]["heldout"]["1200"]["accuracy"] == 1.0  # one needle: the latest is it
    again = needle_probe(Stub(), tok, haystacks, tasks=("multi_key", "single_number"), lengths=(1200,), prompts=5)
    assert again["answers"] == recent["answers"]  # the same seed, the same prompts


def test_lengths_beyond_the_model_are_skipped_and_bad_arguments_named(tok: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(needles_module, "greedy_continuation", _fake(_reader))

    def unread() -> list[str]:
        raise AssertionError("a haystack read although no length runs")

    short = needle_probe(Stub(1000), tok, {"heldout": HELDOUT, "ood": unread}, tasks=("single_number",),
                         lengths=(2048,), prompts=2)
    assert short["skipped"] == [2048] and short["cells"] == {} and short["accuracy"] == {}
    some = needle_probe(Stub(1000), tok, {"heldout": lambda: HELDOUT}, tasks=("single_word",),
                        lengths=(900, 2048), prompts=2)
    assert some["skipped"] == [2048] and set(some["cells"]["single_word"]["heldout"]) == {"900"}
    for kwargs, says in (({"tasks": ("nope",)}, "tasks must be some of"), ({"lengths": (0,)}, "lengths must be"),
                         ({"prompts": 0}, "prompts per cell")):
        with pytest.raises(ValueError, match=says):
            needle_probe(Stub(), tok, {"heldout": HELDOUT}, **kwargs)
    with pytest.raises(ValueError, match="haystack 'ood' holds no text"):
        needle_probe(Stub(), tok, {"ood": [" "]}, lengths=(900,))
    assert set(natural_haystacks(heldout=HELDOUT)) == {"heldout", "ood"}
    assert natural_haystacks(("heldout",), heldout=HELDOUT)["heldout"] is HELDOUT
    with pytest.raises(ValueError, match="haystacks must be some of"):
        natural_haystacks(("train",))


def test_the_license_texts_are_read_once_for_every_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lazy ``ood`` haystack reads its documents on the first call only: the needle probe and the report's two
    perplexities on the license texts share that read."""
    from hf_recattn.data import corpus

    reads = []
    monkeypatch.setattr(corpus, "embedded_texts", lambda split: reads.append(split) or ["a license text"])
    ood = natural_haystacks(("ood",))["ood"]
    assert reads == []
    assert ood() is ood() and ood() == ["a license text"]
    assert reads == ["ood"]


def test_answers_through_the_cache_equal_answers_from_scratch() -> None:
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = RecAttnForCausalLM(RecAttnConfig(**{**tiny_dims(len(tokenizer)), "max_position_embeddings": 2048})).eval()
    texts = [doc.lower() for doc in HELDOUT]  # the tiny tokenizer's alphabet
    prompt = needle_prompt(tokenizer, texts, "multi_query", 1024, seed=1)
    through_cache = needle_answers(model, tokenizer, prompt)
    sequence, fresh = list(prompt.context), []
    for query in prompt.queries:  # each answer decoded from the whole sequence, no cache carried over
        sequence += query.ids
        new = greedy_continuation(model, tokenizer, torch.tensor([sequence]), query.max_new_tokens).tokens.tolist()
        fresh.append(tokenizer.decode(new, skip_special_tokens=True))
        sequence += new
    assert through_cache == fresh and len(sequence) <= prompt.length


# ----- the template file --------------------------------------------------------------------------
GOOD = """\
heldout:
  - name: probe
    form: number
    head: "Head.\\n\\n"
    fact: " The number of {key} is {value}."
    question: " Which number has {key}?"
    answer: " {key} has"
    question_all: " Which numbers has {key}?"
    answer_all: " {key} has the numbers"
train:
  - name: other
    form: word
    head: "Other head.\\n\\n"
    fact: " {key} likes the word {value}."
    question: " Which word does {key} like?"
    answer: " {key} likes"
"""


@pytest.mark.parametrize(("old", "new", "line", "message"), [
    ("form: word", "form: riddle", 12, "form 'riddle' is not one of"),
    ('    answer_all: " {key} has the numbers"\n', "", 2, "needs both 'question_all' and 'answer_all'"),
    ('    question_all: " Which numbers has {key}?"\n    answer_all: " {key} has the numbers"\n', "", 2,
     "a number template: the multi_value task asks with them"),
    ('question: " Which word does {key} like?"', 'question: " Which word?"', 15, r"needs the placeholder\(s\) \{key\}"),
    ('answer: " {key} likes"', 'answer: " {key} likes {value}"', 16, r"\{value\} is not allowed"),
    ("    form: word\n", "", 11, r"lacks the part\(s\) \['form'\]"),
])
def test_a_bad_needles_file_names_its_file_and_line(tmp_path: Path, old: str, new: str, line: int,
                                                    message: str) -> None:
    path = tmp_path / "needles.yaml"
    path.write_text(GOOD)
    assert [t.parts["form"] for t in read_templates(path, "needles").templates] == ["number", "word"]
    assert old in GOOD
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(TemplateError, match=message) as caught:
        read_templates(path, "needles")
    assert str(caught.value).startswith(f"{path}:{line}:"), str(caught.value)


# ----- evaluate, the table, the command -------------------------------------------------------------
def test_sizes_and_the_table(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    quick, full = RecallSizes.for_mode(True), RecallSizes()
    assert (quick.needle_tasks, quick.needle_lengths, quick.needle_prompts, quick.needle_haystacks) == (
        ("single_number", "multi_key"), (1024,), 20, ("heldout", "ood"))
    assert full.needle_tasks == NEEDLE_TASKS and full.needle_lengths == (1024, 2048, 4096)
    for field, value in (("needle_tasks", ("single",)), ("needle_haystacks", ("train",)), ("needle_prompts", 0),
                         ("needle_lengths", (0,))):
        with pytest.raises(ValueError, match=f"^{field} "):
            RecallSizes(**{field: value})
    monkeypatch.setattr(needles_module, "greedy_continuation", _fake(_reader))
    measured = needle_probe(Stub(), tok, {"heldout": HELDOUT, "ood": OOD}, quick.needle_tasks, (1100,), prompts=2)
    rows = {"teacher": {"perplexity": 10.0, "passkey": {"mean_accuracy": 1.0}, "needles": measured},
            "student": {"perplexity": 12.0, "passkey": {"mean_accuracy": 1.0},
                        "needles": {"accuracy": {"heldout": 0.25, "ood": 0.5}}},
            "old": {"perplexity": 11.0, "passkey": {"mean_accuracy": 0.5}}}  # a report from before the probe
    with_ood = {name: {**row, "perplexity_ood": {"perplexity": {"512": value}}}
                for (name, row), value in zip(list(rows.items())[:2], (20.0, 25.0), strict=True)}
    ood_lines = comparison_table({**with_ood, "old": rows["old"]}).splitlines()
    assert ood_lines[0].startswith("| model | perplexity | × teacher | perplexity OOD | × teacher | passkey")
    assert ood_lines[1].count("---:|") == 10
    assert ood_lines[3].startswith("| student | 12.00 | 1.200 | 25.00 | 1.250 | 100% |")
    assert ood_lines[4].startswith("| old | 11.00 | 1.100 | - | - | 50% |")
    lines = comparison_table(rows).splitlines()
    assert lines[0] == ("| model | perplexity | × teacher | passkey (synthetic) | needles (held-out) | needles (OOD) | "
                        "decode ms/token | context | cache MiB |")
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[2] == "| teacher | 10.00 | 1.000 | 100% | 100% | 100% | - | - | - |"
    assert lines[3] == "| student | 12.00 | 1.200 | 100% | 25% | 50% | - | - | - |"
    assert lines[4] == "| old | 11.00 | 1.100 | 50% | - | - | - | - | - |"
    assert "needles" not in comparison_table({"old": rows["old"]})


def test_evaluate_runs_the_needles_on_both_haystacks() -> None:
    """``evaluate`` on a tiny model: the held-out haystack is the recall texts, ``needle_texts`` replaces the other."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = RecAttnForCausalLM(RecAttnConfig(**{**tiny_dims(len(tokenizer)), "max_position_embeddings": 1100}))
    texts = [doc.lower() for doc in HELDOUT]  # the tiny tokenizer's alphabet
    blocks = torch.tensor([tokenizer(texts[0])["input_ids"][:32]])
    sizes = dataclasses.replace(RecallSizes.for_mode(True), passkey_lengths=(1200,), recall_lengths=(1200,),
                                distances=(2000,), long_lengths=(2000,), needle_prompts=1)  # only the needles run
    report = evaluate(model, tokenizer, blocks, quick=True, recall_texts=texts, sizes=sizes,
                      needle_texts={"ood": [doc.lower() for doc in OOD]})
    needles = report["needles"]
    assert set(needles["cells"]) == {"single_number", "multi_key"} and needles["haystacks"] == {"heldout": 12, "ood": 6}
    assert set(needles["accuracy"]) == {"heldout", "ood"} and needles["cells"]["multi_key"]["ood"]["1024"]["n"] == 1
    assert report["passkey"]["skipped"] == [1200]
    # the short-block perplexity of the other kind of text: the first 32 tokens of the first OOD document, by hand
    ood_ids = torch.tensor([tokenizer(OOD[0].lower(), add_special_tokens=False)["input_ids"][:32]])
    with torch.no_grad():
        logits = model(input_ids=ood_ids).logits[0, :-1].double()
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits, ood_ids[0, 1:])))
    ood = report["perplexity_ood"]
    assert ood["blocks"] == {"32": 1} and ood["joined"] == {"32": 0}
    assert ood["perplexity"]["32"] == pytest.approx(expected, rel=1e-5)
    assert abs(ood["perplexity"]["32"] - report["perplexity"]) > 1e-3  # not the held-out block


def test_only_the_named_cells_run(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``needle_cells`` runs the recall bar's cells, not every task at every length."""
    bar = RecallSizes(needle_cells=("single_number@1024", "single_number@4096", "multi_key@2048", "multi_query@2048"))
    assert bar.needle_grid() == (("single_number", "multi_key", "multi_query"), (1024, 2048, 4096), [
        ("single_number", 1024), ("single_number", 4096), ("multi_key", 2048), ("multi_query", 2048)])
    assert RecallSizes().needle_grid() == (NEEDLE_TASKS, (1024, 2048, 4096), None)
    for bad in ("single_number", "riddles@1024", "multi_key@0", "multi_key@2k"):
        with pytest.raises(ValueError, match="^needle_cells must be TASK@LENGTH"):
            RecallSizes(needle_cells=(bad,))
    with pytest.raises(ValueError, match="^needle_cells must not repeat"):
        RecallSizes(needle_cells=("multi_key@2048", "multi_key@2048"))
    monkeypatch.setattr(needles_module, "greedy_continuation", _fake(_reader))
    measured = needle_probe(Stub(), tok, {"heldout": HELDOUT}, ("single_number", "multi_key"), (1100, 1300), prompts=1,
                            cells=[("single_number", 1100), ("multi_key", 1300)])
    assert {task: list(per["heldout"]) for task, per in measured["cells"].items()} == {
        "single_number": ["1100"], "multi_key": ["1300"]}
    with pytest.raises(ValueError, match="outside the tasks"):
        needle_probe(Stub(), tok, {"heldout": HELDOUT}, ("single_number",), (1100,), cells=[("multi_key", 1100)])


def test_eval_command_names_a_bad_needle_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "no-such-checkpoint", "--needle-tasks", "single_number", "riddles"]) == 2
    assert "--needle-tasks: needle_tasks must be some of" in capsys.readouterr().err
    assert main(["eval", "no-such-checkpoint", "--needle-haystacks", "train"]) == 2
    assert "--needle-haystacks" in capsys.readouterr().err
    assert main(["eval", "no-such-checkpoint", "--needle-cells", "multi_key:2048"]) == 2
    assert "--needle-cells: needle_cells must be TASK@LENGTH" in capsys.readouterr().err


def test_the_benchmark_renders_every_cell_with_its_interval(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from script_modules import load_script

    bench = load_script("benchmarks", "needles")
    monkeypatch.setattr(needles_module, "greedy_continuation", _fake(_reader))
    result = needle_probe(Stub(1100), tok, {"heldout": HELDOUT, "ood": OOD}, ("single_number", "multi_query"),
                          (1000, 2048), prompts=2)
    table = bench.render_markdown({"models": {"reader": result}, "notes": [bench.NOTE]}).splitlines()
    assert table[0] == "| model | task | haystack | tokens | accuracy | 95% interval | n | repeated text |"
    assert table[2] == "| reader | single_number | heldout | 1000 | 100% | 34%-100% | 2 | 0 |"
    assert table[5] == "| reader | multi_query | ood | 1000 | 100% | 68%-100% | 8 | 0 |"
    assert table[6] == "| reader | skipped | | 2048 | | | | |" and table[-1] == bench.NOTE


def test_a_chunked_prefill_scores_as_one_prefill(tmp_path: Path) -> None:
    """``benchmarks/needles.py --prefill-chunk``: a sliding-window teacher prefilled in chunks through its cache
    (generate's ``prefill_chunk_size``) gives the logits of one prefill; an hf_recattn checkpoint is refused."""
    from script_modules import load_script

    model = save_tiny_teacher(tmp_path / "gemma", "gemma3_text", sliding_window=16, num_hidden_layers=3, head_dim=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    ids = torch.randint(3, 120, (1, 200), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        return torch.stack(out.logits)

    whole = logits()
    model.generation_config.prefill_chunk_size = 48  # 200 tokens in 5 chunks, each past the window of 16
    torch.testing.assert_close(logits(), whole, rtol=1e-5, atol=1e-5)
    bench = load_script("benchmarks", "needles")
    student = tmp_path / "student"
    RecAttnForCausalLM(RecAttnConfig(**tiny_dims(120), attention="linear")).save_pretrained(student)
    tiny_tokenizer().save_pretrained(student)
    args = bench.argparse.Namespace(hybrid_options=None, hybrid_layers=None, max_positions=None, prefill_chunk=64)
    with pytest.raises(ValueError, match="--prefill-chunk: .* is an hf_recattn checkpoint"):
        bench.measure(str(student), args)


def test_depths_place_each_prompts_needle_and_the_benchmark_counts_them(tok: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``depths`` puts prompt t's asked needle at depths[t % len(depths)] (the table then counts the answers per
    depth); a depth outside [0, 1] is refused."""
    from script_modules import load_script

    bench = load_script("benchmarks", "needles")
    latest = _fake(lambda text: " " + re.findall(r"\d{7}", text)[-1] + ".")  # right only when nothing follows
    monkeypatch.setattr(needles_module, "greedy_continuation", latest)
    result = needle_probe(Stub(), tok, {"heldout": HELDOUT}, ("single_number", "multi_key"), (1200,), prompts=4,
                          depths=[0.9, 0.2])
    assert result["depths"] == [0.9, 0.2, 0.9, 0.2]
    asked = [row["needles"][0]["depth"] for row in result["answers"]["single_number"]["heldout"]["1200"]]
    assert asked == pytest.approx([0.9, 0.2, 0.9, 0.2], abs=0.05)  # at a sentence start near the depth
    rows = result["answers"]["multi_key"]["heldout"]["1200"]  # its asked needle at 0.05 + 0.8 * depth
    assert [next(n["depth"] for n in row["needles"] if n["asked"]) for row in rows] == pytest.approx(
        [0.77, 0.21, 0.77, 0.21], abs=0.05)
    table = bench.render_markdown({"settings": {"depths": [0.9, 0.2]}, "models": {"latest": result},
                                   "notes": [bench.NOTE]}).splitlines()
    assert table[0].endswith("| repeated text | by depth |")
    assert table[2].endswith("| 0.9 (120 back): 2/2, 0.2 (960 back): 2/2 |")  # single_number: one needle
    multi_key = [sum(q["correct"] for q in row["queries"]) for row in rows]
    assert table[3].endswith(f"| 0.9 (120 back): {multi_key[0] + multi_key[2]}/2, 0.2 (960 back): "
                             f"{multi_key[1] + multi_key[3]}/2 |")
    with pytest.raises(ValueError, match="depths must be a non-empty list in"):
        needle_probe(Stub(), tok, {"heldout": HELDOUT}, lengths=(1200,), prompts=2, depths=[1.5])
