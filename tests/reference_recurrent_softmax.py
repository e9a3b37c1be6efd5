"""Independent float64 per-token references for the taylor, heinsen and hybrid mixers, written from the math.

Nothing here imports hf_recattn. Each function loops over batch rows, query heads and query positions and
works on one query vector at a time, so it checks the package's vectorized parallel / chunked / recurrent
forms without sharing their code.

Conventions (the mixer contract): ``q`` ``[B, H, T, D]``, ``k`` / ``v`` ``[B, Hkv, T, D]``; query head ``h``
reads key/value head ``h // (H // Hkv)``; outputs ``[B, T, H, E]``. ``mask`` is ``[B, T]`` bool (True = real)
or None; padded keys contribute nothing and padded query rows are returned as zeros (compare real rows only,
with :func:`real_rows`).

At the end, :func:`cache_mismatch` drives a tiny RecAttnForCausalLM (prefill + steps vs one full forward);
it is a test harness, not a reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor
#: kappa(query vector, key vector, query head) -> non-negative weight
Kernel = Callable[[Tensor, Tensor, int], Tensor]


# ----- helpers ------------------------------------------------------------------------------------------
def rel_err(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-300))


def real_rows(out: Tensor, mask: Tensor | None) -> Tensor:
    """Zero the ``[B, T, ...]`` rows of padded query positions."""
    if mask is None:
        return out
    return out * mask.reshape(*mask.shape, *([1] * (out.dim() - 2))).to(out.dtype)


def _real(mask: Tensor | None, b: int, s: int) -> bool:
    return mask is None or bool(mask[b, s])


def taylor_value(x: Tensor, order: int | str) -> Tensor:
    """sum_{n<=N} x^n / n! term by term (no Horner), or exp(x)."""
    if order == "exp":
        return torch.exp(x)
    return sum(x**n / math.factorial(n) for n in range(int(order) + 1))


def phi(name: str | None, x: Tensor, log_temperature: float = 0.0, is_query: bool = False) -> Tensor:
    """Feature maps applied to one vector before the Taylor expansion / in the linear far part."""
    if name is None or name == "identity":
        return x
    if name == "relu":
        return x.clamp_min(0.0)
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(x))
    if name == "cosine":
        x = x / x.norm().clamp_min(1e-12)
        return x * math.exp(log_temperature) if is_query else x
    if name == "hedgehog":  # at its identity initialization
        return torch.cat([torch.softmax(x, 0), torch.softmax(-x, 0)])
    raise ValueError(name)


def finish(
    num: Tensor,
    den: Tensor,
    count: int,
    kind: str,
    eps: float,
    gain: Tensor | None = None,
    gate: float | None = None,
) -> Tensor:
    """The denominators of Mongaras & Larson on one output vector."""
    if kind == "exact":
        return num / den.clamp_min(eps)
    if kind == "linear":  # linear attention's own rule
        return num / (den + eps)
    if kind == "none":
        return num
    if kind == "gate":
        return num * gate / max(count, 1)
    if kind == "l2":
        out = num / (num.norm() + eps)
    elif kind == "rms":
        out = num / torch.sqrt((num**2).mean() + eps)
    elif kind == "layernorm":
        centered = num - num.mean()
        out = centered / torch.sqrt((centered**2).mean() + eps)
    else:
        raise ValueError(kind)
    return out if gain is None else out * gain


def _stack(rows: dict[tuple[int, int, int], Tensor], shape: tuple[int, int, int, int]) -> Tensor:
    bsz, seq, heads, e = shape
    out = []
    for b in range(bsz):
        out.append(
            torch.stack(
                [
                    torch.stack(
                        [rows.get((b, t, h), torch.zeros(e, dtype=torch.float64)) for h in range(heads)]
                    )
                    for t in range(seq)
                ]
            )
        )
    return torch.stack(out)


# ----- softmax ------------------------------------------------------------------------------------------
def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """o_t = sum_s softmax_s(scale q_t . k_s) v_s over visible real keys."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq, d = q.shape
    groups = heads // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    rows = {}
    for b in range(bsz):
        for h in range(heads):
            hk = h // groups
            for t in range(seq):
                if not _real(mask, b, t):
                    continue
                keys = [s for s in range(seq) if (not causal or s <= t) and _real(mask, b, s)]
                logits = torch.stack([scale * q[b, h, t] @ k[b, hk, s] for s in keys])
                w = torch.softmax(logits, 0)
                rows[(b, t, h)] = sum(w[i] * v[b, hk, s] for i, s in enumerate(keys))
    return _stack(rows, (bsz, seq, heads, v.shape[-1]))


