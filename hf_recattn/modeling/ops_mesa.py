"""Functional forms of MesaNet (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eq. 35): per key
head, two states with a forget gate gamma_t and an
input gate beta_t,

    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T    [D, D]        G_t = gamma_t G_{t-1} + beta_t k_t v_t^T    [D, E]

(G kept keys x values, the transpose of Su's v k^T), and each query head h reads

    o_t = G_t^T x_t,    x_t = (H_t + Lambda_h)^-1 q_t,

with Lambda_h a positive diagonal per query head. H_t + Lambda_h is symmetric positive definite, so the linear
system is solved either exactly (Cholesky) or by ``cg_steps`` steps of conjugate gradients preconditioned by its
diagonal (Jacobi), started from x = q / diag(H_t + Lambda_h). Every form solves the same per-token systems with the
same solver, so that the forms compute the same function for either choice:

* parallel: every state H_t from one decay-weighted sum over the tokens (O(T^2 + T D^2) memory), then the solves
  for all tokens at once;
* chunked: the start state of every chunk by state passing (cheap: the states do not depend on the solves), then
  the solves of all chunks at once; CG never builds H_t, it applies it as e^{g_t} H_start p + sum_s w_ts k_s (k_s.p)
  (O(T C) memory); the exact solve builds H_t per token;
* step: one token, the full H_t.

Shapes: q [B, Hk, G, T, D] (G query heads per key head), k [B, Hk, T, D], v [B, Hk, T, E], log_gamma and beta
[B, Hk, T], lam [Hk, G, D] (Lambda, positive), H [B, Hk, D, D], G [B, Hk, D, E]. Padded tokens are the caller's
business (beta = 0 and log_gamma = 0 leave both states untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

SOLVERS = ("cg", "exact")


class MesaOperands(NamedTuple):
    """What every form reads besides the states (shapes in the module docstring)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_gamma: torch.Tensor
    beta: torch.Tensor
    lam: torch.Tensor


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor], rhs: torch.Tensor, diag: torch.Tensor, steps: int
) -> torch.Tensor:
    """``steps`` iterations of Jacobi-preconditioned CG for A x = rhs, batched over every leading dim (the systems
    live in the last dim). ``matvec`` applies the SPD matrix A, ``diag`` is its diagonal; x starts at rhs / diag.

    A fixed number of steps keeps the function smooth and the same in every form. Where a residual reaches exactly
    zero, the step sizes are 0 / tiny = 0 (the clamp), so a converged system stays put. Every ``_CHECK_EVERY``
    steps, a system whose residual has fallen to rounding level (r.z below ``_converged(dtype)`` of its start) is
    stopped by zeroing its residual: its later steps are exact zeros. Left running, such a residual keeps
    shrinking by the recurrence until the dot products' terms are subnormal floats, which a CPU computes one to
    two orders of magnitude slower (it halved MesaNet's fp32 prefill); what it would still add to x lies far
    below x's own rounding. Once every system of the batch has stopped, the loop ends (where
    ``_may_stop_early``): the steps it skips would add exact zeros, so x is the same, bit for bit.

    Args:
        matvec: maps ``[..., D]`` vectors p to A p (A symmetric positive definite).
        rhs: ``[..., D]`` right-hand sides.
        diag: ``[..., D]`` A's diagonal (broadcast against ``rhs``).
        steps: CG iterations (0: the preconditioned start alone).

    Returns:
        ``[..., D]`` the approximate solutions x.

    Example:
        >>> a = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x = conjugate_gradient(lambda p: p @ a, torch.tensor([[1.0, 2.0]], dtype=torch.float64), a.diagonal(), 2)
        >>> torch.allclose(x @ a, torch.tensor([[1.0, 2.0]], dtype=torch.float64))  # 2 steps solve a 2 x 2 system
        True
    """
    tiny = torch.finfo(rhs.dtype).tiny
    inv = diag.reciprocal()
    x = rhs * inv
    if steps == 0:
        return x
    r = rhs - matvec(x)
    z = r * inv
    p = z
    rz = _dot(r, z)
    converged = rz * _converged(rhs.dtype)
    stop_early = _may_stop_early(rhs)
    for i in range(steps):  # fused updates (addcmul): a decode step runs this loop per layer and token
        ap = matvec(p)
        alpha = rz / _dot(p, ap).clamp_min(tiny)
        x = torch.addcmul(x, alpha, p)
        if i == steps - 1:
            break
        r = torch.addcmul(r, alpha, ap, value=-1.0)
        if i % _CHECK_EVERY == _CHECK_EVERY - 1:
            running = rz > converged
            r = r * running  # zero r -> z, r.z, beta, p, alpha all 0: the system stays put
            if stop_early and not running.any():
                break  # every later step would add exact zeros to x
        z = r * inv
        rz_new = _dot(r, z)
        p = torch.addcmul(z, rz_new / rz.clamp_min(tiny), p)
        rz = rz_new
    return x


