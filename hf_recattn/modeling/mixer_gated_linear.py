"""Gated linear attention (GLA, Yang et al. 2024): linear attention with a data-dependent forget gate per key dim.

Per key head, a state S [D, E]:

    alpha_t = sigmoid(W2 W1 x_t + b) ** (1 / tau)      (log alpha_t = logsigmoid(W2 W1 x_t + b) / tau)
    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,           o_t = q_t S_t   (q scaled by ``scale``)

x is the layer input, W1 [r, C] and W2 [Hkv D, r] a low-rank map (rank r = ``gate_rank``, 16 in the paper), b
[Hkv D] a bias, tau = ``gate_temperature`` (16 in the paper: gates stay close to 1). There is no feature map
and no denominator; each head's output goes through an RMSNorm (``output_norm``, a gain per query head) times a
swish gate silu(W_g x) (``output_gate``), as GLA does. GLA has no positional encoding; ``rope`` keeps the
project's default (True, what a converted Llama's q and k expect); the preset ``gla`` turns it off. Query
heads of a group read their key head's state (GQA). A padded token leaves the state untouched (alpha = 1, no
write). ``causal=False`` has no form (a gated state has a direction) and is refused.

Initializations (``init``): ``scratch``, the published one (fla's GLA layer): W1, W2 and W_g xavier-uniform with
gain 2^-2.5, b = 0 (alpha near 0.5^(1/16) = 0.96); ``convert``, for distilling a softmax teacher: W2 = 0 (gates
start input-independent, so the layer starts as decayed linear attention), W1 and W_g ~ N(0, initializer_range), b
such that each head's D key dimensions have half-lives spread log-uniformly from ``half_life_min`` to
``half_life_max`` tokens (alpha^life = 1/2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decay import log_uniform_half_lives
from .gated_parts import GatedMixer, chunk_options, convert_init_options, head_gate_logits, output_options
from .mixer_base import MixerInputs, MixerShape, State, group_queries, state_dtype, writable
from .ops_gated_linear import gla_chunked, gla_parallel, gla_step
from .options import Option


def half_life_gate_bias(dims: int, temperature: float, shortest: float, longest: float) -> torch.Tensor:
    """b with sigmoid(b)^(1/tau) = 2^(-1/life), lives log-uniform over ``dims`` key dimensions."""
    log_p = -temperature * math.log(2.0) / log_uniform_half_lives(dims, shortest, longest)  # log sigmoid(b)
    return (log_p - torch.log(-torch.expm1(log_p))).float()  # logit of p = exp(log_p)


class GatedLinearMixer(GatedMixer):
    """Gated linear attention: a state per key head decayed per key dimension by a low-rank gate of the input.

    Paper: Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient Training",
    arXiv:2312.06635.
    """

    name = "gated_linear"
    options = {
        "gate_rank": Option((int,), 16, "rank of the gate's low-rank map W2 W1 from the layer input", minimum=1),
        "gate_temperature": Option((float,), 16.0, "tau: log alpha = logsigmoid(W2 W1 x + b) / tau"),
        **output_options(gate=True),
        "scale": Option((float,), None, "query scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        **convert_init_options("input-independent gates at the given half-lives", "gate"),
        **chunk_options("output RMSNorm"),
        "causal": Option((bool,), True, "must be True: GLA has no bidirectional form"),
    }
    state_kind = "recurrent"
    has_chunked = True

    gate_needs_norm = False
    causal_only = "for gla (a gated state has a direction; there is no bidirectional form)"

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if not spec["gate_temperature"] > 0.0:
            raise ValueError(f"{where}: option 'gate_temperature' must be > 0, got {spec['gate_temperature']!r}")
        super().check_spec(spec, where)

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        hk, d, c = shape.num_kv_heads, shape.head_dim, shape.hidden_size
        rank = int(spec["gate_rank"])
        self.temperature = float(spec["gate_temperature"])
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
        self.gate_down = nn.Parameter(torch.zeros(rank, c))
        self.gate_up = nn.Parameter(torch.zeros(hk * d, rank))
        self.gate_bias = nn.Parameter(self._convert_bias() if self.convert_init else torch.zeros(hk * d))
        self.build_output()

    def _convert_bias(self) -> torch.Tensor:
        d = self.shape.head_dim
        lives = (float(self.spec["half_life_min"]), float(self.spec["half_life_max"]))
        return half_life_gate_bias(d, self.temperature, *lives).repeat(self.shape.num_kv_heads)

    def init_parameters(self, init: Any) -> None:
        """See the module docstring (``init`` skips loaded parameters)."""
        gated = [self.gate_down, self.gate_up, *self.output_input_weights().values()]
        if not self.convert_init:
            for param in gated:
                init.xavier_uniform_(param, gain=2**-2.5)
            init.zeros_(self.gate_bias)
            return
        for param in gated:
            if param is self.gate_up:
                init.zeros_(param)
            else:
                init.normal_(param, 0.0, self.initializer_range)
        init.copy_(self.gate_bias, self._convert_bias().to(self.gate_bias))

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scaled grouped queries [B, Hkv, G, T, D], keys [B, Hkv, T, D] and log gates [B, Hkv, T, D], the keys
        and log gates zero on padded tokens."""
        x = inputs.hidden_states
        b, t, _ = x.shape
        low_rank = inputs.linear("gate_down", self.gate_down)
        logits = head_gate_logits(low_rank, self.gate_up, self.gate_bias)
        log_a = (F.logsigmoid(logits) / self.temperature).view(b, t, self.shape.num_kv_heads, -1).transpose(1, 2)
        mask = inputs.token_mask
        if mask is not None:
            keep = mask[:, None, :, None]
            log_a = log_a.masked_fill(~keep, 0.0)
            k = k * keep.to(k.dtype)
        return group_queries(q, self.shape.num_kv_heads) * self.scale, k, log_a

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The gate's low-rank down projection and the output gate, both read from the layer input."""
        return {"gate_down": self.gate_down, **self.output_input_weights()}

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        qg, k, log_a = self._prepare(q, k, inputs)
        return self.finish_output(gla_parallel(qg, k, v, log_a), inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, k, log_a = self._prepare(q, k, inputs)
        o, S = gla_chunked(qg, k, v, log_a, state["S"], self.chunk_size)
        return self.finish_output(o, inputs), {"S": S}

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, k, log_a = self._prepare(q, k, inputs)
        o, S = gla_step(qg, k, v, log_a, state["S"], in_place=writable(state["S"]))
        return self.finish_output(o, inputs), {"S": S}

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        return {"S": torch.zeros(batch_size, hk, d, d, device=device, dtype=state_dtype(dtype))}

    def state_size(self, context_length: int) -> int:
        return self.shape.num_kv_heads * self.shape.head_dim * self.shape.head_dim
