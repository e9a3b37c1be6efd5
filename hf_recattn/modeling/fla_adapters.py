"""flash-linear-attention (fla) as the GPU kernels of the recurrent ops: one adapter from our layout to fla's.

fla (``pip install "hf-recattn[fla]"``, i.e. ``fla-core``) ships chunk kernels (training, prefill) and
fused-recurrent kernels (decode) for the recurrences below. ``backends.pick`` hands an op the fla function that
computes its recurrence (``HF_RECATTN_KERNELS``: ``auto`` on CUDA tensors, ``fla`` everywhere it can run); the op
calls ``run_fla`` / ``run_fla_linear`` with it. This module imports fla only when a call may use it, and runs
without it: it ships beside checkpoints, so a checkpoint loaded with ``trust_remote_code`` on a GPU with fla
installed uses fla too.

What fla computes, per op (the op name is the fla function's):

* delta rule (``rule="delta"``: alpha = 1, erase = beta): ``chunk_delta_rule`` / ``fused_recurrent_delta_rule``
  with ``beta``;
* gated delta rule (``rule="gated"``: erase = alpha beta): ``chunk_gated_delta_rule`` /
  ``fused_recurrent_gated_delta_rule`` with ``g`` = log alpha and ``beta``;
* GLA (a log decay per key dimension): ``chunk_gla`` (``g``) / ``fused_recurrent_gla`` (``gk``);
* decayed linear attention (a scalar log decay per head and token; RetNet's fixed decay is the constant case):
  ``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` with ``g``;
* plain linear attention: ``chunk_linear_attn`` / ``fused_recurrent_linear_attn`` (``normalize=False``);
* Kimi Delta Attention (``kda``: a decay per key channel, the key reading the decayed state):
  ``chunk_kda`` / ``fused_recurrent_kda`` with ``g`` = log a and ``beta``.

Linear attention's denominator rides along as one more value column of ones (its key sum z as one more state
column). The layout: our queries ``[B, Hkv, G, T, F]`` are fla's ``[B, T, H, F]`` with H = Hkv * G; keys, values and
gates (one state per key head) are repeated for the G query heads of their group, which compute identical
states (G times the state work; the final state is read from each group's first head). Our queries come scaled
(``scale=1``), gates are log decays as fla's ``g``, states are keys x values ``[B, H, K, V]`` as fla's
``initial_state`` and kept in the state's dtype (float32 in a half-precision model: the ops cast their inputs to
it). Packed documents need no ``cu_seqlens``: ``packing.py`` lays them out as right-padded rows whose padded
tokens leave the state untouched.

Not covered (``pick`` warns once and the torch form runs):

* Comba (``rule="comba"``): fla's ``chunk_comba`` subtracts ``beta p^T (alpha S)`` (the state read after its
  decay), ours ``beta k^T S`` (before it); they agree only with ``p = k / alpha``, which a strong decay overflows.
* DeltaProduct (``householder_steps`` > 1): fla's ``chunk_gated_delta_product`` decays the state once per token
  like ours, but is left for a GPU check of its own.
* RWKV-7 (``generalized_delta``), MesaNet (``mesa``: fla's ``chunk_mesa_net`` runs a fixed number of
  conjugate-gradient steps, ours to a tolerance), the softmax families (PaTH, DeltaFormer, FoX: fla's parallel
  kernels keep no recurrent state, and ours read a cache) and Taylor / Heinsen (no fla kernel).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

import torch

__all__ = ["delta_gates", "delta_op", "run_fla", "run_fla_linear", "too_wide"]

#: our op names (fla's function names) -> fla's module holding the function
FLA_FUNCTIONS = {
    "chunk_delta_rule": "fla.ops.delta_rule",
    "fused_recurrent_delta_rule": "fla.ops.delta_rule",
    "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule",
    "chunk_gla": "fla.ops.gla",
    "fused_recurrent_gla": "fla.ops.gla",
    "chunk_simple_gla": "fla.ops.simple_gla",
    "fused_recurrent_simple_gla": "fla.ops.simple_gla",
    "chunk_linear_attn": "fla.ops.linear_attn",
    "fused_recurrent_linear_attn": "fla.ops.linear_attn",
    "chunk_kda": "fla.ops.kda",
    "fused_recurrent_kda": "fla.ops.kda",
}
#: the delta rules fla computes: rule -> (chunk op, fused-recurrent op)
DELTA_RULES = {
    "delta": ("chunk_delta_rule", "fused_recurrent_delta_rule"),
    "gated": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
}
#: why fla does not compute a rule of ours (the op then runs its torch form)
UNCOVERED_RULES = {
    "comba": "Comba's rule (fla's comba reads the state after its decay, ours before)",
    "general": "a delta rule given only as (log_alpha, beta, erase) (say rule='delta' or 'gated')",
}
#: the widest key head fla's kernels take
MAX_KEY_WIDTH = 256


def load_fla() -> dict[str, Callable]:
    """fla's functions by op name, or {} where fla does not import (not installed, or broken: one warning)."""
    try:
        return {name: getattr(importlib.import_module(module), name) for name, module in FLA_FUNCTIONS.items()}
    except ImportError:
        return {}
    except Exception as error:  # an installed fla that fails to import must not stop a model from running
        warnings.warn(f"fla is installed but does not import ({error!r}); running the torch forms", stacklevel=2)
        return {}


