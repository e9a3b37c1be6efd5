"""Model cases shared by the generation and cache tests: every mixer, representative specs, hybrids.

A spec whose mixer is not registered yet is skipped; every registered mixer missing from the list gets its
default spec, so a family added later is covered without editing this file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.mixers import MIXERS

VOCAB = 64
PAD = 0

#: representative specs; the tiny model shrinks chunk sizes (see `tiny_spec`) so prompts span several chunks
SPECS: list[dict[str, Any]] = [
    {"mixer": "softmax"},
    {"mixer": "sliding_window", "window": 3},
    {"mixer": "softmax", "forget": "fox", "fox_bias_init": 2.0},  # f = 0.88 at init: the gate really forgets
    {"mixer": "softmax", "forget": "alibi", "rope": False},
    {"mixer": "sliding_window", "window": 3, "forget": "fox", "fox_bias_init": 1.0},
    {"mixer": "linear", "feature_map": "elu"},
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms"},
    {"mixer": "linear", "feature_map": "taylor2"},
    {"mixer": "linear", "feature_map": "cosine", "normalize": "l2"},
    {"mixer": "linear", "decay": "learned"},
    {"mixer": "linear", "feature_map": "hedgehog", "decay": "gated", "half_life_min": 2.0, "sink": True},
    {"mixer": "taylor", "order": 2},
    {"mixer": "taylor", "order": 3, "denominator": "l2"},
    {"mixer": "taylor", "order": 2, "denominator": "gate"},
    {"mixer": "taylor", "order": "exp"},
    {"mixer": "heinsen"},
    {"mixer": "hybrid", "window": 3},
    {"mixer": "hybrid", "window": 3, "far": {"mixer": "taylor", "order": 2}},
    {"mixer": "hybrid", "window": 3, "sink_tokens": 2},
    {"mixer": "hybrid", "window": 2, "far": "none", "sink_tokens": 1},
    {"mixer": "delta"},
    {"mixer": "delta", "rule": "delta", "conv_size": 0, "output_gate": False, "output_norm": False},
    {"mixer": "delta", "rule": "comba", "householder_steps": 2, "negative_eigenvalues": True},
    {"mixer": "delta", "init": "convert", "householder_steps": 3, "conv_size": 2},
    {"mixer": "mesa"},  # 30 CG steps in every form (prefill and decode solve alike)
    {"mixer": "mesa", "solver": "exact", "conv_size": 0, "output_gate": True, "init": "convert"},
    {"mixer": "softmax_delta"},
    {"mixer": "softmax_delta", "write_strength": "sigmoid"},
    {"mixer": "softmax_householder"},
    {"mixer": "softmax_householder", "rope": False},
    {"mixer": "gated_linear"},
    {"mixer": "gated_linear", "init": "convert", "output_gate": False, "output_norm": False, "rope": False},
    {"mixer": "kda"},
    {"mixer": "kda", "init": "convert", "feature_map": "hedgehog", "activation": "none", "conv_size": 2,
     "output_gate": False, "output_norm": False},
    {"mixer": "hybrid", "window": 3, "combine": "sum", "far": {"mixer": "kda", "init": "convert"}},
    {"mixer": "linear", "decay": "retnet"},
    {"mixer": "linear", "feature_map": "identity", "normalize": "layernorm", "decay": "retnet", "gamma_min": 0.5,
     "gamma_max": 0.9},  # the retnet preset with strong decays
    {"mixer": "retrieval_heads", "heads": [1], "others": {"mixer": "hybrid", "window": 3, "sink_tokens": 1}},
    {"mixer": "retrieval_heads", "heads": [0], "others": {"mixer": "delta", "rule": "gated"}},
]

#: models whose layers use different mixers: (attention, overrides, layers)
HYBRID_MODELS: dict[str, tuple[Any, dict | None, int]] = {
    "layers:window+taylor+softmax": (
        {"mixer": "taylor", "order": 2},
        {"0": {"mixer": "sliding_window", "window": 3}, "-1": {"mixer": "softmax"}},
        3,
    ),
    "layers:linear+heinsen+hybrid": (
        [{"mixer": "linear", "feature_map": "hedgehog"}, {"mixer": "heinsen"},
         {"mixer": "hybrid", "window": 4}],
        None,
        3,
    ),
    "layers:delta+window+softmax": (
        {"mixer": "delta", "rule": "gated"},
        {"0": {"mixer": "sliding_window", "window": 3}, "-1": {"mixer": "softmax"}},
        3,
    ),
}


@dataclass(frozen=True)
class Case:
    id: str
    attention: Any
    overrides: dict | None = None
    layers: int = 2

    def mixers(self) -> set[str]:
        specs = self.attention if isinstance(self.attention, list) else [self.attention]
        specs = [*specs, *(self.overrides or {}).values()]
        names = {s["mixer"] for s in specs}
        names |= {s[part]["mixer"] for s in specs for part in ("far", "others") if isinstance(s.get(part), dict)}
        return names


def spec_id(spec: dict[str, Any]) -> str:
    rest = ",".join(
        f"{k}={v['mixer'] if isinstance(v, dict) else v}" for k, v in spec.items() if k != "mixer"
    )
    return f"{spec['mixer']}({rest})" if rest else spec["mixer"]


def all_cases() -> list[Case]:
    specs = list(SPECS)
    named = {s["mixer"] for s in specs}
    specs += [{"mixer": name} for name in MIXERS if name not in named]  # families registered later
    cases = [Case(spec_id(s), s) for s in specs]
    cases += [Case(name, att, ov, n) for name, (att, ov, n) in HYBRID_MODELS.items()]
    return cases


def case_params() -> list[Any]:
    """pytest params: one per case, skipped while one of its mixers is not registered."""
    params = []
    for case in all_cases():
        missing = sorted(case.mixers() - set(MIXERS))
        marks = [pytest.mark.skip(reason=f"mixer(s) {missing} not registered yet")] if missing else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def tiny_spec(spec: Any) -> Any:
    """Small chunks, so that short prompts exercise several chunks of the chunked form."""
    if isinstance(spec, list):
        return [tiny_spec(s) for s in spec]
    spec = copy.deepcopy(spec)
    cls = MIXERS.get(spec["mixer"])
    if cls is not None and "chunk_size" in cls.all_options() and "chunk_size" not in spec:
        spec["chunk_size"] = 4
    for part in ("far", "others"):  # nested specs
        if isinstance(spec.get(part), dict):
            spec[part] = tiny_spec(spec[part])
    return spec


def tiny_model(case: Case, max_positions: int = 64, seed: int = 0) -> RecAttnForCausalLM:
    """A 2-3 layer fp32 model (hidden 32, 4 heads, 2 KV heads, head_dim 8) with spread-out logits."""
    torch.manual_seed(seed)
    overrides = {k: tiny_spec(v) for k, v in case.overrides.items()} if case.overrides else None
    config = RecAttnConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=case.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        attention=tiny_spec(case.attention), attention_overrides=overrides,
    )
    return RecAttnForCausalLM(config).eval()


def left_padded_batch(
    lengths: tuple[int, ...] = (6, 8, 9), seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and 0/1 mask of rows with the given real lengths, left-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def assert_generates_through_the_cache_and_reloads(model: RecAttnForCausalLM, folder: Any) -> None:
    """Greedy decoding of a left-padded batch with the cache (chunked prefill, then steps) gives the tokens and the
    logits (within 1e-4 relative) of the full forward without a cache; saved to ``folder`` and loaded, the model gives
    the same logits exactly. The reference logits come before the cached generate, which lays the weights out for
    decoding (rounding in the last bits)."""
    ids, mask = left_padded_batch()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=False)
    full = torch.cat([mask, torch.ones(mask.shape[0], 5, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(plain, attention_mask=full, use_cache=False).logits[:, ids.shape[1] - 1 : -1]
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    assert torch.equal(cached.sequences, plain)
    got = torch.stack(cached.logits, dim=1)
    assert float((got - logits).norm() / logits.norm()) <= 1e-4
    model.save_pretrained(folder)
    loaded = RecAttnForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        again = loaded(plain, attention_mask=full, use_cache=False).logits[:, ids.shape[1] - 1 : -1]
    assert torch.equal(again, logits)


def one_thread() -> None:
    """Tiny models run fastest on one thread; two OpenMP threads on two shared cores stall (10x slower)."""
    torch.set_num_threads(1)


def kinds(model: RecAttnForCausalLM) -> list[str]:
    return [layer.self_attn.mixer.state_kind for layer in model.model.layers]
