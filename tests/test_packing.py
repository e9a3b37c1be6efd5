"""Packed documents (position ids restarting, as DataCollatorWithFlattening makes them) do not leak.

For every registered mixer family (the representative specs and hybrid models of ``generation_cases``, so a
family added later is covered), a packed row of documents gives each document's logits when run alone, and the
gradients of the summed loss are the sums of the per-document gradients. Tolerances: fp32 logits within 1e-5;
float64 gradients within 1e-9 relative to the largest gradient entry of each parameter (plus 1e-12 absolute).
The reference is the plain model on one document, which no packing code touches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from generation_cases import VOCAB, Case, case_params, one_thread, tiny_model
from transformers import DataCollatorWithFlattening

from hf_recattn import RecAttnForCausalLM

LENGTHS = (5, 9, 4)  # with chunk_size 4: two documents span several chunks, one fits in one
BIDIRECTIONAL = [
    pytest.param(Case(f"{spec['mixer']}(causal=False)", spec), id=f"{spec['mixer']}(causal=False)")
    for spec in ({"mixer": "linear", "causal": False}, {"mixer": "heinsen", "causal": False},
                 {"mixer": "delta", "rule": "delta", "causal": False})
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def documents(lengths: tuple[int, ...] = LENGTHS, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, total] ids and position ids restarting at 0 for each document."""
    return torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]


def summed_loss(logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the tokens whose successor is in the same document."""
    same_doc = positions[:, 1:] == positions[:, :-1] + 1
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (losses * same_doc.flatten()).sum()


def gradients(model: RecAttnForCausalLM) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", [*case_params(), *BIDIRECTIONAL])
def test_packed_documents_equal_documents_alone(case: Case) -> None:
    model = tiny_model(case)
    docs = documents()
    ids, positions = packed(docs)
    with torch.no_grad():
        out = model(ids, position_ids=positions)
        want = torch.cat([model(d[None]).logits for d in docs], dim=1)
    assert out.past_key_values is None  # packed documents leave no cache behind
    assert (out.logits - want).abs().max() <= 1e-5

    model = model.double().train()
    summed_loss(model(ids, position_ids=positions).logits, ids, positions).backward()
    got = gradients(model)
    model.zero_grad()
    for d in docs:
        one, pos = d[None], torch.arange(len(d))[None]
        summed_loss(model(one).logits, one, pos).backward()
    expected = gradients(model)
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        tol = 1e-9 * float(expected[name].abs().max()) + 1e-12
        assert (grad - expected[name]).abs().max() <= tol, name


MIXED: dict[str, Any] = {
    "attention": {"mixer": "delta", "rule": "gated"},
    "overrides": {"0": {"mixer": "softmax", "forget": "fox", "fox_bias_init": 2.0},
                  "1": {"mixer": "hybrid", "window": 3, "sink_tokens": 1}, "-1": {"mixer": "mesa"}},
}


def mixed_model() -> RecAttnForCausalLM:
    return tiny_model(Case("mixed", MIXED["attention"], MIXED["overrides"], 4))


def test_rows_packed_separately_with_padding() -> None:
    """Two rows, each packing its own documents, one right-padded: every document as if alone."""
    model = mixed_model()
    row0, row1 = documents((5, 9, 4)), documents((7, 1, 6), seed=4)
    width = 18
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    positions = torch.zeros(2, width, dtype=torch.long)
    for r, docs in enumerate((row0, row1)):
        tokens, pos = packed(docs)
        ids[r, : tokens.shape[1]], positions[r, : pos.shape[1]] = tokens[0], pos[0]
        mask[r, : tokens.shape[1]] = 1
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        for r, docs in enumerate((row0, row1)):
            start = 0
            for d in docs:
                alone = model(d[None]).logits[0]
                assert (got[r, start : start + len(d)] - alone).abs().max() <= 1e-5
                start += len(d)


def test_data_collator_with_flattening_gives_the_per_document_loss() -> None:
    """transformers' DataCollatorWithFlattening output: the token-weighted mean of the documents' losses."""
    model = mixed_model()
    docs = documents((6, 11, 3, 8))
    for flash_kwargs in (False, True):
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
        batch = collator([{"input_ids": d.tolist()} for d in docs])
        if flash_kwargs:  # the FlashAttention boundaries alone also separate the documents
            del batch["position_ids"]
        with torch.no_grad():
            loss = model(**batch).loss
            total = sum(model(d[None], labels=d[None]).loss * (len(d) - 1) for d in docs)
        want = total / sum(len(d) - 1 for d in docs)
        assert abs(float(loss) - float(want)) <= 1e-5


def test_packed_documents_with_a_cache_are_refused() -> None:
    model = mixed_model()
    ids, positions = packed(documents())
    with torch.no_grad():
        cache = model(ids[:, :3], use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"packed documents .* cache holding 3 tokens"):
            model(ids, position_ids=positions, past_key_values=cache)
        with pytest.raises(ValueError, match=r"packed documents .* cache holding 0 tokens"):
            model(ids, position_ids=positions, past_key_values=model.new_cache())
        # consecutive positions (one document, e.g. generate()'s prefill) keep using the cache
        one = torch.arange(ids.shape[1])[None]
        assert model(ids, position_ids=one, use_cache=True).past_key_values.get_seq_length() == ids.shape[1]
