"""Adapters from the ops' grouped layout to the Triton kernels' per-head layout (``backends.pick`` chooses).

The ops hold one state per key head, read by G query heads (q ``[B, Hkv, G, T, F]``, k / v ``[B, Hkv, T, *]``).
The chunked kernels take one state per head (q, k ``[B, H, T, K]``): each key head is repeated for its G query
heads, which compute identical states (G times the state work; the final state is read from the first copy).
The decode kernels read one state with G queries directly. Linear attention's denominator rides along as one more
value column of ones (its state z as one more state column).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: tokens per chunk of the chunked kernels (a kernel's own choice: the result does not depend on it)
KERNEL_CHUNK = 64
#: the widest key / value head each kernel takes (the chunked delta rule's backward needs K <= 128 in shared memory)
MAX_WIDTH = {"chunk_linear": 256, "chunk_delta": 128, "linear_step": 256, "delta_step": 256}


def too_wide(name: str, k: torch.Tensor, v: torch.Tensor, extra_columns: int = 0) -> str | None:
    """Why the kernel ``name`` cannot take heads this wide, or None. ``extra_columns``: value columns the adapter
    appends (linear attention's denominator: one column of ones).

    Args:
        name: the kernel's op (a key of ``MAX_WIDTH``: ``chunk_linear``, ``chunk_delta``, ``linear_step``,
            ``delta_step``).
        k: ``[..., K]`` keys.
        v: ``[..., V]`` values.
        extra_columns: value columns the adapter adds.

    Returns:
        A reason (str) when K or V + ``extra_columns`` exceeds the kernel's limit, else None.

    Example:
        >>> too_wide("chunk_delta", torch.zeros(1, 1, 4, 256), torch.zeros(1, 1, 4, 64))
        'key / value heads of 256 / 64 (at most 128)'
        >>> too_wide("chunk_linear", torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 64)) is None
        True
    """
    limit, widths = MAX_WIDTH[name], (k.shape[-1], v.shape[-1] + extra_columns)
    return f"key / value heads of {widths[0]} / {widths[1]} (at most {limit})" if max(widths) > limit else None


def _per_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hkv * G, ...], each key head's slice repeated for its G query heads."""
    if groups == 1:
        return x
    return x.unsqueeze(2).expand(x.shape[0], x.shape[1], groups, *x.shape[2:]).reshape(-1, x.shape[1] * groups,
                                                                                       *x.shape[2:])


def _first_of_group(state: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv * G, ...] -> [B, Hkv, ...]: the state of each group's first query head."""
    return state.view(state.shape[0], -1, groups, *state.shape[2:])[:, :, 0]


