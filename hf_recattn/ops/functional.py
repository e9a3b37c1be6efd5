"""Functional recurrent attention in the layout users know from fla and transformers' Qwen3-Next code.

Every function takes ``[B, T, H, D]`` tensors and returns ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in the
dtype of ``q``, ``final_state`` is ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) in the compute dtype
when ``output_final_state`` is set, else ``None``.

Shared arguments:

* ``q``, ``k``: ``[B, T, H, K]``; ``v``: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (each query/key head
  serves ``HV // H`` consecutive value heads, which have states of their own).
* ``g``: ``[B, T, HV]`` log decay; each step multiplies the state by ``exp(g)``, so ``g <= 0`` (not checked).
* ``beta``: ``[B, T, HV]`` write strength of the delta rule.
* ``scale``: multiplies ``q`` (default ``K ** -0.5``).
* ``initial_state``: ``[B, HV, K, V]``, or ``[N, HV, K, V]`` with ``cu_seqlens``.
* ``use_qk_l2norm_in_kernel``: ``q`` and ``k`` become ``x * rsqrt(sum(x^2) + 1e-6)`` before ``scale``.
* ``cu_seqlens``: 1-D integer tensor ``[0, ..., T]`` of packed sequence boundaries (needs ``B == 1``); the state
  starts from ``initial_state[i]`` (or zeros) at the start of sequence ``i``. Sequences run one after another.
* ``chunk_size``: tokens per chunk of the chunked forms (default 64); any ``T`` works.

Half-precision inputs are computed in float32 (float64 stays float64) and ``o`` is cast back. Bad shapes raise
``ValueError`` naming the argument.

The rules (``o_t = S_t^T q_t``, states keys x values):

* gated delta rule: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``;
* delta rule: the same with ``g = 0``;
* simple GLA: ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``;
* linear attention: ``S_t = S_{t-1} + k_t v_t^T`` (no feature map; apply one to ``q``/``k`` first if wanted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..modeling.ops_delta import delta_chunked, delta_step
from ..modeling.ops_linear import linear_chunked

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_linear_attn",
    "chunk_simple_gla",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
]

L2NORM_EPS = 1e-6

# One sequence at a time, internal layout: (q [B,HV,1,T,K], k [B,HV,T,K], v [B,HV,T,V], g, beta [B,HV,T] or None,
# state [B,HV,K,V]) -> (o [B,HV,1,T,V], final state).
_Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# ----- validation ---------------------------------------------------------------------------------------------
def _check_qkv(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{fn}: {name} must be [B, T, H, D], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {x.dtype}")
    if q.shape[1] == 0:
        raise ValueError(f"{fn}: q, k, v must hold at least one token (T = 0)")
    if k.shape != q.shape:
        raise ValueError(f"{fn}: k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{fn}: v must be [B, T, HV, V] with B, T of q {tuple(q.shape[:2])}, got {tuple(v.shape)}")
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"{fn}: v's heads ({v.shape[2]}) must be a multiple of q/k heads ({q.shape[2]})")


def _check_gate(fn: str, name: str, x: torch.Tensor | None, v: torch.Tensor) -> None:
    if x is None:
        raise ValueError(f"{fn}: {name} is required")
    if tuple(x.shape) != tuple(v.shape[:3]):
        raise ValueError(f"{fn}: {name} must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {x.dtype}")


def _bounds(fn: str, cu_seqlens: torch.Tensor | None, batch: int, length: int) -> list[tuple[int, int]] | None:
    """Checked (start, end) pairs of the packed sequences, or None without cu_seqlens."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D integer tensor [0, ..., T]")
    if batch != 1:
        raise ValueError(f"{fn}: cu_seqlens needs batch size 1 (sequences packed along T), got B = {batch}")
    edges = [int(x) for x in cu_seqlens.tolist()]
    if len(edges) < 2 or edges[0] != 0:
        raise ValueError(f"{fn}: cu_seqlens must start at 0 and hold at least one sequence, got {edges[:4]}")
    if any(b <= a for a, b in zip(edges[:-1], edges[1:], strict=True)):
        raise ValueError(f"{fn}: cu_seqlens must be strictly increasing, got {edges}")
    if edges[-1] != length:
        raise ValueError(f"{fn}: cu_seqlens must end at T = {length}, got {edges[-1]}")
    return list(zip(edges[:-1], edges[1:], strict=True))


