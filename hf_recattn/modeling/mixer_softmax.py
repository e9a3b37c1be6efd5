"""Softmax attention (full and sliding window) through transformers' attention interface.

Their "state" is the key/value cache: all past keys for ``softmax``, the last ``window - 1`` for
``sliding_window`` (with the current token that makes ``window`` visible keys).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .mixer_base import Mixer, MixerInputs, MixerShape, State
from .options import Option

SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa")


def softmax_visibility(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_is_real: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """[B or 1, 1, Tq, Tk] bool: which keys each query sees (causal, padding, window; always itself)."""
    qpos = query_positions[:, None]
    kpos = key_positions[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible = visible & (qpos - kpos < window)
    visible = visible[None, None]
    if key_is_real is not None:
        visible = visible & key_is_real[:, None, None, :]
    # a padded query row would otherwise see nothing (NaN under sdpa); its output is never used
    return visible | (kpos == qpos)[None, None]


class SoftmaxMixer(Mixer):
    """Exact softmax attention; eager or sdpa as chosen by ``config._attn_implementation``."""

    name = "softmax"
    options: dict[str, Option] = {}
    state_kind = "kv"
    window: int | None = None

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.num_key_value_groups = shape.groups
        self.is_causal = True
        self.scaling = shape.head_dim**-0.5
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)

    # ----- helpers ------------------------------------------------------------------------------------------
    def _implementation(self) -> str:
        impl = getattr(self.config, "_attn_implementation", None) or "sdpa"
        if impl not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(
                f"layer {self.shape.layer_idx} ({self.name}): attn_implementation {impl!r} is not supported; "
                f"use one of {SUPPORTED_IMPLEMENTATIONS}"
            )
        return impl

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        inputs: MixerInputs,
        num_past_keys: int,
    ) -> torch.Tensor:
        impl = self._implementation()
        t = q.shape[2]
        past = inputs.past_length
        needs_mask = (
            impl == "eager"
            or inputs.padding_mask is not None
            or (t > 1 and num_past_keys > 0)
            or (self.window is not None and t > 1)
        )
        mask = None
        if needs_mask:
            qpos = torch.arange(past, past + t, device=q.device)
            kpos = torch.arange(past - num_past_keys, past + t, device=q.device)
            real = None
            if inputs.padding_mask is not None:
                real = inputs.padding_mask[:, past - num_past_keys : past + t].bool()
            mask = softmax_visibility(qpos, kpos, real, self.window)
            if impl == "eager":
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~mask, torch.finfo(q.dtype).min
                )
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, _ = interface(
            self,
            q,
            keys,
            values,
            mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
        )
        return out

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        return self._attend(q, k, v, inputs, num_past_keys=0)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        keys = torch.cat([state["k"], k], dim=2)
        values = torch.cat([state["v"], v], dim=2)
        out = self._attend(q, keys, values, inputs, num_past_keys=state["k"].shape[2])
        return out, self._keep(keys, values)

    step = chunked

    def _keep(self, keys: torch.Tensor, values: torch.Tensor) -> State:
        return {"k": keys, "v": values}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        shape = (batch_size, self.shape.num_kv_heads, 0, self.shape.head_dim)
        return {
            "k": torch.zeros(shape, device=device, dtype=dtype),
            "v": torch.zeros(shape, device=device, dtype=dtype),
        }

    def state_size(self, context_length: int) -> int:
        return 2 * self.shape.num_kv_heads * self.shape.head_dim * context_length


class SlidingWindowMixer(SoftmaxMixer):
    """Softmax over the last ``window`` tokens (the current one included)."""

    name = "sliding_window"
    options = {"window": Option((int,), 64, "visible keys per query, the current token included", minimum=1)}
    state_kind = "window"

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.window = int(spec["window"])

    def _keep(self, keys: torch.Tensor, values: torch.Tensor) -> State:
        keep = self.window - 1
        start = max(keys.shape[2] - keep, 0)
        return {"k": keys[:, :, start:].contiguous(), "v": values[:, :, start:].contiguous()}

    def state_size(self, context_length: int) -> int:
        return 2 * self.shape.num_kv_heads * self.shape.head_dim * min(context_length, self.window - 1)
