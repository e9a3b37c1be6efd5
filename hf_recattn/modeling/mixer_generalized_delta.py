"""RWKV-7's generalized delta rule as a mixer ("RWKV-7 'Goose' with Expressive Dynamic State Evolution", Peng et
al., arXiv:2503.14456; the reference definition is fla's ``RWKV7Attention`` layer with ``chunk_rwkv7``).

Per key head a state S [E, D] (values x keys; stored transposed, see ops_generalized_delta.py), with row vectors
per token:

    S_t = S_{t-1} (diag(w_t) - k^_t^T (a_t * k^_t)) + v_t^T k~_t,
    o_t = LayerNorm(S_t (scale q_t)^T)                  (times sigmoid(W_g x_t) with ``output_gate``)

* q, k, v are the layer's q / k / v projections (RoPE applied unless ``rope: false``): RWKV-7's receptance r is q,
  so a softmax teacher's projections carry over;
* decay w_t = exp(-e^{-1/2} sigmoid(w0 + tanh(x_t A_w) B_w)) in (e^{-e^{-1/2}}, 1) ~ (0.545, 1) per key dimension,
  from the layer input x through a low-rank map (A_w [C, r_w], B_w [r_w, Hkv D], ``decay_rank`` r_w);
* in-context learning rate a_t = sigmoid(a0 + x_t A_a B_a) in (0, 1) per key dimension (rank ``iclr_rank``);
* removal key k^_t = (k_t * k_k) / |k_t * k_k| per head (L2 norm, ``eps`` inside the root), k_k a learned gain;
* written key k~_t = k_t * (1 + (a_t - 1) * k_a), k_a a learned mix (k_a = 1: RWKV-7's k * a; k_a = 0: k).

That is RWKV-7's time-mixing recurrence with these parameterization choices (fla's layer otherwise): the decay
and the rate read the current token's layer input (no token shift: RWKV-7 interpolates each input with the previous
token's, which would add a buffer of the previous layer input to the state and has no counterpart in a teacher);
no value residual (v_first mixes values across layers, outside a per-layer mixer); no bonus term (r * k * r_k) v;
the output is normalized per head by a LayerNorm without bias (RWKV-7's GroupNorm with one group per head,
``output_norm``); the optional output gate sigmoid(W_g x_t) is full rank (``output_gate``: off, on in the ``rwkv7``
preset; RWKV-7's is low rank). With GQA the Hkv key heads hold the states (w, a, k^, k~ per key head) and
the G query heads of a group read their key head's state, as in the delta family. A padded token leaves the state
untouched (w = 1, a = 0, k~ = 0). ``causal=False`` is refused (a decayed state has a direction). As a ``hybrid``'s
far part it reads every token as it arrives and needs ``combine='sum'`` (far_part.py's ``ARRIVING``).

Initializations (``init``):

* ``scratch``, RWKV-7's (as fla's layer initializes it): A_w = A_a = 0, B_w and B_a orthogonal with gain 0.1,
  w0_j = 0.5 - 7 + 5 (j / (N - 1))^(0.85 + sqrt(l / (L - 1))) over the N = Hkv D key channels (layer l of L),
  a0 = 0 (a = 1/2), k_k = 0.85, k_a = 1;
* ``convert``, for distilling a softmax teacher: B_w = B_a = 0 (decay and rate start input-independent), A_w and A_a
  ~ N(0, initializer_range), w0 such that each head's D key dimensions have half-lives spread log-uniformly from
  ``half_life_min`` to ``half_life_max`` tokens, a0 such that a = ``beta_init``, k_k = 1, k_a = 0 (the teacher's
  keys are written unchanged). The layer then starts as decayed linear attention on the teacher's q, k, v with a
  delta-rule correction of strength ``beta_init``.

Both: W_g ~ N(0, initializer_range) (with a gate), the output norm's gains 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .decay import log_uniform_half_lives
from .far_part import ARRIVING, FarPart
from .gated_parts import (
    GatedMixer,
    chunk_options,
    convert_init_options,
    head_gate_logits,
    logit,
    output_options,
    qk_norm,
)
from .mixer_base import MixerInputs, MixerShape, State, group_queries, state_dtype, writable
from .ops_generalized_delta import MAX_DECAY_RATE, mask_padding, rwkv7_chunked, rwkv7_parallel, rwkv7_step
from .options import Option

#: the shortest half-life (tokens) w can have: ln 2 / e^{-1/2}
SHORTEST_HALF_LIFE = math.log(2.0) / MAX_DECAY_RATE


def half_life_decay_bias(dims: int, shortest: float, longest: float) -> torch.Tensor:
    """w0 [dims] giving w^life = 1/2 at B_w = 0 for half-lives log-uniform from ``shortest`` to ``longest``."""
    p = SHORTEST_HALF_LIFE / log_uniform_half_lives(dims, shortest, longest)  # sigmoid(w0)
    return torch.log(p / (1.0 - p)).float()


def scratch_decay_bias(channels: int, layer: int, layers: int) -> torch.Tensor:
    """RWKV-7's w0 over ``channels`` key channels of layer ``layer`` of ``layers``."""
    depth = layer / (layers - 1) if layers > 1 else 0.0
    position = torch.arange(channels, dtype=torch.float64) / max(channels - 1, 1)
    return (0.5 - 7.0 + 5.0 * position ** (0.85 + depth**0.5)).float()


