"""The mixer contract shared by every attention family.

A mixer receives projected (and rotary-embedded) queries, keys and values and returns the per-head output.
It offers up to three forms of the same function:

* ``parallel(q, k, v, inputs)``: the whole sequence at once (training / prefill, may be quadratic);
* ``chunked(q, k, v, inputs, state)``: chunkwise state passing, sub-quadratic, returns the final state;
* ``step(q, k, v, inputs, state)``: one token, fixed-size state in, state out.

States are plain ``dict[str, Tensor]`` whose leading dimension is the batch, so the cache can reorder,
repeat and select them without knowing the family. Shapes: ``q`` is ``[B, H, T, D]``, ``k`` and ``v`` are
``[B, Hkv, T, D]``; every form returns ``[B, T, H, E]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .options import Option, resolve_options

State = dict[str, torch.Tensor]
#: a parameter key of a composite mixer (relative to the mixer, e.g. "far.feature_map.q_weight") -> its key in one
#: of the mixer's variants, or None where the variant has no place for it
KeyMap = Callable[[str], "str | None"]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of an accumulating state (a running sum over every token seen): at least float32.

    A bfloat16 sum of thousands of outer products would drop each new token's contribution below its 8-bit
    mantissa, so recurrent states stay float32 in half-precision models; the ops cast their inputs up to the
    state's dtype. KV caches, windows and convolution buffers hold copies of inputs and keep the model's dtype.
    """
    return torch.promote_types(dtype, torch.float32)


def writable(*tensors: torch.Tensor) -> bool:
    """True when a decode step may update these state tensors in place (a fixed buffer, no new tensor per token).

    Only with autograd off, and only for plain tensors that the cache owns: not views, not tensors that require
    grad, and no inference tensors outside inference mode. A caller that needs a state after the step has run
    must clone it first (the cache hands each state to exactly one step).
    """
    if torch.is_grad_enabled():
        return False
    inference = torch.is_inference_mode_enabled()
    return all(not t.requires_grad and t._base is None and (inference or not t.is_inference()) for t in tensors)

COMMON_OPTIONS: dict[str, Option] = {
    "rope": Option((bool,), True, "apply rotary position embeddings to q and k before the mixer"),
}


