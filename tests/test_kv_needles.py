"""The needles probe of the KV-compression peers (benchmarks/kv_needles.py): the prompts are natural_recall's, the
budgets and kvpress ratios of each mode, the scoring, the table and resuming. No kvpress needed: the worker's
records are written by hand. Exact comparisons throughout (token ids, counts, rendered lines)."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import test_needles as tn
import torch
from script_modules import load_script

from hf_recattn.evaluation import Continuation, needle_probe
from hf_recattn.evaluation import needles as needles_module
from hf_recattn.evaluation.needles import needle_template
from hf_recattn.modeling.cache_precision import PAIR_CODES, pair_codes

PER_TOKEN = 46_080  # SmolLM2-135M: 30 layers x (keys + values) x 3 heads x 64 dims x 4 bytes


@pytest.fixture(scope="module")
def kn() -> ModuleType:
    return load_script("benchmarks", "kv_needles")


@pytest.fixture(scope="module")
def tok() -> Any:
    return tn.tok.__wrapped__()


def kvpress_kept(length: int, ratio: float) -> int:
    """What kvpress 0.5.5 keeps of ``length`` tokens at ``compression_ratio`` (kvpress.utils.compute_n_kept)."""
    return max(1, int(length * (1 - ratio)))


def probe_feeds(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The ids the needle probe feeds the model at each greedy continuation, recorded in the list returned, every
    answer one token (5) and no model run."""
    fed: list[list[int]] = []

    def record(model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, cache: Any = None,
               stop_at_eos: bool = True) -> Continuation:
        fed.append(ids[0].tolist())
        return Continuation(torch.tensor([5], dtype=torch.long), None)

    monkeypatch.setattr(needles_module, "greedy_continuation", record)
    return fed