class GeneralizedDeltaMixer(GatedMixer, FarPart):
    """RWKV-7's generalized delta rule: a state per key head with a vector decay and an in-context learning rate.

    Paper: Peng et al., "RWKV-7 'Goose' with Expressive Dynamic State Evolution", arXiv:2503.14456.
    """

    name = "generalized_delta"
    options = {
        "decay_rank": Option((int,), 64, "rank r_w of the decay's low-rank map tanh(x A_w) B_w", minimum=1),
        "iclr_rank": Option((int,), 64, "rank r_a of the in-context learning rate's map x A_a B_a", minimum=1),
        **output_options(gate=False, activation="sigmoid"),
        "scale": Option((float,), None, "query scale; None: head_dim ** -0.5", nullable=True, minimum=0.0),
        **convert_init_options("input-independent decay and rate, the teacher's keys written as they are", "decay",
                               beta="in-context learning rate a"),
        **chunk_options("key norm and the output norm"),
        "causal": Option((bool,), True, "must be True: a decayed state has no bidirectional form"),
    }
    options["output_norm"] = Option((bool,), True, "LayerNorm of each head's output (no bias, learnable gain)")
    state_kind = "recurrent"
    has_chunked = True
    causal_only = "for generalized_delta (a decayed state has a direction; there is no bidirectional form)"
    #: RWKV-7's GroupNorm with a group per head
    output_norm_kind = "layernorm"
    gate_activation = "sigmoid"
    #: as a hybrid's far part (far_part.py): every token as it arrives (its decay and rate read the token's own
    #: layer input), its output normalized on its own (combine='sum'); FarPart's defaults run its forms
    far_reads = ARRIVING

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if spec["half_life_min"] < SHORTEST_HALF_LIFE:
            raise ValueError(f"{where}: option 'half_life_min' must be >= {SHORTEST_HALF_LIFE:.4f} (ln 2 / e^(-1/2), "
                             f"the fastest RWKV-7's decay forgets), got {spec['half_life_min']!r}")
        super().check_spec(spec, where)

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        hk, d, c = shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.scale = d**-0.5 if spec["scale"] is None else float(spec["scale"])
        self.num_layers = int(getattr(config, "num_hidden_layers", 1))
        # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
        self.decay_down = nn.Parameter(torch.zeros(int(spec["decay_rank"]), c))  # A_w^T
        self.decay_up = nn.Parameter(torch.zeros(hk * d, int(spec["decay_rank"])))  # B_w^T
        self.decay_bias = nn.Parameter(torch.zeros(hk * d))  # w0
        self.iclr_down = nn.Parameter(torch.zeros(int(spec["iclr_rank"]), c))  # A_a^T
        self.iclr_up = nn.Parameter(torch.zeros(hk * d, int(spec["iclr_rank"])))  # B_a^T
        self.iclr_bias = nn.Parameter(torch.zeros(hk * d))  # a0
        self.key_gain = nn.Parameter(torch.ones(hk, d))  # k_k
        self.key_mix = nn.Parameter(torch.zeros(hk, d))  # k_a
        self.build_output()

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        """S [B, Hk, D (keys), E (values)], the paper's S transposed; float32 in a half-precision model."""
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        return {"S": torch.zeros(batch_size, hk, d, d, device=device, dtype=state_dtype(dtype))}

    def state_size(self, context_length: int) -> int:
        """Hk D^2, whatever the context."""
        return self.shape.num_kv_heads * self.shape.head_dim**2

    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        """Beside the hybrid's exact cache (cache_slots): the residual ``far_recall_error`` scores."""
        return None

    def far_recall_error(self, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        """||v - k^ S|| with the removal key k^ = (k * k_k) / |k * k_k|: what the update removes before it writes
        (the rate a and the written key read the layer input, gone when a cached pair is re-scored)."""
        S = state["S"]
        removal = qk_norm(k * self.key_gain[:, None].to(k.dtype), "l2", self.eps).to(S.dtype)
        return (v.to(S.dtype) - removal @ S).norm(dim=-1)

    def init_parameters(self, init: Any) -> None:
        """See the module docstring (``init`` skips loaded parameters)."""
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        self.init_output_gate(init, self.initializer_range)
        if not self.convert_init:
            for down, up in ((self.decay_down, self.decay_up), (self.iclr_down, self.iclr_up)):
                init.zeros_(down)
                init.orthogonal_(up, gain=0.1)
            decay_bias = scratch_decay_bias(hk * d, self.shape.layer_idx, self.num_layers)
            iclr_bias, key_gain, key_mix = 0.0, 0.85, 1.0
        else:
            for down, up in ((self.decay_down, self.decay_up), (self.iclr_down, self.iclr_up)):
                init.normal_(down, 0.0, self.initializer_range)
                init.zeros_(up)
            lives = (float(self.spec["half_life_min"]), float(self.spec["half_life_max"]))
            decay_bias = half_life_decay_bias(d, *lives).repeat(hk)
            iclr_bias, key_gain, key_mix = logit(float(self.spec["beta_init"])), 1.0, 0.0
        init.copy_(self.decay_bias, decay_bias.to(self.decay_bias))
        init.constant_(self.iclr_bias, iclr_bias)
        init.constant_(self.key_gain, key_gain)
        init.constant_(self.key_mix, key_mix)

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The down projections of the decay and of the in-context learning rate and the output gate, read from the
        layer input."""
        return {"decay_down": self.decay_down, "iclr_down": self.iclr_down, **self.output_input_weights()}

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> tuple[torch.Tensor, ...]:
        """Scaled grouped queries [B, Hk, G, T, D] and, per key head [B, Hk, T, D], the written keys, log w, the
        removal keys and a, padded tokens made no-ops."""
        x = inputs.hidden_states
        b, t, _ = x.shape
        hk, d = self.shape.num_kv_heads, self.shape.head_dim

        def per_head(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, hk, d).transpose(1, 2)

        low = torch.tanh(inputs.linear("decay_down", self.decay_down))
        decay_logits = head_gate_logits(low, self.decay_up, self.decay_bias)
        log_w = per_head(torch.sigmoid(decay_logits) * -MAX_DECAY_RATE)
        rate_logits = head_gate_logits(inputs.linear("iclr_down", self.iclr_down), self.iclr_up, self.iclr_bias)
        a = per_head(torch.sigmoid(rate_logits))
        removal = k * self.key_gain[:, None].to(k.dtype)
        removal = qk_norm(removal, "l2", self.eps)
        written = k * (1.0 + (a - 1.0) * self.key_mix[:, None].to(k.dtype))
        written, log_w, a = mask_padding(written, log_w, a, inputs.token_mask)
        return group_queries(q, hk) * self.scale, written, log_w, removal, a

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        qg, written, log_w, removal, a = self._prepare(q, k, inputs)
        start = self.init_state(q.shape[0], q.device, q.dtype)["S"]
        return self.finish_output(rwkv7_parallel(qg, written, v, log_w, removal, a, start)[0], inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, written, log_w, removal, a = self._prepare(q, k, inputs)
        o, S = rwkv7_chunked(qg, written, v, log_w, removal, a, state["S"], self.chunk_size)
        return self.finish_output(o, inputs), {"S": S}

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        qg, written, log_w, removal, a = self._prepare(q, k, inputs)
        o, S = rwkv7_step(qg, written, v, log_w, removal, a, state["S"], in_place=writable(state["S"]))
        return self.finish_output(o, inputs), {"S": S}
