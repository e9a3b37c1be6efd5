"""Long blocks joined from short documents, and the next-token loss by position bucket.

The loss by position is checked against an independent float64 loop over a model whose logits are a known function
of the position (``StepLM``), and against ``perplexity`` (the buckets' token-weighted mean is its log). Tolerances:
rel 1e-5 against the float64 loop (float32 log-softmax), rel 1e-6 between the two float32 measures.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_lm import tiny_dims, tiny_tokenizer

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.evaluation import perplexity
from hf_recattn.evaluation.heldout import (
    LONG_LENGTHS,
    bucket_losses,
    long_blocks,
    long_perplexity,
    long_rows,
    loss_by_position,
    position_buckets,
    position_losses,
)

SLOPE = 0.3


class StepLM(torch.nn.Module):
    """logits[t] = SLOPE * t on token 0 and 0 elsewhere: the loss at every position is known without running it."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.slope = torch.nn.Parameter(torch.tensor(SLOPE))  # a parameter, which says where the model lives
        self.vocab = vocab
        self.config = SimpleNamespace(vocab_size=vocab)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., 0] = self.slope * torch.arange(input_ids.shape[1], dtype=torch.float32)
        return SimpleNamespace(logits=logits)


class BigramLM(torch.nn.Module):
    """logits[t] = table[token t]."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * 3)
        self.config = SimpleNamespace(vocab_size=vocab)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


def _step_loss(vocab: int, position: int, target: int) -> float:
    """StepLM's NLL of ``target`` at ``position`` (predicted from the logits at position - 1), in float64."""
    boosted = SLOPE * (position - 1)
    log_z = math.log(math.exp(boosted) + vocab - 1)
    return log_z - (boosted if target == 0 else 0.0)


