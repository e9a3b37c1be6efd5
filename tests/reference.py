"""Independent float64 per-token references for attention mixers, written from the math.

Nothing here imports hf_recattn: every function loops over tokens in plain Python and works on one query
vector at a time, so that it can check the package's vectorized parallel / chunked / recurrent forms.

Conventions (those of the mixer contract): ``q`` is ``[B, H, T, D]``, ``k`` and ``v`` are ``[B, Hkv, T, D]``;
query head ``h`` reads key/value head ``h // (H // Hkv)``; outputs are ``[B, T, H, E]``. ``padding_mask`` is
``[B, T]`` bool (True = real token) or None; padded keys contribute nothing, and the output rows of padded
queries are defined as zero here (callers compare real rows only, see :func:`real_rows`).

Reusable pieces for other references: :func:`kv_head`, :func:`visible`, :func:`kernel_attention` (any kernel
``kappa(q_t, k_s)``), :func:`normalize_output`, the per-vector feature maps and :func:`rel_err`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor
#: kappa(q vector, k vector, query head, kv head) -> scalar
Kernel = Callable[[Tensor, Tensor, int, int], Tensor]

EXP_KEY_CLAMP = 40.0  # documented: keys are clamped at 40 before exp
NORMALIZE_KINDS = ("denominator", "l2", "rms", "layernorm")


# ----- small helpers ------------------------------------------------------------------------------------
def kv_head(h: int, num_heads: int, num_kv_heads: int) -> int:
    """The key/value head read by query head ``h`` (consecutive query heads share one)."""
    return h // (num_heads // num_kv_heads)


def is_real(padding_mask: Tensor | None, b: int, s: int) -> bool:
    return padding_mask is None or bool(padding_mask[b, s])


def visible(t: int, s: int, seq_len: int, causal: bool, window: int | None) -> bool:
    """Position rule only (padding is checked apart): causal, and within ``window`` tokens (self included)."""
    if causal and s > t:
        return False
    return window is None or t - s < window


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected| (in float64)."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-300))


def real_rows(out: Tensor, padding_mask: Tensor | None) -> Tensor:
    """Zero the output rows ``[B, T, ...]`` of padded query positions."""
    if padding_mask is None:
        return out
    shape = padding_mask.shape + (1,) * (out.dim() - 2)
    return out * padding_mask.reshape(shape).to(out.dtype)


# ----- softmax --------------------------------------------------------------------------------------------
def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    padding_mask: Tensor | None = None,
    window: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    logit_bias: Callable[[int, int, int, int], Tensor] | None = None,
) -> Tensor:
    """o_t = sum_s softmax_s(q_t . k_s * scale + bias) v_s over the visible real keys s; the bias is
    ``logit_bias(b, h, s, t)`` (row b, query head h, key s, query t), or none."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, num_heads, seq_len, d = q.shape
    num_kv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(bsz, seq_len, num_heads, v.shape[-1], dtype=torch.float64)
    rows = []
    for b in range(bsz):
        for h in range(num_heads):
            hk = kv_head(h, num_heads, num_kv)
            for t in range(seq_len):
                if not is_real(padding_mask, b, t):
                    rows.append(((b, t, h), None))
                    continue
                keys = [
                    s
                    for s in range(seq_len)
                    if visible(t, s, seq_len, causal, window) and is_real(padding_mask, b, s)
                ]
                scores = [torch.dot(q[b, h, t], k[b, hk, s]) * scale for s in keys]
                if logit_bias is not None:
                    scores = [x + logit_bias(b, h, s, t) for x, s in zip(scores, keys, strict=True)]
                top = max(float(x.detach()) for x in scores)
                weights = [torch.exp(x - top) for x in scores]
                total = sum(weights)
                rows.append(
                    ((b, t, h), sum(w / total * v[b, hk, s] for w, s in zip(weights, keys, strict=True)))
                )
    return _assemble(out, rows)


def _assemble(out: Tensor, rows: list[tuple[tuple[int, int, int], Tensor | None]]) -> Tensor:
    """Stack per-(b, t, h) vectors into ``out`` while keeping autograd (no in-place writes)."""
    zero = torch.zeros(out.shape[-1], dtype=out.dtype)
    by_index = dict(rows)
    bsz, seq_len, num_heads, _ = out.shape
    return torch.stack(
        [
            torch.stack(
                [
                    torch.stack(
                        [
                            by_index[(b, t, h)] if by_index[(b, t, h)] is not None else zero
                            for h in range(num_heads)
                        ]
                    )
                    for t in range(seq_len)
                ]
            )
            for b in range(bsz)
        ]
    )


