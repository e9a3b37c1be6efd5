"""Per-layer decode-state size against a KV cache, and the context at which the state breaks even."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from .modeling.configuration import RecAttnConfig
from .modeling.hybrid_cached import CACHE_OPTIONS, ExactCacheForms
from .modeling.hybrid_options import (
    config_with_hybrid_options,
    hybrid_cache_slots,
)
from .modeling.mixer_base import MixerShape
from .modeling.mixers import build_mixer


@dataclass
class LayerStateSize:
    layer: int
    mixer: str
    kind: str  # kv, window, recurrent
    state_elements: int  # per sequence at the requested context
    kv_cache_elements: int  # what the teacher's layer holds at that context (a sliding layer: its window's pairs)
    break_even_context: int | None  # first context where that KV cache is at least as large; None: never smaller
    window: int | None = None  # a sliding window's visible keys (a teacher's window layer kept as it is)
    code_bytes: int = 0  # of the state, the bytes held as integer codes and their scales (counted at a quarter above)

    @property
    def label(self) -> str:
        """The mixer, with its window when it has one: ``sliding_window(512)``."""
        return self.mixer if self.window is None else f"{self.mixer}({self.window})"

    def state_bytes(self, bytes_per_element: int) -> int:
        """The state's bytes with its floating-point elements at ``bytes_per_element`` and its integer codes and their
        scales at their own bytes."""
        coded_elements = -(-self.code_bytes // 4)
        return (self.state_elements - coded_elements) * bytes_per_element + self.code_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_bytes(rows: list[LayerStateSize], bytes_per_element: int) -> int:
    """The rows' states in bytes (``LayerStateSize.state_bytes``)."""
    return sum(r.state_bytes(bytes_per_element) for r in rows)


def teacher_kv_bytes(rows: list[LayerStateSize], bytes_per_element: int) -> int:
    """The teacher's KV cache beside the rows' states in bytes, at ``bytes_per_element`` a key or value element."""
    return sum(r.kv_cache_elements for r in rows) * bytes_per_element


def _code_bytes(mixer: torch.nn.Module) -> int:
    """The bytes a mixer's exact caches (its own or its parts') hold as integer codes and scales."""
    return sum(m.code_bytes() for m in mixer.modules() if isinstance(m, ExactCacheForms))


def teacher_kv_tokens(config: RecAttnConfig, layer: int, context_length: int) -> int:
    """The pairs the teacher's KV cache holds in ``layer`` after ``context_length`` tokens: all of them, or
    ``window - 1`` in a layer the teacher ran with a sliding window (``teacher_kv_windows``)."""
    windows = getattr(config, "teacher_kv_windows", None)
    window = windows[layer] if windows else None
    return context_length if window is None else min(context_length, window - 1)


def _break_even(mixer: Any, kv_per_token: int, kv_tokens_at_most: int) -> int | None:
    """The first context at which the teacher's cache (``kv_per_token`` a pair, at most ``kv_tokens_at_most``
    pairs) is at least the size of the mixer's state once it stops growing; None if it never is."""
    if mixer.state_kind == "kv":
        return None
    fixed = mixer.state_size(1 << 40)  # the state's size once it stops growing
    tokens = -(-fixed // kv_per_token)
    return tokens if tokens <= kv_tokens_at_most else None


def state_size_report(config: RecAttnConfig, context_length: int) -> list[LayerStateSize]:
    """One row per layer; element counts per sequence (multiply by the dtype size for bytes). The KV cache beside
    each state is the teacher's: the whole context, or its window in a layer the teacher slid
    (``teacher_kv_windows``)."""
    if context_length < 1:
        raise ValueError(f"context length must be >= 1, got {context_length}")
    rows = []
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim
    with torch.device("meta"):
        for i, spec in enumerate(config.layer_specs()):
            shape = MixerShape(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim, i
            )
            mixer = build_mixer(spec, shape, config)
            rows.append(
                LayerStateSize(
                    layer=i,
                    mixer=spec["mixer"],
                    kind=mixer.state_kind,
                    state_elements=mixer.state_size(context_length),
                    kv_cache_elements=kv_per_token * teacher_kv_tokens(config, i, context_length),
                    break_even_context=_break_even(mixer, kv_per_token, teacher_kv_tokens(config, i, 1 << 40)),
                    window=spec.get("window") if isinstance(spec.get("window"), int) else None,
                    code_bytes=_code_bytes(mixer),
                )
            )
    return rows


def exact_cache_bytes(config: RecAttnConfig, context_length: int, bytes_per_element: int) -> int:
    """What the hybrid layers' exact cache (``cache_slots``, its pending buffer included) adds to the state per
    sequence in bytes (``state_bytes``): the state less that of the same model without the cache; 0 without one."""
    if not hybrid_cache_slots(config):
        return 0
    plain = config_with_hybrid_options(config, {name: option.default for name, option in CACHE_OPTIONS.items()})
    return state_bytes(state_size_report(config, context_length), bytes_per_element) - state_bytes(
        state_size_report(plain, context_length), bytes_per_element)


def format_report(rows: list[LayerStateSize], bytes_per_element: int = 2) -> str:
    """A plain-text table with totals in MiB at the given element size."""
    lines = [f"{'layer':>5} {'mixer':<20} {'kind':<9} {'state':>14} {'teacher kv':>14} {'break-even':>11}"]
    for r in rows:
        be = "-" if r.break_even_context is None else str(r.break_even_context)
        lines.append(
            f"{r.layer:>5} {r.label:<20} {r.kind:<9} {r.state_elements:>14,} {r.kv_cache_elements:>14,} {be:>11}"
        )
    total_state = state_bytes(rows, bytes_per_element) / 2**20
    total_kv = teacher_kv_bytes(rows, bytes_per_element) / 2**20
    lines.append(
        f"total per sequence: state {total_state:.2f} MiB, teacher's kv cache {total_kv:.2f} MiB "
        f"({bytes_per_element} bytes per element)"
    )
    return "\n".join(lines)