def test_the_cells_hold_the_probes_own_prompts_split_at_the_question(kn: ModuleType, tok: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    fed = probe_feeds(monkeypatch)
    haystacks = {"heldout": tn.HELDOUT, "ood": tn.OOD}
    needle_probe(tn.Stub(), tok, haystacks, tasks=("single_number",), lengths=(600, 900), prompts=3)
    cells = kn.needle_cells(tok, haystacks, "single_number", [600, 900], prompts=3)
    assert [c["key"] for c in cells] == ["single_number/heldout/600", "single_number/ood/600",
                                         "single_number/heldout/900", "single_number/ood/900"]
    in_probe_order = [cells[i] for i in (0, 2, 1, 3)]
    cases = [case for cell in in_probe_order for case in cell["cases"]]
    assert [c["context_ids"] + c["query_ids"] for c in cases] == fed  # the probe's tokens
    template = needle_template("single_number")
    for case in cases:
        question, lead_in = case["query_ids"][: case["split"]], case["query_ids"][case["split"] :]
        assert tn._text(tok, question) == template.fill("question", key=case["key"])
        assert tn._text(tok, lead_in) == template.fill("answer", key=case["key"])
        assert len(case["values"]) == 1 and len(case["values"][0]) == 7 and case["max_new_tokens"] > 4
    assert all("later" not in case for case in cases)


def test_queries_asked_in_turn_are_the_probes_own(kn: ModuleType, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """multi_query's cases: the context and the first query, then the later queries; with every answer one token
    (5), the probe feeds each query after the context, the queries and the answers before it. Its cells take only
    the question-agnostic runs."""
    fed = probe_feeds(monkeypatch)
    haystacks = {"heldout": tn.HELDOUT}
    needle_probe(tn.Stub(), tok, haystacks, tasks=("multi_query",), lengths=(700,), prompts=2)
    (cell,) = kn.needle_cells(tok, haystacks, "multi_query", [700], prompts=2)
    rebuilt = []
    for case in cell["cases"]:
        sequence = case["context_ids"]
        assert len(case["later"]) == 3 and len({q["key"] for q in [case, *case["later"]]}) == 4
        for query in [case, *case["later"]]:
            sequence = sequence + query["query_ids"]
            rebuilt.append(sequence)
            sequence = sequence + [5]
    assert rebuilt == fed
    runs = kn.plan_needle_runs(["KeyDiff", "SnapKV"], list(kn.MODES), {300: ["student"]}, [cell])
    assert [run["name"] for run in kn.runs_of_cell(cell, runs)] == [kn.kv.NO_PRESS, f"KeyDiff {kn.AGNOSTIC} 300"]
    record = {"answers": [{"answer": f" {case['values'][0]}", "cache_tokens": 300,
                           "later_answers": [" no idea", f"it is {case['later'][1]['values'][0]}.", ""]}
                          for case in cell["cases"]]}
    scored = kn.score_cell(record, cell)
    assert [[q["correct"] for q in p["queries"]] for p in scored["prompts"]] == [[True, False, True, False]] * 2
    assert scored["summary"]["n"] == 8 and scored["summary"]["correct"] == 4
    record["answers"][0]["later_answers"].pop()
    with pytest.raises(ValueError, match="3 answers to 4 queries"):
        kn.score_cell(record, cell)


def cells_of(lengths: dict[str, list[tuple[int, int]]]) -> list[dict[str, Any]]:
    """Cells whose cases have the given (context tokens, question tokens)."""
    return [{"key": key, "cases": [{"context_ids": [0] * c, "split": q, "query_ids": [0] * (q + 3)}
                                   for c, q in shapes]} for key, shapes in lengths.items()]


def test_budgets_modes_and_ratios(kn: ModuleType) -> None:
    recall = {"benchmark": "natural_recall", "models": {
        "teacher": {"cache_mib": {"1024": 45.0, "4096": 180.0}, "constant_memory": False},
        "window 512 + 4 sinks": {"cache_mib": {"1024": 22.734832763671875}, "constant_memory": True},
        "student": {"cache_mib": {"1024": 10.371551513671875}, "constant_memory": True}}}
    named = kn.recall_budgets(recall)
    assert named == {"window 512 + 4 sinks": 22.734832763671875, "student": 10.371551513671875}
    assert kn.kept_by_budget(named | {"10.37 MiB": 10.37}, PER_TOKEN) == {517: ["window 512 + 4 sinks"],
                                                                          236: ["student"], 235: ["10.37 MiB"]}
    with pytest.raises(SystemExit, match="natural_recall"):
        kn.recall_budgets({"benchmark": "pareto"})
    cells = cells_of({"a": [(1000, 20), (1003, 22)], "b": [(4070, 21)]})
    assert kn.compressed_lengths(cells, kn.AGNOSTIC) == [1000, 1003, 4070]
    assert kn.compressed_lengths(cells, kn.AWARE) == [1020, 1025, 4091]
    runs = kn.plan_needle_runs(["StreamingLLM", "SnapKV"], list(kn.MODES), {517: ["w"], 236: ["s"]}, cells)
    assert [r["name"] for r in runs] == [
        "teacher (no press)", "StreamingLLM question-agnostic 517", "StreamingLLM question-aware 517",
        "SnapKV question-aware 517", "StreamingLLM question-agnostic 236", "StreamingLLM question-aware 236",
        "SnapKV question-aware 236"]  # SnapKV scores by the last queries: question-aware only
    for run in runs[1:]:
        assert list(run["ratios"]) == [str(n) for n in kn.compressed_lengths(cells, run["mode"])]
        assert all(kvpress_kept(int(n), ratio) == run["kept"] for n, ratio in run["ratios"].items())


def answers(verdicts: str, **extra: Any) -> list[dict[str, Any]]:
    """Worker answers: ``y`` the right value, ``n`` a wrong one."""
    return [{"answer": " 1234567." if v == "y" else " 7654321", "cache_tokens": 236, **extra} for v in verdicts]


def results_and_cells(kn: ModuleType) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    cells = {}
    for haystack in ("heldout", "ood"):
        for length in (1024, 4096):
            key = f"single_number/{haystack}/{length}"
            cells[key] = {"key": key, "task": "single_number", "haystack": haystack, "length": length,
                          "cases": [{"key": "Rufi", "values": ["1234567"], "repeated": False}] * 4}
    runs = kn.plan_needle_runs(["KNorm", "SnapKV"], list(kn.MODES), {236: ["student"]}, cells_of({}))
    settings = {"tasks": ["single_number"], "lengths": [1024, 4096], "haystacks": ["heldout", "ood"]}
    results = {"settings": settings, "rows": {r["name"]: kn.new_row(r, PER_TOKEN) for r in runs},
               "seconds": {}, "bytes_per_token": PER_TOKEN, "worker_versions": {"kvpress": "0.5.5"}}
    return results, cells


def test_scoring_the_table_and_resuming(kn: ModuleType) -> None:
    results, cells = results_and_cells(kn)
    teacher, knorm = "teacher (no press)", "KNorm question-agnostic 236"
    for key in cells:
        kn.add_record(results, {"cell": key, "name": teacher, "answers": answers("yyyy")}, cells)
    checked = answers("y", difference=3e-7, hooked_answer=" 1234567.") + answers("n", difference=0.0,
                                                                              hooked_answer=" 1") + answers("yn")
    line = kn.add_record(results, {"cell": "single_number/heldout/1024", "name": knorm, "answers": checked}, cells)
    assert line == f"{knorm} single_number/heldout/1024: 2/4"
    kn.add_record(results, {"cell": "single_number/ood/1024", "name": "SnapKV question-aware 236",
                            "error": "RuntimeError: no\nmore"}, cells)
    assert kn.add_record(results, {"cell": "single_number/ood/1024", "seconds": 9.0, "prompts": 4},
                         cells) == "single_number/ood/1024: 4 prompts in 9 s"
    results = json.loads(json.dumps(results))
    cell = results["rows"][knorm]["cells"]["single_number"]["heldout"]["1024"]
    assert cell["summary"] | {"interval": None} == {"accuracy": 0.5, "correct": 2, "n": 4, "interval": None,
                                                    "prompts": 4, "repeated": 0}
    assert cell["verified"] == {"prompts": 2, "same_answers": 1, "max_difference": 3e-7}
    assert [p["queries"][0]["answer"] for p in cell["prompts"]] == ["1234567.", "7654321", "1234567.", "7654321"]
    lines = kn.render_markdown(results).splitlines()
    assert lines[0] == ("| press | mode | kept tokens | cache MiB | single_number heldout 1k | "
                        "single_number ood 1k | single_number heldout 4k | single_number ood 4k |")
    assert lines[2] == "| teacher (no press) | - | all | all" + " | 100% [51-100]" * 4 + " |"
    assert lines[3] == "| KNorm | question-agnostic | 236 | 10.37 | 50% [15-85] | - | - | - |"
    assert lines[4] == "| KNorm | question-aware | 236 | 10.37 | - | - | - | - |"
    assert lines[5] == "| SnapKV | question-aware | 236 | 10.37 | could not run: RuntimeError: no |  |  |  |"
    assert "real prefill with the press, 1 of 2 answers the same." in lines[-1] and "46,080 bytes" in lines[-1]
    assert "Kept tokens: the bytes of student (236)." in lines[-1]
    assert kn.pooled(results["rows"][teacher]["cells"]["single_number"], ["heldout", "ood"], "4096")[::2] == (1.0, 8)
    assert kn.pooled(results["rows"][knorm]["cells"]["single_number"], ["heldout", "ood"], "1024") is None  # no ood
    done = {name: [key for key, c in cells.items() if kn.measured(row, c)] for name, row in results["rows"].items()}
    assert done == {teacher: list(cells), knorm: ["single_number/heldout/1024"], "KNorm question-aware 236": [],
                    "SnapKV question-aware 236": list(cells)}  # a press that could not run is not run again


def test_results_of_other_settings_are_not_resumed(kn: ModuleType, tmp_path: Path) -> None:
    args = argparse.Namespace(teacher="embedded", tasks=["single_number"], haystacks=["heldout"], lengths=[1024],
                              prompts=2, seed=0, cache_dtype="model", out=tmp_path / "r.json")
    args.out.write_text(json.dumps({"settings": kn.settings(args), "rows": {"x": {}}, "seconds": {"c": 1}}))
    assert "cache_dtype" not in kn.settings(args)  # files measured before the option keep their settings
    assert kn.start_results(args)["rows"] == {"x": {}}
    args.cache_dtype = "int8"
    assert kn.start_results(args)["rows"] == {}  # presses held as int8 are other measurements
    args.cache_dtype, args.prompts = "model", 3
    assert kn.start_results(args)["rows"] == {} and kn.start_results(args)["benchmark"] == "kv_needles"


@pytest.mark.parametrize(("cache_dtype", "per_token", "kept"),
                         [("int8", 12_240, 1923), ("int4", 7_200, 3269), ("int4g16", 7_200, 3269),
                          ("k8v4g16", 9_720, 2421)])
def test_coded_presses_keep_more_tokens_rounded_as_the_students_round(kn: ModuleType, cache_dtype: str,
                                                                      per_token: int, kept: int) -> None:
    """``--cache-dtype int8`` / ``int4`` / ``int4g16`` / ``k8v4g16``: a teacher token's keys and values cost their
    codes and scales (SmolLM2: 30 layers x 2 x 3 heads x (64 + 4) = 12,240 bytes for int8, x (32 + 2 x 4) = 7,200 for
    int4, x (32 + 4 x 2) for int4g16's float16 scales; 30 x 3 x (68 + 40) = 9,720 for k8v4g16's int8 keys and int4g16
    values), every
    run is marked to hold its cache so, and the worker's rounding is hf_recattn's ``cache_dtype`` rounding, bit for
    bit (the worker imports no hf_recattn: its functions are read from its source)."""
    assert kn.coded_bytes_per_token(PER_TOKEN, 64, cache_dtype) == per_token
    assert kn.kept_by_budget({"student": 22.45}, per_token) == {kept: ["student"]}
    runs = kn.plan_needle_runs(["KeyDiff"], [kn.AGNOSTIC], {kept: ["student"]}, cells_of({"a": [(4000, 20)]}),
                               cache_dtype)
    assert [r["cache_dtype"] for r in runs] == [cache_dtype, cache_dtype]  # the teacher without a press too
    source = (Path(__file__).parents[1] / "benchmarks" / "kvpress_worker.py").read_text()
    tree = ast.parse(source)
    nodes = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "coded_round_trip")
             or (isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "CODES")]
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(nodes, type_ignores=[]), "kvpress_worker.py", "exec"), namespace)
    x = torch.randn(2, 3, 7, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 64)
    x[0, 0, 0] = 0.0
    x[0, 0, 1, :32] = 0.0  # a zero group beside a filled one
    assert set(namespace["CODES"]) == set(PAIR_CODES)  # the mirror covers every coded cache_dtype
    pair = pair_codes(cache_dtype)
    for vectors, worker_codes in zip((pair.keys, pair.values), namespace["CODES"][cache_dtype], strict=True):
        codes, scale = vectors.quantize(x)
        held = namespace["coded_round_trip"](x, *worker_codes)
        assert torch.equal(held, vectors.dequantize(codes, scale, x.dtype))