#: CG steps between two convergence checks (each is two small ops: a decode step runs 30 solves per token)
_CHECK_EVERY = 4


def _may_stop_early(t: torch.Tensor) -> bool:
    """Whether the solver may end its loop once every system has stopped: on a CPU, where reading the flag back
    costs a few microseconds, and neither under torch.compile / torch.export (a data-dependent branch would split
    the graph) nor under torch.jit.trace (which would record one input's step count for all). Elsewhere the
    remaining steps run and add exact zeros: the same x either way."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.jit.is_tracing()


def _converged(dtype: torch.dtype) -> float:
    """r.z relative to its start below which a system counts as converged: (eps / 256)^2, a residual 256 times
    below the dtype's rounding (about 2e-19 for float32, 8e-37 for float64)."""
    return (torch.finfo(dtype).eps / 256) ** 2


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot products over the last dim, kept as a trailing dim of size 1."""
    return (a * b).sum(-1, keepdim=True)


def solve_dense(h: torch.Tensor, q: torch.Tensor, lam: torch.Tensor, solver: str, cg_steps: int) -> torch.Tensor:
    """x = (H + Lambda)^-1 q for explicit matrices: h [B, Hk, T, D, D] (symmetric), q [B, Hk, T, G, D],
    lam [Hk, G, D]. Returns x [B, Hk, T, G, D].

    Args:
        h: ``[B, Hk, T, D, D]`` symmetric positive semi-definite states H_t.
        q: ``[B, Hk, T, G, D]`` right-hand sides, G query heads per key head.
        lam: ``[Hk, G, D]`` Lambda, a positive diagonal per query head.
        solver: ``"exact"`` (Cholesky) or ``"cg"``.
        cg_steps: conjugate-gradient steps when ``solver="cg"``.

    Returns:
        ``[B, Hk, T, G, D]`` the solutions x.

    Example:
        >>> h, q, lam = torch.eye(3).expand(1, 1, 2, 3, 3), torch.ones(1, 1, 2, 1, 3), torch.ones(1, 1, 3)
        >>> solve_dense(h, q, lam, "exact", 0)[0, 0, 0]  # (I + I)^-1 1
        tensor([[0.5000, 0.5000, 0.5000]])
    """
    lam = lam[:, None]  # [Hk, 1, G, D]: broadcasts over B and T
    if solver == "exact":
        chol = torch.linalg.cholesky(h[..., None, :, :] + torch.diag_embed(lam))
        return torch.cholesky_solve(q[..., None], chol)[..., 0]
    diag = h.diagonal(dim1=-2, dim2=-1)[..., None, :] + lam
    return conjugate_gradient(lambda p: torch.addcmul(p @ h, lam, p), q, diag, cg_steps)


def _decay_weights(log_gamma: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[t, s] = beta_s e^{g_t - g_s} for s <= t (0 above), g the cumulative log forget gate; and g."""
    t = log_gamma.shape[-1]
    cum = log_gamma.cumsum(-1)
    index = torch.arange(t, device=log_gamma.device)
    causal = index[:, None] >= index[None, :]
    w = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp() * beta[..., None, :]
    return w, cum


def _outer(k: torch.Tensor) -> torch.Tensor:
    """[..., T, D] -> [..., T, D * D]: the flattened k_t k_t^T."""
    return (k[..., :, None] * k[..., None, :]).flatten(-2)


