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
    appends (linear attention's denominator: one column of ones)."""
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

    ``gates`` are the kernel's per-token arguments in the key layout ([B, Hkv, T] or [B, Hkv, T, F])."""
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
    column of ones)."""
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

    q [B, Hkv, G, 1, F], k [B, Hkv, 1, F], v [B, Hkv, 1, E]; g [B, Hkv] or gk [B, Hkv, F] log decays."""
    S, z = _step_state(S, in_place), _step_state(z, in_place)
    q1, k1 = q[:, :, :, 0], k[:, :, 0]
    num = kernel(q1, k1, v[:, :, 0], S, g=g, gk=gk)
    den = kernel(q1, k1, k1.new_ones(*k1.shape[:2], 1), z.unsqueeze(-1), g=g, gk=gk)
    return num.unsqueeze(3), den, S, z


def run_gated_step(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, in_place: bool,
    gk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GLA decode step through the fused kernel: (o [B, Hkv, G, 1, E], S)."""
    S = _step_state(S, in_place)
    return kernel(q[:, :, :, 0], k[:, :, 0], v[:, :, 0], S, gk=gk).unsqueeze(3), S


def run_delta_step(
    kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
    beta: torch.Tensor, erase: torch.Tensor, state: torch.Tensor, in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule decode step through the fused kernel: (o [B, Hk, G, 1, E], state)."""
    state = _step_state(state, in_place)
    o = kernel(q[:, :, :, 0], k[:, :, 0], v[:, :, 0], state, log_alpha[:, :, 0], beta[:, :, 0], erase[:, :, 0])
    return o.unsqueeze(3), state
