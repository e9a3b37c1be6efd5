"""The prompts stay token for token what they were: the probes' (passkey, associative recall, recall at a distance,
every needle task on both template splits), the head search's and stage 2's default retrieval blocks (ids and loss
weights), each pinned by the sha256 of its ids.

The tokenizer is a BPE with a fixed vocabulary and fixed merges (no training), so the ids depend only on the prompt
builders, the template files and the texts. A digest changes when a builder, a template or the seeds change: a
change that is meant (a new template, a new layout) takes new digests, printed by the failing assertion.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

import pytest
import torch
from distill_fixtures import tiny_texts
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hf_recattn.conversion.retrieval_data import retrieval_blocks
from hf_recattn.conversion.retrieval_heads import recall_objective
from hf_recattn.evaluation import NEEDLE_TASKS, distance_prompt, needle_prompt, passkey_ids, probe_template
from hf_recattn.evaluation.recall import recall_prompt
from hf_recattn.evaluation.templates import templates

_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("e", "r"), ("o", "n"), ("▁", "s"),
           ("r", "e"), ("▁", "o"), ("▁o", "f"), ("▁", "i"), ("▁i", "s"), ("a", "n"), ("▁a", "n"), ("e", "d"),
           ("▁", "c"), ("o", "d"), ("▁c", "od"), ("▁cod", "e"), ("▁", "1"), ("0", "0"), ("a", "t"), ("▁s", "e")]

PINS = {
    "passkey": "2b911193911c2786",
    "recall_codes": "afb096ec0f741355",
    "recall_words_train": "d87d1e9456db2e9b",
    "distance": "4618e081960b11d5",
    "needles_heldout": "0abc3bfacab2e50a",
    "needles_train": "abc2f32cade6226c",
    "head_search": "d2b934d9054bdc49",
    "stage2_blocks": "a8efacde361a0bb2",
    "stage2_weights": "2b6dedea401fb8b5",
}


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Characters and a few merges, fixed (no trainer decides the ids), and a BOS before every text."""
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation + "\n") | {"▁"})
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *alphabet, *(a + b for a, b in _MERGES)])}
    model = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # a BOS
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def _digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def _needles(tok: Any, split: str) -> list[Any]:
    texts = tiny_texts(40, seed=5)
    out = []
    for task in NEEDLE_TASKS:
        prompt = needle_prompt(tok, texts, task, 900, seed=f"pin:{task}", split=split)
        out.append([list(prompt.context), list(prompt.positions), [[list(q.ids), q.max_new_tokens]
                                                                   for q in prompt.queries]])
    return out


def _prompts(tok: Any) -> dict[str, Any]:
    texts = tiny_texts()
    words = templates("words", "train")[1]
    blocks, weights = retrieval_blocks(tok, texts, 6, 700, answer_weight=5.0, seed=1, min_distance=64)
    return {
        "passkey": [passkey_ids(tok, 400, "52913", depth) for depth in (0.1, 0.5, 0.9)],
        "recall_codes": recall_prompt(tok, texts, 600, 4, seed="pin").ids(),
        "recall_words_train": recall_prompt(tok, texts, 600, 2, seed="pin", template=words, min_distance=64).ids(),
        "distance": distance_prompt(tok, texts, 150, seed="pin", template=probe_template("words")).ids(),
        "needles_heldout": _needles(tok, "heldout"),
        "needles_train": _needles(tok, "train"),
        "head_search": [p.ids() for p in recall_objective(tok, texts, 500, prompts=2, seed=3)],
        "stage2_blocks": blocks,
        "stage2_weights": weights,
    }


def test_prompts_are_token_for_token_what_they_were(tok: Any) -> None:
    built = _prompts(tok)
    found = {name: _digest([v.tolist() if isinstance(v, torch.Tensor) else v for v in value])
             if isinstance(value, list) else _digest(value) for name, value in built.items()}
    assert found == PINS, f"prompt digests changed: {found}"


def test_the_pins_see_a_one_token_change(tok: Any) -> None:
    """A digest moves when one id moves: the pins can fail."""
    ids = recall_prompt(tok, tiny_texts(), 600, 4, seed="pin").ids()
    changed = ids.clone()
    changed[0, 300] += 1
    assert _digest(ids) != _digest(changed)