# ----- feature maps, one vector at a time ---------------------------------------------------------------
def phi_identity(x: Tensor) -> Tensor:
    return x


def phi_elu(x: Tensor) -> Tensor:
    """elu(x) + 1: x + 1 where x > 0, exp(x) elsewhere."""
    return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))


def phi_relu(x: Tensor) -> Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def phi_cosine(x: Tensor, log_temperature: Tensor | None = None) -> Tensor:
    """x / |x|, times exp(log_temperature) on the query side."""
    y = x / torch.sqrt(torch.sum(x * x))
    return y if log_temperature is None else y * torch.exp(log_temperature)


def phi_exp_query(x: Tensor) -> Tensor:
    """exp(x - max(x)); the max is a constant shift (it cancels in every normalization), so no gradient."""
    return torch.exp(x - x.detach().max())


def phi_exp_key(x: Tensor) -> Tensor:
    """exp(min(x, 40))."""
    return torch.exp(torch.clamp(x, max=EXP_KEY_CLAMP))


def phi_hedgehog(x: Tensor, weight: Tensor) -> Tensor:
    """[softmax(x W), softmax(-x W)] with ``(x W)_e = sum_d x_d W[d, e]``."""
    proj = torch.mv(weight.transpose(0, 1), x)

    def softmax(z: Tensor) -> Tensor:
        ez = torch.exp(z - z.detach().max())
        return ez / ez.sum()

    return torch.cat([softmax(proj), softmax(-proj)])


def taylor2_kernel_value(qv: Tensor, kv: Tensor) -> Tensor:
    """1 + s + s^2 / 2 with s = q . k / sqrt(d): the second-order Taylor polynomial of exp(s)."""
    s = torch.dot(qv, kv) / math.sqrt(qv.shape[0])
    return 1.0 + s + s * s / 2.0


def feature_map_kernel(name: str, params: dict[str, Tensor] | None = None) -> Kernel:
    """kappa(q, k) = phi_q(q) . phi_k(k) for the named feature map (taylor2 is given as its kernel directly).

    ``params``: ``log_temperature`` [H] (cosine); ``q_weight`` [H, D, D], ``k_weight`` [Hkv, D, D] (hedgehog).
    """
    params = params or {}

    def dot_of(phi_q: Callable[[Tensor, int], Tensor], phi_k: Callable[[Tensor, int], Tensor]) -> Kernel:
        return lambda qv, kv, h, hk: torch.dot(phi_q(qv, h), phi_k(kv, hk))

    plain = {"identity": phi_identity, "elu": phi_elu, "relu": phi_relu}
    if name in plain:
        phi = plain[name]
        return dot_of(lambda x, h: phi(x), lambda x, hk: phi(x))
    if name == "cosine":
        temp = params.get("log_temperature")
        return dot_of(
            lambda x, h: phi_cosine(x, None if temp is None else temp[h].double()),
            lambda x, hk: phi_cosine(x),
        )
    if name == "exp":
        return dot_of(lambda x, h: phi_exp_query(x), lambda x, hk: phi_exp_key(x))
    if name == "hedgehog":
        qw, kw = params["q_weight"].double(), params["k_weight"].double()
        return dot_of(lambda x, h: phi_hedgehog(x, qw[h]), lambda x, hk: phi_hedgehog(x, kw[hk]))
    if name == "taylor2":
        return lambda qv, kv, h, hk: taylor2_kernel_value(qv, kv)
    raise ValueError(f"reference: unknown feature map {name!r}")


# ----- kernel (linear) attention ---------------------------------------------------------------------------
def _norm(x: Tensor) -> Tensor:
    """|x|, with the subgradient 0 at x = 0 (plain sqrt would give a NaN gradient there)."""
    sq = torch.sum(x * x)
    positive = sq > 0
    return torch.where(
        positive, torch.sqrt(torch.where(positive, sq, torch.ones_like(sq))), torch.zeros_like(sq)
    )