def _check_state(fn: str, state: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if state is not None and tuple(state.shape) != shape:
        raise ValueError(f"{fn}: initial_state must be [N, HV, K, V] = {shape}, got {tuple(state.shape)}")


def _check_chunk_size(fn: str, chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")


# ----- layout -------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim.

    Args:
        x: ``[..., D]`` vectors.
        eps: added under the root.

    Returns:
        ``[..., D]`` the normalized vectors.

    Example:
        >>> from hf_recattn.ops import l2norm
        >>> l2norm(torch.tensor([[3.0, 4.0]]), eps=0.0)
        tensor([[0.6000, 0.8000]])
    """
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _inverse_norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """rsqrt(sum(x^2) + eps) over the last dim (keepdim), without an x^2 temporary."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _heads_first(x: torch.Tensor, repeat: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H * repeat, T, ...] in `dtype`."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=2)
    return x.transpose(1, 2).to(dtype)


def _run(
    fn: str,
    core: _Core,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    l2norm_qk: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared plumbing: checks, layout, dtype, normalization, scale, packed sequences."""
    batch, length, heads, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    bounds = _bounds(fn, cu_seqlens, batch, length)
    n_states = batch if bounds is None else len(bounds)
    _check_state(fn, initial_state, (n_states, hv, dk, dv))
    dtype = _compute_dtype(q)
    repeat = hv // heads
    qh, kh, vh = _heads_first(q, repeat, dtype), _heads_first(k, repeat, dtype), _heads_first(v, 1, dtype)
    scale = dk**-0.5 if scale is None else scale
    if l2norm_qk:  # one pass each: x * (scale / sqrt(sum(x^2) + eps))
        qh, kh = qh * (_inverse_norm(qh) * scale), kh * _inverse_norm(kh)
    else:
        qh = qh * scale
    qh = qh.unsqueeze(2)  # [B, HV, 1, T, K]
    gh = None if g is None else g.transpose(1, 2).to(dtype)
    bh = None if beta is None else beta.transpose(1, 2).to(dtype)
    if initial_state is None:
        state = torch.zeros(n_states, hv, dk, dv, dtype=dtype, device=q.device)
    else:
        state = initial_state.to(dtype)
    if bounds is None:
        out, final = core(qh, kh, vh, gh, bh, state)
        out = out.squeeze(2).transpose(1, 2)
    else:  # split() rather than slicing: the backward then joins the pieces' gradients once
        lengths = [b - a for a, b in bounds]
        pieces = zip(
            qh.split(lengths, dim=3), kh.split(lengths, dim=2), vh.split(lengths, dim=2),
            [None] * len(lengths) if gh is None else gh.split(lengths, dim=-1),
            [None] * len(lengths) if bh is None else bh.split(lengths, dim=-1),
            state.split(1, dim=0), strict=True,
        )
        outs, finals = [], []
        for piece in pieces:
            o_i, s_i = core(*piece)
            outs.append(o_i.squeeze(2).transpose(1, 2))
            finals.append(s_i)
        out, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    out = out.to(q.dtype).contiguous()  # [B, T, HV, V]
    return out, (final if output_final_state else None)


# ----- cores (internal layout, one sequence span) ---------------------------------------------------------------
def _delta_coefficients(
    g: torch.Tensor | None, beta: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_alpha, beta, erase) of the gated (erase = beta e^g) or plain (g = 0, erase = beta) delta rule."""
    if gated:
        return g, beta, beta * g.exp()
    return torch.zeros_like(beta), beta, beta


def _delta_chunk_core(gated: bool, chunk_size: int) -> _Core:
    def core(q, k, v, g, beta, state):
        log_alpha, beta, erase = _delta_coefficients(g, beta, gated)
        return delta_chunked(q, k, v, log_alpha, beta, erase, state, chunk_size=chunk_size,
                             rule="gated" if gated else "delta")

    return core


def _delta_recurrent_core(gated: bool) -> _Core:
    def core(q, k, v, g, beta, state):
        log_alpha, beta, erase = _delta_coefficients(g, beta, gated)
        tokens = zip(
            q.split(1, dim=3), k.split(1, dim=2), v.split(1, dim=2),
            *(x.split(1, dim=-1) for x in (log_alpha, beta, erase)), strict=True,
        )
        outs = []
        for args in tokens:
            o, state = delta_step(*args, state, rule="gated" if gated else "delta")
            outs.append(o)
        return torch.cat(outs, dim=3), state

    return core


def _linear_core(chunk_size: int, normalize: bool) -> _Core:
    def core(q, k, v, g, beta, state):
        z = state.new_zeros(state.shape[:-1])
        num, den, final, _ = linear_chunked(q, k, v, state, z, chunk_size, log_g=g)
        return (num / den[..., None] if normalize else num), final

    return core


# ----- public functions -----------------------------------------------------------------------------------------
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunkwise (O(T * chunk)): S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        g: ``[B, T, HV]`` log decay (<= 0, not checked).
        beta: ``[B, T, HV]`` write strength.
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: L2-normalize q and k (``x * rsqrt(sum(x^2) + 1e-6)``) before ``scale``.
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.
        chunk_size: tokens per chunk (any T works).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import chunk_gated_delta_rule
        >>> q, k, v = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4), torch.randn(1, 6, 4, 3)  # 2 value heads per key
        >>> g, beta = -torch.rand(1, 6, 4), torch.rand(1, 6, 4)
        >>> o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        >>> o.shape, s.shape
        (torch.Size([1, 6, 4, 3]), torch.Size([1, 4, 4, 3]))
    """
    fn = "chunk_gated_delta_rule"
    _check_qkv(fn, q, k, v)
    _check_gate(fn, "g", g, v)
    _check_gate(fn, "beta", beta, v)
    _check_chunk_size(fn, chunk_size)
    return _run(fn, _delta_chunk_core(True, chunk_size), q, k, v, g, beta, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, one token at a time (the decode form; same result as the chunked one).

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        g: ``[B, T, HV]`` log decay (<= 0, not checked).
        beta: ``[B, T, HV]`` write strength.
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: L2-normalize q and k (``x * rsqrt(sum(x^2) + 1e-6)``) before ``scale``.
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        >>> q, k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 3)
        >>> g, beta, s0 = -torch.rand(1, 5, 2), torch.rand(1, 5, 2), torch.randn(1, 2, 4, 3)
        >>> args = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        >>> o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **args)
        >>> o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, **args)
        >>> torch.allclose(o, o_ref, atol=1e-5), torch.allclose(s, s_ref, atol=1e-5)
        (True, True)
    """
    fn = "fused_recurrent_gated_delta_rule"
    _check_qkv(fn, q, k, v)
    _check_gate(fn, "g", g, v)
    _check_gate(fn, "beta", beta, v)
    return _run(fn, _delta_recurrent_core(True), q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule (DeltaNet), chunkwise: S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        beta: ``[B, T, HV]`` write strength.
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: L2-normalize q and k (``x * rsqrt(sum(x^2) + 1e-6)``) before ``scale``.
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.
        chunk_size: tokens per chunk (any T works).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import chunk_delta_rule
        >>> q, k, v = torch.randn(1, 7, 2, 4), torch.randn(1, 7, 2, 4), torch.randn(1, 7, 2, 3)
        >>> beta = torch.rand(1, 7, 2)
        >>> cu_seqlens = torch.tensor([0, 3, 7])  # two sequences packed along T
        >>> o, s = chunk_delta_rule(q, k, v, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
        ...                         cu_seqlens=cu_seqlens)
        >>> o.shape, s.shape
        (torch.Size([1, 7, 2, 3]), torch.Size([2, 2, 4, 3]))
    """
    fn = "chunk_delta_rule"
    _check_qkv(fn, q, k, v)
    _check_gate(fn, "beta", beta, v)
    _check_chunk_size(fn, chunk_size)
    return _run(fn, _delta_chunk_core(False, chunk_size), q, k, v, None, beta, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule (DeltaNet), one token at a time.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        beta: ``[B, T, HV]`` write strength.
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: L2-normalize q and k (``x * rsqrt(sum(x^2) + 1e-6)``) before ``scale``.
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import fused_recurrent_delta_rule
        >>> q, k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 5)
        >>> beta = torch.rand(2, 3, 1)
        >>> o, s = fused_recurrent_delta_rule(q, k, v, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        >>> o.shape, s.shape
        (torch.Size([2, 3, 1, 5]), torch.Size([2, 1, 4, 5]))
    """
    fn = "fused_recurrent_delta_rule"
    _check_qkv(fn, q, k, v)
    _check_gate(fn, "beta", beta, v)
    return _run(fn, _delta_recurrent_core(False), q, k, v, None, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal linear attention o_t = sum_{s<=t} (scale q_t . k_s) v_s, chunkwise; no feature map is applied.

    ``normalize=True`` divides by ``sum_{s<=t} q_t . k_s`` (of this call's keys, so ``scale`` cancels): the
    classic linear attention ratio, meaningful for positive feature-mapped ``q``/``k``. The state carries no key
    sum, so ``normalize=True`` cannot continue from an ``initial_state``.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        normalize: divide by the sum of the scores (needs ``initial_state=None``).
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.
        chunk_size: tokens per chunk (any T works).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import chunk_linear_attn
        >>> q, k, v = torch.rand(1, 4, 1, 3), torch.rand(1, 4, 1, 3), torch.randn(1, 4, 1, 2)
        >>> o, _ = chunk_linear_attn(q, k, v, normalize=True, chunk_size=2)
        >>> w = (q[0, :, 0] @ k[0, :, 0].T).tril()
        >>> torch.allclose(o[0, :, 0], (w / w.sum(-1, keepdim=True)) @ v[0, :, 0], atol=1e-6)
        True
    """
    fn = "chunk_linear_attn"
    _check_qkv(fn, q, k, v)
    _check_chunk_size(fn, chunk_size)
    if normalize and initial_state is not None:
        raise ValueError(f"{fn}: normalize=True cannot start from initial_state (the state holds no key sum)")
    return _run(fn, _linear_core(chunk_size, normalize), q, k, v, None, None, scale, initial_state,
                output_final_state, False, cu_seqlens)


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a scalar log decay per head and token, chunkwise: S_t = e^{g_t} S_{t-1} + k_t v_t^T.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; HV a multiple of H (each query / key head serves HV // H value heads).
        g: ``[B, T, HV]`` log decay (<= 0, not checked).
        scale: multiplies q (None: ``K ** -0.5``).
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), or None for zeros.
        output_final_state: return the final state.
        cu_seqlens: ``[N + 1]`` integer boundaries ``[0, ..., T]`` of N sequences packed along T (B = 1), or None.
        chunk_size: tokens per chunk (any T works).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
        ``cu_seqlens``) in the compute dtype (float32 for 16-bit inputs) if ``output_final_state``, else None.

    Example:
        >>> from hf_recattn.ops import chunk_simple_gla
        >>> q, k, v, g = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 3), -torch.rand(1, 5, 2)
        >>> o, s = chunk_simple_gla(q, k, v, g, output_final_state=True)
        >>> o.shape, s.shape
        (torch.Size([1, 5, 2, 3]), torch.Size([1, 2, 4, 3]))
    """
    fn = "chunk_simple_gla"
    _check_qkv(fn, q, k, v)
    _check_gate(fn, "g", g, v)
    _check_chunk_size(fn, chunk_size)
    return _run(fn, _linear_core(chunk_size, False), q, k, v, g, None, scale, initial_state, output_final_state,
                False, cu_seqlens)