def run_chunked(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    **gates: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunked kernel on grouped tensors: returns (o [B, Hkv, G, T, E], final state [B, Hkv, F, E]).

    Args:
        kernel: a chunked kernel in the per-head layout (``hf_recattn.kernels.chunk_linear_attention`` or
            ``chunk_delta_rule``, as ``backends.pick`` returns them).
        q: ``[B, Hkv, G, T, F]`` queries, G query heads per key head.
        k: ``[B, Hkv, T, F]`` keys.
        v: ``[B, Hkv, T, E]`` values.
        state: ``[B, Hkv, F, E]`` start state.
        gates: the kernel's per-token arguments in the key layout (``[B, Hkv, T]`` or ``[B, Hkv, T, F]``), e.g.
            ``g`` / ``gk``, or ``log_alpha`` / ``beta`` / ``erase``.

    Returns:
        ``(o, state)``: o ``[B, Hkv, G, T, E]`` and the final state ``[B, Hkv, F, E]`` in ``state``'s dtype.

    Example (a GPU, or ``TRITON_INTERPRET=1`` set before triton loads on a CPU):
        >>> from hf_recattn.kernels import chunk_linear_attention
        >>> with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        ...     q, k, v = torch.randn(1, 2, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
        ...     s0 = torch.zeros(1, 2, 16, 16)
        ...     o, s = run_chunked(chunk_linear_attention, q, k, v, s0)
        >>> o.shape, s.shape
        (torch.Size([1, 2, 2, 8, 16]), torch.Size([1, 2, 16, 16]))
    """
    b, hk, g, t, f = q.shape
    heads = {name: None if x is None else _per_head(x, g) for name, x in gates.items()}
    o, final = kernel(q.reshape(b, hk * g, t, f), _per_head(k, g), _per_head(v, g), **heads,
                      initial_state=_per_head(state, g), output_final_state=True, chunk_size=KERNEL_CHUNK)
    return o.view(b, hk, g, t, -1), _first_of_group(final, g).to(state.dtype)


def run_linear_chunked(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    **gates: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Numerator, denominator, S and z of linear attention through the chunked kernel (the key sums as a value
    column of ones).

    Args:
        kernel: ``hf_recattn.kernels.chunk_linear_attention`` (or a kernel of its signature).
        q: ``[B, Hkv, G, T, F]`` feature-mapped queries.
        k: ``[B, Hkv, T, F]`` feature-mapped keys.
        v: ``[B, Hkv, T, E]`` values.
        S: ``[B, Hkv, F, E]`` start state.
        z: ``[B, Hkv, F]`` start key sum.
        gates: ``g`` ``[B, Hkv, T]`` (a scalar log decay) or ``gk`` ``[B, Hkv, T, F]``, or neither.

    Returns:
        ``(num, den, S, z)`` as ``ops_linear.linear_chunked`` returns them.

    Example (a GPU, or ``TRITON_INTERPRET=1`` set before triton loads on a CPU):
        >>> from hf_recattn.kernels import chunk_linear_attention
        >>> with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        ...     q, k, v = torch.rand(1, 1, 2, 8, 16), torch.rand(1, 1, 8, 16), torch.randn(1, 1, 8, 15)
        ...     num, den, S, z = run_linear_chunked(chunk_linear_attention, q, k, v, torch.zeros(1, 1, 16, 15),
        ...                                     torch.zeros(1, 1, 16))
        >>> num.shape, den.shape, S.shape, z.shape
        (torch.Size([1, 1, 2, 8, 15]), torch.Size([1, 1, 2, 8]), torch.Size([1, 1, 16, 15]), torch.Size([1, 1, 16]))
    """
    e = v.shape[-1]
    ones = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    out, final = run_chunked(kernel, q, k, ones, torch.cat([S, z.unsqueeze(-1)], dim=-1), **gates)
    return out[..., :e], out[..., e], final[..., :e].contiguous(), final[..., e].contiguous()


def _step_state(state: torch.Tensor, in_place: bool) -> torch.Tensor:
    return state if in_place and state.is_contiguous() else state.clone(memory_format=torch.contiguous_format)


def run_linear_step(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor,
    in_place: bool, g: torch.Tensor | None = None, gk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of (decayed) linear attention through the fused kernel: (num, den, S, z) as the torch form.

    Args:
        kernel: ``hf_recattn.kernels.fused_linear_step`` (or a kernel of its signature).
        q: ``[B, Hkv, G, 1, F]`` the token's feature-mapped queries.
        k: ``[B, Hkv, 1, F]`` its feature-mapped key.
        v: ``[B, Hkv, 1, E]`` its value.
        S: ``[B, Hkv, F, E]`` float32 state before the token.
        z: ``[B, Hkv, F]`` float32 key sum before the token.
        in_place: update S and z in their buffers (when contiguous).
        g: ``[B, Hkv]`` a scalar log decay, or None.
        gk: ``[B, Hkv, F]`` a log decay per key dimension, or None.

    Returns:
        ``(num, den, S, z)``: numerator ``[B, Hkv, G, 1, E]``, denominator ``[B, Hkv, G, 1]``, the new S and z.

    Example (a GPU, or ``TRITON_INTERPRET=1`` set before triton loads on a CPU):
        >>> from hf_recattn.kernels import fused_linear_step
        >>> with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        ...     q, k, v = torch.rand(1, 2, 3, 1, 16), torch.rand(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        ...     num, den, S, z = run_linear_step(fused_linear_step, q, k, v, torch.zeros(1, 2, 16, 16),
        ...                                  torch.zeros(1, 2, 16), in_place=True)
        >>> num.shape, den.shape, S.shape, z.shape
        (torch.Size([1, 2, 3, 1, 16]), torch.Size([1, 2, 3, 1]), torch.Size([1, 2, 16, 16]), torch.Size([1, 2, 16]))
    """
    S, z = _step_state(S, in_place), _step_state(z, in_place)
    q1, k1 = q[:, :, :, 0], k[:, :, 0]
    num = kernel(q1, k1, v[:, :, 0], S, g=g, gk=gk)
    den = kernel(q1, k1, k1.new_ones(*k1.shape[:2], 1), z.unsqueeze(-1), g=g, gk=gk)
    return num.unsqueeze(3), den, S, z


def run_gated_step(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, in_place: bool,
    gk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GLA decode step through the fused kernel: (o [B, Hkv, G, 1, E], S).

    Args:
        kernel: ``hf_recattn.kernels.fused_linear_step`` (or a kernel of its signature).
        q: ``[B, Hkv, G, 1, D]`` the token's queries.
        k: ``[B, Hkv, 1, D]`` its key.
        v: ``[B, Hkv, 1, E]`` its value.
        S: ``[B, Hkv, D, E]`` float32 state before the token.
        in_place: update S in its buffer (when contiguous).
        gk: ``[B, Hkv, D]`` the token's log forget gates.

    Returns:
        ``(o, S)``: o ``[B, Hkv, G, 1, E]`` and the new state.

    Example (a GPU, or ``TRITON_INTERPRET=1`` set before triton loads on a CPU):
        >>> from hf_recattn.kernels import fused_linear_step
        >>> with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        ...     q, k, v = torch.randn(1, 2, 3, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        ...     o, S = run_gated_step(fused_linear_step, q, k, v, torch.zeros(1, 2, 16, 16), False,
        ...                           -torch.rand(1, 2, 16))
        >>> o.shape, S.shape
        (torch.Size([1, 2, 3, 1, 16]), torch.Size([1, 2, 16, 16]))
    """
    S = _step_state(S, in_place)
    return kernel(q[:, :, :, 0], k[:, :, 0], v[:, :, 0], S, gk=gk).unsqueeze(3), S


def run_delta_step(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
    beta: torch.Tensor, erase: torch.Tensor, state: torch.Tensor, in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule decode step through the fused kernel: (o [B, Hk, G, 1, E], state).

    Args:
        kernel: ``hf_recattn.kernels.fused_delta_step`` (or a kernel of its signature).
        q: ``[B, Hk, G, 1, D]`` the token's queries.
        k: ``[B, Hk, 1, D]`` its key.
        v: ``[B, Hk, 1, E]`` its value.
        log_alpha: ``[B, Hk, 1]`` log decay of the state.
        beta: ``[B, Hk, 1]`` write strength.
        erase: ``[B, Hk, 1]`` removal strength.
        state: ``[B, Hk, D, E]`` float32 state before the token.
        in_place: update the state in its buffer (when contiguous).

    Returns:
        ``(o, state)``: o ``[B, Hk, G, 1, E]`` and the new state.

    Example (a GPU, or ``TRITON_INTERPRET=1`` set before triton loads on a CPU):
        >>> from hf_recattn.kernels import fused_delta_step
        >>> with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        ...     q, k, v = torch.randn(1, 2, 3, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        ...     b, s0 = torch.rand(1, 2, 1), torch.zeros(1, 2, 16, 16)
        ...     o, s = run_delta_step(fused_delta_step, q, k, v, torch.zeros(1, 2, 1), b, b, s0, False)
        >>> o.shape, s.shape
        (torch.Size([1, 2, 3, 1, 16]), torch.Size([1, 2, 16, 16]))
    """
    state = _step_state(state, in_place)
    o = kernel(q[:, :, :, 0], k[:, :, 0], v[:, :, 0], state, log_alpha[:, :, 0], beta[:, :, 0], erase[:, :, 0])
    return o.unsqueeze(3), state