def normalize_output(num: Tensor, den: Tensor, kind: str, eps: float, gain: Tensor | None = None) -> Tensor:
    """One head's output from numerator ``sum kappa v`` and denominator ``sum kappa``.

    denominator: num / (den + eps); l2: num / (|num| + eps); rms: num / sqrt(mean num^2 + eps);
    layernorm: (num - mean) / sqrt(var + eps). The vector norms multiply by the head's ``gain`` [E].
    """
    if kind == "denominator":
        return num / (den + eps)
    if kind == "l2":
        out = num / (_norm(num) + eps)
    elif kind == "rms":
        out = num / torch.sqrt(torch.mean(num * num) + eps)
    elif kind == "layernorm":
        centered = num - torch.mean(num)
        out = centered / torch.sqrt(torch.mean(centered * centered) + eps)
    else:
        raise ValueError(f"reference: unknown normalize {kind!r}")
    return out if gain is None else out * gain


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel: Kernel,
    padding_mask: Tensor | None = None,
    causal: bool = True,
    normalize: str = "denominator",
    eps: float = 1e-6,
    gain: Tensor | None = None,
    forget: Tensor | None = None,
    sink: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """o_t = norm(sum_s kappa(q_t, k_s) v_s, sum_s kappa(q_t, k_s)) over real keys s (s <= t when causal).

    ``gain`` is [H, E] (per query head) for the vector norms. ``forget`` [B, Hkv, T] are per-token forget
    factors g: key s then reaches query t with the weight kappa * g_{s+1} * ... * g_t. ``sink`` is an extra
    (key [Hkv, D], value [Hkv, E], log weight [Hkv]) that every query sees with weight e^w kappa(q, key).
    """
    q, k, v = q.double(), k.double(), v.double()
    gain = None if gain is None else gain.double()
    bsz, num_heads, seq_len, _ = q.shape
    num_kv, e = k.shape[1], v.shape[-1]
    rows = []
    for b in range(bsz):
        for h in range(num_heads):
            hk = kv_head(h, num_heads, num_kv)
            for t in range(seq_len):
                if not is_real(padding_mask, b, t):
                    rows.append(((b, t, h), None))
                    continue
                num = torch.zeros(e, dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                if sink is not None:
                    sink_key, sink_value, sink_log_weight = (x.double() for x in sink)
                    weight = torch.exp(sink_log_weight[hk]) * kernel(q[b, h, t], sink_key[hk], h, hk)
                    num = num + weight * sink_value[hk]
                    den = den + weight
                for s in range(seq_len):
                    if not visible(t, s, seq_len, causal, None) or not is_real(padding_mask, b, s):
                        continue
                    weight = kernel(q[b, h, t], k[b, hk, s], h, hk)
                    if forget is not None:
                        for r in range(s + 1, t + 1):
                            weight = weight * forget[b, hk, r]
                    num = num + weight * v[b, hk, s]
                    den = den + weight
                rows.append(
                    ((b, t, h), normalize_output(num, den, normalize, eps, None if gain is None else gain[h]))
                )
    return _assemble(torch.zeros(bsz, seq_len, num_heads, e, dtype=torch.float64), rows)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: str,
    params: dict[str, Tensor] | None = None,
    padding_mask: Tensor | None = None,
    causal: bool = True,
    normalize: str = "denominator",
    eps: float = 1e-6,
    gain: Tensor | None = None,
    forget: Tensor | None = None,
    sink: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Linear attention with a named feature map (see :func:`feature_map_kernel` for ``params``)."""
    return kernel_attention(
        q, k, v, feature_map_kernel(feature_map, params), padding_mask, causal, normalize, eps, gain, forget, sink
    )


def forget_factors(x: Tensor, bias: Tensor, weight: Tensor | None = None) -> Tensor:
    """[B, Hkv, T] factors g = 1 / (1 + exp(-(w_h . x_t / sqrt(C) + b_h))), one token and head at a time, in
    float64 (C: channels of x)."""
    x, bias = x.double(), bias.double()
    bsz, seq_len, _ = x.shape
    out = torch.zeros(bsz, bias.shape[0], seq_len, dtype=torch.float64)
    for b in range(bsz):
        for h in range(bias.shape[0]):
            for t in range(seq_len):
                if weight is None:
                    logit = bias[h]
                else:
                    logit = torch.dot(weight[h].double(), x[b, t]) / math.sqrt(x.shape[-1]) + bias[h]
                out[b, h, t] = 1.0 / (1.0 + torch.exp(-logit))
    return out
