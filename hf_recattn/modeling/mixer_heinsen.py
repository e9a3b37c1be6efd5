"""Heinsen's attention (Heinsen, arXiv:2404.05843): Softmax(log(exp(Q) exp(K)^T)) V with log-space states of
constant size.

The kernel exp(s q) . exp(s k) is positive, so the output is a weighted average of values; every sum of
exponentials is kept as a logarithm or relative to one (see ops_heinsen for the states and signed values).
It stays finite and accurate in fp32 with q and k entries far beyond where exp overflows (tested at +-80).
"""

from __future__ import annotations

from typing import Any

import torch

from .mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, state_dtype, ungroup_output, writable
from .ops_heinsen import (
    heinsen_chunked,
    heinsen_parallel,
    heinsen_step,
    init_heinsen_state,
    mask_keys,
    shift_queries,
)
from .options import Option


class HeinsenMixer(Mixer):
    """Log-space attention with the kernel exp(q) . exp(k); states H^Z [D] (log space) and the value sums
    relative to it, M [D, E], per KV head.

    Paper: Heinsen, "Softmax Attention with Constant Cost per Token", arXiv:2404.05843.
    """

    name = "heinsen"
    options = {
        "scale": Option((float,), 1.0, "q and k are multiplied by this before exp (the paper uses 1)"),
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        "causal": Option((bool,), True, "causal (decoder) or bidirectional attention"),
    }
    state_kind = "recurrent"
    has_chunked = True

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if spec["scale"] <= 0:
            raise ValueError(f"{where}: option 'scale' must be > 0, got {spec['scale']!r}")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.scale = float(spec["scale"])
        self.chunk_size = int(spec["chunk_size"])
        self.causal = bool(spec["causal"])

    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qg = shift_queries(group_queries(q, self.shape.num_kv_heads) * self.scale)
        return qg, mask_keys(k * self.scale, inputs.token_mask)

    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        qg, kg = self._prepare(q, k, inputs)
        return ungroup_output(heinsen_parallel(qg, kg, v, causal=self.causal))

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("chunked")
        qg, kg = self._prepare(q, k, inputs)
        out, state = heinsen_chunked(qg, kg, v, state, self.chunk_size)
        return ungroup_output(out), state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("step")
        qg, kg = self._prepare(q, k, inputs)
        out, state = heinsen_step(qg, kg, v, state, in_place=writable(*state.values()))
        return ungroup_output(out), state

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        d = self.shape.head_dim
        return init_heinsen_state(batch_size, self.shape.num_kv_heads, d, d, device, state_dtype(dtype))

    def state_size(self, context_length: int) -> int:
        d = self.shape.head_dim
        return self.shape.num_kv_heads * (d * d + d)
