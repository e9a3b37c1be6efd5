"""Retrieval templates as data: the packaged files load and split into train / held-out; a bad file is one error
naming its file and line; and neither the held-out wording nor held-out text ever reaches the training prompts,
while the probes use nothing else.

The stream checks decode the prompts with a byte-level tokenizer (text round-trips exactly) and look for the fixed
text of every template (each piece between placeholders, 10 characters or more) and for held-out documents.
"""

from __future__ import annotations

import fnmatch
import random
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_recattn.conversion.recipe import load_recipe
from hf_recattn.conversion.retrieval_data import recipe_window, retrieval_blocks
from hf_recattn.conversion.retrieval_heads import recall_objective
from hf_recattn.data.corpus import split_heldout
from hf_recattn.evaluation import NEEDLE_TASKS, distance_prompt, needle_prompt, passkey_ids, sentence_pieces
from hf_recattn.evaluation.recall import Haystack, recall_prompt
from hf_recattn.evaluation.templates import (
    KINDS,
    TemplateError,
    load_templates,
    probe_template,
    read_templates,
    templates,
    templates_folder,
    word_list,
)

MIN_PIECE = 10  # characters: shorter pieces (" is ", ".") are ordinary text
_WORDS = ("amber basin cobble drift ember fjord grove hollow inlet juniper knoll loam marsh nook orchard pasture "
          "quarry ridge shale thicket upland vale willow yarrow brook cairn dell fen glen heath").split()


def _pieces(template: object) -> list[str]:
    return [p.strip() for p in template.pieces() if len(p.strip()) >= MIN_PIECE]  # type: ignore[attr-defined]


def _all(split: str) -> list:  # noqa: ANN202
    return [t for kind in KINDS for t in templates(kind, split)]


def _documents(n: int, seed: int) -> list[str]:
    """Pseudo-prose documents: paragraphs of capitalized sentences of 6 to 12 words, no digits."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
                     for _ in range(8)]
        docs.append(" ".join(sentences[:4]) + "\n\n" + " ".join(sentences[4:]))
    return docs


def _byte_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A small byte-level BPE: every text decodes back to itself exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str], PreTrainedTokenizerFast]:
    train, heldout = split_heldout(_documents(100, seed=0), 0.2)
    wording = [text for t in _all("train") + _all("heldout") for text in t.parts.values()]
    return train, heldout, _byte_tokenizer(train + heldout + wording)


# ----- the packaged files -------------------------------------------------------------------------
def test_every_kind_splits_into_train_and_heldout() -> None:
    for kind in KINDS:
        loaded = load_templates(kind)
        assert loaded.split("heldout") and len(loaded.split("train")) >= 3, kind
        assert probe_template(kind) == loaded.split("heldout")[0]
        assert {t.split for t in loaded.templates} == {"train", "heldout"}
        assert all(t.where.startswith(str(templates_folder() / f"{kind}.yaml") + ":") for t in loaded.templates)
    assert [probe_template(k).name for k in KINDS] == ["pass-key", "codes-of-people", "capitals", "magic-numbers"]
    assert not set(word_list("train")) & set(word_list("heldout")) and len(word_list("heldout")) >= 16
    with pytest.raises(ValueError, match="unknown template kind"):
        load_templates("riddles")


def test_the_template_files_ship_with_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["hf_recattn"]
    package = templates_folder().parents[1]
    files = sorted(p.relative_to(package).as_posix() for p in templates_folder().iterdir())
    assert files == [f"templates/retrieval/{kind}.yaml" for kind in sorted(KINDS)]
    assert all(any(fnmatch.fnmatchcase(f, pattern) for pattern in patterns) for f in files)


def test_heldout_wording_is_in_no_training_template() -> None:
    training = "\x00".join(text for t in _all("train") for text in t.parts.values())
    for template in _all("heldout"):
        pieces = _pieces(template)
        assert pieces, template.name
        assert not [p for p in pieces if p in training], template.name
    assert all(_pieces(t) for t in _all("train"))


def test_the_probes_keep_their_wording() -> None:
    """The held-out templates are the probes' wording as it was before templates were data."""
    passkey, codes = probe_template("passkey").parts, probe_template("codes").parts
    assert passkey["fact"].format(value="KEY") == "\n\nThe pass key is KEY. Remember it. KEY is the pass key.\n\n"
    assert passkey["question"] + passkey["answer"] == "\n\nWhat is the pass key? The pass key is"
    assert passkey["filler"].startswith("The river runs past the old mill") and passkey["filler"].endswith("summer.")
    assert codes["head"] == "The text below mentions the codes of a few people. Remember every code.\n\n"
    assert codes["fact"] == " The code of {key} is {value}." and "query" not in codes
    assert codes["intro"] == "\n\nThe codes mentioned in the text above:"


