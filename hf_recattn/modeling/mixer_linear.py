"""Linear attention with a feature map: o_t = phi(q_t) S_t / phi(q_t) z_t, or a vector norm of the numerator."""

from __future__ import annotations

from typing import Any

import torch

from .feature_maps import FEATURE_MAPS, FeatureMap
from .mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, ungroup_output
from .ops_linear import linear_chunked, linear_parallel, linear_step, noncausal_linear
from .options import Option
from .output_norms import OUTPUT_NORMS, OutputNorm

NORMALIZATIONS = ("denominator", *OUTPUT_NORMS)


class LinearMixer(Mixer):
    """Kernelized attention phi(q) . phi(k) with a fixed-size state S = sum phi(k) v^T (and z = sum phi(k))."""

    name = "linear"
    options = {
        "feature_map": Option((str,), "elu", "phi applied to q and k", choices=FEATURE_MAPS),
        "normalize": Option((str,), "denominator", "how the numerator is normalized", choices=NORMALIZATIONS),
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        "eps": Option((float,), 1e-6, "added to denominators / norms", minimum=0.0),
        "causal": Option((bool,), True, "causal (decoder) or bidirectional attention"),
    }
    state_kind = "recurrent"
    has_chunked = True

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.feature_map = FeatureMap(spec["feature_map"], shape)
        self.normalize = spec["normalize"]
        self.eps = float(spec["eps"])
        self.chunk_size = int(spec["chunk_size"])
        self.causal = bool(spec["causal"])
        self.output_norm = (
            None
            if self.normalize == "denominator"
            else OutputNorm(self.normalize, shape, shape.head_dim, self.eps)
        )

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _features(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qf = self.feature_map(group_queries(q, self.shape.num_kv_heads), is_query=True)
        kf = self.feature_map(k, is_query=False)
        mask = inputs.token_mask
        if mask is not None:
            kf = kf * mask[:, None, :, None].to(kf.dtype)
        return qf, kf

    def _finish(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        if self.output_norm is None:
            out = num / (den[..., None] + self.eps)
        else:
            out = self.output_norm(num)
        return ungroup_output(out)

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        qf, kf = self._features(q, k, inputs)
        if not self.causal:
            return self._finish(*noncausal_linear(qf, kf, v))
        return self._finish(*linear_parallel(qf, kf, v))

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("chunked")
        qf, kf = self._features(q, k, inputs)
        num, den, S, z = linear_chunked(qf, kf, v, state["S"], state["z"], self.chunk_size)
        return self._finish(num, den), {"S": S, "z": z}

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("step")
        qf, kf = self._features(q, k, inputs)
        num, den, S, z = linear_step(qf, kf, v, state["S"], state["z"])
        return self._finish(num, den), {"S": S, "z": z}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, f, e = self.shape.num_kv_heads, self.feature_map.out_dim, self.shape.head_dim
        return {
            "S": torch.zeros(batch_size, hk, f, e, device=device, dtype=dtype),
            "z": torch.zeros(batch_size, hk, f, device=device, dtype=dtype),
        }

    def state_size(self, context_length: int) -> int:
        f = self.feature_map.out_dim
        return self.shape.num_kv_heads * f * (self.shape.head_dim + 1)
