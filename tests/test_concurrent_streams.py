"""The many-streams benchmark's bookkeeping (benchmarks/concurrent_streams.py): the cache sizes it predicts before
allocating, the out-of-memory verdict, one configuration in a process of its own, and its table."""

from __future__ import annotations

import argparse
import os
from types import ModuleType
from typing import Any

import pytest
import torch
from script_modules import load_script
from transformers import LlamaConfig, LlamaForCausalLM

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.conversion.recipe import load_recipe

#: decode.py's synthetic fill draws token ids from the SmolLM2 vocabulary; every other width is tiny
TINY = dict(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=512)
FILL = argparse.Namespace(fill="synthetic", prefill_tokens=80)  # more than the hybrid's 64 + 4 tokens


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks", "concurrent_streams")


def _ours(recipe: str) -> RecAttnForCausalLM:
    return RecAttnForCausalLM(RecAttnConfig(**TINY, attention=load_recipe(recipe).attention)).eval()


def _models(bench: ModuleType) -> dict[str, tuple[torch.nn.Module, Any]]:
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    out: dict[str, tuple[torch.nn.Module, Any]] = {"teacher": (llama, lambda c: bench.llama_cache(llama, c))}
    for recipe in bench.RECIPES:
        model = _ours(recipe)
        out[recipe] = (model, lambda c, m=model: bench.filled_cache(m, c, FILL))  # decode.py's fill, as it imports
    return out


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"repeats": 4, "min_repeats": 2, "seconds": 60.0, **kw})


def test_predicted_cache_is_what_the_filled_cache_holds(bench: ModuleType) -> None:
    for name, (model, fill) in _models(bench).items():
        with torch.inference_mode():
            cache = fill(200)
            cache.batch_repeat_interleave(3)
        elements, nbytes = bench.held(cache)
        assert elements == bench.cache_elements(model, 3, 200), name
        assert nbytes <= bench.cache_bytes(model, 3, 200), name
    teacher = _models(bench)["teacher"][0]
    assert bench.cache_elements(teacher, 3, 400) == 2 * bench.cache_elements(teacher, 3, 200)  # a KV cache grows
    hybrid = _ours(bench.RECIPES[0])
    assert bench.cache_elements(hybrid, 3, 400) == bench.cache_elements(hybrid, 3, 200)  # a bounded state does not


def test_a_configuration_above_the_limit_is_not_allocated(bench: ModuleType) -> None:
    model, _ = _models(bench)["teacher"]

    def fill(context: int) -> None:
        raise AssertionError("an out-of-memory configuration must not fill a cache")

    need = bench.predicted_bytes(model, 4, 300)
    row = bench.measure(model, fill, 4, 300, _args(), limit=need - 1)
    assert row["status"] == "out of memory"
    assert row["needs_gib"] * bench.GIB >= bench.own("VmRSS") + bench.cache_bytes(model, 4, 300)


def test_a_configuration_runs_in_its_own_process(bench: ModuleType) -> None:
    for name, (model, fill) in _models(bench).items():
        row = bench.in_fork(lambda m=model, f=fill: bench.measure(m, f, 2, 120, _args(), limit=2**60))
        assert row["status"] == "ok", (name, row)
        assert 2 <= row["steps"] <= 4 and row["tokens_per_s"] > 0
        assert row["peak_gib"] >= row["cache_gib"] > 0


def test_in_fork_reports_the_childs_result_and_its_errors(bench: ModuleType) -> None:
    assert bench.in_fork(lambda: {"pid": os.getpid()})["pid"] != os.getpid()

    def fail() -> dict:
        raise ValueError("boom")

    row = bench.in_fork(fail)
    assert row["status"] == "error" and "ValueError: boom" in row["error"]


def test_table_names_what_ran_out_of_memory(bench: ModuleType) -> None:
    recipe = bench.RECIPES[0]
    rows = [
        {"model": bench.TEACHER, "streams": 64, "context": 8192, "status": "out of memory", "needs_gib": 24.64,
         "cache_gib": 22.5},
        {"model": recipe, "streams": 64, "context": 8192, "status": "ok", "tokens_per_s": 75.25, "peak_gib": 1.03,
         "cache_gib": 0.179, "needs_gib": 1.2},
    ]
    results = {
        "rows": rows, "provenance": {"threads": 1}, "generate_check": None,
        "memory": {"total_gib": 23.5, "limit_gib": 21.2, "headroom": 0.1},
        "settings": {"recipes": [recipe], "repeats": 12, "min_repeats": 3, "seconds": 6.0},
    }
    table = bench.render_markdown(results)
    assert f"| {bench.TEACHER} | 64 | 8192 | out of memory (needs 24.6 GiB) | - | 22.5 |" in table
    assert f"| {recipe} | 64 | 8192 | 75.2 | 1.03 | 0.179 |" in table
    assert f"Out of memory: {bench.TEACHER} at 64 x 8192." in table
