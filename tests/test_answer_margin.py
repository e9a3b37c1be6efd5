"""scripts/answer_margin.py: the held-out passkey answers teacher-forced, against a model whose every logit is known."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from script_modules import load_script
from tiny_lm import tiny_tokenizer

from hf_recattn.evaluation import passkey, passkey_probe

margin = load_script("scripts", "answer_margin")


class BigramLM(torch.nn.Module):
    """logits[t] = table[token t], with the model's ``logits_to_keep`` (the last N positions)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))
        self.config = SimpleNamespace(vocab_size=vocab)

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        logits = self.table[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def _log_softmax_row(row: list[float]) -> list[float]:
    """One row in float64 with an explicit log-sum-exp."""
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


def test_answer_margin_matches_a_float64_reference() -> None:
    model = BigramLM(11)
    prompt, answer = [3, 7, 1, 4], [9, 2, 2, 5]
    got = margin.answer_margin(model, prompt, answer)
    table = model.table.detach().double().tolist()
    rows = [_log_softmax_row(table[prev]) for prev in [prompt[-1], *answer[:-1]]]
    first = rows[0][answer[0]]
    rival = max((x, i) for i, x in enumerate(rows[0]) if i != answer[0])
    assert got["first"] == pytest.approx(first, abs=1e-6)
    assert (got["rival"], got["rival_id"]) == (pytest.approx(rival[0], abs=1e-6), rival[1])
    assert got["lead"] == pytest.approx(first - rival[0], abs=1e-6)
    assert got["rest"] == pytest.approx(sum(r[a] for r, a in zip(rows[1:], answer[1:], strict=True)) / 3, abs=1e-6)
    forced = all(max(range(11), key=row.__getitem__) == a for row, a in zip(rows, answer, strict=True))
    assert got["forced"] is forced


def test_lead_and_forced_follow_the_answer_path() -> None:
    """A table that predicts the answer at every step: forced, with a positive lead; one wrong step unforces it."""
    model = BigramLM(11)
    prompt, answer = [3, 7, 1, 4], [9, 2, 5]
    with torch.no_grad():
        for prev, nxt in zip([prompt[-1], *answer[:-1]], answer, strict=True):
            model.table[prev, nxt] = 50.0
    sure = margin.answer_margin(model, prompt, answer)
    assert sure["forced"] and sure["lead"] > 40 and sure["rest"] > -1e-6
    with torch.no_grad():
        model.table[2, 6] = 60.0  # after the second answer token the model now prefers 6 to 5
    unsure = margin.answer_margin(model, prompt, answer)
    assert not unsure["forced"] and unsure["lead"] == pytest.approx(sure["lead"])


def test_rows_are_the_eval_prompts() -> None:
    """The same keys and depths as passkey_probe (lengths drawn in its order), prompts of length - 8 tokens."""
    tok = tiny_tokenizer()
    rows = margin.margins(BigramLM(len(tok)), tok, [200, 400], trials=3, depths=[0.1, 0.5, 0.9], seed=1)
    probe_keys = passkey.passkey_keys([200, 400], 3, seed=1)
    assert [r["key"] for r in rows] == probe_keys[200] + probe_keys[400]
    assert [r["depth"] for r in rows] == [0.1, 0.5, 0.9] * 2
    for row in rows:
        ids, at = passkey.passkey_ids(tok, row["length"] - margin.ANSWER_ROOM, row["key"], row["depth"])
        assert len(ids) == row["length"] - 8 and row["back"] == len(ids) - at
    assert tok.decode(margin.answer_ids(tok, "12345")).strip() == "12345"


def test_passkey_keys_are_the_probes_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tiny_tokenizer()
    monkeypatch.setattr(passkey, "greedy_continuation",
                        lambda *a, **k: SimpleNamespace(tokens=torch.tensor(tok("no idea")["input_ids"])))
    probe = passkey_probe(BigramLM(len(tok)), tok, context_lengths=(200, 400), trials=2, seed=3)
    keys = passkey.passkey_keys([200, 400], 2, seed=3)
    assert {int(n): [a["key"] for a in rows] for n, rows in probe["answers"].items()} == keys


def test_bad_lengths_are_refused() -> None:
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="--lengths"):
        margin.margins(BigramLM(len(tok)), tok, [8], trials=1, depths=[0.5])
    with pytest.raises(ValueError, match="--trials"):
        margin.margins(BigramLM(len(tok)), tok, [200], trials=0, depths=[0.5])
