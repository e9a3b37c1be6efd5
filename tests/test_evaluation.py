"""Evaluation: perplexity against an independent float64 loop, passkey scoring, generation through the cache,
decode cost, reports, model cards and the eval / generate commands."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny_lm import save_tiny_teacher, tiny_dims, tiny_tokenizer

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, from_teacher
from hf_recattn import evaluation as ev
from hf_recattn.cli import main
from hf_recattn.evaluation import (
    comparison_table,
    decode_stats,
    evaluate,
    generation_samples,
    heldout,
    passkey,
    passkey_probe,
    passkey_prompt,
    perplexity,
    suite,
    write_report,
)


class BigramLM(torch.nn.Module):
    """logits[t] = table[token t]: a model whose every logit is known without running it."""

    def __init__(self, vocab: int, scale: float = 3.0) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab) * scale)
        self.config = SimpleNamespace(vocab_size=vocab)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


def _reference_perplexity(table: torch.Tensor, blocks: torch.Tensor) -> float:
    """exp of the mean NLL, one token at a time in float64 with an explicit log-sum-exp."""
    table = table.double()
    nll, count = 0.0, 0
    for row in blocks.tolist():
        for prev, nxt in zip(row[:-1], row[1:], strict=True):
            logits = table[prev].tolist()
            top = max(logits)
            log_z = top + math.log(sum(math.exp(x - top) for x in logits))
            nll += log_z - logits[nxt]
            count += 1
    return math.exp(nll / count)


def _tiny_model(tokenizer, spec: object = "softmax", max_positions: int = 2048) -> RecAttnForCausalLM:  # noqa: ANN001
    torch.manual_seed(0)
    dims = dict(tiny_dims(len(tokenizer)), max_position_embeddings=max_positions)
    return RecAttnForCausalLM(RecAttnConfig(**dims, attention=spec)).eval()


# ----- perplexity ---------------------------------------------------------------------------------
def test_perplexity_matches_float64_reference_for_any_batch_size() -> None:
    model = BigramLM(17)
    blocks = torch.randint(0, 17, (5, 9), generator=torch.Generator().manual_seed(0))
    expected = _reference_perplexity(model.table.detach(), blocks)
    for batch_size in (1, 2, 5, 8):
        assert perplexity(model, blocks, batch_size=batch_size) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [1, 5, 12, 40])
def test_summed_nll_is_cross_entropy_bit_for_bit(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                 positions: int) -> None:
    """The slice-by-slice log-softmax gives exactly the full cross-entropy's sum (so no published perplexity
    moves), with slices that do not divide the positions."""
    monkeypatch.setattr(heldout, "NLL_ROWS", 5)
    gen = torch.Generator().manual_seed(positions)
    logits = (torch.randn(positions, 300, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 300, (positions,), generator=gen)
    expected = F.cross_entropy(logits.float(), targets, reduction="sum")
    assert torch.equal(heldout.summed_nll(logits, targets), expected)


def test_perplexity_of_uniform_logits_is_the_vocab_size() -> None:
    model = BigramLM(23, scale=0.0)
    blocks = torch.randint(0, 23, (3, 7))
    assert perplexity(model, blocks) == pytest.approx(23.0, rel=1e-6)
    model.train()
    perplexity(model, blocks)
    assert model.training  # restored
    with pytest.raises(ValueError, match="blocks"):
        perplexity(model, torch.zeros(3, dtype=torch.long))


class PositionsLM(BigramLM):
    """A BigramLM that declares ``max_position_embeddings``."""

    def __init__(self, vocab: int, max_positions: int) -> None:
        super().__init__(vocab)
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_positions)


def test_long_blocks_keep_each_document_whole_and_in_order() -> None:
    tok = tiny_tokenizer()
    docs = ["the river runs past the old mill. " * 3, "birds sing. " * 12, "a b c. " * 30, "short."]
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert len(ids[0]) < 64 and 64 <= len(ids[1]) < 128 and 128 <= len(ids[2]) < 192
    blocks = ev.long_blocks(tok, docs, 64, 10)
    expected = [ids[1][:64], ids[2][:64], ids[2][64:128]]  # the first block of each long document, then the second
    assert blocks.tolist() == expected
    assert ev.long_blocks(tok, docs, 64, 2).tolist() == expected[:2]
    assert ev.long_blocks(tok, docs, 4096, 3).shape == (0, 4096) and ev.long_blocks(tok, [], 8, 1).shape == (0, 8)
    with pytest.raises(ValueError, match="length >= 2"):
        ev.long_blocks(tok, docs, 1, 1)


def test_long_perplexity_scores_the_long_blocks_and_names_what_it_skips() -> None:
    tok = tiny_tokenizer()
    docs = ["birds sing. " * 12, "a b c. " * 30]
    model = PositionsLM(len(tok), max_positions=100)
    result = ev.long_perplexity(model, tok, docs, (32, 64, 4096, 200), blocks=3)
    for length in (32, 64):
        expected = perplexity(model, ev.long_blocks(tok, docs, length, 3))
        assert result["perplexity"][str(length)] == pytest.approx(expected, rel=1e-6)
        assert result["blocks"][str(length)] == 3
    assert result["skipped"] == {"4096": "beyond max_position_embeddings 100",
                                 "200": "beyond max_position_embeddings 100"}
    unbounded = ev.long_perplexity(BigramLM(len(tok)), tok, docs, (4096,))
    assert unbounded["skipped"] == {"4096": "no held-out document has 4096 tokens"} and unbounded["perplexity"] == {}
    with pytest.raises(ValueError, match="lengths"):
        ev.long_perplexity(model, tok, docs, ())


def test_long_documents_join_the_pieces_of_each_file() -> None:
    from hf_recattn.data import corpus as corpus_module
    from hf_recattn.data.embedded import Corpus, Document

    docs = (Document("src/b.txt#10", "heldout", "b ten"), Document("src/a.txt#1", "heldout", "a one"),
            Document("src/b.txt#2", "heldout", "b two"), Document("src/a.txt#0", "heldout", "a zero"),
            Document("src/c.txt#0", "train", "c zero"), Document("src/LICENSE", "ood", "license"))
    corpus = Corpus(docs, "sha", 3)
    assert corpus.files("heldout") == ["a zero\n\na one", "b two\n\nb ten"]
    assert corpus.files("ood") == ["license"] and corpus.files("train") == ["c zero"]
    with pytest.raises(ValueError, match="split"):
        corpus.files("test")
    assert corpus_module.long_documents("some/folder", ["x", "y"]) == ["x", "y"]


# ----- generation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["softmax", {"mixer": "linear", "feature_map": "elu"}])
def test_samples_are_greedy_through_the_cache(spec: object) -> None:
    tok = tiny_tokenizer()
    model = _tiny_model(tok, spec)
    prompts = ["the river runs", "what is the pass key?"]
    samples = generation_samples(model, tok, prompts, max_new_tokens=6)
    for prompt, sample in zip(prompts, samples, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        plain = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=2)
        assert sample == tok.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_chat_template_is_used_when_present() -> None:
    tok = tiny_tokenizer()
    raw = ev.prompt_ids(tok, "the river")
    tok.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>{% endif %}")
    chat = ev.prompt_ids(tok, "the river")[0].tolist()
    assert chat[0] == tok.bos_token_id and chat[-1] == tok.bos_token_id
    assert chat[-2] == tok.eos_token_id and len(chat) > raw.shape[1]
    assert ev.prompt_ids(tok, "the river", chat=False).tolist() == raw.tolist()


# ----- passkey ------------------------------------------------------------------------------------
def test_passkey_prompt_length_and_depth() -> None:
    tok = tiny_tokenizer()
    unit = len(tok(ev.probe_template("passkey").parts["filler"], add_special_tokens=False)["input_ids"])
    for length, depth in ((300, 0.2), (600, 0.8)):
        ids = passkey_prompt(tok, length, "12345", depth)[0]
        assert abs(ids.shape[0] - length) <= unit + 4
        text = tok.decode(ids)
        assert text.count("12345") == 2 and text.rstrip().endswith("The pass key is")
        assert abs(text.index("12345") / len(text) - depth) < 0.1


def test_passkey_scoring(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tiny_tokenizer()
    model = _tiny_model(tok)

    def oracle(model, tokenizer, ids, max_new_tokens, **kwargs):  # noqa: ANN001, ANN003, ANN202
        key = re.search(r"\d{5}", tokenizer.decode(ids[0])).group(0)  # the filler has no digits
        return ev.Continuation(torch.tensor(tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]), None)

    monkeypatch.setattr(passkey, "greedy_continuation", oracle)
    result = passkey_probe(model, tok, context_lengths=(200, 400), trials=3, seed=1)
    assert result["accuracy"] == {"200": 1.0, "400": 1.0} and result["mean_accuracy"] == 1.0
    keys = [a["key"] for a in result["answers"]["200"]]
    assert len(set(keys)) == 3 and all(len(k) == 5 for k in keys)
    assert passkey_probe(model, tok, (200, 400), trials=3, seed=1)["answers"] == result["answers"]  # seeded
    monkeypatch.setattr(passkey, "greedy_continuation",
                        lambda *a, **k: ev.Continuation(torch.tensor(tok("no idea")["input_ids"]), None))
    assert passkey_probe(model, tok, (200,), trials=2)["mean_accuracy"] == 0.0


def test_passkey_runs_a_real_model() -> None:
    tok = tiny_tokenizer()
    result = passkey_probe(_tiny_model(tok, {"mixer": "linear", "feature_map": "elu"}), tok, (128,), trials=2)
    assert result["accuracy"]["128"] in (0.0, 0.5, 1.0) and len(result["answers"]["128"]) == 2


def test_probes_respect_max_position_embeddings() -> None:
    tok = tiny_tokenizer()
    model = _tiny_model(tok, max_positions=256)
    result = passkey_probe(model, tok, context_lengths=(1024,), trials=1)
    assert result["skipped"] == [1024] and result["accuracy"] == {} and result["mean_accuracy"] is None
    stats = decode_stats(model, context_length=512, steps=4)
    assert stats["context_length"] == 252 and stats["requested_context_length"] == 512


# ----- decode cost --------------------------------------------------------------------------------
def test_decode_stats_cache_bytes() -> None:
    tok = tiny_tokenizer()
    kv_per_token = 2 * 2 * 8 * 4  # k and v, 2 kv heads, head_dim 8, fp32
    stats = decode_stats(_tiny_model(tok), context_length=40, steps=3)
    assert stats["cache_bytes"] == 2 * 40 * kv_per_token  # 2 layers
    assert stats["cache_bytes_after_decode"] == 2 * 43 * kv_per_token
    assert stats["median_ms_per_token"] > 0 and stats["steps"] == 3
    linear_model = _tiny_model(tok, {"mixer": "linear", "feature_map": "elu"})
    linear = decode_stats(linear_model, context_length=40, steps=3)
    assert linear["cache_bytes"] == linear["cache_bytes_after_decode"] > 0  # a fixed-size state
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(**tiny_dims(len(tok)))).eval()  # a DynamicCache: counted generically
    assert decode_stats(llama, context_length=40, steps=2)["cache_bytes"] == 2 * 40 * kv_per_token


# ----- reports ------------------------------------------------------------------------------------
def test_long_perplexity_of_both_kinds_of_text() -> None:
    """With the needle probe's OOD haystack the report measures long blocks of it too (short texts joined), the same
    figure long_perplexity gives on those texts; without it there is no OOD field."""
    tok = tiny_tokenizer()
    model = _tiny_model(tok, {"mixer": "linear", "feature_map": "elu"})
    blocks = torch.randint(3, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    ood = ["the license grants every right. " * 3, "no warranty of any kind is given. " * 3]
    sizes = ev.RecallSizes(passkey_lengths=(200,), passkey_trials=1, recall_lengths=(200,), recall_pairs=(1,),
                           recall_trials=1, distances=(10,), distance_trials=1, long_lengths=(24, 40), long_blocks=1,
                           needle_tasks=("single_number",), needle_lengths=(400,), needle_prompts=1,
                           needle_haystacks=("heldout", "ood"))
    report = evaluate(model, tok, blocks, quick=True, sizes=sizes, needle_texts={"ood": ood})
    want = ev.long_perplexity(model, tok, ood, (24, 40), blocks=1, join=True)
    assert report["long_perplexity_ood"]["perplexity"] == pytest.approx(want["perplexity"])
    assert set(want["perplexity"]) == {"24", "40"}
    plain = evaluate(model, tok, blocks, quick=True, sizes=dataclasses.replace(sizes, needle_haystacks=("heldout",)))
    assert "long_perplexity_ood" not in plain


def test_evaluate_quick_report_and_card(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = _tiny_model(tok, {"mixer": "linear", "feature_map": "elu"})
    blocks = torch.randint(3, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    sizes = dataclasses.replace(ev.RecallSizes.for_mode(True), needle_prompts=1, needle_haystacks=("heldout",))
    report = evaluate(model, tok, blocks, quick=True, sizes=sizes)  # quick, with 1 needle prompt per cell
    assert report["perplexity"] == pytest.approx(perplexity(model, blocks))
    assert report["eval_tokens"] == 32 and report["block_size"] == 16
    assert set(report["passkey"]["accuracy"]) == {"1024"} and len(report["samples"]) == 2
    assert report["model"]["mixers"] == {"linear": 2}
    assert set(report["recall_by_distance"]["accuracy"]) == {"100", "1000"}  # quick: 100 and 1,000 tokens back
    assert report["recall_by_distance"]["trials"] == 2
    needles = report["needles"]["cells"]  # in the blocks' 32 tokens of text, which had to repeat
    assert set(needles) == {"single_number", "multi_key"} and needles["multi_key"]["heldout"]["1024"]["repeated"] == 1
    # a linear student needs no positions (tests/test_length_limit.py): 4096 and 8192 are left out for want of text
    assert report["long_perplexity"]["skipped"] == {
        str(n): f"no held-out document has {n} tokens, nor all the shorter ones joined" for n in (4096, 8192)}
    path = write_report(tmp_path, report)
    assert json.loads(path.read_text())["perplexity"] == report["perplexity"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file left


def test_comparison_table() -> None:
    rows = {
        "teacher": {"perplexity": 20.0, "passkey": {"mean_accuracy": 1.0},
                    "decode": {"median_ms_per_token": 37.0, "context_length": 2048, "cache_bytes": 2**21}},
        "window-only": {"perplexity": 30.0},
        "hybrid": {"perplexity": 22.0, "passkey": {"mean_accuracy": 0.5}},
    }
    lines = comparison_table(rows).splitlines()
    assert lines[0].startswith("| model | perplexity | × teacher |") and len(lines) == 5
    assert lines[0].startswith("| model | perplexity | × teacher | passkey (synthetic) | decode")
    assert lines[2] == "| teacher | 20.00 | 1.000 | 100% | 37.0 | 2048 | 2.00 |"
    assert lines[3] == "| window-only | 30.00 | 1.500 | - | - | - | - |"
    assert lines[4].startswith("| hybrid | 22.00 | 1.100 | 50% |")
    with pytest.raises(ValueError):
        comparison_table({})
    rows["teacher"]["recall_by_distance"] = {"accuracy": {"100": 1.0, "1000": 0.5}}
    rows["hybrid"]["recall_by_distance"] = {"accuracy": {"100": 1.0}}
    rows["hybrid"]["long_perplexity"] = {"perplexity": {"16384": 30.0, "4096": 25.0}}
    rows["hybrid"]["long_perplexity_ood"] = {"perplexity": {"4096": 12.5}}
    lines = comparison_table(rows).splitlines()
    assert lines[0] == ("| model | perplexity | × teacher | passkey (synthetic) | recall @ 100/1000 | ppl @ 4096 | "
                        "ppl @ 16384 | ppl @ 4096 OOD | decode ms/token | context | cache MiB |")
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[2] == "| teacher | 20.00 | 1.000 | 100% | 100/50% | - | - | - | 37.0 | 2048 | 2.00 |"
    assert lines[3] == "| window-only | 30.00 | 1.500 | - | - | - | - | - | - | - | - |"
    assert lines[4] == "| hybrid | 22.00 | 1.100 | 50% | 100/-% | 25.00 | 30.00 | 12.50 | - | - | - |"


# ----- commands -----------------------------------------------------------------------------------
def test_eval_and_generate_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "passkey_probe", lambda *a, **k: {"accuracy": {}, "mean_accuracy": 0.0})
    teacher = save_tiny_teacher(tmp_path / "teacher")
    student = from_teacher(teacher, "softmax")  # the same function: the same perplexity
    student.save_pretrained(tmp_path / "student")
    tiny_tokenizer().save_pretrained(tmp_path / "student")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"the river runs past the old mill {i} times and birds sing " * 3)
    common = ["--corpus", str(docs), "--block-size", "16", "--quick"]
    student_dir, teacher_dir = str(tmp_path / "student"), str(tmp_path / "teacher")
    code = main(["eval", student_dir, "--tokens", "64", "--teacher", teacher_dir, *common])
    assert code == 0
    out = capsys.readouterr().out
    assert "| teacher |" in out and "| student |" in out
    saved = json.loads((tmp_path / "student" / "eval.json").read_text())
    results = saved["results"]
    assert saved["heldout_tokens"] == 64
    assert "corpus" not in saved["provenance"] and saved["provenance"]["command"]  # a local corpus, not the pinned one
    assert results["student"]["perplexity"] == pytest.approx(results["teacher"]["perplexity"], rel=1e-4)
    # with a teacher, the untrained window of 512 + 4 sinks by default: built from the teacher's weights, so on
    # 16-token blocks its perplexity is the teacher's
    window = results["window 512 + 4 sinks"]
    assert "| window 512 + 4 sinks |" in out and window["model"]["mixers"] == {"hybrid": 2}
    assert window["perplexity"] == pytest.approx(results["teacher"]["perplexity"], rel=1e-4)
    assert main(["eval", student_dir, "--tokens", "32", "--teacher", teacher_dir, "--baselines", *common]) == 0
    assert set(json.loads((tmp_path / "student" / "eval.json").read_text())["results"]) == {"teacher", "student"}
    assert main(["eval", student_dir, "--teacher", teacher_dir, "--baselines", "window", "sinks", *common]) == 2
    assert "--baselines: unknown baseline(s) ['sinks']" in capsys.readouterr().err

    generate = ["generate", str(tmp_path / "student"), "--prompt", "the river", "--max-new-tokens", "5"]
    assert main(generate) == 0
    assert main([*generate, "--sample", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert "prompt + 5 new tokens" in captured.err

    other = tmp_path / "other"
    save_tiny_teacher(other, vocab_size=len(tiny_tokenizer()))
    from transformers import PreTrainedTokenizerFast

    tok = tiny_tokenizer(vocab_size=90)
    assert isinstance(tok, PreTrainedTokenizerFast)
    tok.save_pretrained(other)  # a different vocabulary
    assert main(["eval", str(tmp_path / "student"), "--tokens", "32", "--teacher", str(other), *common]) == 2
    assert "tokenizer differs" in capsys.readouterr().err


def test_eval_with_hybrid_options(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--hybrid-option cache_slots=4`` evaluates the saved hybrid with the cache, labels the row and records the
    options, on every hybrid layer or, with ``--hybrid-layers``, on those only; a checkpoint without hybrid layers,
    layers without options and a bad layer item are refused with the reason."""
    monkeypatch.setattr(suite, "passkey_probe", lambda *a, **k: {"accuracy": {}, "mean_accuracy": 0.0})
    teacher = save_tiny_teacher(tmp_path / "teacher")
    for name, attention in (("hybrid", {"mixer": "hybrid", "window": 4, "far": {"mixer": "linear"}}),
                            ("plain", "softmax")):
        from_teacher(teacher, attention).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"the river runs past the old mill {i} times and birds sing " * 3)
    common = ["--corpus", str(docs), "--block-size", "16", "--quick", "--tokens", "32"]
    out = tmp_path / "out"
    assert main(["eval", str(tmp_path / "hybrid"), "--hybrid-option", "cache_slots=4", *common,
                 "--output", str(out)]) == 0
    saved = json.loads((out / "eval.json").read_text())
    assert saved["hybrid_options"] == {"cache_slots": 4}
    row = saved["results"]["hybrid+cache_slots=4"]
    assert all(spec["cache_slots"] == 4 for spec in row["model"]["attention"])
    assert main(["eval", str(tmp_path / "plain"), "--hybrid-option", "cache_slots=4", *common]) == 2
    assert "no hybrid layer" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "hybrid"), "--hybrid-option", "cache_slots=4", "--hybrid-layers", "1",
                 *common, "--output", str(out)]) == 0
    saved = json.loads((out / "eval.json").read_text())
    assert saved["hybrid_layers"] == [1]
    specs = saved["results"]["hybrid+cache_slots=4 on layers 1"]["model"]["attention"]
    assert [spec.get("cache_slots", 0) for spec in specs] == [0, 4]  # the other layer as trained
    assert main(["eval", str(tmp_path / "hybrid"), "--hybrid-layers", "1", *common]) == 2
    assert "--hybrid-layers needs --hybrid-option" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "hybrid"), "--hybrid-option", "cache_slots=4", "--hybrid-layers", "1-x",
                 *common]) == 2
    assert "--hybrid-layers: '1-x'" in capsys.readouterr().err


