"""Functional forms of the delta-rule family: one token updates the state S [D, E] (keys x values) as

    S_t = alpha_t S_{t-1} - erase_t k_t (k_t^T S_{t-1}) + beta_t k_t v_t^T,        o_t = S_t^T q_t.

* DeltaNet:        alpha = 1,  erase = beta = b        (S_t = S_{t-1} (I - b k k^T) + b k v^T, keys x values)
* Gated DeltaNet:  alpha = a,  erase = a b, beta = b   (S_t = a S_{t-1} (I - b k k^T) + b k v^T)
* Comba:           alpha = g,  erase = beta = e        (S_t = g S_{t-1} + e k (v - S_{t-1}^T k)^T)

Every rule is the same linear recurrence S_t = alpha_t S_{t-1} + k_t u_t^T with the "new value"
u_t = beta_t v_t - erase_t S_{t-1}^T k_t. Inside a block with start state S_0 and log decay G_t = sum log alpha,
u_t depends on the earlier u_s through k_t . k_s, a unit lower-triangular system (the UT transform):

    (I + L) U = diag(beta) V - diag(erase_t e^{G_{t-1}}) K S_0,   L_ts = erase_t e^{G_{t-1} - G_s} k_t . k_s (s < t),

The parallel form is one block over the whole sequence, solved by two triangular solves for
W = (I + L)^-1 diag(erase e^{G_{t-1}}) K and U~ = (I + L)^-1 diag(beta) V, so U = U~ - W S_0 once S_0 is known.
The chunked form builds the in-chunk terms and inverts (I + L) for many chunks at once (batched products), then
passes the state from chunk to chunk, three small products per chunk (see ``delta_chunked``).

DeltaProduct (``steps`` n > 1): each token carries n keys / values / coefficients, applied as n successive updates
before its query reads the state. The key-side tensors then hold T * n entries (token-major), the queries T.

Shapes: q [B, Hk, G, T, D] (G query heads read one key head's state), k [B, Hk, T*n, D], v [B, Hk, T*n, E],
log_alpha / beta / erase [B, Hk, T*n]; S [B, Hk, D, E]. No scaling, normalization or masking happens here: padded
entries are the caller's business (beta = erase = 0 and log_alpha = 0 leave the state untouched).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .backends import pick
from .fla_adapters import delta_gates, delta_op, run_fla, too_wide
from .triangular import unit_lower_solve

#: why fla's kernels do not run DeltaProduct
SEVERAL_UPDATES = "several updates per token (DeltaProduct)"


def _block_terms(operands: tuple[torch.Tensor, ...], steps: int) -> tuple[torch.Tensor, ...]:
    """Everything of a block that does not depend on its start state (any leading dims before the block's).

    ``operands``: q [..., G, Tq, D], k [..., C, D] with C = Tq * steps, v, log_alpha, beta and erase. Returns
    W [..., C, D], U~ [..., C, E], the decayed in-block scores [..., G, Tq, C], q e^{G_t} [..., G, Tq, D] (reads
    S_0), k e^{G_C - G_s} [..., C, D] (writes the block into the next state) and e^{G_C} [...] (carries S_0 over
    the block).
    """
    q, k, v, log_alpha, beta, erase = operands
    c = k.shape[-2]
    index = torch.arange(c, device=k.device)
    cum = log_alpha.cumsum(-1)
    prev = cum - log_alpha
    strictly_before = index[:, None] > index[None, :]
    to_prev = (prev[..., :, None] - cum[..., None, :]).masked_fill(~strictly_before, float("-inf")).exp()
    lower = (k @ k.transpose(-1, -2)) * to_prev * erase[..., :, None]
    # two solves: LAPACK's batched triangular solve is slower per column with the keys and values side by side
    w = unit_lower_solve(lower, (erase * prev.exp())[..., None] * k)
    u = unit_lower_solve(lower, beta[..., None] * v)
    read_at = index[steps - 1 :: steps]  # the micro-step after which each query reads the state
    cum_q = cum[..., steps - 1 :: steps]
    visible = read_at[:, None] >= index[None, :]
    to_query = (cum_q[..., :, None] - cum[..., None, :]).masked_fill(~visible, float("-inf")).exp()
    scores = (q @ k.unsqueeze(-3).transpose(-1, -2)) * to_query.unsqueeze(-3)
    q_state = q * cum_q.exp()[..., None, :, None]
    k_state = k * (cum[..., -1:] - cum).exp()[..., None]
    return w, u, scores, q_state, k_state, cum[..., -1].exp()


def delta_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    beta: torch.Tensor,
    erase: torch.Tensor,
    state: torch.Tensor | None = None,
    steps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence as one block: returns (o [B, Hk, G, T, E], final state [B, Hk, D, E]).

    Args:
        q: ``[B, Hk, G, T, D]`` queries, G query heads per key head.
        k: ``[B, Hk, T * n, D]`` keys, n = ``steps`` per token (token-major).
        v: ``[B, Hk, T * n, E]`` values.
        log_alpha: ``[B, Hk, T * n]`` log decay of the state (<= 0; 0 keeps it).
        beta: ``[B, Hk, T * n]`` write strength of the value.
        erase: ``[B, Hk, T * n]`` strength of the removal of what the state recalls for the key.
        state: ``[B, Hk, D, E]`` start state (the inputs are cast to its dtype), or None for zeros.
        steps: updates per token (DeltaProduct's n); each query reads the state after its token's last one.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 1, 5, 4), F.normalize(torch.randn(1, 2, 5, 4), dim=-1), torch.randn(1, 2, 5, 3)
        >>> b = torch.full((1, 2, 5), 0.5)
        >>> o, s = delta_parallel(q, k, v, torch.zeros(1, 2, 5), b, b)  # DeltaNet: alpha = 1, erase = beta = b
        >>> o.shape, s.shape
        (torch.Size([1, 2, 1, 5, 3]), torch.Size([1, 2, 4, 3]))
    """
    if state is not None:  # computed in the state's dtype (float32 states of a half-precision model)
        q, k, v = q.to(state.dtype), k.to(state.dtype), v.to(state.dtype)
        log_alpha, beta, erase = log_alpha.to(state.dtype), beta.to(state.dtype), erase.to(state.dtype)
    w, u, scores, q_state, k_state, carry = _block_terms((q, k, v, log_alpha, beta, erase), steps)
    if state is None:
        return scores @ u.unsqueeze(2), k_state.transpose(-1, -2) @ u
    u = u - w @ state
    out = q_state @ state.unsqueeze(2) + scores @ u.unsqueeze(2)
    return out, carry[..., None, None] * state + k_state.transpose(-1, -2) @ u


#: in-chunk terms are built for groups of chunks of about this many [C, C] elements at a time: fresh buffers of
#: this size are reused by the allocator from group to group (larger ones fault in new pages on every call)
GROUP_ELEMENTS = 2**19


def _chunk_major(x: torch.Tensor, n: int, lead: int) -> torch.Tensor:
    """[*lead dims, N * L, ...] -> [N, prod(lead dims), L, ...] contiguous: each chunk one block of memory."""
    shape = x.shape
    x = x.reshape(*shape[:lead], n, -1, *shape[lead + 1 :]).movedim(lead, 0)
    return x.reshape(n, -1, *x.shape[lead + 1 :]).contiguous()


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(a))^-1 for [..., C, C], without LAPACK (its batched triangular solves are slower than
    batched products at these sizes, and much slower with more than one thread).

    The diagonal blocks of size 8 are inverted row by row (forward substitution, all blocks at once); then, by
    doubling, each diagonal block of size 2s, [[A, 0], [B, D]], gets the inverse [[A^-1, 0], [-D^-1 B A^-1, D^-1]]
    from its halves' inverses: two batched products per level.
    """
    c = a.shape[-1]
    n = 1 << (c - 1).bit_length()  # the next power of two: pad with identity rows / columns
    if n != c:
        a = F.pad(a, (0, n - c, 0, n - c))
    lead = a.shape[:-2]
    out = torch.zeros_like(a)
    s = min(n, 8)
    m = n // s
    leaves = torch.diagonal(a.view(*lead, m, s, m, s), dim1=-4, dim2=-2).movedim(-1, -3)  # [..., m, s, s]
    inverse = torch.zeros_like(leaves)
    inverse.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    for i in range(1, s):  # row i of the inverse: -a[i, :i] @ inverse[:i, :i]
        inverse[..., i, :i] = -(leaves[..., i : i + 1, :i] @ inverse[..., :i, :i]).squeeze(-2)
    torch.diagonal(out.view(*lead, m, s, m, s), dim1=-4, dim2=-2).copy_(inverse.movedim(-3, -1))
    while s < n:
        m = n // (2 * s)
        # the diagonal blocks of size 2s as [..., 2, s, 2, s, m] views (block index last)
        blocks = torch.diagonal(out.view(*lead, m, 2, s, m, 2, s), dim1=-6, dim2=-3)
        below = torch.diagonal(a.view(*lead, m, 2, s, m, 2, s), dim1=-6, dim2=-3)[..., 1, :, 0, :, :]
        first, second = blocks[..., 0, :, 0, :, :].movedim(-1, -3), blocks[..., 1, :, 1, :, :].movedim(-1, -3)
        product = second @ (below.movedim(-1, -3) @ first)
        torch.neg(product.movedim(-3, -1), out=blocks[..., 1, :, 0, :, :])
        s *= 2
    return out[..., :c, :c] if n != c else out


class _ChunkRecurrence(torch.autograd.Function):
    """The sequential part of the chunked form, chunk by chunk (i < N, batched over X = B * Hk):

        new_i = (I + L_i)^-1 (V~_i - K~_i S_i),        S_{i+1} = c_i S_i + K^_i^T new_i.

    Inputs: L [N, X, C, C] (only its strictly lower triangle is read), K~ [N, X, C, D], V~ [N, X, C, E],
    K^ [N, X, C, D], c [N, X], S_0 [X, D, E]. Returns every state [N + 1, X, D, E] (S_0 .. S_N) and the new
    values [N, X, C, E]. The inverses of all the chunks' systems are computed at once, so that each chunk costs three
    small products each way. The backward runs the adjoint recurrence (g_i = dL/dS_i over all paths):

        r_i = (I + L_i)^-T (dL/dnew_i + K^_i g_{i+1}),     g_i = dL/dS_i (direct) + c_i g_{i+1} - K~_i^T r_i,

    then dL/dV~ = r, dL/dK~ = -r S^T, dL/dL = -strictly_lower(r new^T), dL/dK^ = new g_{i+1}^T and
    dL/dc_i = <S_i, g_{i+1}> for all chunks at once. Written by hand because autograd would add a full-size
    gradient buffer per indexed chunk (O(N^2)).
    """

    @staticmethod
    def forward(ctx, lower, key_rhs, value_rhs, key_state, carry, s0):
        n, x, c, _ = key_rhs.shape
        inverse = _unit_lower_inverse(lower)
        states = s0.new_empty((n + 1, *s0.shape))
        news = s0.new_empty((n, x, c, s0.shape[-1]))
        states[0] = s0
        for i in range(n):
            torch.bmm(inverse[i], torch.baddbmm(value_rhs[i], key_rhs[i], states[i], alpha=-1.0), out=news[i])
            torch.baddbmm(states[i] * carry[i, :, None, None], key_state[i].transpose(-1, -2), news[i],
                          out=states[i + 1])
        ctx.save_for_backward(inverse, key_rhs, key_state, carry, states, news)
        return states, news

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_states, grad_news):
        inverse, key_rhs, key_state, carry, states, news = ctx.saved_tensors
        n = key_rhs.shape[0]
        grad_next = torch.empty_like(states[1:])  # dL/dS_{i+1}, all paths
        grad_rhs = torch.empty_like(news)
        grad = grad_states[n]
        for i in range(n - 1, -1, -1):
            grad_next[i] = grad
            torch.bmm(inverse[i].transpose(-1, -2), torch.baddbmm(grad_news[i], key_state[i], grad), out=grad_rhs[i])
            grad = torch.baddbmm(grad_states[i] + carry[i, :, None, None] * grad, key_rhs[i].transpose(-1, -2),
                                 grad_rhs[i], alpha=-1.0)
        starts = states[:-1]
        grad_lower = -(grad_rhs @ news.transpose(-1, -2)).tril_(-1)
        grad_key_rhs = -(grad_rhs @ starts.transpose(-1, -2))
        grad_key_state = news @ grad_next.transpose(-1, -2)
        grad_carry = (starts * grad_next).sum((-1, -2))
        return grad_lower, grad_key_rhs, grad_rhs, grad_key_state, grad_carry, grad


def _chunk_group(
    operands: tuple[torch.Tensor, ...], state: torch.Tensor, chunk_size: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive tokens (delta_chunked's layout) from state [X, D, E]: (o [B, chunks * Cq, Hk, G, E], state);
    ``operands``: q, k, v, log_alpha, beta, erase."""
    q, k, v, log_alpha, beta, erase = operands
    b, hk, groups, t, d = q.shape
    e = v.shape[-1]
    pad = (-t) % chunk_size
    if pad:  # padded entries: zero keys and coefficients, no decay -> the state is untouched
        q = F.pad(q, (0, 0, 0, pad))
        k, v = F.pad(k, (0, 0, 0, pad * steps)), F.pad(v, (0, 0, 0, pad * steps))
        log_alpha, beta, erase = (F.pad(y, (0, pad * steps)) for y in (log_alpha, beta, erase))
    n, x = (t + pad) // chunk_size, b * hk
    cq, c = chunk_size, chunk_size * steps
    # chunk-major layout [N, X = B * Hk, ...]: every chunk one contiguous block; queries [N, X, G * Cq, D]
    qn = _chunk_major(q, n, 3).view(n, x, groups * cq, d)
    kn, vn = _chunk_major(k, n, 2), _chunk_major(v, n, 2)
    la, be, er = (_chunk_major(y, n, 2) for y in (log_alpha, beta, erase))

    cum = la.cumsum(-1)  # log decay from the chunk's start state through entry s
    prev = cum - la  # ... up to just before entry s
    # P[t, s] = e^{G_{t-1} - G_s} for s < t: the decay from entry s to the state entry t reads (1 on and above the
    # diagonal, where the triangular system is not read). Exponents are clamped at the log of the dtype's smallest
    # normal number: exp() is ~10x slower where it underflows, and e^-87 is below anything fp32 resolves next
    # to the other terms. In-place ops on fresh tensors (autograd-safe) keep these [C, C] passes in cache.
    index = torch.arange(c, device=kn.device)
    strictly_lower = (index[:, None] > index).to(kn.dtype)
    floor = math.log(torch.finfo(kn.dtype).tiny)
    decay = (prev[..., :, None] - cum[..., None, :]).mul_(strictly_lower).clamp_(min=floor).exp_()
    lower = ((kn * er[..., None]) @ kn.transpose(-1, -2)).mul_(decay)
    key_rhs = kn * (er * prev.exp())[..., None]
    value_rhs = vn * be[..., None]
    last = cum[..., -1:]
    key_state = kn * (last - cum).exp()[..., None]

    # queries read after their token's last micro-step r: e^{G_r - G_s} = alpha_r P[r, s] for s < r, 1 at s = r
    read = slice(steps - 1, None, steps)
    to_query = (decay[..., read, :] * la[..., read, None].exp()).mul_(strictly_lower[read])  # [N, X, Cq, C]
    to_query.view(n, x, cq * c)[..., steps - 1 :: c + steps] += 1.0  # (j, r_j): j * (C + steps) + steps - 1
    scores = (qn @ kn.transpose(-1, -2)).view(n, x, groups, cq, c).mul_(to_query[:, :, None])
    q_state = qn.view(n, x, groups, cq, d) * cum[..., read, None].exp()[:, :, None]

    states, news = _ChunkRecurrence.apply(lower, key_rhs, value_rhs, key_state, last[..., 0].exp(), state)
    out = torch.baddbmm(
        scores.reshape(n * x, groups * cq, c) @ news.view(n * x, c, e),
        q_state.reshape(n * x, groups * cq, d),
        states[:-1].view(n * x, d, e),
    )
    # tokens before heads, as callers want them: [B, N * Cq, Hk, G, E]
    out = out.view(n, b, hk, groups, cq, e).permute(1, 0, 4, 2, 3, 5).reshape(b, n * cq, hk, groups, e)
    return out, states[-1]


