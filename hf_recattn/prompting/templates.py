"""The wording of retrieval prompts as data: template files in ``hf_recattn/templates/retrieval``, one per kind.

Kinds: ``passkey`` (one number hidden in text, then a question), ``codes`` (several made-up names with 4-digit
numbers, asked in any order), ``words`` (made-up names with words from the file's word lists) and ``needles``
(the natural-text recall probe's facts, questions and answer lead-ins, each for one ``form`` of value). Each file
holds a ``heldout`` and a ``train`` list of templates (and ``words`` its word lists under the same two names):
the split is the file's, a fixed list. Held-out templates and words serve the probes only, training ones the
training data only (``conversion/retrieval_data.py``), so that the probes ask in words training never showed.

A template maps part names to text with named placeholders (``{key}``, ``{value}``); ``load_templates`` checks
every part, placeholder and word and raises one ``TemplateError`` naming the file and line of the first problem.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

SPLITS = ("heldout", "train")
#: kind -> part -> (required, the placeholders it must hold: no others are allowed)
PARTS: dict[str, dict[str, tuple[bool, tuple[str, ...]]]] = {
    "passkey": {"head": (True, ()), "fact": (True, ("value",)), "question": (True, ()), "answer": (True, ()),
                "filler": (False, ())},
    "codes": {"head": (True, ()), "fact": (True, ("key", "value")), "intro": (True, ()),
              "query": (False, ("key", "value"))},
}
PARTS["words"] = PARTS["codes"]
PARTS["needles"] = {"head": (True, ()), "form": (True, ()), "fact": (True, ("key", "value")),
                    "question": (True, ("key",)), "answer": (True, ("key",)), "question_all": (False, ("key",)),
                    "answer_all": (False, ("key",))}
KINDS = tuple(PARTS)
#: parts that are settings, not wording (no prompt shows them)
SETTINGS = ("form",)
#: the forms of a needles template: the value it states (a 7-digit number, a word, three words, or a 4-digit
#: number stated in prose and asked in other words)
NEEDLE_FORMS = ("number", "word", "phrase", "paraphrase")
_WORD = re.compile(r"[a-z]+")
_MIN_WORDS = 16  # enough distinct values for the largest fact count a prompt asks for


class TemplateError(ValueError):
    """A template file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Template:
    """One template: its kind, name, split, the text of each part and where it is defined (``file:line``)."""

    kind: str
    name: str
    split: str
    parts: Mapping[str, str]
    where: str

    def fill(self, part: str, **values: str) -> str:
        """The text of ``part`` with its placeholders filled."""
        return self.parts[part].format(**values)

    @property
    def asked(self) -> str:
        """The part a fact is asked with: ``query``, else ``fact``."""
        return self.parts.get("query", self.parts["fact"])

    def pieces(self) -> list[str]:
        """The fixed text of every part that is wording (not a setting such as ``form``): each cut at its
        placeholders."""
        return [literal for part, text in self.parts.items() if part not in SETTINGS
                for literal, *_ in string.Formatter().parse(text) if literal]


@dataclass(frozen=True)
class TemplateSet:
    """The templates of one kind and (``words`` only) its word lists by split."""

    kind: str
    templates: tuple[Template, ...]
    words: Mapping[str, tuple[str, ...]]

    def split(self, split: str) -> tuple[Template, ...]:
        if split not in SPLITS:
            raise ValueError(f"unknown template split {split!r}; use one of {SPLITS}")
        return tuple(t for t in self.templates if t.split == split)


def templates_folder() -> Path:
    """The folder of the packaged template files."""
    return Path(str(resources.files("hf_recattn").joinpath("templates", "retrieval")))


@functools.cache
def load_templates(kind: str) -> TemplateSet:
    """The packaged templates of ``kind``, checked (``KINDS``)."""
    if kind not in PARTS:
        raise ValueError(f"unknown template kind {kind!r}; use one of {list(KINDS)}")
    return read_templates(templates_folder() / f"{kind}.yaml", kind)