# ----- bad files ----------------------------------------------------------------------------------
GOOD_CODES = """\
heldout:
  - name: probe
    head: "Head.\\n\\n"
    fact: " The code of {key} is {value}."
    intro: "\\n\\nIntro:"
train:
  - name: other
    head: "Other head.\\n\\n"
    fact: " {key} has number {value}."
    intro: "\\n\\nNumbers:"
"""

GOOD_PASSKEY = """\
heldout:
  - name: probe
    head: "Head.\\n\\n"
    fact: " The key is {value}."
    question: " Which key?"
    answer: " The key is"
    filler: "Some text."
train:
  - name: other
    head: "Other head.\\n\\n"
    fact: " Number {value} it is."
    question: " Which number?"
    answer: " The number is"
"""


@pytest.mark.parametrize(("old", "new", "line", "message"), [
    ('fact: " {key} has number {value}."', 'fact: " The key has a number."', 9, r"needs the placeholder\(s\) \{key\}"),
    ('fact: " {key} has number {value}."', 'fact: " {key} has number {vaule}."', 9, r"\{vaule\} is not allowed"),
    ('fact: " {key} has number {value}."', 'fact: " {key} has number {value:>5}."', 9, r"\{value:>5\} is not allowed"),
    ('fact: " {key} has number {value}."', 'fact: " {key} has number {value."', 9, "literal braces"),
    ('fact: " {key} has number {value}."', 'fact: " {value} belongs to {key}."', 9, "must come before"),
    ('fact: " {key} has number {value}."', 'fact: " {key} has number:{value}."', 9, "a space before it"),
    ('intro: "\\n\\nNumbers:"', 'intro: "\\n\\nNumbers {key}:"', 10, r"allowed: none"),
    ('intro: "\\n\\nNumbers:"', 'outro: "\\n\\nNumbers:"', 10, "unknown part 'outro'"),
    ('intro: "\\n\\nNumbers:"', 'intro: ""', 10, "non-empty text"),
    ('    intro: "\\n\\nNumbers:"\n', "", 7, r"lacks the part\(s\) \['intro'\]"),
    ("name: other", "name: probe", 7, "'probe' is used twice"),
    ("train:", "training:", 6, "unknown section 'training'"),
    ("  - name: other", "  - nom: other", 7, "needs a 'name'"),
])
def test_a_bad_template_names_its_file_and_line(tmp_path: Path, old: str, new: str, line: int, message: str) -> None:
    path = tmp_path / "codes.yaml"
    assert old in GOOD_CODES
    path.write_text(GOOD_CODES.replace(old, new, 1))
    with pytest.raises(TemplateError, match=message) as caught:
        read_templates(path, "codes")
    assert str(caught.value).startswith(f"{path}:{line}:"), str(caught.value)


def test_a_bad_file_is_named(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_CODES)
    loaded = read_templates(good, "codes")
    assert [t.name for t in loaded.templates] == ["probe", "other"] and loaded.templates[1].where == f"{good}:7"
    cases = {
        "heldout: [unclosed": "not valid YAML",
        GOOD_CODES.split("train:")[0]: "no 'train' templates",
        "- just a list": "must be a mapping",
    }
    for text, message in cases.items():
        good.write_text(text)
        with pytest.raises(TemplateError, match=message) as caught:
            read_templates(good, "codes")
        assert str(caught.value).startswith(str(good)), str(caught.value)
    with pytest.raises(TemplateError, match="cannot read"):
        read_templates(tmp_path / "missing.yaml", "codes")
    good.write_text(GOOD_PASSKEY)
    assert read_templates(good, "passkey").templates[0].parts["filler"] == "Some text."
    good.write_text(GOOD_PASSKEY + '    filler: "More text."\n')
    with pytest.raises(TemplateError, match=f"{good}:14: passkey template 'other': only held-out templates bring"):
        read_templates(good, "passkey")
    good.write_text("heldout: []\ntrain: []\n")
    with pytest.raises(TemplateError, match=f"{good}:1: 'heldout' must be a non-empty list"):
        read_templates(good, "codes")


