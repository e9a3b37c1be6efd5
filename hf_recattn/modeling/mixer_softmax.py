"""Softmax attention (full and sliding window) through transformers' attention interface, with optional forgetting.

Their "state" is the key/value cache: all past keys for ``softmax``, the last ``window - 1`` for
``sliding_window`` (with the current token that makes ``window`` visible keys).

``forget`` adds the summed log forget factors between key and query to the logits (Su, "A Brief History of Linear
Attention", kexue.fm/archives/11033, eq. 22):

    logit_ij = s q_i . k_j + c_i - c_j,    c_t = sum_{u <= t} log f_u,   one f per query head,

* ``alibi``: log f = -m_h, fixed slopes m_h = 2^(-8h/H), h = 1..H (H a power of two; otherwise the ALiBi
  paper's rule: the slopes of the largest power of two below H, then every other slope of twice that), or
  ``alibi_slopes`` given explicitly (Press et al. 2022);
* ``fox``: f_t = sigmoid(w_h . x_t / sqrt(C) + b_h) from the layer input x (C channels), the Forgetting
  Transformer's data-dependent gate (Lin et al. 2025). w starts at 0 and b at ``fox_bias_init``; the default 18
  rounds sigmoid(b) to exactly 1.0 in fp32 (log f = -1.5e-8 per token), so a softmax checkpoint converts
  losslessly and the gate then learns to forget.

Padded tokens have f = 1 (they add nothing to c) and are invisible as keys. The cache keeps, beside the keys
and values, ``forget``: c of every cached key per query head ``[B, H, T]`` in float32 (float64 for float64
models), rebased so that the newest cached key has c = 0 (bounded values; a crop stays exact).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as capped_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from .mixer_base import Mixer, MixerInputs, MixerShape, State
from .options import Option

SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa")
FORGETS = ("none", "alibi", "fox")
#: FoX gate bias at initialization: sigmoid(18) rounds to 1.0 in fp32 (log f = -1.52e-8 per token)
FOX_LOSSLESS_BIAS = 18.0

FORGET_OPTIONS: dict[str, Option] = {
    "forget": Option(
        (str,),
        "none",
        "add the summed log forget factors between key and query to the logits: none, alibi (fixed slopes "
        "per head) or fox (a learned gate sigmoid(w.x + b) per head)",
        choices=FORGETS,
    ),
    "alibi_slopes": Option(
        (list,),
        None,
        "alibi: one slope (>= 0, log f = -slope) per query head; None: 2^(-8h/H), h = 1..H",
        nullable=True,
    ),
    "fox_bias_init": Option(
        (float,),
        None,
        f"fox: the gate bias b at initialization (w starts at 0); None: {FOX_LOSSLESS_BIAS:g}, f = 1 in fp32 "
        "(lossless conversion of a softmax checkpoint)",
        nullable=True,
    ),
}


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's geometric slopes: 2^(-8h/n), h = 1..n, for the power of two n nearest below ``num_heads``,
    then every other slope of 2n until there are ``num_heads``."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    base = 2 ** int(math.floor(math.log2(num_heads)))
    return geometric(base) + geometric(2 * base)[0::2][: num_heads - base]


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


def _forget_dtype(dtype: torch.dtype) -> torch.dtype:
    """Cumulative log-forget is kept in float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class SoftmaxMixer(Mixer):
    """Exact softmax attention (optionally with ALiBi or FoX forgetting); eager or sdpa.

    Paper: Vaswani et al., "Attention Is All You Need", arXiv:1706.03762.

    Options from other papers:

    * ``forget="alibi"``: Press, Smith & Lewis, "Train Short, Test Long: Attention with Linear Biases Enables
      Input Length Extrapolation", arXiv:2108.12409;
    * ``forget="fox"``: Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate",
      arXiv:2503.02130.

    The forget bias follows Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033, eq. 22.
    """

    name = "softmax"
    options: dict[str, Option] = dict(FORGET_OPTIONS)
    state_kind = "kv"
    has_attention_weights = True
    #: applies ``config.attn_logit_softcapping`` (Gemma 2) to its logits; the config refuses it for other mixers
    applies_softcap = True
    window: int | None = None

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        slopes = spec["alibi_slopes"]
        if slopes is not None:
            if spec["forget"] != "alibi":
                raise ValueError(f"{where}: option 'alibi_slopes' needs forget='alibi', got {spec['forget']!r}")
            for s in slopes:
                number = isinstance(s, (int, float)) and not isinstance(s, bool)
                if not number or not math.isfinite(s) or s < 0:
                    raise ValueError(
                        f"{where}: option 'alibi_slopes' takes finite numbers >= 0 (log f = -slope), got {s!r}"
                    )
            spec["alibi_slopes"] = [float(s) for s in slopes]
        bias = spec["fox_bias_init"]
        if bias is not None:
            if spec["forget"] != "fox":
                raise ValueError(f"{where}: option 'fox_bias_init' needs forget='fox', got {spec['forget']!r}")
            if not math.isfinite(bias):
                raise ValueError(f"{where}: option 'fox_bias_init' must be finite, got {bias!r}")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.num_key_value_groups = shape.groups
        self.is_causal = True
        self.scaling = shape.head_dim**-0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self.forget = spec.get("forget", "none")
        if self.forget == "alibi":
            slopes = spec.get("alibi_slopes") or alibi_slopes(shape.num_heads)
            if len(slopes) != shape.num_heads:
                raise ValueError(
                    f"layer {shape.layer_idx} ({self.name}): option 'alibi_slopes' has {len(slopes)} slopes "
                    f"for {shape.num_heads} query heads"
                )
            self.slopes = [float(s) for s in slopes]
        elif self.forget == "fox":
            bias = spec.get("fox_bias_init")
            self.fox_bias_init = FOX_LOSSLESS_BIAS if bias is None else float(bias)
            # plain parameters, not nn.Linear: the model's generic Linear init must not touch them
            self.fox_weight = nn.Parameter(torch.zeros(shape.num_heads, shape.hidden_size))
            self.fox_bias = nn.Parameter(torch.full((shape.num_heads,), self.fox_bias_init))

    def init_parameters(self, init: Any) -> None:
        """FoX gate: weights 0, biases ``fox_bias_init`` (``init`` skips loaded ones)."""
        if self.forget == "fox":
            init.zeros_(self.fox_weight)
            init.constant_(self.fox_bias, self.fox_bias_init)

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        return "sliding_attention" if cls.window is not None or "window" in spec else "full_attention"

    def tensor_parallel_problem(self) -> str | None:
        """Plain softmax works on whatever heads a rank holds; forget factors are per-head parameters."""
        if self.forget == "none":
            return None
        return f"forget={self.forget!r} keeps one factor per query head, which the plan does not split"

    # ----- helpers ------------------------------------------------------------------------------------------
    def _implementation(self) -> str:
        impl = getattr(self.config, "_attn_implementation", None) or "sdpa"
        if impl not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(
                f"layer {self.shape.layer_idx} ({self.name}): attn_implementation {impl!r} is not supported; "
                f"use one of {SUPPORTED_IMPLEMENTATIONS}"
            )
        return impl

    def log_forget(self, inputs: MixerInputs) -> torch.Tensor | None:
        """log f of the current tokens, [B, H, T] (float32 or float64), 0 at padded tokens; None without forget."""
        if self.forget == "none":
            return None
        x = inputs.hidden_states
        dtype = _forget_dtype(x.dtype)
        b, t, _ = x.shape
        if self.forget == "alibi":
            slopes = torch.tensor(self.slopes, dtype=dtype, device=x.device)
            out = (-slopes)[None, :, None].expand(b, -1, t)
        else:
            weight = self.fox_weight.to(dtype) * x.shape[-1] ** -0.5
            out = F.logsigmoid(F.linear(x.to(dtype), weight, self.fox_bias.to(dtype))).transpose(1, 2)
        mask = inputs.token_mask
        if mask is not None:
            out = out.masked_fill(~mask.bool()[:, None, :], 0.0)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        inputs: MixerInputs,
        num_past_keys: int,
        forget: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``forget``: (c of the queries [B, H, Tq], c of the keys [B, H, Tk]) on a common baseline."""
        impl = self._implementation()
        if inputs.output_attentions or self.softcap is not None:
            impl = "eager"  # the one implementation that computes the weights (or caps the logits): same function
        t = q.shape[2]
        past = inputs.past_length
        needs_mask = (
            impl == "eager"
            or forget is not None
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
            visible = softmax_visibility(qpos, kpos, real, self.window)
            lowest = torch.finfo(q.dtype).min
            if forget is not None:
                query_c, key_c = forget
                bias = (query_c[..., :, None] - key_c[..., None, :]).to(q.dtype)
                mask = bias.masked_fill(~visible, lowest)
            elif impl == "eager":
                mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, lowest)
            else:
                mask = visible
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        capped = {}
        if self.softcap is not None:  # cap * tanh(logits / cap) before the mask, as Gemma 2
            interface, capped = capped_attention_forward, {"softcap": self.softcap}
        out, weights = interface(
            self,
            q,
            keys,
            values,
            mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **capped,
        )
        if inputs.output_attentions:
            inputs.attention_probs = weights
        return out

    def log_attention_weights(self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        """[B, H, T, T] float32: the log of the weights ``parallel`` attends with, computed in float32: q.k scaled,
        soft-capped, the forget bias added, keys outside the causal window (or padded) at -inf."""
        b, h, t, d = q.shape
        kv_heads = k.shape[1]
        grouped = (b, kv_heads, h // kv_heads, t)
        logits = q.float().view(*grouped, d) @ k.float()[:, :, None].transpose(-1, -2) * self.scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        log_f = self.log_forget(inputs)
        if log_f is not None:
            c = log_f.cumsum(-1).float().view(grouped)
            logits = logits + (c[..., :, None] - c[..., None, :])
        positions = torch.arange(t, device=q.device)
        visible = softmax_visibility(positions, positions, inputs.token_mask, self.window)[:, :, None]
        return logits.masked_fill(~visible, float("-inf")).log_softmax(-1).view(b, h, t, t)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        """The softmax weights themselves (float32)."""
        return self.log_attention_weights(q, k, inputs).exp()

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        log_f = self.log_forget(inputs)
        forget = None
        if log_f is not None:
            c = log_f.cumsum(-1)
            forget = (c, c)
        return self._attend(q, k, v, inputs, num_past_keys=0, forget=forget)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        # an empty state takes the new keys as they are (their head count may be a tensor-parallel rank's share)
        keys = torch.cat([state["k"], k], dim=2) if state["k"].shape[2] else k
        values = torch.cat([state["v"], v], dim=2) if state["v"].shape[2] else v
        new = {"k": keys, "v": values}
        log_f = self.log_forget(inputs)
        forget = None
        if log_f is not None:
            past_c = state["forget"]
            if past_c.shape[-1] > 0:  # rebase on the newest cached key (exact after a crop too)
                past_c = past_c - past_c[..., -1:]
            query_c = log_f.cumsum(-1)
            key_c = torch.cat([past_c.to(query_c.dtype), query_c], dim=-1)
            forget = (query_c, key_c)
            new["forget"] = key_c - query_c[..., -1:]
        out = self._attend(q, keys, values, inputs, num_past_keys=state["k"].shape[2], forget=forget)
        return out, self._keep(new)

    step = chunked

    def _keep(self, state: State) -> State:
        return state

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        shape = (batch_size, self.shape.num_kv_heads, 0, self.shape.head_dim)
        state = {
            "k": torch.zeros(shape, device=device, dtype=dtype),
            "v": torch.zeros(shape, device=device, dtype=dtype),
        }
        if self.forget != "none":
            state["forget"] = torch.zeros(
                batch_size, self.shape.num_heads, 0, device=device, dtype=_forget_dtype(dtype)
            )
        return state

    def _per_token(self) -> int:
        """State elements per cached token: key and value per KV head, plus c per query head with forget."""
        extra = self.shape.num_heads if self.forget != "none" else 0
        return 2 * self.shape.num_kv_heads * self.shape.head_dim + extra

    def state_size(self, context_length: int) -> int:
        return self._per_token() * context_length


class SlidingWindowMixer(SoftmaxMixer):
    """Softmax over the last ``window`` tokens (the current one included), optionally with forgetting.

    Paper: sliding-window (local) attention as in Beltagy, Peters & Cohan, "Longformer: The Long-Document
    Transformer", arXiv:2004.05150. ``forget`` as in ``softmax``: ALiBi (arXiv:2108.12409) or FoX
    (arXiv:2503.02130).
    """

    name = "sliding_window"
    options = {
        "window": Option((int,), 64, "visible keys per query, the current token included", minimum=1),
        **FORGET_OPTIONS,
    }
    state_kind = "window"

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.window = int(spec["window"])

    def _keep(self, state: State) -> State:
        """The last ``window - 1`` keys, values (and their c): tokens on axis 2 of every tensor."""
        keep = self.window - 1
        start = max(state["k"].shape[2] - keep, 0)
        return {name: t[:, :, start:].contiguous() for name, t in state.items()}

    def state_size(self, context_length: int) -> int:
        return self._per_token() * min(context_length, self.window - 1)