def _blocks(vocab: int, n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


# ----- buckets ------------------------------------------------------------------------------------------------
def test_position_buckets_are_log_spaced_and_cover_the_block() -> None:
    assert position_buckets(8192) == (1, 64, 256, 1024, 4096, 8192)
    assert position_buckets(4096) == (1, 64, 256, 1024, 4096)
    assert position_buckets(5000) == (1, 64, 256, 1024, 4096, 5000)
    assert position_buckets(40) == (1, 40) and position_buckets(40, first=4, factor=2) == (1, 4, 8, 16, 32, 40)
    for bad in ((1,), (8, 1), (8, 4, 1)):
        with pytest.raises(ValueError, match="position_buckets"):
            position_buckets(*bad)


def test_loss_by_position_matches_a_float64_loop_on_a_model_of_known_loss() -> None:
    vocab, length = 7, 24
    blocks = _blocks(vocab, 3, length)
    blocks[:, 5::3] = 0  # some targets take the boosted logit
    buckets = (1, 4, 10, 24)
    for batch_size in (1, 2, 4):
        got = loss_by_position(StepLM(vocab), blocks, buckets, batch_size=batch_size)
        assert [(b["start"], b["end"], b["tokens"]) for b in got] == [(1, 4, 9), (4, 10, 18), (10, 24, 42)]
        for bucket in got:
            span = range(bucket["start"], bucket["end"])
            losses = [_step_loss(vocab, p, int(row[p])) for row in blocks for p in span]
            assert bucket["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    early, late = got[0]["loss"], got[-1]["loss"]
    assert early != pytest.approx(late, rel=1e-2)  # the buckets differ, so a mix-up of positions would show


def test_position_losses_put_position_p_in_column_p_minus_1() -> None:
    vocab = 5
    blocks = _blocks(vocab, 2, 9, seed=3)
    losses = position_losses(StepLM(vocab), blocks)
    assert losses.shape == (2, 8) and losses.dtype == torch.float32
    expected = [[_step_loss(vocab, p, int(row[p])) for p in range(1, 9)] for row in blocks]
    assert torch.allclose(losses.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)


def test_buckets_weighted_by_tokens_average_to_log_perplexity() -> None:
    model = BigramLM(11)
    blocks = _blocks(11, 3, 40, seed=2)
    got = loss_by_position(model, blocks, position_buckets(40, first=4, factor=2))
    assert sum(b["tokens"] for b in got) == 3 * 39
    mean = sum(b["loss"] * b["tokens"] for b in got) / sum(b["tokens"] for b in got)
    assert mean == pytest.approx(math.log(perplexity(model, blocks)), rel=1e-6)
    assert loss_by_position(model, blocks)[0]["end"] == 40  # default buckets: position_buckets(T)


def test_loss_by_position_on_a_tiny_recattn_model_agrees_with_perplexity() -> None:
    torch.manual_seed(0)
    model = RecAttnForCausalLM(RecAttnConfig(**tiny_dims(64), attention="softmax")).eval()
    blocks = _blocks(64, 2, 48, seed=4)
    got = loss_by_position(model, blocks, (1, 8, 32, 48))
    mean = sum(b["loss"] * b["tokens"] for b in got) / sum(b["tokens"] for b in got)
    assert mean == pytest.approx(math.log(perplexity(model, blocks)), rel=1e-6)


def test_positions_outside_every_bucket_are_not_counted_and_bad_buckets_are_named() -> None:
    losses = torch.arange(2 * 11, dtype=torch.float32).view(2, 11)  # blocks of 12 tokens
    (only,) = bucket_losses(losses, (5, 9))
    assert only == {"start": 5, "end": 9, "loss": pytest.approx(float(losses[:, 4:8].mean())), "tokens": 8}
    for bad in ((0, 5), (1,), (1, 5, 5), (5, 3), (1, 13)):
        with pytest.raises(ValueError, match="buckets must be increasing"):
            bucket_losses(losses, bad)
    with pytest.raises(ValueError, match="losses must be"):
        bucket_losses(torch.zeros(2, 0), (1, 2))
    with pytest.raises(ValueError, match="blocks must be"):
        loss_by_position(StepLM(3), torch.zeros(3, dtype=torch.long), (1, 2))


# ----- long blocks -------------------------------------------------------------------------------------------
DOCS = ["birds sing. " * 12, "the river runs. ", "a b c. " * 30, "the old mill. ", "short."]


def test_long_lengths_include_8192() -> None:
    assert 4096 in LONG_LENGTHS and 8192 in LONG_LENGTHS


def test_joined_blocks_follow_the_single_document_ones_with_eos_between_documents() -> None:
    tok = tiny_tokenizer()
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    long = [k for k, row in enumerate(ids) if len(row) >= 64]
    assert long == [0, 2] and len(ids[2]) < 192
    single = long_blocks(tok, DOCS, 64, 10).tolist()
    assert long_blocks(tok, DOCS, 64, 10, join=True).tolist()[: len(single)] == single
    for length in (8, 16):
        rows, joined = long_rows(tok, DOCS, length, 100, join=True)
        n_single = sum(len(row) // length for k, row in enumerate(ids) if len(row) >= length)
        short_stream = [t for row in ids if len(row) < length for t in ([tok.eos_token_id] + row)][1:]  # in order
        assert joined == len(short_stream) // length and rows.shape == (n_single + joined, length)
        assert rows[n_single:].flatten().tolist() == short_stream[: joined * length]
    assert len(single) == 3 and long_rows(tok, DOCS, 64, 2, join=True)[1] == 0  # enough blocks: nothing joined
    rows, joined = long_rows(tok, DOCS, 64, 4, join=True)
    assert joined == 0 and rows.tolist() == single  # the short documents hold fewer than 64 tokens together
    rows, joined = long_rows(tok, DOCS, 256, 2, join=True)
    full = [t for row in ids for t in ([tok.eos_token_id] + row)][1:]
    assert len(full) >= 256 and joined == 1 and rows.tolist() == [full[:256]]  # no document reaches 256
    assert long_rows(tok, DOCS, 256, 2)[0].shape == (0, 256)


def test_join_needs_an_eos_token() -> None:
    tok = tiny_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="EOS token"):
        long_blocks(tok, DOCS, 256, 1, join=True)


def test_long_perplexity_says_how_many_blocks_each_length_got_and_how_many_are_joined() -> None:
    tok = tiny_tokenizer()
    model = BigramLM(len(tok))
    result = long_perplexity(model, tok, DOCS, (64, 256, 100_000), blocks=5, join=True)
    for length, joined in ((64, 0), (256, 1)):
        expected = perplexity(model, long_blocks(tok, DOCS, length, 5, join=True))
        assert result["perplexity"][str(length)] == pytest.approx(expected, rel=1e-6)
        assert result["joined"][str(length)] == joined
    assert result["blocks"] == {"64": 3, "256": 1}
    assert result["skipped"] == {"100000": "no held-out document has 100000 tokens, nor all the shorter ones joined"}
    plain = long_perplexity(model, tok, DOCS, (64, 256), blocks=5)
    assert plain["blocks"] == {"64": 3} and plain["joined"] == {"64": 0} and "256" in plain["skipped"]


@pytest.mark.slow
def test_the_embedded_splits_give_two_blocks_of_8192_tokens_each() -> None:
    """The held-out split has files of 8,192 tokens and more; the license texts reach it only joined."""
    from hf_recattn.conversion.teacher import teacher_tokenizer
    from hf_recattn.data.embedded import embedded_corpus

    tok, corpus = teacher_tokenizer(), embedded_corpus()
    rows, joined = long_rows(tok, corpus.files("heldout"), 8192, 2, join=True)
    assert rows.shape == (2, 8192) and joined == 0
    assert long_rows(tok, corpus.files("ood"), 8192, 2)[0].shape[0] == 0
    rows, joined = long_rows(tok, corpus.files("ood"), 8192, 2, join=True)
    assert rows.shape == (2, 8192) and joined == 2
