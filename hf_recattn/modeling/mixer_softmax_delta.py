"""DeltaFormer: DeltaNet's inverse with softmax kernels (Su, "A Brief History of Linear Attention",
https://kexue.fm/archives/11033, section "Feeding Back in Progress", eq. 23).

    u_i = v_i - b_i * sum_{j < i} softmax_j(k_i . k_j * key_scale) u_j      (real keys j < i only)
    o_i = sum_{j <= i} softmax_j(q_i . k_j * scale) u_j                       (real keys j <= i)

i.e. ``O = A (I + B)^{-1} V`` with A the causal softmax of Q K^T (diagonal included) and B the softmax of K K^T
over the strictly earlier keys, row by row. ``write_strength='none'`` is the equation as Su writes it (b = 1);
``'sigmoid'`` adds DeltaFormer's beta, b_i = sigmoid(w_b . x_i + c) per key head from the layer input. u depends
only on keys and values, so it lives per key head (GQA / MQA share it). The cache holds every key and its u.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .gated_parts import INITS, head_gate_logits, init_head_gate
from .mixer_base import ContinuingMixer, MixerInputs, MixerShape, State, group_queries, ungroup_output
from .ops_softmax_delta import deltaformer_attention
from .options import Option, check_open_unit

WRITE_STRENGTHS = ("none", "sigmoid")


class SoftmaxDeltaMixer(ContinuingMixer):
    """DeltaFormer: softmax attention reading values u = (I + B)^-1 v fed back through key-key softmax.

    Paper: Zhong et al., "Understanding Transformer from the Perspective of Associative Memory",
    arXiv:2505.19488 (DeltaFormer; ``write_strength="sigmoid"`` is its beta).

    The equations follow Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033 (eq. 23).
    """

    name = "softmax_delta"
    options = {
        "write_strength": Option((str,), "none", "b_i scaling the feedback of token i: none (b = 1, as Su writes "
                                 "eq. 23) or sigmoid (b = sigmoid(w_b . x + c) per key head)",
                                 choices=WRITE_STRENGTHS),
        "scale": Option((float,), None, "query-key scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        "key_scale": Option((float,), None, "key-key scale inside B; None: head_dim ** -0.5", nullable=True,
                            minimum=0.0),
        "init": Option((str,), "scratch", "write_strength=sigmoid: scratch (w_b ~ N(0, initializer_range), "
                       "c = 0) or convert (w_b = 0, b = beta_init: near plain softmax)", choices=INITS),
        "beta_init": Option((float,), 0.01, "init=convert: initial write strength b, in (0, 1)"),
        "causal": Option((bool,), True, "must be True (decoder only)"),
    }
    state_kind = "kv"

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        return "full_attention"  # a key cache read by every query
    has_chunked = False
    causal_only = "(softmax_delta has no bidirectional form)"

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        check_open_unit(spec, where, "beta_init")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        d = shape.head_dim
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        self.key_scale = d**-0.5 if spec["key_scale"] is None else float(spec["key_scale"])
        self.initializer_range = float(getattr(config, "initializer_range", 0.02))
        if spec["write_strength"] == "sigmoid":
            self.beta_weight = nn.Parameter(torch.zeros(shape.num_kv_heads, shape.hidden_size))
            self.beta_bias = nn.Parameter(torch.zeros(shape.num_kv_heads))

    def init_parameters(self, init: Any) -> None:
        """The write-strength gate (if any): N(0, initializer_range) and zero bias (b ~ 0.5), or with
        init=convert zero weight and b = beta_init for every token (the layer starts close to softmax)."""
        if hasattr(self, "beta_weight"):
            start = self.spec["beta_init"] if self.spec["init"] == "convert" else None
            init_head_gate(init, self.beta_weight, self.beta_bias, start, self.initializer_range)

    # ----- forms ------------------------------------------------------------------------------------------
    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, State]:
        write = None
        if hasattr(self, "beta_weight"):
            write = torch.sigmoid(head_gate_logits(inputs.hidden_states, self.beta_weight, self.beta_bias))
            write = write.transpose(1, 2)  # [B, Hk, T]
        if state is None:
            state = self.init_state(q.shape[0], q.device, q.dtype)
        mask = inputs.padding_mask
        key_real = None if mask is None else mask[:, -(state["k"].shape[2] + k.shape[2]) :]
        o, keys, u = deltaformer_attention(
            group_queries(q, self.shape.num_kv_heads), k, v, write, (state["k"], state["u"]), key_real,
            self.scale, self.key_scale,
        )
        return ungroup_output(o), {"k": keys, "u": u}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        shape = (batch_size, self.shape.num_kv_heads, 0, self.shape.head_dim)
        return {name: torch.zeros(shape, device=device, dtype=dtype) for name in ("k", "u")}

    def state_size(self, context_length: int) -> int:
        """Every key and its u: 2 Hk D per token (the size of a softmax KV cache)."""
        return 2 * self.shape.num_kv_heads * self.shape.head_dim * context_length