def too_wide(k: torch.Tensor) -> str | None:
    """Why fla's kernels cannot take keys this wide, or None.

    Args:
        k: ``[..., K]`` keys.

    Returns:
        A reason (str) when K exceeds ``MAX_KEY_WIDTH``, else None.

    Example:
        >>> too_wide(torch.zeros(1, 1, 4, 512))
        'key heads of 512 (at most 256)'
        >>> too_wide(torch.zeros(1, 1, 4, 64)) is None
        True
    """
    width = k.shape[-1]
    return f"key heads of {width} (at most {MAX_KEY_WIDTH})" if width > MAX_KEY_WIDTH else None


def delta_op(rule: str, chunked: bool) -> tuple[str, str | None]:
    """(op name, why fla cannot run it or None) of a delta rule's chunked or decode form.

    Args:
        rule: ``delta``, ``gated``, ``comba`` or ``general``.
        chunked: the chunk op (training, prefill) rather than the fused-recurrent one (decode).

    Returns:
        ``(name, reason)``: the op to ask ``backends.pick`` for and, for a rule fla does not compute, the reason.

    Example:
        >>> delta_op("gated", chunked=True)
        ('chunk_gated_delta_rule', None)
        >>> delta_op("comba", chunked=False)[1].startswith("Comba")
        True
    """
    if rule in DELTA_RULES:
        return DELTA_RULES[rule][0 if chunked else 1], None
    return ("chunk_gated_delta_rule" if chunked else "fused_recurrent_gated_delta_rule"), UNCOVERED_RULES[rule]


def delta_gates(rule: str, log_alpha: torch.Tensor, beta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gate arguments of fla's delta rule for ``rule``: ``beta``, and ``g`` (log alpha) when gated.

    Args:
        rule: ``delta`` or ``gated``.
        log_alpha: ``[B, Hk, T]`` log decay of the state.
        beta: ``[B, Hk, T]`` write strength.

    Returns:
        ``{"beta": beta}`` or ``{"g": log_alpha, "beta": beta}``.

    Example:
        >>> sorted(delta_gates("gated", torch.zeros(1, 1, 3), torch.ones(1, 1, 3)))
        ['beta', 'g']
    """
    return {"g": log_alpha, "beta": beta} if rule == "gated" else {"beta": beta}


def _per_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hkv * G, ...], each key head's slice repeated for its G query heads."""
    if groups == 1:
        return x
    shape = x.shape
    return x.unsqueeze(2).expand(shape[0], shape[1], groups, *shape[2:]).reshape(shape[0], -1, *shape[2:])


def _tokens_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, ...] -> fla's [B, T, Hkv * G, ...]."""
    return _per_head(x, groups).transpose(1, 2)