@dataclass
class MixerInputs:
    """What a mixer may read besides q, k and v."""

    hidden_states: torch.Tensor  # [B, T, C] the (normed) layer input, for gates and projections
    padding_mask: torch.Tensor | None = None  # [B, past + T] bool, True marks real tokens; None: all real
    past_length: int = 0  # tokens already folded into the state
    #: the mixer's own input products computed with q/k/v (decode layout), by the weight's name in
    #: ``Mixer.input_weights``; see ``linear``
    projected: dict[str, torch.Tensor] | None = None
    #: the caller wants the attention weights (``output_attentions``); a mixer with ``has_attention_weights``
    #: then puts them [B, H, T, keys] in ``attention_probs``
    output_attentions: bool = False
    attention_probs: torch.Tensor | None = None

    def linear(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """hidden_states @ weight.T for the mixer's input weight ``name``: the layer's product when it has it,
        else computed here."""
        if self.projected is not None and name in self.projected:
            return self.projected[name]
        return F.linear(self.hidden_states, weight.to(self.hidden_states.dtype))

    @property
    def token_mask(self) -> torch.Tensor | None:
        """[B, T] bool mask of the current tokens, or None when every token is real."""
        if self.padding_mask is None:
            return None
        return self.padding_mask[:, -self.hidden_states.shape[1] :]


@dataclass(frozen=True)
class MixerShape:
    """Sizes a mixer is built for."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_idx: int

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


class Mixer(nn.Module):
    """Base class: subclasses set ``name``, ``options``, ``state_kind`` and implement the forms."""

    name: ClassVar[str]
    options: ClassVar[dict[str, Option]] = {}
    #: "kv" (grows with context), "window" (bounded) or "recurrent" (fixed size)
    state_kind: ClassVar[str] = "recurrent"
    #: whether the mixer can return softmax attention weights over the keys it attends to (``output_attentions``)
    has_attention_weights: ClassVar[bool] = False
    has_chunked: ClassVar[bool] = False
    #: whether the mixer caps its attention logits by ``config.attn_logit_softcapping`` (the config refuses the
    #: option where a layer's mixer does not)
    applies_softcap: ClassVar[bool] = False
    #: for a family whose ``causal`` option must stay True (no bidirectional form): the reason the error gives
    causal_only: ClassVar[str | None] = None
    #: options that, when nonzero, keep exact softmax keys at any distance back beside a bounded reach (e.g. the
    #: hybrid's attention sinks and exact cache; see ``position_need``); none by default
    distant_key_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__()
        self.spec = dict(spec)
        self.shape = shape
        #: the family's compiled ``step`` (``compiled_step.compile_decode``), or None for the eager one
        self.compiled_step: Any = None
        self.config = config

    # ----- spec handling -------------------------------------------------------------------------------
    @classmethod
    def all_options(cls) -> dict[str, Option]:
        return {**COMMON_OPTIONS, **cls.options}

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        """Cross-option checks; raise ValueError naming `where` and the option."""

    @classmethod
    def validate(cls, spec: dict[str, Any], where: str) -> dict[str, Any]:
        return resolve_options(spec, cls.all_options(), where, cls._checks)

    @classmethod
    def _checks(cls, spec: dict[str, Any], where: str) -> None:
        if cls.causal_only is not None and not spec.get("causal", True):
            raise ValueError(f"{where}: option 'causal' must be True {cls.causal_only}")
        cls.check_spec(spec, where)

    # ----- the contract ---------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        raise NotImplementedError

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        """Default for families without a chunked form: the recurrent step, token by token (exact, slow).

        Prefill with a cache always comes here, so every mixer with a ``step`` can generate.
        """
        t = q.shape[2]
        outs = []
        for i in range(t):
            mask = inputs.padding_mask
            one = replace(
                inputs,
                hidden_states=inputs.hidden_states[:, i : i + 1],
                padding_mask=None if mask is None else mask[:, : mask.shape[1] - t + i + 1],
                past_length=inputs.past_length + i,
                projected=None,  # products of all T tokens: the step computes its own
            )
            out, state = self.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], one, state)
            outs.append(out)
        return torch.cat(outs, dim=1), state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        raise NotImplementedError

    def state_size(self, context_length: int) -> int:
        """Number of state elements per sequence held after `context_length` tokens."""
        raise NotImplementedError

    def backward_numbers(self, tokens: int) -> int:
        """Numbers per sequence of ``tokens`` that the training form keeps for the backward beyond the layer's q, k,
        v and output (stage 2's memory estimate, conversion/memory.py): none by default, where they are of that
        order."""
        return 0

    def input_weights(self) -> dict[str, nn.Parameter]:
        """Weights [out, hidden] this mixer multiplies the layer input by (bias-free, read through
        ``MixerInputs.linear`` under these names): the decode layout computes them in the layer's q/k/v product.
        None by default."""
        return {}

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        """transformers' name for a layer with this (validated) spec, for ``config.layer_types``: a recurrent
        state by default ("linear_attention")."""
        return "linear_attention"

    @classmethod
    def softmax_reach(cls, spec: dict[str, Any]) -> str | None:
        """How far back this layer's exact softmax logits (a query against each key, e^{q.k}) reach, for the
        (validated) ``spec``: "context" (every earlier key: a KV cache), "window" (a span of fixed length) or None
        (no exact logits: a recurrent state). By default from ``state_kind``: "kv", "window", "recurrent"."""
        return {"kv": "context", "window": "window"}.get(cls.state_kind)

    @classmethod
    def position_need(cls, spec: dict[str, Any]) -> str | None:
        """Why a layer with this (validated) spec needs positions, i.e. supports sequences only up to
        ``max_position_embeddings``, or None when it runs at any length (see docs/conversion.md).

        The rule: a layer needs positions where an exact softmax logit compares, through RoPE, a query with a key
        at a distance back that grows with the context: there it meets rotation angles the teacher never saw past
        its context (what makes a softmax model fail beyond it). So with ``rope`` on: a "context" reach
        (``softmax_reach``), or a key kept at any distance back beside a window (``distant_key_options``: sinks,
        an exact cache). A window (distance < its length), a recurrent state (no exact logits; what it makes of
        rotated q and k is a learned function whose long-context quality the probes measure) and a layer without
        RoPE (NoPE, ALiBi, FoX, PaTH) do not. A composite's parts (options whose value is a spec: a hybrid's
        ``far``) are asked by ``registry.position_need``."""
        if not spec.get("rope", True):
            return None
        if cls.softmax_reach(spec) == "context":
            return "its exact softmax compares each query with every earlier key through RoPE"
        for name in cls.distant_key_options:
            if spec.get(name):
                return (f"option '{name}'={spec[name]} keeps exact softmax keys at any distance back, compared "
                        "through RoPE")
        return None

    @classmethod
    def variants(cls, spec: dict[str, Any]) -> dict[str, tuple[dict[str, Any], KeyMap]]:
        """A composite's named parts as mixers of their own, for the (validated) ``spec``: variant name ->
        (the variant's spec, the map of this mixer's parameter keys to the variant's). Conversion evaluates a
        model built from each variant with the composite's trained weights. None by default."""
        return {}

    def rollback_problem(self) -> str | None:
        """Why this layer's cache cannot drop its newest tokens (``cache.crop``, which assisted generation needs), or
        None: a key/value cache can, any state that has absorbed its tokens cannot."""
        if self.state_kind == "kv":
            return None
        return f"it keeps a {self.state_kind} state, which has absorbed its tokens and cannot give them back"

    def tensor_parallel_problem(self) -> str | None:
        """Why this mixer cannot run under the tensor-parallel plan (q/k/v split by heads across ranks, see
        ``RecAttnForCausalLM._tp_plan``), or None when it can. By default it cannot: its own per-head parameters and
        state sizes follow the full head count, and the plan does not split them."""
        return "its per-head parameters and state are sized for all heads and the plan does not split them"

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs) -> torch.Tensor | None:
        """[B, H, T, T]: how much of each key's value goes into each query's output, for mixers whose output is
        a weighted mean of the values (rows sum to 1, less what a learned sink takes); None for the others
        (the default). Stage 1 of conversion can match these to the teacher's softmax weights."""
        return None

    def log_attention_weights(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor | None:
        """[B, H, T, T] float32: the log of the softmax attention weights of a fresh sequence, for softmax-family
        mixers; None for the others (the default). Stage 1 of conversion matches a student's weights to these."""
        return None

    # ----- dispatch --------------------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        inputs: MixerInputs,
        state: State | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, State | None]:
        """Pick the form: parallel or chunked without a cache, chunked prefill or one step with one.

        A bidirectional layer (``causal=False``) runs a whole fresh sequence in parallel form, cache or not
        (e.g. the default ``use_cache=True`` of a training forward), and refuses to continue one.
        """
        seq_len = q.shape[2]
        if not self.is_causal_mixer:
            if inputs.past_length > 0:
                self.require_causal("recurrent")
            return self.parallel(q, k, v, inputs), None
        if not use_cache and state is None:
            long_sequence = seq_len > self.spec.get("chunk_size", seq_len)
            if self.has_chunked and long_sequence:
                out, _ = self.chunked(q, k, v, inputs, self.init_state(q.shape[0], q.device, q.dtype))
                return out, None
            return self.parallel(q, k, v, inputs), None
        if state is None:
            state = self.init_state(q.shape[0], q.device, q.dtype)
        if seq_len == 1:
            if self.compiled_step is not None:
                return self.compiled_step(self, q, k, v, inputs, state)
            return self.step(q, k, v, inputs, state)
        return self.chunked(q, k, v, inputs, state)

    @property
    def is_causal_mixer(self) -> bool:
        return bool(self.spec.get("causal", True))

    def require_causal(self, form: str) -> None:
        """Raise a clear error when a bidirectional layer is asked for a causal-only form."""
        if not self.is_causal_mixer:
            raise ValueError(
                f"layer {self.shape.layer_idx} ({self.name}): causal=False has no {form} form; "
                "a bidirectional layer cannot be decoded token by token"
            )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.spec.items() if k != "mixer")


class ContinuingMixer(Mixer):
    """A mixer whose forms are one function of the new tokens and the cached state, ``_run``: without a state it
    is the parallel form; with one, a prefill or a decode step continues from it (KV-cache families)."""

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State | None
    ) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        return self._run(q, k, v, inputs, None)[0]

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        return self._run(q, k, v, inputs, state)

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        return self._run(q, k, v, inputs, state)


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, Hkv, G, T, D]: the query heads that share one key/value head."""
    b, h, t, d = q.shape
    return q.view(b, num_kv_heads, h // num_kv_heads, t, d)


def ungroup_output(o: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, T, E] -> [B, T, H, E]."""
    b, hk, g, t, e = o.shape
    return o.reshape(b, hk * g, t, e).transpose(1, 2)