def templates(kind: str, split: str) -> tuple[Template, ...]:
    """The ``split`` ("train" or "heldout") templates of ``kind``, in file order."""
    return load_templates(kind).split(split)


def probe_template(kind: str) -> Template:
    """The template the probes use for ``kind``: its first held-out one."""
    return templates(kind, "heldout")[0]


def word_list(split: str) -> tuple[str, ...]:
    """The values of word-valued facts for ``split``."""
    if split not in SPLITS:
        raise ValueError(f"unknown template split {split!r}; use one of {SPLITS}")
    return load_templates("words").words[split]


# ----- reading and checking a file ----------------------------------------------------------------
def read_templates(path: Path, kind: str) -> TemplateSet:
    """Read and check the template file ``path`` of ``kind``; TemplateError naming the file and line."""
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise TemplateError(f"{path}: not valid YAML: {err}") from None
    except OSError as err:
        raise TemplateError(f"{path}: cannot read the template file: {err}") from None
    allowed = (*SPLITS, "words") if kind == "words" else SPLITS
    sections = dict(_mapping(root, path, f"a {kind} template file"))
    for key, (key_node, _) in sections.items():
        if key not in allowed:
            raise TemplateError(f"{_at(path, key_node)}: unknown section {key!r}; use {list(allowed)}")
    found: list[Template] = []
    for split in SPLITS:
        if split not in sections:
            raise TemplateError(f"{path}: no {split!r} templates (each kind needs both splits)")
        key_node, node = sections[split]
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise TemplateError(f"{_at(path, key_node)}: {split!r} must be a non-empty list of templates")
        found += [_template(item, path, kind, split) for item in node.value]
    for k, t in enumerate(found):
        if any(t.name == earlier.name for earlier in found[:k]):
            raise TemplateError(f"{t.where}: template name {t.name!r} is used twice in this file")
    words = _words(sections.get("words"), path) if kind == "words" else {}
    if kind == "words" and not words:
        raise TemplateError(f"{path}: no 'words' section (the values of word-valued facts, by split)")
    return TemplateSet(kind, tuple(found), words)


def _at(path: Path, node: yaml.Node) -> str:
    return f"{path}:{node.start_mark.line + 1}"


def _mapping(node: yaml.Node | None, path: Path, what: str) -> list[tuple[str, tuple[yaml.Node, yaml.Node]]]:
    """(key, (key node, value node)) of a YAML mapping with string keys."""
    if not isinstance(node, yaml.MappingNode):
        raise TemplateError(f"{path if node is None else _at(path, node)}: {what} must be a mapping")
    out = []
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            raise TemplateError(f"{_at(path, key)}: keys must be plain names")
        if any(name == key.value for name, _ in out):
            raise TemplateError(f"{_at(path, key)}: {key.value!r} appears twice")
        out.append((key.value, (key, value)))
    return out