def run_fla(
    fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    in_place: bool = False, **gates: torch.Tensor | bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fla chunk or fused-recurrent function on our grouped tensors: (o [B, Hkv, G, T, E], final state).

    Args:
        fn: fla's function (``backends.pick`` returns it), called as ``fn(q=, k=, v=, **gates, scale=1.0,
            initial_state=, output_final_state=True)`` in fla's layout.
        q: ``[B, Hkv, G, T, F]`` queries (already scaled), G query heads per key head.
        k: ``[B, Hkv, T, F]`` keys.
        v: ``[B, Hkv, T, E]`` values.
        state: ``[B, Hkv, F, E]`` start state (keys x values).
        in_place: write the final state into ``state``'s buffer (a decode step on a state the cache owns).
        gates: fla's gate arguments in our key layout (``[B, Hkv, T]`` or ``[B, Hkv, T, F]``: ``g``, ``gk``,
            ``beta``), and fixed flags passed as they are (``normalize=False``).

    Returns:
        ``(o, state)``: o ``[B, Hkv, G, T, E]`` in v's dtype and the final state ``[B, Hkv, F, E]`` in state's.

    Example (any function of fla's signature; fla's own run on CUDA tensors):
        >>> def zero_state_reads(q, k, v, scale, initial_state, output_final_state):
        ...     return q.new_zeros(*q.shape[:3], v.shape[-1]), initial_state
        >>> q, k, v = torch.randn(1, 2, 3, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
        >>> o, s = run_fla(zero_state_reads, q, k, v, torch.zeros(1, 2, 4, 6))
        >>> o.shape, s.shape
        (torch.Size([1, 2, 3, 5, 6]), torch.Size([1, 2, 4, 6]))
    """
    b, hk, g, t, f = q.shape
    heads = {name: x if isinstance(x, bool) else _tokens_first(x, g) for name, x in gates.items()}
    o, final = fn(q=q.reshape(b, hk * g, t, f).transpose(1, 2), k=_tokens_first(k, g), v=_tokens_first(v, g),
                  **heads, scale=1.0, initial_state=_per_head(state, g), output_final_state=True)
    o = o.transpose(1, 2).reshape(b, hk, g, t, -1).to(v.dtype)
    final = final.view(b, hk, g, *final.shape[2:])[:, :, 0].to(state.dtype)
    if in_place:
        return o, state.copy_(final)
    return o, final


def run_fla_linear(
    fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    in_place: bool = False, **gates: torch.Tensor | bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Numerator, denominator, S and z of (decayed) linear attention through fla (the key sums as a value column
    of ones, z as a state column).

    Args:
        fn: fla's linear-attention or simple-GLA function (see ``run_fla``).
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries.
        k: ``[B, Hkv, T, F]`` feature-mapped keys.
        v: ``[B, Hkv, T, E]`` values.
        S: ``[B, Hkv, F, E]`` start state.
        z: ``[B, Hkv, F]`` start key sum.
        in_place: write the new S and z into their buffers.
        gates: ``g`` ``[B, Hkv, T]`` (a scalar log decay) and fixed flags (``normalize=False``).

    Returns:
        ``(num, den, S, z)``: numerator ``[B, Hkv, G, T, E]``, denominator ``[B, Hkv, G, T]``, the final S and z.

    Example (any function of fla's signature; fla's own run on CUDA tensors):
        >>> def zero_state_reads(q, k, v, scale, initial_state, output_final_state):
        ...     return q.new_zeros(*q.shape[:3], v.shape[-1]), initial_state
        >>> q, k, v = torch.rand(1, 1, 2, 8, 16), torch.rand(1, 1, 8, 16), torch.randn(1, 1, 8, 15)
        >>> num, den, S, z = run_fla_linear(zero_state_reads, q, k, v, torch.zeros(1, 1, 16, 15), torch.zeros(1, 1, 16))
        >>> num.shape, den.shape, S.shape, z.shape
        (torch.Size([1, 1, 2, 8, 15]), torch.Size([1, 1, 2, 8]), torch.Size([1, 1, 16, 15]), torch.Size([1, 1, 16]))
    """
    e = v.shape[-1]
    ones = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    out, final = run_fla(fn, q, k, ones, torch.cat([S, z.unsqueeze(-1)], dim=-1), **gates)
    num, den = out[..., :e], out[..., e]
    if in_place:
        return num, den, S.copy_(final[..., :e]), z.copy_(final[..., e])
    return num, den, final[..., :e].contiguous(), final[..., e].contiguous()