# ----- the same metrics as evaluate modules ------------------------------------------------------
def test_evaluate_modules_agree_with_the_builtin_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluate = pytest.importorskip("evaluate")
    from hf_recattn.metrics import path

    model = BigramLM(17)
    blocks = torch.randint(0, 17, (5, 9), generator=torch.Generator().manual_seed(0))
    logits = model(blocks).logits.detach()
    nll = [float(F.cross_entropy(logits[i, :-1], blocks[i, 1:], reduction="sum")) for i in range(5)]
    result = evaluate.load(path("heldout_perplexity")).compute(negative_log_likelihood=nll, num_tokens=[8] * 5)
    assert result["perplexity"] == pytest.approx(perplexity(model, blocks), rel=1e-6) and result["num_tokens"] == 40

    tok = tiny_tokenizer()
    calls = iter(range(100))

    def every_other(model, tokenizer, ids, max_new_tokens, **kwargs):  # noqa: ANN001, ANN003, ANN202
        key = re.search(r"\d{5}", tokenizer.decode(ids[0])).group(0)
        text = f" {key[:2]} {key[2:]}." if next(calls) % 2 == 0 else " 00000"
        return ev.Continuation(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]), None)

    monkeypatch.setattr(passkey, "greedy_continuation", every_other)
    probe = passkey_probe(_tiny_model(tok), tok, context_lengths=(200, 400), trials=3, seed=2)
    trials = [(a["answer"], a["key"], int(n)) for n, rows in probe["answers"].items() for a in rows]
    answers, keys, lengths = map(list, zip(*trials, strict=True))
    metric = evaluate.load(path("passkey_accuracy")).compute(predictions=answers, references=keys,
                                                             context_lengths=lengths)
    assert metric["accuracy"] == probe["accuracy"] == {"200": 2 / 3, "400": 1 / 3}
    assert metric["mean_accuracy"] == pytest.approx(probe["mean_accuracy"])
    with pytest.raises(ValueError, match="unknown metric"):
        path("bleu")