def test_the_figure_puts_every_row_and_press_at_its_bytes(kn: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    figure = load_script("benchmarks", "recall_plot")
    results, cells = results_and_cells(kn)
    for key in cells:
        kn.add_record(results, {"cell": key, "name": "KNorm question-agnostic 236", "answers": answers("yyyn")}, cells)
    summary = {"accuracy": 0.5, "correct": 10, "n": 20, "interval": [0.3, 0.7], "prompts": 20, "repeated": 0}
    cells_20 = {"single_number": {h: {"1024": summary, "4096": summary} for h in ("heldout", "ood")}}
    recall = {"settings": {"lengths": [1024, 4096], "haystacks": ["heldout", "ood"]}, "models": {
        "teacher": {"cache_mib": {"1024": 45.0, "4096": 180.0}, "cells": cells_20},
        "a": {"cache_mib": {"1024": 10.0, "4096": 10.0}, "cells": cells_20},
        "b": {"cache_mib": {"1024": 10.0, "4096": 10.0}, "cells": {}}}}
    refs = {s["label"]: s for s in figure.reference_series(recall, "single_number", ["heldout", "ood"])}
    assert refs["teacher"]["points"]["4096"][:2] == (180.0, 0.5) and refs["b"]["points"] == {}
    assert refs["a"]["points"]["1024"][2] == pytest.approx((0.3520, 0.6480), abs=1e-4)  # pooled: 20 of 40
    (press,) = figure.press_series(json.loads(json.dumps(results)), "single_number", ["heldout", "ood"])
    assert press["label"] == "KNorm (question-agnostic)" and list(press["points"]) == ["1024", "4096"]
    ((mib, accuracy, _),) = press["points"]["1024"]
    budget = 236 * PER_TOKEN / 2**20
    assert accuracy == 0.75 and mib == pytest.approx(budget, rel=0.2) and mib != budget  # drawn a little aside
    path = tmp_path / "recall.png"
    assert figure.plot(recall, results, path) == f"plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def worker_definitions(*names: str) -> dict[str, Any]:
    """The worker's functions and classes of ``names``, read from its source (it imports kvpress, which this
    environment does not have)."""
    tree = ast.parse((Path(__file__).parents[1] / "benchmarks" / "kvpress_worker.py").read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names]
    assert sorted(n.name for n in nodes) == sorted(names)
    from dataclasses import dataclass

    from transformers import DynamicCache
    namespace: dict[str, Any] = {"torch": torch, "Any": Any, "dataclass": dataclass, "DynamicCache": DynamicCache}
    exec(compile(ast.Module(nodes, type_ignores=[]), "kvpress_worker.py", "exec"), namespace)
    return namespace


def test_a_windowed_teacher_keeps_its_windows_and_the_full_layers_take_the_rest(kn: ModuleType) -> None:
    """Gemma 3 270M held as int4 (18 layers x 2 x 256 dims x (1/2 + 8 scales x 4 / 256) = 5,760 bytes per token):
    its 15 sliding-window layers hold their last 511 tokens whatever the budget, and each of its 3 full-attention
    layers keeps what the rest of the budget buys; a budget below the windows is refused by name."""
    from test_conversion_memory import GEMMA3_270M
    from transformers import Gemma3TextConfig, LlamaConfig

    layout = kn.TeacherLayout.of(Gemma3TextConfig(**GEMMA3_270M, sliding_window=512))
    assert len(layout.window_layers) == 15 and layout.window_layers[:2] == (0, 1) and layout.window == 512
    assert layout.window_bytes(5_760) == 15 * 511 * 320
    budget = 3.91552734375  # the smallest of the Gemma 3 students' caches
    kept = int((budget * 2**20 - 15 * 511 * 320) / (3 * 320))
    assert kn.kept_by_budget({"student": budget}, 5_760, layout) == {kept: ["student"]} and kept == 1721
    assert layout.mib(kept, 5_760) <= budget < layout.mib(kept + 1, 5_760)
    with pytest.raises(SystemExit, match="budget tiny .* sliding-window layers alone hold 2.34 MiB"):
        kn.kept_by_budget({"tiny": 2.3}, 5_760, layout)
    flat = kn.TeacherLayout.of(LlamaConfig(num_hidden_layers=30))
    assert flat.window_layers == () and flat.window_bytes(PER_TOKEN) == 0
    for mib in (22.45, 10.371551513671875, 0.05):  # a teacher without windows: every layer pressed, as before
        assert kn.kept_by_budget({"b": mib}, PER_TOKEN, flat) == {kn.kv.kept_tokens(mib, PER_TOKEN): ["b"]}
    row = kn.new_row({"press": "KeyDiff", "mode": kn.AGNOSTIC, "kept": kept, "budget_of": ["student"]}, 5_760,
                     layout)
    assert row["cache_mib"] == layout.mib(kept, 5_760)


def test_the_workers_masks_give_a_windowed_teacher_its_own_logits() -> None:
    """Gemma 3 with a cache whose sliding-window layers hold only their last window - 1 tokens and whose
    full-attention layers hold every token in a shuffled order (as a press may leave them): the questions fed
    through it, as one block or token by token with the worker's masks, give the logits of one forward over the
    whole prompt (fp32, within 1e-5 relative to the logits' scale)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    worker = worker_definitions("Layout", "attention_masks", "pressed_length", "FullAttentionRotary")
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    model = Gemma3ForCausalLM(config).eval()
    n, follow = 23, [5, 17, 3, 40]
    ids = torch.randint(0, 97, (1, n + len(follow)))
    layout = worker["Layout"](frozenset({0, 2}), 6)
    with torch.no_grad():
        reference = model(input_ids=ids).logits[0, n:]
        prefill = worker["DynamicCache"]()
        model.model(input_ids=ids[:, :n], past_key_values=prefill)

        def cache() -> Any:
            held = worker["DynamicCache"]()
            order = torch.randperm(n)
            for index, layer in enumerate(prefill.layers):
                keys, values = (layer.keys, layer.values) if index in layout.window_layers else (
                    layer.keys[:, :, order], layer.values[:, :, order])
                held.update(keys.clone(), values.clone(), index)
            return layout.held_window(held)

        block = cache()
        assert [layer.keys.shape[2] for layer in block.layers] == [5, n, 5, n]
        assert worker["pressed_length"](block, layout) == n
        masks = worker["attention_masks"](layout, n, n, 0, len(follow), 1)
        got = model(input_ids=ids[:, n:], past_key_values=block, position_ids=torch.arange(n, ids.shape[1])[None],
                    attention_mask=masks).logits[0]
        steps, one = [], cache()
        for fed in range(len(follow)):
            masks = worker["attention_masks"](layout, n, n, fed, 1, 1)
            steps.append(model(input_ids=ids[:, n + fed : n + fed + 1], past_key_values=one,
                               position_ids=torch.tensor([[n + fed]]), attention_mask=masks).logits[0, -1])
    scale = reference.abs().max()
    assert (got - reference).abs().max() <= 1e-5 * scale
    assert (torch.stack(steps) - reference).abs().max() <= 1e-5 * scale
    assert worker["attention_masks"](worker["Layout"](), n, n, 0, 1, 1) is None  # no windows: transformers' masks
    rotary = worker["FullAttentionRotary"](model.model.rotary_emb)  # for the presses that call it without a type
    x, positions = torch.randn(1, 3, 32), torch.arange(7, 10)[None]
    for kind in ("full_attention", "sliding_attention"):
        assert all(map(torch.equal, rotary(x, positions, kind), model.model.rotary_emb(x, positions, kind)))
    assert all(map(torch.equal, rotary(x, positions), model.model.rotary_emb(x, positions, "full_attention")))
    assert not torch.equal(rotary(x, positions)[0], rotary(x, positions, "sliding_attention")[0])


@pytest.mark.parametrize("stops", [False, True])
def test_the_worker_asks_in_turn_as_the_probe_asks_a_model(tok: Any, stops: bool) -> None:
    """A tiny Llama's cache of the context, unpressed: the worker's answers to queries asked in turn are the
    probe's own (``needle_answers`` through transformers' generate), with answers that run to their length and, with
    ``stops``, answers that end at an EOS, which stays in the context of the next query."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_recattn.evaluation.generation import greedy_continuation
    from hf_recattn.evaluation.needles import needle_answers
    from hf_recattn.prompting.haystack import Haystack
    from hf_recattn.prompting.needles import needle_prompt

    worker = worker_definitions("Layout", "attention_masks", "pressed_length", "greedy_rows", "answers_in_turn")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    prompt = needle_prompt(tok, Haystack(tok, tn.HELDOUT), "multi_query", 500, "0:heldout:multi_query:500:0", 0.5)
    first, *later = prompt.queries
    case = {"query_ids": list(first.ids), "max_new_tokens": first.max_new_tokens,
            "later": [{"query_ids": list(q.ids), "max_new_tokens": q.max_new_tokens} for q in later]}
    unstopped = needle_answers(model, tok, prompt)
    if stops:  # the second token the model answers the first query with becomes its EOS
        ids = torch.tensor([[*prompt.context, *first.ids]])
        model.generation_config.eos_token_id = int(greedy_continuation(model, tok, ids, 2).tokens[1])
    expected = needle_answers(model, tok, prompt)
    assert (expected != unstopped) == stops
    cache = worker["DynamicCache"]()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([prompt.context]), past_key_values=cache)
    got = worker["answers_in_turn"](SimpleNamespace(model=model, tokenizer=tok), cache, case, len(prompt.context),
                                    worker["Layout"]())
    assert got == expected and len(set(unstopped)) > 1


