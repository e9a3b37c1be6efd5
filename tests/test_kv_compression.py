"""KV-compression peers (benchmarks/kv_compression.py): budgets in bytes to kept tokens to kvpress ratios, the
probe file, the scoring, the table, and the rows pareto.py reads with --peers. No kvpress needed."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from script_modules import load_script
from tiny_lm import tiny_dims, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from hf_recattn.evaluation import passkey_ids

PER_TOKEN = 46_080  # SmolLM2-135M: 30 layers x (keys + values) x 3 heads x 64 dims x 4 bytes


@pytest.fixture(scope="module")
def kv() -> ModuleType:
    return load_script("benchmarks", "kv_compression")


@pytest.fixture(scope="module")
def pareto() -> ModuleType:
    return load_script("benchmarks", "pareto")


def kvpress_kept(length: int, ratio: float) -> int:
    """What kvpress 0.5.5 keeps of ``length`` tokens at ``compression_ratio`` (kvpress.utils.compute_n_kept)."""
    return max(1, int(length * (1 - ratio)))


def test_bytes_to_kept_tokens_to_the_ratio_kvpress_needs(kv: ModuleType) -> None:
    assert kv.kept_tokens(22.734832763671875, PER_TOKEN) == 517  # window-512+4-sinks of the Pareto table
    assert kv.kept_tokens(PER_TOKEN * 100 / 2**20, PER_TOKEN) == 100  # an exact multiple is not rounded down
    for length in (1003, 1024, 4075, 8192):
        for kept in (1, 32, 133, 517, length - 1):
            assert kvpress_kept(length, kv.compression_ratio(kept, length)) == kept
    assert kv.compression_ratio(1024, 1024) is None and kv.compression_ratio(2000, 1024) is None
    with pytest.raises(ValueError, match="keeps nothing"):
        kv.compression_ratio(0, 1024)


def test_duoattention_keeps_the_budget_on_average_over_heads(kv: ModuleType) -> None:
    length, kept = 4096, 1000
    share = kv.duo_head_share(kept, length)
    assert (1 - share) * length + share * kv.DUO_STREAMING_TOKENS == pytest.approx(kept)
    assert kv.duo_head_share(100, length) == 1.0 and kv.duo_head_share(length, length) is None
    assert kv.press_ratio("DuoAttention", kept, length) == share
    assert kv.press_ratio("SnapKV", kept, length) == kv.compression_ratio(kept, length)


def test_the_teacher_kv_bytes_per_token(kv: ModuleType) -> None:
    dims = tiny_dims(64)
    teacher = LlamaForCausalLM(LlamaConfig(**dims))
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    assert kv.bytes_per_token(teacher) == dims["num_hidden_layers"] * 2 * dims["num_key_value_heads"] * head_dim * 4


def test_budgets_from_bytes_and_a_pareto_file(kv: ModuleType) -> None:
    pareto = {"models": {"teacher": {"cache_mib": 360.0}, "a": {"cache_mib": 22.73}, "b": {"cache_mib": 2.86},
                         "c": {"cache_mib": 2.86}}}
    got = kv.budgets([22.73], pareto, None, PER_TOKEN)
    assert list(got.items()) == [(517, ["22.73 MiB", "a"]), (65, ["b", "c"])]  # the largest first, equal together
    assert kv.budgets([], pareto, ["b"], PER_TOKEN) == {65: ["b"]}
    with pytest.raises(SystemExit, match="--students"):
        kv.budgets([], pareto, ["nobody"], PER_TOKEN)


def test_passkey_cases_are_the_projects_prompts_split_before_the_question(kv: ModuleType) -> None:
    tokenizer = tiny_tokenizer()
    cases = kv.passkey_cases(tokenizer, [200, 240], trials=3)
    assert [c["length"] for c in cases] == [200] * 3 + [240] * 3
    for i, case in enumerate(cases):
        ids, _ = passkey_ids(tokenizer, case["length"] - kv.MAX_NEW_TOKENS, case["key"], (0.1, 0.5, 0.9)[i % 3])
        assert case["context_ids"] + case["question_ids"] == ids
        assert "pass key" in tokenizer.decode(case["question_ids"]) and case["max_new_tokens"] == 8
    assert len({c["key"] for c in cases}) == 6
    assert [c["key"] for c in kv.passkey_cases(tokenizer, [200, 240], trials=3)] == [c["key"] for c in cases]
    later = kv.passkey_cases(tokenizer, [240], trials=3, drawn_before=[200])  # the 240 prompts of that probe alone
    assert later == cases[3:]


def test_the_probe_file_round_trip(kv: ModuleType, tmp_path: Path) -> None:
    cases = kv.passkey_cases(tiny_tokenizer(), [200], trials=3)
    ppl = {"contexts": [[1, 2, 3]], "continuations": [[4, 5]], "blocks": [[1, 2, 3, 4]]}
    runs = kv.plan_runs(["StreamingLLM", "DuoAttention"], {100: ["a"]}, [150, 80])
    path = tmp_path / "probes.json"
    kv.write_probes(path, tmp_path / "teacher", cases, ppl, runs)
    back = kv.read_probes(path)
    assert back == {"model": str(tmp_path / "teacher"), "passkey": cases, "perplexity": ppl, "runs": runs}
    assert [r["name"] for r in back["runs"]] == [kv.NO_PRESS, "StreamingLLM 100", "DuoAttention 100"]
    assert back["runs"][1]["ratios"] == {"150": kv.compression_ratio(100, 150), "80": None}


def record(name: str, answers: list[str], nll: float, **extra: object) -> dict:
    return {"name": name, "passkey_answers": {"200": answers}, "passkey_cache_tokens": {"200": [50] * 3},
            "continuation_nll": nll, "continuation_tokens": 10, "continuation_cache_tokens": [40], "seconds": 1.0,
            **extra}


def results_of(kv: ModuleType) -> dict:
    cases = [{"length": 200, "key": key} for key in ("11111", "22222", "33333")]
    runs = {r["name"]: r for r in kv.plan_runs(["SnapKV", "DuoAttention"], {100: ["window-64"]}, [192])}
    rows = {kv.NO_PRESS: kv.score(record(kv.NO_PRESS, ["11111.", "2 2222", "33333"], 10.0, block_perplexity=3.0),
                                  runs[kv.NO_PRESS], cases, PER_TOKEN),
            "SnapKV 100": kv.score(record("SnapKV 100", ["11111", "no", "the"], 20.0), runs["SnapKV 100"], cases,
                                   PER_TOKEN),
            "DuoAttention 100": kv.score({"name": "DuoAttention 100", "error": "ConnectionError: offline",
                                          "seconds": 0.5}, runs["DuoAttention 100"], cases, PER_TOKEN)}
    settings = {"passkey_lengths": [200], "ppl_context": 64, "ppl_continuation": 11}
    return {"benchmark": "kv_compression", "settings": settings, "rows": rows, "bytes_per_token": PER_TOKEN,
            "worker_versions": {"kvpress": "0.5.5"}}


def test_scoring_and_the_table(kv: ModuleType) -> None:
    results = json.loads(json.dumps(results_of(kv)))
    rows = results["rows"]
    assert rows[kv.NO_PRESS]["passkey"] == {"200": 1.0}  # whitespace inside the key is ignored, as the project does
    assert rows["SnapKV 100"]["passkey"] == {"200": pytest.approx(1 / 3)}
    assert rows["SnapKV 100"]["continuation_perplexity"] == pytest.approx(7.389056, rel=1e-6)
    assert rows["SnapKV 100"]["cache_mib"] == pytest.approx(100 * PER_TOKEN / 2**20)
    lines = kv.render_markdown(results).splitlines()
    assert lines[0] == "| press | budget of | kept tokens | cache MiB | passkey 200 | ppl x no press (64+11) |"
    assert lines[2] == "| teacher (no press) | - | all | all | 100% | 1.000 |"
    assert lines[3] == "| SnapKV | window-64 | 100 | 4.39 | 33% | 2.718 |"
    assert lines[4].startswith("| DuoAttention | window-64 | 100 | 4.39 | could not run: ConnectionError: offline |")
    assert "kvpress 0.5.5" in lines[-1] and "46,080 bytes per token" in lines[-1]


def test_pareto_reads_the_presses_as_peer_rows(kv: ModuleType, pareto: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(results_of(kv)))
    peers = pareto.peer_rows([str(path)])
    assert list(peers) == ["SnapKV 100 tokens (kvpress)"]  # the press that ran; not the teacher, not the failure
    assert peers["SnapKV 100 tokens (kvpress)"]["perplexity_ratio"] == {"in-distribution": pytest.approx(2.718282)}
    teacher = {"cache_mib": 360.0, "perplexity_in-distribution": 10.0, "perplexity_out-of-distribution": 8.0,
               "passkey": {"200": 1.0}, "associative_recall": {"1024": {"1": 1.0}}, "training_tokens": 0}
    student = teacher | {"cache_mib": 1.0, "perplexity_in-distribution": 20.0}
    results = {"settings": {"context": 8192}, "models": {"teacher": teacher, "student": student}}
    plain = pareto.table(results).splitlines()
    lines = pareto.table(results, peers).splitlines()
    assert [line for line in lines if "kvpress" not in line] == plain  # the models' rows stay as they were
    assert lines[3] == "| SnapKV 100 tokens (kvpress) | 4.39 | 0.012 | 2.718 | - | 33% | - | 0 |"
    teacher["passkey"]["4096"] = student["passkey"]["4096"] = 0.5
    assert pareto.table(results, peers).splitlines()[3].endswith("| 33% | - | - | 0 |")  # not measured at 4096
    assert lines[4].startswith("| student | 1.00 |")
    longer = results_of(kv)
    longer["rows"]["SnapKV 100"]["passkey"] = {"800": 0.0}
    (tmp_path / "kv800.json").write_text(json.dumps(longer))
    both = pareto.peer_rows([str(path), str(tmp_path / "kv800.json")])  # one row with both lengths
    assert list(both) == list(peers) and both["SnapKV 100 tokens (kvpress)"]["passkey"] == {
        "200": pytest.approx(1 / 3), "800": 0.0}
    longer["rows"]["SnapKV 100"]["continuation_perplexity"] *= 2
    (tmp_path / "kv800.json").write_text(json.dumps(longer))
    with pytest.raises(SystemExit, match="another perplexity ratio"):
        pareto.peer_rows([str(path), str(tmp_path / "kv800.json")])
    for bad, why in ((tmp_path / "none.json", "no such file"), (tmp_path / "other.json", "kv_compression.py")):
        if why != "no such file":
            bad.write_text(json.dumps({"benchmark": "pareto"}))
        with pytest.raises(SystemExit, match=why):
            pareto.peer_rows([str(bad)])


def test_the_passkey_probe_refuses_a_teacher_with_sliding_windows(kv: ModuleType, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ``--probe needles`` keeps a sliding-window layer's window apart from the press; the passkey probe would
    press those layers too, so it names the teacher and stops before any work."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig

    monkeypatch.setattr(kv, "ensure_env", lambda venv, rebuild=False: venv)
    monkeypatch.setattr(kv, "load_teacher", lambda name: (SimpleNamespace(config=Gemma3TextConfig()), None))
    with pytest.raises(SystemExit, match="--teacher gemma3-270m has sliding-window layers: only --probe needles"):
        kv.main(["--teacher", "gemma3-270m", "--bytes", "3.9", "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
