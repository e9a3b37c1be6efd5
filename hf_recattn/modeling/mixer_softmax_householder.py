"""PaTH attention (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, "Hardcore Position Encoding",
eq. 25): Householder products as position encoding.

    logit_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j * scale   (j <= i, real keys only),   H_t = I - b_t w_t w_t^T,

with, per key head and token, w_t = W_w x_t / |W_w x_t| (unit norm) and b_t = 2 sigmoid(w_b . x_t + c) in (0, 2)
(PaTH's range: H_t is a reflection at b = 2, the identity at b = 0), read from the layer input x. Query heads of
a group share their key head's Householders, so the cache lives per key head. Padded tokens apply no Householder
(b = 0) and are invisible as keys. ``rope=True`` keeps RoPE on q and k underneath (the family's default, so that a
converted softmax checkpoint starts from itself at b ~ 0); ``rope=False`` replaces it (the ``path`` preset).

Forms (ops_softmax_householder.py): blocks of ``chunk_size`` tokens through the UT transform; the cache holds every
key carried to the latest token and every value, and a decode step applies its Householder to the cached keys.
Cropping such a cache cannot be exact (the kept keys carry the removed tokens' Householders): a per-token stamp (1
on the latest token, 0 before) lets the next forward refuse a cropped cache instead of continuing from wrong keys.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gated_parts import INITS, head_gate_logits, init_head_gate
from .mixer_base import ContinuingMixer, MixerInputs, MixerShape, State, group_queries, ungroup_output
from .ops_softmax_householder import path_attention
from .options import Option


class SoftmaxHouseholderMixer(ContinuingMixer):
    """PaTH: softmax attention with data-dependent Householder transports between query and key positions.

    Paper: Yang et al., "PaTH Attention: Position Encoding via Accumulating Householder Transformations",
    arXiv:2505.16381.

    The equations follow Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033 (eqs. 25-29).
    """

    name = "softmax_householder"
    options = {
        "scale": Option((float,), None, "query-key scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        "init": Option((str,), "scratch", "scratch (W_w, w_b ~ N(0, initializer_range), c = 0: b ~ 1) or "
                       "convert (w_b = 0, b = beta_init: near the softmax it converts)", choices=INITS),
        "beta_init": Option((float,), 0.01, "init=convert: initial b, in (0, 2)"),
        "chunk_size": Option((int,), 64, "tokens per block of the UT transform", minimum=1),
        "eps": Option((float,), 1e-6, "added inside the norm of w", minimum=0.0),
        "causal": Option((bool,), True, "must be True (decoder only)"),
    }
    state_kind = "kv"

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        return "full_attention"  # a key cache read by every query

    def rollback_problem(self) -> str | None:
        return "its cached keys carry the Householder transforms of the tokens after them, which a crop cannot undo"
    has_chunked = False
    causal_only = "(softmax_householder has no bidirectional form)"

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if not 0.0 < spec["beta_init"] < 2.0:
            raise ValueError(f"{where}: option 'beta_init' must be in (0, 2), got {spec['beta_init']!r}")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        hk, d, c = shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        self.chunk_size = int(spec["chunk_size"])
        self.eps = float(spec["eps"])
        self.initializer_range = float(getattr(config, "initializer_range", 0.02))
        self.w_weight = nn.Parameter(torch.zeros(hk * d, c))
        self.beta_weight = nn.Parameter(torch.zeros(hk, c))
        self.beta_bias = nn.Parameter(torch.zeros(hk))

    def init_parameters(self, init: Any) -> None:
        """W_w ~ N(0, initializer_range); the b gate N(0, initializer_range) with zero bias (b ~ 1), or with
        init=convert zero weight and b = beta_init for every token."""
        init.normal_(self.w_weight, 0.0, self.initializer_range)
        half = self.spec["beta_init"] / 2.0 if self.spec["init"] == "convert" else None  # b = 2 sigmoid(...)
        init_head_gate(init, self.beta_weight, self.beta_bias, half, self.initializer_range)

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The Householder directions' projection, read from the layer input."""
        return {"householder": self.w_weight}

    def householders(self, inputs: MixerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit w [B, Hk, T, D] and b [B, Hk, T] of the current tokens (b = 0 on padded ones)."""
        x = inputs.hidden_states
        bsz, t, _ = x.shape
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        w = inputs.linear("householder", self.w_weight).view(bsz, t, hk, d).transpose(1, 2)
        w = F.rms_norm(w, (d,), eps=self.eps / d) * d**-0.5  # w / sqrt(|w|^2 + eps)
        b = 2.0 * torch.sigmoid(head_gate_logits(x, self.beta_weight, self.beta_bias))
        mask = inputs.token_mask
        if mask is not None:
            b = b * mask[..., None].to(b.dtype)
        return w, b.transpose(1, 2)

    # ----- forms ------------------------------------------------------------------------------------------
    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, State]:
        if state is None:
            state = self.init_state(q.shape[0], q.device, q.dtype)
        elif state["k"].shape[2] and bool((state["stamp"][:, 0, -1] == 0).any()):
            raise ValueError(
                f"layer {self.shape.layer_idx} (path): the cache was cropped; its keys still carry the removed "
                "tokens' Householders, so PaTH cannot continue from it: re-run the prompt up to the wanted length"
            )
        w, b = self.householders(inputs)
        mask = inputs.padding_mask
        key_real = None if mask is None else mask[:, -(state["k"].shape[2] + k.shape[2]) :]
        o, keys, values = path_attention(
            group_queries(q, self.shape.num_kv_heads), k, v, w, b, (state["k"], state["v"]), key_real,
            self.scale, self.chunk_size,
        )
        stamp = keys.new_zeros(keys.shape[0], 1, keys.shape[2])
        stamp[:, :, -1] = 1.0  # marks the token the keys are carried to; a crop removes it
        return ungroup_output(o), {"k": keys, "v": values, "stamp": stamp}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        shape = (batch_size, self.shape.num_kv_heads, 0, self.shape.head_dim)
        state = {name: torch.zeros(shape, device=device, dtype=dtype) for name in ("k", "v")}
        state["stamp"] = torch.zeros(batch_size, 1, 0, device=device, dtype=dtype)
        return state

    def state_size(self, context_length: int) -> int:
        """Every key (carried to the latest token), every value and a one-element stamp: 2 Hk D + 1 per token."""
        return (2 * self.shape.num_kv_heads * self.shape.head_dim + 1) * context_length