def mesa_parallel(
    operands: MesaOperands,
    h0: torch.Tensor | None = None,
    g0: torch.Tensor | None = None,
    solver: str = "exact",
    cg_steps: int = 30,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence at once: returns (o [B, Hk, G, T, E], final H, final G).

    Args:
        operands: ``MesaOperands``: q ``[B, Hk, G, T, D]``, k ``[B, Hk, T, D]``, v ``[B, Hk, T, E]``, log_gamma and
            beta ``[B, Hk, T]``, lam ``[Hk, G, D]``.
        h0: ``[B, Hk, D, D]`` start state H, or None for zeros.
        g0: ``[B, Hk, D, E]`` start state G, or None for zeros.
        solver: ``"exact"`` or ``"cg"``.
        cg_steps: conjugate-gradient steps when ``solver="cg"``.

    Returns:
        ``(o, H, G)``: o ``[B, Hk, G, T, E]``, the final H ``[B, Hk, D, D]`` and G ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
        >>> operands = MesaOperands(q, k, v, -torch.rand(1, 2, 5), torch.rand(1, 2, 5), torch.ones(2, 1, 4))
        >>> o, h, g = mesa_parallel(operands)
        >>> o.shape, h.shape, g.shape
        (torch.Size([1, 2, 1, 5, 3]), torch.Size([1, 2, 4, 4]), torch.Size([1, 2, 4, 3]))
    """
    q, k, v, log_gamma, beta, lam = operands
    b, hk, groups, t, d = q.shape
    w, cum = _decay_weights(log_gamma, beta)  # [B, Hk, T, T]
    h_all = (w @ _outer(k)).view(b, hk, t, d, d)
    start = cum.exp()  # e^{g_t}: how much of the start state token t still sees
    if h0 is not None:
        h_all = h_all + start[..., None, None] * h0[:, :, None]
    x = solve_dense(h_all, q.transpose(2, 3), lam, solver, cg_steps).transpose(2, 3)  # [B, Hk, G, T, D]
    out = ((x @ k[:, :, None].transpose(-1, -2)) * w[:, :, None]) @ v[:, :, None]
    g_final = (k * w[..., -1, :, None]).transpose(-1, -2) @ v
    if g0 is not None:
        out = out + start[:, :, None, :, None] * (x @ g0[:, :, None])
        g_final = g_final + start[..., -1, None, None] * g0
    return out, h_all[:, :, -1], g_final


def mesa_chunked(
    operands: MesaOperands,
    h0: torch.Tensor,
    g0: torch.Tensor,
    chunk_size: int = 64,
    solver: str = "cg",
    cg_steps: int = 30,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks of ``chunk_size`` tokens from the states (h0, g0): returns (o [B, Hk, G, T, E], final H, final G).

    Inside chunk i with start states (H_i, G_i) and in-chunk cumulative log gate g_t, token t sees
    H_t = e^{g_t} H_i + sum_{s <= t} w_ts k_s k_s^T with w_ts = beta_s e^{g_t - g_s}, likewise G_t; the chunk
    leaves H_{i+1} = e^{g_C} H_i + sum_s w_Cs k_s k_s^T. The start states are passed first (a loop of one small
    product per chunk), then the chunks are solved a few at a time (CG's vectors small enough to stay in cache)
    and read at once.

    Args:
        operands: ``MesaOperands`` (q, k, v, log_gamma, beta, lam), shaped as for ``mesa_parallel``.
        h0: ``[B, Hk, D, D]`` start state H.
        g0: ``[B, Hk, D, E]`` start state G.
        chunk_size: tokens per chunk (any T works: the last chunk is padded).
        solver: ``"cg"`` or ``"exact"``.
        cg_steps: conjugate-gradient steps when ``solver="cg"``.

    Returns:
        ``(o, H, G)``: o ``[B, Hk, G, T, E]``, the final H ``[B, Hk, D, D]`` and G ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 5, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
        >>> operands = MesaOperands(q, k, v, -torch.rand(1, 1, 5), torch.rand(1, 1, 5), torch.ones(1, 2, 4))
        >>> h0, g0 = torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 3)
        >>> o, h, g = mesa_chunked(operands, h0, g0, chunk_size=2, solver="exact")
        >>> torch.allclose(o, mesa_parallel(operands, h0, g0, solver="exact")[0], atol=1e-5)
        True
    """
    q, k, v, log_gamma, beta, lam = operands
    b, hk, groups, t, d = q.shape
    e = v.shape[-1]
    pad = (-t) % chunk_size
    if pad:  # padded tail: zero keys and gates, no decay -> states untouched, outputs dropped
        q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        log_gamma, beta = F.pad(log_gamma, (0, pad)), F.pad(beta, (0, pad))
    n, c = (t + pad) // chunk_size, chunk_size
    qc = q.view(b, hk, groups, n, c, d).transpose(2, 3)  # [B, Hk, N, G, C, D]
    kc, vc = k.view(b, hk, n, c, d), v.view(b, hk, n, c, e)
    w, cum = _decay_weights(log_gamma.view(b, hk, n, c), beta.view(b, hk, n, c))  # [B, Hk, N, C, C], [.., C]
    written = kc * w[..., -1, :, None]  # keys weighted as the chunk's end state holds them
    carry = cum[..., -1].exp()  # [B, Hk, N]
    h_write, g_write = written.transpose(-1, -2) @ kc, written.transpose(-1, -2) @ vc
    h_starts, g_starts = [], []
    h, g = h0, g0
    for a, dh, dg in zip(carry.unbind(2), h_write.unbind(2), g_write.unbind(2), strict=True):
        h_starts.append(h)
        g_starts.append(g)
        h = a[..., None, None] * h + dh
        g = a[..., None, None] * g + dg
    h_start, g_start = torch.stack(h_starts, 2), torch.stack(g_starts, 2)  # [B, Hk, N, D, D], [B, Hk, N, D, E]
    start = cum.exp()[:, :, :, None, :, None]  # e^{g_t}: [B, Hk, N, 1, C, 1]

    if solver == "exact":
        h_tok = (w @ _outer(kc)).view(b, hk, n, c, d, d) + cum.exp()[..., None, None] * h_start[:, :, :, None]
        x = solve_dense(h_tok.view(b, hk, n * c, d, d), qc.transpose(3, 4).reshape(b, hk, n * c, groups, d),
                        lam, solver, cg_steps)
        x = x.view(b, hk, n, c, groups, d).transpose(3, 4)  # [B, Hk, N, G, C, D]
    else:
        diag = start * h_start.diagonal(dim1=-2, dim2=-1)[:, :, :, None, None, :] + (w @ kc.square())[:, :, :, None]
        diag = diag + lam[:, None, :, None, :]
        per_group = max(1, _CG_GROUP_ELEMENTS // (b * hk * groups * c * d))
        # split() rather than slicing: its backward joins the groups' gradients once
        parts = (t.split(per_group, dim=2) for t in (qc, diag, h_start, start, w, kc))
        x = torch.cat([_chunk_solves(*group, lam, cg_steps) for group in zip(*parts, strict=True)], dim=2)
    out = ((x @ kc[:, :, :, None].transpose(-1, -2)) * w[:, :, :, None]) @ vc[:, :, :, None]
    out = out + start * (x.reshape(b, hk, n, groups * c, d) @ g_start).view(b, hk, n, groups, c, e)
    out = out.transpose(2, 3).reshape(b, hk, groups, n * c, e)[:, :, :, :t]
    return out, h, g


#: entries of one CG vector over the chunks solved together (256 KiB of float32: they stay in cache)
_CG_GROUP_ELEMENTS = 1 << 16


def _chunk_solves(
    q: torch.Tensor,
    diag: torch.Tensor,
    h_start: torch.Tensor,
    start: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    lam: torch.Tensor,
    cg_steps: int,
) -> torch.Tensor:
    """CG for every token of some chunks: q [B, Hk, N, G, C, D], their start states h_start [B, Hk, N, D, D] seen
    with the weights start = e^{g_t} [B, Hk, N, 1, C, 1], in-chunk weights w [B, Hk, N, C, C] and keys
    k [B, Hk, N, C, D]; H_t p = e^{g_t} H_start p + sum_s w_ts k_s (k_s . p) + Lambda p, never built."""
    b, hk, n, groups, c, d = q.shape
    wg = w[:, :, :, None]  # broadcast over the query heads
    lam_b = lam[:, None, :, None, :]  # [Hk, 1, G, 1, D]
    keys_t = k.transpose(-1, -2)

    def matvec(p: torch.Tensor) -> torch.Tensor:
        rows = p.reshape(b, hk, n, groups * c, d)  # the query heads stacked: no broadcast copies of the keys
        old = (rows @ h_start).view(p.shape)
        scores = (rows @ keys_t).view(b, hk, n, groups, c, c) * wg
        inner = (scores.view(b, hk, n, groups * c, c) @ k).view(p.shape)
        return torch.addcmul(torch.addcmul(inner, start, old), lam_b, p)

    return conjugate_gradient(matvec, q, diag, cg_steps)


def mesa_step(
    operands: MesaOperands,
    h: torch.Tensor,
    g: torch.Tensor,
    solver: str = "exact",
    cg_steps: int = 30,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token (T == 1): returns (o [B, Hk, G, 1, E], new H, new G); ``in_place`` writes them into h and g.

    Args:
        operands: ``MesaOperands`` of one token: q ``[B, Hk, G, 1, D]``, k ``[B, Hk, 1, D]``, v ``[B, Hk, 1, E]``,
            log_gamma and beta ``[B, Hk, 1]``, lam ``[Hk, G, D]``.
        h: ``[B, Hk, D, D]`` state H before the token.
        g: ``[B, Hk, D, E]`` state G before the token.
        solver: ``"exact"`` or ``"cg"``.
        cg_steps: conjugate-gradient steps when ``solver="cg"``.
        in_place: update h and g in their buffers.

    Returns:
        ``(o, H, G)``: o ``[B, Hk, G, 1, E]`` and the new states.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5)
        >>> operands = MesaOperands(q, k, v, torch.zeros(1, 2, 1), torch.ones(1, 2, 1), torch.ones(2, 3, 4))
        >>> o, h, g = mesa_step(operands, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 5))
        >>> o.shape, h.shape, g.shape
        (torch.Size([1, 2, 3, 1, 5]), torch.Size([1, 2, 4, 4]), torch.Size([1, 2, 4, 5]))
    """
    q, k, v, log_gamma, beta, lam = operands
    gamma = log_gamma.exp()[..., None]  # [B, Hk, 1, 1]
    written = (k * beta[..., None]).transpose(-1, -2)  # beta k as a column: [B, Hk, D, 1]
    if in_place:
        h = h.mul_(gamma).addcmul_(written, k)
        g = g.mul_(gamma).addcmul_(written, v)
    else:  # the same ops out of place (so both give the same floats)
        h = torch.addcmul(gamma * h, written, k)
        g = torch.addcmul(gamma * g, written, v)
    if solver == "cg":
        x = _solve_one_token(h, q[:, :, :, 0], lam, cg_steps)  # [B, Hk, G, D]
    else:
        x = solve_dense(h[:, :, None], q.transpose(2, 3), lam, solver, cg_steps)[:, :, 0]
    return (x @ g)[:, :, :, None], h, g


def _solve_one_token(h: torch.Tensor, q: torch.Tensor, lam: torch.Tensor, cg_steps: int) -> torch.Tensor:
    """CG for one token's systems, h [B, Hk, D, D], q [B, Hk, G, D]: each query head's H + Lambda built once and
    every system a row of one 3-D batch (the same iterations as ``solve_dense``; ops on 3-D batches cost less
    than broadcasting ones over 5-D shapes, which is what a decode step's solve is made of)."""
    d = q.shape[-1]
    systems = (h[:, :, None] + torch.diag_embed(lam)).reshape(-1, d, d)  # [B * Hk * G, D, D]
    diag = systems.diagonal(dim1=-2, dim2=-1).unsqueeze(1)
    x = conjugate_gradient(lambda p: torch.bmm(p, systems), q.reshape(-1, 1, d), diag, cg_steps)
    return x.view(q.shape)