def _text(node: yaml.Node, path: Path, what: str) -> str:
    if not (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str" and node.value.strip()):
        raise TemplateError(f"{_at(path, node)}: {what} must be non-empty text")
    return node.value


def _template(node: yaml.Node, path: Path, kind: str, split: str) -> Template:
    """One template mapping, every part checked against ``PARTS[kind]``."""
    entries = dict(_mapping(node, path, f"a {split} template"))
    if "name" not in entries:
        raise TemplateError(f"{_at(path, node)}: a {kind} template needs a 'name'")
    name = _text(entries.pop("name")[1], path, "'name'")
    label = f"{kind} template {name!r}"
    rules = PARTS[kind]
    parts: dict[str, str] = {}
    for part, (key_node, value_node) in entries.items():
        if part not in rules:
            raise TemplateError(f"{_at(path, key_node)}: {label}: unknown part {part!r}; use {list(rules)}")
        if part == "filler" and split != "heldout":
            raise TemplateError(f"{_at(path, key_node)}: {label}: only held-out templates bring their own filler "
                                "(training text comes from the training split)")
        parts[part] = _text(value_node, path, f"{label}: {part!r}")
        _check_placeholders(parts[part], rules[part][1], f"{_at(path, value_node)}: {label}: {part!r}")
    missing = [part for part, (required, _) in rules.items() if required and part not in parts]
    if missing:
        raise TemplateError(f"{_at(path, node)}: {label} lacks the part(s) {missing}")
    if kind in ("codes", "words"):
        asked = "query" if "query" in parts else "fact"
        _check_asked(parts[asked], f"{_at(path, entries[asked][1])}: {label}: {asked!r}")
    if kind == "needles":
        _check_needle(parts, entries, f"{_at(path, node)}: {label}", path)
    return Template(kind, name, split, parts, _at(path, node))


def _check_needle(parts: dict[str, str], entries: dict[str, tuple[yaml.Node, yaml.Node]], where: str,
                  path: Path) -> None:
    """A needles template: a known ``form``; ``question_all`` and ``answer_all`` together, and in every ``number``
    template (the multi_value task asks with them)."""
    if parts["form"] not in NEEDLE_FORMS:
        raise TemplateError(f"{_at(path, entries['form'][1])}: form {parts['form']!r} is not one of "
                            f"{list(NEEDLE_FORMS)}")
    plural = [part for part in ("question_all", "answer_all") if part in parts]
    if len(plural) == 1 or (parts["form"] == "number" and not plural):
        raise TemplateError(f"{where} needs both 'question_all' and 'answer_all'"
                            + (" (a number template: the multi_value task asks with them)" if not plural else ""))


def _check_placeholders(text: str, wanted: tuple[str, ...], where: str) -> None:
    """Every placeholder of ``text`` is one of ``wanted`` (plain, no format), and each of ``wanted`` is there."""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(text)
                  if name is not None]
    except ValueError as err:
        raise TemplateError(f"{where}: {err} (write {{{{ and }}}} for literal braces)") from None
    for name, spec, conversion in fields:
        if name not in wanted or spec or conversion:
            allowed = ", ".join(f"{{{w}}}" for w in wanted) or "none"
            raise TemplateError(f"{where}: placeholder {{{name}{'!' + conversion if conversion else ''}"
                                f"{':' + spec if spec else ''}}} is not allowed here (allowed: {allowed})")
    absent = [w for w in wanted if w not in {name for name, _, _ in fields}]
    if absent:
        raise TemplateError(f"{where}: needs the placeholder(s) {', '.join(f'{{{w}}}' for w in absent)}")


def _check_asked(text: str, where: str) -> None:
    """The asked form names the key first, then the value once, after a space: the answer is the value."""
    if text.count("{value}") != 1 or " {value}" not in text:
        raise TemplateError(f"{where}: a fact is asked with ' {{value}}' once (a space before it)")
    if text.index("{key}") > text.index("{value}"):
        raise TemplateError(f"{where}: {{key}} must come before {{value}} (the question names the key)")


def _words(entry: tuple[yaml.Node, yaml.Node] | None, path: Path) -> dict[str, tuple[str, ...]]:
    """The word lists by split: lower-case words, distinct, the two lists disjoint."""
    if entry is None:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for split, (key_node, node) in _mapping(entry[1], path, "'words'"):
        if split not in SPLITS:
            raise TemplateError(f"{_at(path, key_node)}: words: unknown split {split!r}; use {list(SPLITS)}")
        if not isinstance(node, yaml.SequenceNode):
            raise TemplateError(f"{_at(path, node)}: words.{split} must be a list of words")
        words = tuple(_text(item, path, f"words.{split}") for item in node.value)
        bad = [w for w in words if not _WORD.fullmatch(w)]
        if bad or len(set(words)) != len(words) or len(words) < _MIN_WORDS:
            raise TemplateError(f"{_at(path, node)}: words.{split} must hold at least {_MIN_WORDS} distinct "
                                f"lower-case words{f'; not words: {bad}' if bad else ''}")
        out[split] = words
    if set(out) != set(SPLITS):
        raise TemplateError(f"{_at(path, entry[0])}: words needs both {list(SPLITS)} lists")
    shared = sorted(set(out["heldout"]) & set(out["train"]))
    if shared:
        raise TemplateError(f"{_at(path, entry[0])}: words {shared} are in both splits")
    return out