def _operands(
    chunked: bool, operands: tuple[torch.Tensor, ...], state: torch.Tensor, several_updates: bool, rule: str
) -> tuple[tuple[torch.Tensor, ...], Callable | None]:
    """(q, k, v, log_alpha, beta, erase) in the state's dtype (the float32 state of a half-precision model), and
    fla's function ``pick`` chooses for ``rule``'s chunk (``chunked``) or decode op on them (None: the torch form
    runs)."""
    operands = tuple(x.to(state.dtype) for x in operands)
    name, uncovered = delta_op(rule, chunked)
    unsupported = SEVERAL_UPDATES if several_updates else uncovered or too_wide(operands[1])
    return operands, pick(name, *operands, state, unsupported=unsupported)


def delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    beta: torch.Tensor,
    erase: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    steps: int = 1,
    rule: str = "general",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of ``chunk_size`` tokens: the in-chunk terms of a group of chunks at once, then state passing.

    In a chunk with start state S, the new values solve (I + L) U = diag(beta) V - diag(erase e^{G_{t-1}}) K S
    (see the module docstring); the chunk's queries read q e^{G_t} S + scores U and it leaves the state
    e^{G_C} S + K^T U with K^ the keys decayed to the chunk's end. Returns (o [B, Hk, G, T, E], final state).

    O(T * chunk) time. The [C, C] terms exist for one group of chunks at a time (about GROUP_ELEMENTS elements);
    with autograd, checkpointing per group keeps them out of the saved activations. ``o`` is a permuted view of
    memory laid out [B, T, Hk, G, E].

    Args:
        q: ``[B, Hk, G, T, D]`` queries, G query heads per key head.
        k: ``[B, Hk, T * n, D]`` keys, n = ``steps`` per token (token-major).
        v: ``[B, Hk, T * n, E]`` values.
        log_alpha: ``[B, Hk, T * n]`` log decay of the state (<= 0).
        beta: ``[B, Hk, T * n]`` write strength of the value.
        erase: ``[B, Hk, T * n]`` strength of the removal of what the state recalls for the key.
        state: ``[B, Hk, D, E]`` start state; the inputs are cast to its dtype.
        chunk_size: tokens per chunk (any T works: the last chunk is padded).
        steps: updates per token (DeltaProduct's n).
        rule: which rule the coefficients follow (``delta``: alpha = 1, erase = beta; ``gated``: erase = alpha
            beta; ``comba``; ``general``): where fla computes it, ``backends.pick`` may run fla's chunk kernel.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, T, E]`` and the final state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 1, 2, 6, 4), F.normalize(torch.randn(1, 1, 6, 4), dim=-1), torch.randn(1, 1, 6, 3)
        >>> log_a, b, s0 = -torch.rand(1, 1, 6), torch.rand(1, 1, 6), torch.zeros(1, 1, 4, 3)
        >>> o, s = delta_chunked(q, k, v, log_a, b, b * log_a.exp(), s0, chunk_size=4)  # Gated DeltaNet
        >>> o_ref, s_ref = delta_parallel(q, k, v, log_a, b, b * log_a.exp(), s0)
        >>> torch.allclose(o, o_ref, atol=1e-5), torch.allclose(s, s_ref, atol=1e-5)
        (True, True)
    """
    (q, k, v, log_alpha, beta, erase), kernel = _operands(
        True, (q, k, v, log_alpha, beta, erase), state, several_updates=steps > 1, rule=rule
    )
    if kernel is not None:
        return run_fla(kernel, q, k, v, state, **delta_gates(rule, log_alpha, beta))
    b, hk, g, t, d = q.shape
    e = v.shape[-1]
    x, c = b * hk, chunk_size * steps
    state = state.reshape(x, d, e)
    # groups of whole chunks, each laid out chunk-major and finished before the next (keeps buffers small)
    per_group = chunk_size * max(1, GROUP_ELEMENTS // (x * c * max(c, g * chunk_size)))
    # split() (not slicing) so that the backward joins the gradients in one cat instead of a full-size buffer each
    pieces = zip(
        q.split(per_group, dim=3), k.split(per_group * steps, dim=2), v.split(per_group * steps, dim=2),
        *(y.split(per_group * steps, dim=-1) for y in (log_alpha, beta, erase)), strict=True,
    )
    # with autograd, each group's in-chunk terms ([C, C] per token) are recomputed in the backward instead of
    # kept: about one more forward, for activation memory that no longer grows with the chunk size
    tracked = torch.is_grad_enabled() and any(y.requires_grad for y in (q, k, v, log_alpha, beta, erase, state))
    outs = []
    for group in pieces:
        if tracked:
            o, state = checkpoint(_chunk_group, group, state, chunk_size, steps,
                                  use_reentrant=False, preserve_rng_state=False)
        else:
            o, state = _chunk_group(group, state, chunk_size, steps)
        outs.append(o[:, : group[0].shape[3]])
    # one copy into [B, T, Hk, G, E] memory (a cat, whose backward only slices), returned as [B, Hk, G, T, E]
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out.permute(0, 2, 3, 1, 4), state.view(b, hk, d, e)


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    beta: torch.Tensor,
    erase: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
    rule: str = "general",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (T == 1, its ``steps`` updates in a row): returns (o [B, Hk, G, 1, E], new state).

    Args:
        q: ``[B, Hk, G, 1, D]`` the token's queries.
        k: ``[B, Hk, n, D]`` its keys, one per update (n = 1 but for DeltaProduct).
        v: ``[B, Hk, n, E]`` its values.
        log_alpha: ``[B, Hk, n]`` log decay of the state.
        beta: ``[B, Hk, n]`` write strength of the value.
        erase: ``[B, Hk, n]`` strength of the removal of what the state recalls for the key.
        state: ``[B, Hk, D, E]`` the state before the token.
        in_place: write the new state into ``state``'s buffer.
        rule: which rule the coefficients follow (see ``delta_chunked``): where fla computes it,
            ``backends.pick`` may run fla's fused-recurrent kernel.

    Returns:
        ``(o, state)``: o ``[B, Hk, G, 1, E]`` and the new state ``[B, Hk, D, E]``.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 1, 4), F.normalize(torch.randn(1, 2, 1, 4), dim=-1), torch.randn(1, 2, 1, 5)
        >>> b = torch.full((1, 2, 1), 0.5)
        >>> o, s = delta_step(q, k, v, torch.zeros(1, 2, 1), b, b, torch.zeros(1, 2, 4, 5))
        >>> o.shape, s.shape
        (torch.Size([1, 2, 3, 1, 5]), torch.Size([1, 2, 4, 5]))
    """
    (q, k, v, log_alpha, beta, erase), kernel = _operands(
        False, (q, k, v, log_alpha, beta, erase), state, several_updates=k.shape[2] > 1, rule=rule
    )
    if kernel is not None:
        return run_fla(kernel, q, k, v, state, in_place, **delta_gates(rule, log_alpha, beta))
    for j in range(k.shape[2]):
        kj = k[:, :, j : j + 1]  # [B, Hk, 1, D]
        read = kj @ state  # k^T S: [B, Hk, 1, E]
        new = beta[:, :, j, None, None] * v[:, :, j : j + 1] - erase[:, :, j, None, None] * read
        alpha = log_alpha[:, :, j, None, None].exp()
        if in_place:
            state = state.mul_(alpha).addcmul_(kj.transpose(-1, -2), new)
        else:
            state = torch.addcmul(alpha * state, kj.transpose(-1, -2), new)
    return (q[:, :, :, 0] @ state).unsqueeze(3), state  # [B, Hk, G, D] @ [B, Hk, D, E]: no copy of the state
