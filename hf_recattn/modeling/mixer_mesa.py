"""MesaNet (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eq. 35; von Oswald et al. 2025,
arXiv:2506.05233): the closed-form least-squares read of a gated linear state.

Per key head, two states with a forget gate gamma_t and an input gate beta_t read from the layer input x_t:

    G_t = gamma_t G_{t-1} + beta_t v_t k_t^T,      H_t = gamma_t H_{t-1} + beta_t k_t k_t^T,
    o_t = G_t (H_t + Lambda)^-1 q_t

(ops_mesa.py stores G as keys x values). Choices, following the MesaNet paper and fla's MesaNet layer:

* gates: gamma_t = sigmoid(W_f x_t / sqrt(C) + c_f), beta_t = sigmoid(W_b x_t / sqrt(C) + c_b), one of each per
  key head (the gates read x / sqrt(C) as the delta family's do; ``scratch`` scales W up by sqrt(C), so the logits
  start as N(0, initializer_range) logits of x with zero biases, as fla's plain nn.Linear gates);
* Lambda = softplus(lambda_param) + ``lambda_min`` per query head and key dimension, lambda_param initialized so
  that Lambda = ``lambda_init`` (fla: lower bound 0.25, initial value 1). Lambda is read-side only, so each query
  head of a GQA group solves its own system against the shared H of its key head;
* a short causal convolution (``conv_size`` taps) on q and k only, then SiLU, then L2-normalized q and k (no query
  scale); v passes unchanged; an RMSNorm per head on the output, optionally times silu(W_g x) (``output_gate``);
* ``solver``: ``cg`` runs ``cg_steps`` Jacobi-preconditioned conjugate-gradient steps (the paper's training
  solver, 30 steps in fla), ``exact`` a Cholesky solve. Every form (parallel, chunked, step) uses the same
  solver, so a model gives the same outputs with and without a cache whichever is chosen.

Padded tokens leave both states untouched (beta = 0, no decay, zeroed convolution inputs). No bidirectional form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gated_parts import (
    QK_NORMS,
    GatedMixer,
    chunk_options,
    conv_options,
    convert_init_options,
    head_gate_logits,
    logit,
    output_options,
    qk_norm,
)
from .mixer_base import MixerInputs, MixerShape, State, group_queries, state_dtype, writable
from .ops_mesa import SOLVERS, MesaOperands, mesa_chunked, mesa_parallel, mesa_step
from .options import Option
from .short_conv import ShortConvolution, convolve_streams


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class MesaMixer(GatedMixer):
    """MesaNet: gated states G and H per key head, read as G (H + Lambda)^-1 q (conjugate gradients or exact).

    Paper: von Oswald et al., "MesaNet: Sequence Modeling by Locally Optimal Test-Time Training",
    arXiv:2506.05233.

    The equations follow Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033 (eq. 35).
    """

    name = "mesa"
    options = {
        "solver": Option((str,), "cg", "linear solve of every form: cg (conjugate gradients) or exact (Cholesky)",
                         choices=SOLVERS),
        "cg_steps": Option((int,), 30, "solver=cg: conjugate-gradient steps per token", minimum=0),
        "lambda_min": Option((float,), 0.25, "lower bound of the regularizer Lambda", minimum=1e-6),
        "lambda_init": Option((float,), 1.0, "initial Lambda (above lambda_min)", minimum=1e-6),
        **conv_options("q and k"),
        "qk_norm": Option((str,), "l2", "normalization of q and k", choices=QK_NORMS),
        **output_options(gate=False),
        **convert_init_options("identity convolution, input-independent gates", "forget", "input gate beta"),
        **chunk_options("q/k and output norms"),
        "causal": Option((bool,), True, "must be True: MesaNet has no bidirectional form"),
    }
    state_kind = "recurrent"
    has_chunked = True

    causal_only = "for mixer 'mesa' (no bidirectional form)"

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if spec["lambda_init"] <= spec["lambda_min"]:
            raise ValueError(
                f"{where}: option 'lambda_init' ({spec['lambda_init']}) must be above 'lambda_min' "
                f"({spec['lambda_min']})"
            )
        super().check_spec(spec, where)

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        h, hk, d, c = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.solver = spec["solver"]
        self.cg_steps = int(spec["cg_steps"])
        self.lambda_min = float(spec["lambda_min"])
        # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
        self.forget_weight = nn.Parameter(torch.zeros(hk, c))
        self.forget_bias = nn.Parameter(torch.zeros(hk))
        self.beta_weight = nn.Parameter(torch.zeros(hk, c))
        self.beta_bias = nn.Parameter(torch.zeros(hk))
        self.lambda_param = nn.Parameter(torch.zeros(h, d))
        size = int(spec["conv_size"])
        channels = {"conv_q": h * d, "conv_k": hk * d}
        self.convs = nn.ModuleDict(
            {name: ShortConvolution(n, size, self.convert_init) for name, n in channels.items()} if size else {}
        )
        self.build_output()

    def init_parameters(self, init: Any) -> None:
        """Lambda = lambda_init. scratch: gate weights N(0, initializer_range) as logits of x, zero biases (gates
        start near 1/2); convert: zero gate weights, forget half-lives log-uniform over the key heads from
        half_life_min to half_life_max, beta = beta_init. The output gate: N(0, initializer_range)."""
        init.constant_(self.lambda_param, _inverse_softplus(self.spec["lambda_init"] - self.lambda_min))
        hk = self.forget_bias.numel()
        if self.convert_init:
            init.zeros_(self.forget_weight)
            init.zeros_(self.beta_weight)
            lo, hi = self.spec["half_life_min"], self.spec["half_life_max"]
            lives = [math.sqrt(lo * hi)] if hk == 1 else [lo * (hi / lo) ** (i / (hk - 1)) for i in range(hk)]
            biases = torch.tensor([logit(0.5 ** (1.0 / life)) for life in lives], device=self.forget_bias.device)
            init.copy_(self.forget_bias, biases.to(self.forget_bias.dtype))
            init.constant_(self.beta_bias, logit(self.spec["beta_init"]))
        else:
            std = self.initializer_range * math.sqrt(self.forget_weight.shape[1])  # logits of x / sqrt(C)
            init.normal_(self.forget_weight, 0.0, std)
            init.normal_(self.beta_weight, 0.0, std)
            init.zeros_(self.forget_bias)
            init.zeros_(self.beta_bias)
        self.init_output_gate(init, self.initializer_range)

    def regularizer(self) -> torch.Tensor:
        """Lambda [Hk, G, D], positive: softplus(lambda_param) + lambda_min."""
        lam = F.softplus(self.lambda_param) + self.lambda_min
        return lam.view(self.shape.num_kv_heads, self.shape.groups, -1)

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _gates(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log gamma, beta), each [B, Hk, T]; log gamma = 0 and beta = 0 on padded tokens."""
        x = x * x.shape[-1] ** -0.5
        log_gamma = F.logsigmoid(head_gate_logits(x, self.forget_weight, self.forget_bias))
        beta = torch.sigmoid(head_gate_logits(x, self.beta_weight, self.beta_bias))
        if mask is not None:
            keep = mask[..., None].to(x.dtype)
            log_gamma, beta = log_gamma * keep, beta * keep
        return log_gamma.transpose(1, 2), beta.transpose(1, 2)

    def _prepare(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, torch.Tensor, State]:
        """Convolved, activated, normalized q [B, Hk, G, T, D] and k [B, Hk, T, D], and the convolution states."""
        b, h, t, d = q.shape
        hk = self.shape.num_kv_heads
        streams = {"conv_q": q.transpose(1, 2).reshape(b, t, h * d), "conv_k": k.transpose(1, 2).reshape(b, t, hk * d)}
        streams, new_state = convolve_streams(streams, self.convs, state, inputs.token_mask, self.spec["activation"])
        q = group_queries(streams["conv_q"].view(b, t, h, d).transpose(1, 2), hk)
        k = streams["conv_k"].view(b, t, hk, d).transpose(1, 2)
        kind = self.spec["qk_norm"]
        return qk_norm(q, kind, self.eps), qk_norm(k, kind, self.eps), new_state

    def _operands(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[MesaOperands, State]:
        """The ops' operands in the solves' dtype (float32 or more), and the new convolution states."""
        dtype = q.dtype
        work = dtype if dtype in (torch.float32, torch.float64) else torch.float32  # solves need fp32 or more
        qg, kd, new_state = self._prepare(q, k, inputs, state)
        log_gamma, beta = self._gates(inputs.hidden_states, inputs.token_mask)
        qg, kd, vd, log_gamma, beta = (y.to(work) for y in (qg, kd, v, log_gamma, beta))
        return MesaOperands(qg, kd, vd, log_gamma, beta, self.regularizer().to(work)), new_state

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The output gate, read from the layer input."""
        return self.output_input_weights()

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        operands, _ = self._operands(q, k, v, inputs, None)
        o, _, _ = mesa_parallel(operands, None, None, self.solver, self.cg_steps)
        return self.finish_output(o.to(q.dtype), inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        operands, new_state = self._operands(q, k, v, inputs, state)
        h0, g0 = state["H"].to(operands.q.dtype), state["G"].to(operands.q.dtype)
        o, h, g = mesa_chunked(operands, h0, g0, self.chunk_size, self.solver, self.cg_steps)
        new_state["H"], new_state["G"] = h.to(state["H"].dtype), g.to(state["G"].dtype)
        return self.finish_output(o.to(q.dtype), inputs), new_state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        operands, new_state = self._operands(q, k, v, inputs, state)
        h0, g0 = state["H"].to(operands.q.dtype), state["G"].to(operands.q.dtype)
        in_place = h0 is state["H"] and g0 is state["G"] and writable(h0, g0)
        o, h, g = mesa_step(operands, h0, g0, self.solver, self.cg_steps, in_place=in_place)
        new_state["H"], new_state["G"] = h.to(state["H"].dtype), g.to(state["G"].dtype)
        return self.finish_output(o.to(q.dtype), inputs), new_state

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        state = {
            "H": torch.zeros(batch_size, hk, d, d, device=device, dtype=state_dtype(dtype)),
            "G": torch.zeros(batch_size, hk, d, d, device=device, dtype=state_dtype(dtype)),
        }
        state.update({name: conv.init_state(batch_size, device, dtype) for name, conv in self.convs.items()})
        return state

    def state_size(self, context_length: int) -> int:
        """H (D x D) and G (D x E) per key head, plus the last W - 1 convolution inputs of q and k."""
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        return 2 * hk * d * d + sum(conv.channels * (conv.size - 1) for conv in self.convs.values())
