"""What the hybrid's training form with the exact cache keeps for the backward: it grows linearly in the sequence
(each span attends the sinks and their candidates up to the last new sink, the cache, and the tokens not decided
yet, never the whole block), ``backward_numbers`` bounds it within a small factor (stage 2's memory estimate), and
conversion/memory.py counts it, so a SmolLM2 student with 1,000 int8 slots per KV head gets checkpointing.
Saved bytes are measured by autograd's saved-tensor hooks, each storage once."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest
import torch
from generation_cases import one_thread
from test_conversion_memory import SMOLLM2, _meta_models
from transformers import LlamaConfig, LlamaForCausalLM

from hf_recattn.conversion.memory import GIB, choose_memory_options, stage2_shape
from hf_recattn.conversion.recipe import load_recipe
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer
from hf_recattn.modeling.registry import validate_spec

SHAPE = MixerShape(64, 4, 2, 16, 0)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def saved_bytes(mixer: Any, form: str, tokens: int) -> int:
    """Bytes autograd keeps for the backward of ``form`` over ``tokens`` random tokens (every storage once)."""
    gen = torch.Generator().manual_seed(0)
    shape = mixer.shape
    q = torch.randn(1, shape.num_heads, tokens, shape.head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, shape.num_kv_heads, tokens, shape.head_dim, generator=gen, requires_grad=True)
            for _ in range(2))
    x = torch.randn(1, tokens, shape.hidden_size, generator=gen)
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if form == "parallel":
            out = mixer.parallel(q, k, v, MixerInputs(x, None))
        else:
            out = mixer.chunked(q, k, v, MixerInputs(x, None), mixer.init_state(1, q.device, q.dtype))
    # Only what the output's graph still holds counts; a tensor saved by a graph freed during the forward is
    # gone, and its storage's address may have been reused, so addresses are read while the output lives.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (ref() for ref in saved) if t is not None}
    del out
    return sum(storages.values())


def cached(**options: Any) -> Any:
    spec = {"mixer": "hybrid", "far": "none", "window": 8, "sink_tokens": 2, "cache_slots": 16,
            "cache_score": "keydiff", "chunk_size": 8, **options}
    return build_mixer(validate_spec(spec, "layer 0"), SHAPE)


@pytest.mark.parametrize("options", [{}, {"cache_dtype": "int8"}, {"window": 4, "cache_slots": 40}])
def test_the_parallel_form_keeps_linearly_many_numbers(options: dict[str, Any]) -> None:
    """Doubling the sequence at most doubles what the parallel form keeps, plus the cache's fixed share: a span
    that attended every earlier token of the block, or every token as a sink candidate, would make it near four
    times (3.7x here before spans were cut to what they can see and decisions stopped keeping views of the
    block's whole order; 2.1x with the views still kept)."""
    mixer = cached(**options)
    short, long = saved_bytes(mixer, "parallel", 256), saved_bytes(mixer, "parallel", 512)
    assert long < 2.1 * short, (short, long)


@pytest.mark.parametrize("options", [{}, {"cache_dtype": "int8"}, {"window": 4, "cache_slots": 40},
                                     {"sink_tokens": 0, "cache_slots": 100}])
def test_backward_numbers_bound_what_both_forms_keep(options: dict[str, Any]) -> None:
    """The estimate, at 4 bytes a number, is at least what either form keeps and at most 3x the larger."""
    mixer = cached(**options)
    kept = max(saved_bytes(mixer, form, 384) for form in ("parallel", "chunked"))
    estimate = 4 * mixer.backward_numbers(384)
    assert kept <= estimate <= 3 * kept, (kept, estimate)
    assert build_mixer(validate_spec({"mixer": "hybrid", "far": "none", "window": 8}, "layer 0"),
                       SHAPE).backward_numbers(384) == 0  # no cache: of the order of the layer's own


def test_stage2_counts_the_caches_and_turns_checkpointing_on() -> None:
    """SmolLM2's shape with ``retrieval9-int8keydiff``'s streaming heads in every layer (its retrieval heads are
    chosen at conversion): the caches keep about 9 GiB for the backward at 2,048 tokens, over any budget, so
    checkpointing is chosen where the recipe leaves it unset, which the recipe's full budget sets; its quick budget
    (no training) keeps it off and the log line says that this is over the budget."""
    full = load_recipe("retrieval9-int8keydiff", "full")
    teacher, student = _meta_models(LlamaConfig(**SMOLLM2), LlamaForCausalLM, full, torch.float32)
    shape = stage2_shape(teacher, student, full.stage2, fused_loss=False)
    per_layer = student.model.layers[0].self_attn.mixer.backward_numbers(2048)
    assert shape.mixer_numbers == (per_layer,) * 30 and 4 * per_layer > 0.25 * GIB
    assert shape.terms(512, False)["activations"] > 10 * GIB
    assert shape.terms(512, True)["activations"] < 1 * GIB  # one layer's caches, every layer's input
    choice = choose_memory_options(full.stage2, shape, 16 * GIB)
    assert choice.gradient_checkpointing and choice.estimate < choice.budget
    unset = dataclasses.replace(full.stage2, gradient_checkpointing=None)
    assert choose_memory_options(unset, shape, 16 * GIB).chosen == ("gradient_checkpointing",)
    quick = load_recipe("retrieval9-int8keydiff", "quick")
    line = choose_memory_options(quick.stage2, stage2_shape(teacher, student, quick.stage2, False), 16 * GIB).line()
    assert "OVER THE BUDGET" in line and "gradient_checkpointing off" in line