def test_the_replay_is_checked_on_the_first_cell_where_a_press_compresses(kn: ModuleType) -> None:
    """A budget that holds a 1k prompt whole compresses nothing there, so the check against a real prefill goes to
    the first 4k cell (a rerun that starts at 1k still checks); with no cell compressed, none is checked."""
    cells = cells_of({"single_number/heldout/1024": [(1000, 20)], "single_number/heldout/4096": [(4070, 21)],
                      "single_number/ood/4096": [(4075, 20)]})
    runs = kn.plan_needle_runs(["KeyDiff"], [kn.AGNOSTIC], {1721: ["student"]}, cells)
    for cell in cells:
        cell["runs"] = [run["name"] for run in runs]
    kn.mark_verified_cell(cells, runs, 2)
    assert [cell["verify"] for cell in cells] == [0, 2, 0]
    kn.mark_verified_cell(cells[:1], runs, 2)
    assert cells[0]["verify"] == 0
    for cell in cells:
        cell["runs"] = [kn.kv.NO_PRESS]
    kn.mark_verified_cell(cells, runs, 2)
    assert [cell["verify"] for cell in cells] == [0, 0, 0]


class _Saved:
    """Stands in for a model or tokenizer: ``save_pretrained`` writes one file, or fails."""

    def __init__(self, name: str, text: str, fail: bool = False) -> None:
        self.name, self.text, self.fail = name, text, fail

    def save_pretrained(self, folder: Path) -> None:
        if self.fail:
            raise OSError("disk full")
        (Path(folder) / self.name).write_text(self.text)


def test_the_teacher_folder_is_written_once_and_whole(tmp_path: Path) -> None:
    """The worker's teacher folder appears whole or not at all (an interrupted save leaves nothing a later run
    would take for it) and is written once: a second run reuses it."""
    kv = load_script("benchmarks", "kv_compression")
    folder = tmp_path / "work" / "teacher"
    with pytest.raises(OSError, match="disk full"):
        kv.save_teacher(_Saved("config.json", "{}"), _Saved("tokenizer.json", "", fail=True), folder)
    assert not folder.exists() and not list(folder.parent.iterdir())
    assert kv.save_teacher(_Saved("config.json", "first"), _Saved("tokenizer.json", "t"), folder) == folder
    kv.save_teacher(_Saved("config.json", "second"), _Saved("tokenizer.json", "t"), folder)
    assert (folder / "config.json").read_text() == "first"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["teacher"]
