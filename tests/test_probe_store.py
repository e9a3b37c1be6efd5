"""An interrupted evaluation resumes: finished probes and needle cells are read back, not run again, and the
resumed report equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_lm import tiny_dims, tiny_tokenizer

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.evaluation import ProbeStore, RecallSizes, evaluate, needles, suite

SIZES = RecallSizes(passkey_lengths=(200,), passkey_trials=1, recall_lengths=(200,), recall_pairs=(1,),
                    recall_trials=1, distances=(10,), distance_trials=1, long_lengths=(24,), long_blocks=1,
                    needle_tasks=("single_number", "multi_key"), needle_lengths=(500, 600), needle_prompts=2,
                    needle_haystacks=("heldout",))
TIMED = ("seconds", "decode", "resumed_probes")  # what differs between two runs of the same evaluation


class Interrupt(Exception):
    """Stands for Ctrl-C or a killed job in the middle of a probe."""


def test_store_round_trip_and_refusals(tmp_path: Path) -> None:
    store = ProbeStore(tmp_path / "s")
    assert store.get("needles-heldout/1024") is None
    assert store.put("needles-heldout/1024", {"accuracy": (0.5, 1)}) == {"accuracy": [0.5, 1]}  # as JSON reads it
    assert store.path("needles-heldout/1024").name == "needles-heldout_1024.json"
    calls = []
    assert store.cached("needles-heldout/1024", lambda: calls.append(1)) == {"accuracy": [0.5, 1]} and not calls
    assert store.resumed == ["needles-heldout/1024"]
    assert store.cached("other", lambda: 3) == 3 and store.resumed == ["needles-heldout/1024"]
    (tmp_path / "s" / "needles-heldout_1024.json").write_text(json.dumps({"key": "needles:heldout:1024", "value": 1}))
    with pytest.raises(ValueError, match="holds the result of 'needles:heldout:1024'"):
        store.get("needles-heldout/1024")  # two keys that share a file name never read each other's result
    with pytest.raises(ValueError, match="names no file"):
        store.path("//")


def _model(tokenizer: Any) -> RecAttnForCausalLM:
    torch.manual_seed(0)
    config = RecAttnConfig(**dict(tiny_dims(len(tokenizer)), max_position_embeddings=1024),
                           attention={"mixer": "linear", "feature_map": "elu"})
    return RecAttnForCausalLM(config).eval()


def _strip(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in json.loads(json.dumps(report)).items() if k not in TIMED}


def test_an_interrupted_evaluation_resumes_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tiny_tokenizer()
    model = _model(tok)
    blocks = torch.randint(3, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    whole = evaluate(model, tok, blocks, sizes=SIZES)  # no store: the reference
    scored = []
    score = needles.score_needle_prompt

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if len(scored) == 4:  # the third cell's first prompt: two cells of two prompts finished before it
            raise Interrupt
        scored.append(1)
        return score(*args, **kwargs)

    monkeypatch.setattr(needles, "score_needle_prompt", counting)
    with pytest.raises(Interrupt):
        evaluate(model, tok, blocks, sizes=SIZES, store=ProbeStore(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "needles-heldout-single_number-500-2x-seed0.json", "needles-heldout-single_number-600-2x-seed0.json",
        "passkey.json", "perplexity.json"]
    scored.clear()
    monkeypatch.setattr(needles, "score_needle_prompt", lambda *a, **k: scored.append(1) or score(*a, **k))
    perplexities = []
    monkeypatch.setattr(suite, "perplexity", lambda *a, **k: perplexities.append(1))
    resumed = evaluate(model, tok, blocks, sizes=SIZES, store=ProbeStore(tmp_path))
    assert len(scored) == 4 and not perplexities  # only the two unfinished cells ran; the perplexity was read back
    assert resumed["resumed_probes"] == ["perplexity", "passkey", "needles-heldout-single_number-500-2x-seed0",
                                         "needles-heldout-single_number-600-2x-seed0"]
    assert _strip(resumed) == _strip(whole)
    again = evaluate(model, tok, blocks, sizes=SIZES, store=ProbeStore(tmp_path))  # everything read back
    assert len(scored) == 4 and _strip(again) == _strip(whole) and again["decode"] == resumed["decode"]


def test_cells_with_other_placements_are_not_read_back(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = _model(tok)
    texts = ["the river runs past the old mill and the road turns north. " * 40]
    store = ProbeStore(tmp_path)
    first = needles.needle_probe(model, tok, {"heldout": texts}, tasks=("single_number",), lengths=(600,),
                                 prompts=2, store=store)
    near = needles.needle_probe(model, tok, {"heldout": texts}, tasks=("single_number",), lengths=(600,),
                                prompts=2, depths=(0.95,), store=store)
    assert store.resumed == [] and len(list(tmp_path.iterdir())) == 2

    def depths(report: dict[str, Any]) -> list[float]:
        return [r["needles"][0]["depth"] for r in report["answers"]["single_number"]["heldout"]["600"]]

    assert depths(near) != depths(first) and min(depths(near)) > 0.8  # its own prompts, near the question