# ----- taylor (Mongaras & Larson)-----------------------------------------------------------------------
def taylor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    order: int | str,
    denominator: str,
    mask: Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    feature_map: str | None = None,
    log_temperature: Tensor | None = None,
    cosine_log_temperature: Tensor | None = None,
    gate_logits: Tensor | None = None,
    gate_clamp: float | None = None,
    norm_gain: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """o_t = G_t sum_s T_N(x_ts) v_s with x_ts = s tau_h phi(q_t) . phi(k_s).

    ``gate_logits`` ``[B, T, H]`` are the gate's pre-sigmoid values; ``gate_clamp`` clamps x from above for
    order "exp" and, for finite orders, bounds |s tau phi(q)| and |phi(k)| by sqrt(clamp) (see the mixer).
    ``norm_gain`` ``[H, E]`` is the learnable gain of the l2 / rms / layernorm denominators.
    """
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq, d = q.shape
    groups = heads // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    rows = {}
    for b in range(bsz):
        for h in range(heads):
            hk = h // groups
            tau = 1.0 if log_temperature is None else math.exp(float(log_temperature[h]))
            ctau = 0.0 if cosine_log_temperature is None else float(cosine_log_temperature[h])
            for t in range(seq):
                if not _real(mask, b, t):
                    continue
                qv = phi(feature_map, q[b, h, t], ctau, is_query=True) * scale * tau
                if gate_clamp is not None and order != "exp":
                    qv = qv * (math.sqrt(gate_clamp) / qv.norm()).clamp(max=1.0)
                num = torch.zeros(v.shape[-1], dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                count = 0
                for s in range(seq):
                    if (causal and s > t) or not _real(mask, b, s):
                        continue
                    kv = phi(feature_map, k[b, hk, s])
                    if gate_clamp is not None and order != "exp":
                        kv = kv * (math.sqrt(gate_clamp) / kv.norm()).clamp(max=1.0)
                    x = qv @ kv
                    if gate_clamp is not None and order == "exp":
                        x = x.clamp(max=gate_clamp)
                    w = taylor_value(x, order)
                    num = num + w * v[b, hk, s]
                    den = den + w
                    count += 1
                gate = (
                    None
                    if gate_logits is None
                    else float(torch.sigmoid(gate_logits[b, t, h].detach().double()))
                )
                gain = None if norm_gain is None else norm_gain[h].double()
                rows[(b, t, h)] = finish(num, den, count, denominator, eps, gain, gate)
    return _stack(rows, (bsz, seq, heads, v.shape[-1]))


# ----- heinsen (Heinsen 2024) ----------------------------------------------------------------------------
def heinsen_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = True, scale: float = 1.0
) -> Tensor:
    """o_t = sum_s w_ts v_s / sum_s w_ts with w_ts = sum_i exp(s q_ti) exp(s k_si), directly in float64."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq, _ = q.shape
    groups = heads // k.shape[1]
    rows = {}
    for b in range(bsz):
        for h in range(heads):
            hk = h // groups
            for t in range(seq):
                if not _real(mask, b, t):
                    continue
                num = torch.zeros(v.shape[-1], dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                for s in range(seq):
                    if (causal and s > t) or not _real(mask, b, s):
                        continue
                    w = (torch.exp(scale * q[b, h, t]) * torch.exp(scale * k[b, hk, s])).sum()
                    num = num + w * v[b, hk, s]
                    den = den + w
                rows[(b, t, h)] = num / den
    return _stack(rows, (bsz, seq, heads, v.shape[-1]))


# ----- hybrid -------------------------------------------------------------------------------------------
def linear_kernel(feature_map: str) -> Kernel:
    def kappa(qv: Tensor, kv: Tensor, h: int) -> Tensor:
        return phi(feature_map, qv) @ phi(feature_map, kv)

    return kappa


def taylor_kernel(order: int, scale: float) -> Kernel:
    def kappa(qv: Tensor, kv: Tensor, h: int) -> Tensor:
        return taylor_value(scale * (qv @ kv), order)

    return kappa


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    far_kernel: Kernel,
    window_share: Tensor,
    combine: str = "shared",
    far_finish: str = "linear",
    mask: Tensor | None = None,
    far_gain: Tensor | None = None,
    eps: float = 1e-6,
    sinks: int = 0,
) -> Tensor:
    """Softmax over keys t-W < s <= t plus ``far_kernel`` over keys s <= t-W, with window share g_h.

    shared: (g sum_win e^x v + (1-g) sum_far kappa v) / (g sum_win e^x + (1-g) sum_far kappa);
    sum: g softmax_window + (1-g) finish(far numerator, far denominator) with the far mixer's own rule.
    ``sinks``: the first N real tokens of each row join the softmax keys of every later query and leave the
    far set. ``far_kernel`` None: softmax over the window and the sinks only.
    """
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq, d = q.shape
    groups = heads // k.shape[1]
    scale = d**-0.5
    rows = {}
    for b in range(bsz):
        for h in range(heads):
            hk, g = h // groups, float(window_share[h])
            for t in range(seq):
                if not _real(mask, b, t):
                    continue
                sink = [s for s in range(seq) if _real(mask, b, s)][:sinks]
                near = [s for s in range(max(0, t - window + 1), t + 1) if _real(mask, b, s)]
                near += [s for s in sink if s <= t - window]
                far = [s for s in range(0, t - window + 1) if _real(mask, b, s) and s not in sink]
                e = [torch.exp(scale * q[b, h, t] @ k[b, hk, s]) for s in near]
                near_num = sum(w * v[b, hk, s] for w, s in zip(e, near, strict=True))
                near_den = sum(e)
                if far_kernel is None:
                    rows[(b, t, h)] = near_num / near_den
                    continue
                far_num = torch.zeros(v.shape[-1], dtype=torch.float64)
                far_den = torch.zeros((), dtype=torch.float64)
                for s in far:
                    w = far_kernel(q[b, h, t], k[b, hk, s], h)
                    far_num = far_num + w * v[b, hk, s]
                    far_den = far_den + w
                if combine == "shared":
                    rows[(b, t, h)] = (g * near_num + (1 - g) * far_num) / (g * near_den + (1 - g) * far_den)
                else:
                    gain = None if far_gain is None else far_gain[h].double()
                    far_out = finish(far_num, far_den, len(far), far_finish, eps, gain)
                    rows[(b, t, h)] = g * near_num / near_den + (1 - g) * far_out
    return _stack(rows, (bsz, seq, heads, v.shape[-1]))


# ----- harness: a tiny model through the cache ---------------------------------------------------------
def cache_mismatch(spec: dict, prefill: int = 6, seq_len: int = 11, pad: int = 3, seed: int = 0) -> float:
    """Max |logits| difference on real tokens between one full forward and a cached prefill + single steps,
    with the second row left-padded by ``pad`` tokens. Builds a 2-layer, 4-head (2 KV heads), d=8 model.
    """
    from hf_recattn import RecAttnConfig, RecAttnForCausalLM

    torch.manual_seed(seed)
    config = RecAttnConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention=spec,
    )
    model = RecAttnForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, seq_len))
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        cache = model.new_cache()
        parts = [
            model(
                input_ids=ids[:, :prefill],
                attention_mask=mask[:, :prefill],
                past_key_values=cache,
                use_cache=True,
            ).logits
        ]
        for t in range(prefill, seq_len):
            parts.append(
                model(
                    input_ids=ids[:, t : t + 1],
                    attention_mask=mask[:, : t + 1],
                    past_key_values=cache,
                    use_cache=True,
                ).logits
            )
    stepped = torch.cat(parts, dim=1)
    real = mask.bool()
    return float((full - stepped)[real].abs().max())