def test_bad_word_lists_are_named(tmp_path: Path) -> None:
    path = tmp_path / "words.yaml"
    heldout, train = list(_WORDS[:16]), list(_WORDS[14:])  # orchard and pasture in both

    def write(held: list[str], trained: list[str]) -> None:
        path.write_text(GOOD_CODES + f"words:\n  heldout: [{', '.join(held)}]\n  train: [{', '.join(trained)}]\n")

    write(heldout, train)
    with pytest.raises(TemplateError, match=f"{path}:11: words \\['orchard', 'pasture'\\] are in both splits"):
        read_templates(path, "words")
    write(heldout, ["Thicket", *train[2:]])
    with pytest.raises(TemplateError, match=f"{path}:13: words.train must hold at least 16 distinct lower-case "
                       "words; not words: \\['Thicket'\\]"):
        read_templates(path, "words")
    write(heldout, train[2:])
    with pytest.raises(TemplateError, match="words.train must hold at least 16"):
        read_templates(path, "words")
    write([*heldout[:-2], "moss", "peat"], [*train[2:], "mud", "clay"])
    assert read_templates(path, "words").words["train"][-1] == "clay"
    with pytest.raises(TemplateError, match=f"{path}:11: unknown section 'words'"):
        read_templates(path, "codes")
    path.write_text(GOOD_CODES)
    with pytest.raises(TemplateError, match="no 'words' section"):
        read_templates(path, "words")


# ----- the streams --------------------------------------------------------------------------------
def _training_stream(tokenizer: PreTrainedTokenizerFast, train: list[str]) -> str:
    """Stage 2's retrieval blocks for several seeds (with the retrieval recipe's window and without; the default
    kinds and the needles), and the head search's prompts, decoded."""
    window = recipe_window(load_recipe("hybrid-w64-sink4-hedgehog-retrieval"))
    rows = []
    for seed in range(4):
        ids, _ = retrieval_blocks(tokenizer, train, 12, 1024, answer_weight=100.0, seed=seed,
                                  min_distance=window if seed % 2 else 0)
        rows += ids.tolist()
    for seed in range(2):
        ids, _ = retrieval_blocks(tokenizer, train, 14, 1024, seed=seed, min_distance=window if seed else 0,
                                  kinds=("needles",))
        rows += ids.tolist()
    rows += [p.ids()[0].tolist() for p in recall_objective(tokenizer, train, 1024, prompts=3, seed=0)]
    return "\x00".join(tokenizer.decode(row) for row in rows)


def _sentences(texts: list[str], shortest: int = 20) -> list[str]:
    return [s.strip() for text in texts for s in sentence_pieces(text) if len(s.strip()) >= shortest]


def test_training_prompts_never_show_heldout_wording_or_text(corpus: tuple) -> None:
    train, heldout, tokenizer = corpus
    stream = _training_stream(tokenizer, train)
    leaked = [(t.kind, t.name, p) for t in _all("heldout") for p in _pieces(t) if p in stream]
    assert leaked == []
    filler = _sentences([probe_template("passkey").parts["filler"]], MIN_PIECE)
    assert filler and not [s for s in filler if s in stream]
    assert not [s for s in _sentences(heldout) if s in stream]
    assert not [w for w in word_list("heldout") if re.search(rf"\b{w}\b", stream)]
    # the converse, so that the checks above can fail: every training template and training text shows up
    unused = [(t.kind, t.name) for t in _all("train") if not any(p in stream for p in _pieces(t))]
    assert unused == []
    assert sum(s in stream for s in _sentences(train)) > 100
    assert sum(bool(re.search(rf"\b{w}\b", stream)) for w in word_list("train")) > 10


def test_probes_use_heldout_wording_and_text_only(corpus: tuple) -> None:
    train, heldout, tokenizer = corpus
    haystack = Haystack(tokenizer, heldout)
    rows = [passkey_ids(tokenizer, 1024, "24680", depth)[0] for depth in (0.1, 0.5, 0.9)]
    rows += [recall_prompt(tokenizer, haystack, 1024, n, seed=n).ids()[0].tolist() for n in (1, 4, 16)]
    rows += [distance_prompt(tokenizer, haystack, d, seed=d).ids()[0].tolist() for d in (100, 600)]
    needles = [needle_prompt(tokenizer, haystack, task, 1024, seed=task) for task in NEEDLE_TASKS]
    rows += [list(p.context) + [token for q in p.queries for token in q.ids] for p in needles]
    stream = "\x00".join(tokenizer.decode(row) for row in rows)
    assert not [(t.kind, t.name, p) for t in _all("train") for p in _pieces(t) if p in stream]
    assert not [s for s in _sentences(train) if s in stream and not any(s in h for h in heldout)]
    assert not [w for w in word_list("train") if re.search(rf"\b{w}\b", stream)]
    assert all(p in stream for kind in KINDS for p in _pieces(probe_template(kind)))
    assert all(p in stream for t in templates("needles", "heldout") for p in _pieces(t))  # every task's wording
    assert sum(s in stream for s in _sentences(heldout)) > 20
