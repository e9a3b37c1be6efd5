"""The hybrid's exact cache (``cache_slots``, LoLA-style): a float64 per-token reference written here from the rule,
every form and every kind of far part against it, the eviction order on hand-made sequences (and variants of the
rule broken on purpose, which those tests must catch), left padding, fixed state size, generation and bad specs.

The rule (docs/mixers.md): a real token leaving the window joins the pending buffer; when a row's pending buffer
holds W tokens, after that query, the cache's pairs and the pending ones are scored against the far state
(``far_recall_error``; with ``cache_score: novelty`` by the distance of their values to the nearest value of the
window after that query, over their own norm), the G highest stay cached (ties: the older), the others are evicted
(into the far state for a far part reading leaving keys, in token order). A query sees sinks, cache, pending and
window by softmax, plus the far state. Tolerances: fp32 forms within 1e-5 relative of the reference, float64
within 1e-10; float64 gradients within 1e-9.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import mixer_checks as checks
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from generation_cases import PAD as PAD_ID
from generation_cases import Case, left_padded_batch, one_thread, tiny_model
from mixer_checks import PAD, SHAPE
from mixer_steps import left_padded, run_chunked, run_steps
from reference import phi_elu, phi_hedgehog, real_rows, rel_err
from reference_delta import delta_reference
from reference_recurrent_softmax import finish, taylor_value
from reference_retention import retention_score
from test_delta import params_live, params_of

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling import cache_scores, hybrid_cached
from hf_recattn.modeling.far_part import ARRIVING, LEAVING, FarPart, FarTerms
from hf_recattn.modeling.mixer_base import Mixer, MixerInputs, State, group_queries, ungroup_output
from hf_recattn.modeling.mixers import MIXERS, build_mixer, register_mixer, validate_spec
from hf_recattn.modeling.options import Option
from hf_recattn.modeling.variants import variant_models

HK, D = SHAPE.num_kv_heads, SHAPE.head_dim
EPS = 1e-6
FP32, FP64, GRAD = 1e-5, 1e-10, 1e-9
FARS: dict[str, tuple[Any, str]] = {
    "linear-elu": ({"mixer": "linear", "feature_map": "elu"}, "shared"),
    "linear-hedgehog": ({"mixer": "linear", "feature_map": "hedgehog"}, "shared"),
    "linear-relu-l2": ({"mixer": "linear", "feature_map": "relu", "normalize": "l2"}, "sum"),
    "taylor2": ({"mixer": "taylor", "order": 2}, "shared"),
    "toy": ("toy_recall", "shared"),
    "delta": ({"mixer": "delta", "rule": "gated", "conv_size": 3, "init": "convert", "half_life_min": 2.0,
               "half_life_max": 8.0}, "sum"),
    "delta-noconv": ({"mixer": "delta", "rule": "delta", "conv_size": 0, "init": "convert"}, "sum"),
    "rwkv7": ({"mixer": "generalized_delta", "init": "convert", "decay_rank": 4, "iclr_rank": 4}, "sum"),
}


# ----- a far part registered here, by the protocol alone -------------------------------------------------------
class ToyRecall(Mixer, FarPart):
    """Linear attention with elu + 1 features written out in plain torch: only what the cache needs of a far part
    reading leaving keys (read, add, score), and its terms' normalization."""

    name = "toy_recall"
    far_reads = LEAVING
    far_shared = True

    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        return None

    def far_read(self, q: torch.Tensor, inputs: MixerInputs, state: State) -> FarTerms:
        qf = F.elu(group_queries(q, HK)) + 1.0
        return FarTerms(torch.einsum("bhgtf,bhfe->bhgte", qf, state["S"]), torch.einsum("bhgtf,bhf->bhgt", qf,
                                                                                         state["z"]))

    def far_add(self, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, state: State) -> State:
        kf = (F.elu(k) + 1.0) * weight[..., None]
        return {"S": state["S"] + torch.einsum("bhnf,bhne->bhfe", kf, v), "z": state["z"] + kf.sum(2)}

    def far_recall_error(self, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        kf = F.elu(k) + 1.0
        recall = torch.einsum("bhnf,bhfe->bhne", kf, state["S"]) / (torch.einsum("bhnf,bhf->bhn", kf, state["z"])
                                                                    + EPS)[..., None]
        return (v - recall).norm(dim=-1)

    def far_output(self, terms: FarTerms, inputs: MixerInputs) -> torch.Tensor:
        return ungroup_output(terms.num / (terms.den[..., None] + EPS))

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        return {"S": torch.zeros(batch_size, HK, D, D, dtype=dtype), "z": torch.zeros(batch_size, HK, D, dtype=dtype)}

    def state_size(self, context_length: int) -> int:
        return HK * D * (D + 1)


class ToyMute(Mixer, FarPart):
    """A far part reading every token, with FarPart's defaults: it declares no recall score."""

    name = "toy_mute"
    options = {"causal": Option((bool,), True, "causal")}
    far_reads = ARRIVING


@pytest.fixture(autouse=True, scope="module")
def toys() -> Iterator[None]:
    for cls in (ToyRecall, ToyMute):
        register_mixer(cls)
    yield
    for cls in (ToyRecall, ToyMute):
        MIXERS.pop(cls.name)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def make(far: str, dtype: torch.dtype = torch.float32, window: int = 3, slots: int = 2, **options: Any) -> Mixer:
    """A hybrid with the cache over the named far part ("none": none), its parameters moved off their initial
    values."""
    spec, combine = FARS[far] if far != "none" else ("none", "shared")
    spec = validate_spec({"mixer": "hybrid", "far": spec, "combine": combine, "window": window,
                          "cache_slots": slots, "chunk_size": 4, **options}, "layer 5")
    mixer = build_mixer(spec, SHAPE)
    checks.perturb_parameters(mixer, scale=0.3)
    return mixer.to(dtype)


# ----- the float64 reference ------------------------------------------------------------------------------
class Leaving(NamedTuple):
    """A far part reading leaving keys, one vector at a time: kappa(q, k, query head, key head) for the queries,
    kappa_r(k, k_i, key head) and the floor of the denominator for the recall score, its own output rule."""

    kernel: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    recall: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    floor: Callable[[torch.Tensor], torch.Tensor]
    finish: str = "linear"
    gain: torch.Tensor | None = None


class Arriving(NamedTuple):
    """A far part reading every token: its own output [B, T, H, E] and the recall error of (k, v) against its
    state after token t of row b, key head hk: ``residual(b, t, hk, k, v)``."""

    out: torch.Tensor
    residual: Callable[[int, int, int, torch.Tensor, torch.Tensor], torch.Tensor]


def _near_terms(qv: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[Any, Any]:
    weights = [torch.exp(qv @ key / math.sqrt(qv.shape[0])) for key in keys]
    return sum(w * value for w, value in zip(weights, values, strict=True)), sum(weights)


def _output(far: Leaving | Arriving | None, share: torch.Tensor, combine: str, b: int, t: int, h: int, hk: int,
            qv: torch.Tensor, near: tuple[Any, Any], evicted: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One query head's output from its softmax terms and the far part (the softmax alone without one)."""
    g = share[h]
    near_num, near_den = near
    if far is None:
        return near_num / near_den
    if isinstance(far, Arriving):
        return g * near_num / near_den + (1 - g) * far.out[b, t, h]
    weights = [far.kernel(qv, key, h, hk) for key, _ in evicted]
    far_num = sum((w * value for w, (_, value) in zip(weights, evicted, strict=True)), torch.zeros_like(qv))
    far_den = sum(weights, torch.zeros((), dtype=qv.dtype))
    if combine == "shared":
        return (g * near_num + (1 - g) * far_num) / (g * near_den + (1 - g) * far_den)
    gain = None if far.gain is None else far.gain[h]
    return g * near_num / near_den + (1 - g) * finish(far_num, far_den, len(evicted), far.finish, EPS, gain)


def _novelty(value: torch.Tensor, window: list[torch.Tensor]) -> float:
    """How unlike the window's values ``value`` is: the nearest one's distance over its own norm."""
    value = value.detach()
    nearest = min(float(torch.linalg.vector_norm(value - other.detach())) for other in window)
    return nearest / float(torch.linalg.vector_norm(value))


def _key_diversity(key: torch.Tensor, candidates: list[torch.Tensor]) -> float:
    """Minus the cosine between ``key`` and the mean of the candidates' unit keys."""
    units = [c.detach() / torch.linalg.vector_norm(c.detach()) for c in candidates]
    anchor = sum(units, torch.zeros_like(units[0])) / len(units)
    key = key.detach()
    return -float(key @ anchor) / float(torch.linalg.vector_norm(key) * torch.linalg.vector_norm(anchor))


def _score(far: Leaving | Arriving, b: int, t: int, hk: int, key: torch.Tensor, value: torch.Tensor,
           evicted: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """How badly the far state recalls (key, value) after token t."""
    if isinstance(far, Arriving):
        return float(far.residual(b, t, hk, key, value).detach())
    weights = [far.recall(key, other, hk) for other, _ in evicted]
    num = sum((w * v for w, (_, v) in zip(weights, evicted, strict=True)), torch.zeros_like(value))
    den = far.floor(sum(weights, torch.zeros((), dtype=key.dtype)))
    return float(torch.linalg.vector_norm(value - num / den).detach())


def half_at_or_above(scale: float) -> float:
    """The smallest float16 that is not below ``scale`` (numpy's float16, not torch's)."""
    half = np.float16(scale)
    return float(half if float(half) >= scale else np.nextafter(half, np.float16(np.inf)))


def coded_held(x: torch.Tensor, bits: int, group: int, half_scales: bool = False) -> torch.Tensor:
    """A vector as a coded cache slot holds it: each group of ``group`` dimensions round(x / s) s with s its largest
    magnitude over 2^(bits - 1) - 1 (127 for int8, 7 for int4), with ``half_scales`` the float16 at or above that; the
    gradient straight through the rounding."""
    levels = 2 ** (bits - 1) - 1
    parts = []
    for part in x.detach().split(group):
        scale = part.abs().max() / levels
        if half_scales:
            scale = torch.tensor(half_at_or_above(float(scale)), dtype=part.dtype)
        parts.append(part if float(scale) == 0 else torch.round(part / scale).clamp(-levels, levels) * scale)
    return x + (torch.cat(parts) - x).detach()


#: how each ``cache_dtype`` holds a vector: int8 with one scale per vector, int4 with one per 32 dimensions, int4g16
#: with a float16 one per 16
HOLDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "model": lambda x: x,
    "int8": lambda x: coded_held(x, 8, len(x)),
    "int4": lambda x: coded_held(x, 4, min(32, len(x))),
    "int4g16": lambda x: coded_held(x, 4, min(16, len(x)), half_scales=True),
}
#: how each ``cache_dtype`` holds a key and its value: k8v4g16 the key as int8 does, the value as int4g16 does; the
#: others both alike
PAIR_HOLDS = {**{name: (hold, hold) for name, hold in HOLDS.items()}, "k8v4g16": (HOLDS["int8"], HOLDS["int4g16"])}


def cached_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, mixer: Mixer,
                     far: Leaving | Arriving | None) -> torch.Tensor:
    """The hybrid with the cache, token by token, one row and key head at a time: lists of token positions for the
    sinks, the cache, the pending buffer and the evicted pairs. With a coded ``cache_dtype`` a decision scores and
    keeps the pending pairs as the codes hold them (``PAIR_HOLDS``, once); a pending pair evicted at once leaves as
    computed, a cached one as it was held."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, seq, _ = q.shape
    groups, window, slots = heads // HK, mixer.window, mixer.cache_slots
    share = torch.sigmoid(mixer.mix_logit.double())
    hold_key, hold_value = PAIR_HOLDS[mixer.spec.get("cache_dtype", "model")]
    rows: dict[tuple[int, int, int], torch.Tensor] = {}
    for b in range(bsz):
        real = [t for t in range(seq) if bool(mask[b, t])]
        sinks = real[: mixer.sink_tokens]
        for hk in range(HK):
            cache: list[int] = []
            pending: list[int] = []
            evicted: list[tuple[torch.Tensor, torch.Tensor]] = []  # in the order they left
            held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the pairs decided on, as the cache holds them

            def pair(s: int) -> tuple[torch.Tensor, torch.Tensor]:
                return held.get(s, (k[b, hk, s], v[b, hk, s]))  # noqa: B023 (read at once, in this row and head)

            for t in range(seq):
                if t - window in real and t - window not in sinks:
                    pending.append(t - window)
                if t in real:
                    win = [s for s in range(t - window + 1, t + 1) if s in real and s not in sinks]
                    near = [s for s in sinks if s <= t] + cache + pending + win
                    pairs = evicted
                    for h in range(hk * groups, (hk + 1) * groups):
                        terms = _near_terms(q[b, h, t], [pair(s)[0] for s in near], [pair(s)[1] for s in near])
                        rows[(b, t, h)] = _output(far, share, mixer.combine, b, t, h, hk, q[b, h, t], terms, pairs)
                if len(pending) == window:
                    leaving = {s: pair(s) for s in cache + pending}  # before the pending ones are rounded
                    held.update({s: (hold_key(k[b, hk, s]), hold_value(v[b, hk, s])) for s in pending})
                    candidates = cache + pending
                    pairs = evicted
                    if mixer.spec["cache_score"] == "novelty":
                        after = [v[b, hk, s] for s in range(t - window + 1, t + 1) if s in real and s not in sinks]
                        scores = [_novelty(pair(s)[1], after) for s in candidates]
                    elif mixer.spec["cache_score"] == "keydiff":
                        keys = [pair(s)[0] for s in candidates]
                        scores = [_key_diversity(key, keys) for key in keys]
                    elif mixer.spec["cache_score"] == "keydiff_span":
                        keys = [pair(s)[0] for s in candidates]
                        own = [_key_diversity(key, keys) for key in keys]
                        r = cache_scores.SPAN_RADIUS
                        scores = [max(own[max(i - r, 0) : i + r + 1]) for i in range(len(own))]
                    elif mixer.spec["cache_score"] == "recent":
                        scores = list(candidates)  # token positions: the newest highest
                    elif mixer.spec["cache_score"] == "learned":
                        scores = [retention_score(mixer.retention, hk, *pair(s)) for s in candidates]
                    else:
                        scores = [_score(far, b, t, hk, *pair(s), pairs) for s in candidates]
                    reserve = mixer.spec.get("cache_recent", 0)  # the newest candidates first, whatever they score
                    scores = [math.inf if reserve and s in candidates[-reserve:] else x
                              for s, x in zip(candidates, scores, strict=True)]
                    ranked = sorted(range(len(candidates)), key=lambda i: -scores[i])  # stable: the older first
                    cache = sorted(candidates[i] for i in ranked[:slots])
                    evicted += [leaving[s] for s in candidates if s not in cache]
                    pending = []
    zero = torch.zeros(v.shape[-1], dtype=torch.float64)
    return torch.stack([torch.stack([torch.stack([rows.get((b, t, h), zero) for h in range(heads)])
                                     for t in range(seq)]) for b in range(bsz)])


def far_of(mixer: Mixer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
           mask: torch.Tensor) -> Leaving | Arriving | None:
    """The reference's view of the mixer's far part (live parameters, so that gradients reach them); None without
    one."""
    if mixer.far is None:
        return None
    far, name = mixer.far, mixer.far.name
    if name == "delta":
        params = params_live(far) if q.dtype == torch.float64 else params_of(far)
        out, _ = delta_reference(q, k, v, x, mask, params)
        states: dict[int, torch.Tensor] = {}

        def residual(b: int, t: int, hk: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            if t not in states:  # the state after token t: the reference run on the first t + 1 tokens
                states[t] = delta_reference(q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], x[:, : t + 1],
                                            mask[:, : t + 1], params)[1]["S"]
            key, value = F.silu(key), F.silu(value)
            unit = key / torch.sqrt((key * key).sum() + far.eps)
            return torch.linalg.vector_norm(value - unit @ states[t][b, hk].double())

        return Arriving(out, residual)
    if name == "taylor":
        scale = far.scale

        def t2(a: torch.Tensor, b: torch.Tensor, *heads: int) -> torch.Tensor:
            return taylor_value(scale * (a @ b), 2)

        return Leaving(t2, t2, lambda den: den.clamp_min(EPS))
    if name == "linear" and far.spec["feature_map"] == "hedgehog":
        qw, kw = far.feature_map.q_weight.double(), far.feature_map.k_weight.double()

        def hedgehog(a: torch.Tensor, b: torch.Tensor, h: int, hk: int) -> torch.Tensor:
            return phi_hedgehog(a, qw[h]) @ phi_hedgehog(b, kw[hk])

        def hedgehog_keys(a: torch.Tensor, b: torch.Tensor, hk: int) -> torch.Tensor:
            return phi_hedgehog(a, kw[hk]) @ phi_hedgehog(b, kw[hk])

        return Leaving(hedgehog, hedgehog_keys, lambda den: den + EPS)
    phi = phi_elu if name == "toy_recall" or far.spec["feature_map"] == "elu" else F.relu
    gain = None if getattr(far, "output_norm", None) is None else far.output_norm.weight.double()
    finish_kind = "linear" if gain is None else far.spec["normalize"]
    return Leaving(lambda a, b, *heads: phi(a) @ phi(b), lambda a, b, hk: phi(a) @ phi(b), lambda den: den + EPS,
                   finish_kind, gain)


def reference_of(mixer: Mixer) -> Callable[[checks.Inputs, torch.Tensor], torch.Tensor]:
    def reference(inputs: checks.Inputs, mask: torch.Tensor) -> torch.Tensor:
        q, k, v, x = inputs
        return cached_reference(q, k, v, mask, mixer, far_of(mixer, q, k, v, x, mask))

    return reference


# ----- every form and far part against the reference -----------------------------------------------------------
@pytest.mark.parametrize("sinks", [0, 1])
@pytest.mark.parametrize("far", ["linear-elu", "linear-hedgehog", "linear-relu-l2", "taylor2", "toy", "delta"])
def test_forms_match_the_reference(far: str, sinks: int) -> None:
    """fp32: parallel, chunked (chunks of 4 over 14 tokens), token steps and a prefill of 5 + steps; left padding."""
    mixer = make(far, sink_tokens=sinks)
    inputs = checks.random_inputs(SHAPE, 14, seed=1)
    mask = left_padded(14, PAD)
    with torch.no_grad():
        parallel, state = checks.assert_forms_agree(mixer, inputs, mask, FP32)
        expected = reference_of(mixer)(inputs, mask)
    assert rel_err(real_rows(parallel, mask), expected) < FP32
    assert state["cmask"].all() and state["far.S"].abs().sum() > 0  # the cache filled, pairs went to the far part
    without = make("linear-elu" if far == "toy" else far, slots=0, sink_tokens=sinks)  # the toy has no own forms
    without.load_state_dict(mixer.state_dict())
    with torch.no_grad():
        plain = without.parallel(*inputs[:3], MixerInputs(inputs[3], mask))
    assert rel_err(real_rows(plain, mask), expected) > 1e-3  # the cache matters


#: (options, other options to tell them from, far part, sinks, seed): the scores that read no far state, and the
#: cache held as int8 (``cache_dtype``, test_cache_precision.py) told from the same cache as computed, and int4 from
#: int8
Options = dict[str, Any]
OTHER_OPTIONS: list[tuple[Options, Options, str, int, int]] = [
    ({"cache_score": "novelty"}, {"cache_score": "far"}, far, sinks, 11)
    for far in ("linear-hedgehog", "toy", "delta") for sinks in (0, 1)]
OTHER_OPTIONS += [({"cache_score": "keydiff"}, {"cache_score": "novelty"}, far, sinks, 12)
                  for far, sinks in (("linear-hedgehog", 1), ("delta", 0), ("none", 1))]
OTHER_OPTIONS += [({"cache_score": "recent"}, {"cache_score": "keydiff"}, far, sinks, 13)
                  for far, sinks in (("linear-hedgehog", 0), ("none", 1))]
OTHER_OPTIONS += [({"cache_score": score, "cache_dtype": "int8"}, {"cache_score": score}, far, sinks, 21)
                  for far, score, sinks in (("linear-hedgehog", "far", 1), ("delta", "far", 0), ("delta", "novelty", 1),
                                            ("none", "keydiff", 1), ("linear-relu-l2", "far", 0), ("toy", "far", 0),
                                            ("none", "recent", 0))]
OTHER_OPTIONS += [({"cache_score": score, "cache_dtype": "int4"}, {"cache_score": score, "cache_dtype": "int8"}, far,
                   sinks, 24)
                  for far, score, sinks in (("linear-hedgehog", "far", 1), ("delta", "novelty", 0),
                                            ("none", "keydiff", 1))]
OTHER_OPTIONS += [({"cache_score": score, "cache_dtype": "int4g16"}, {"cache_score": score, "cache_dtype": "int8"},
                   far, sinks, 25) for far, score, sinks in (("delta", "far", 1), ("none", "keydiff", 0))]
OTHER_OPTIONS += [({"cache_score": score, "cache_dtype": "k8v4g16"}, {"cache_score": score, "cache_dtype": other},
                   far, sinks, 26) for far, score, sinks, other in (("delta", "far", 1, "int8"),
                                                                    ("none", "keydiff", 0, "int4g16"))]

#: cache_recent: the newest pairs reserved, the other slots as the score says, told from the score alone
OTHER_OPTIONS += [({"slots": 5, "cache_score": score, "cache_recent": 2, **codes}, {"slots": 5, "cache_score": score,
                                                                                    **codes}, far, sinks, 27)
                  for far, score, sinks, codes in (("none", "keydiff", 1, {}), ("delta", "far", 0, {}),
                                                   ("linear-hedgehog", "novelty", 1, {}),
                                                   ("none", "keydiff_span", 1, {"cache_dtype": "k8v4g16"}))]


@pytest.mark.parametrize(("options", "other_options", "far", "sinks", "seed"), OTHER_OPTIONS)
def test_options_match_the_reference(options: Options, other_options: Options, far: str, sinks: int,
                                     seed: int) -> None:
    """cache_score 'novelty' (by the window's values) and 'keydiff' (by how far each candidate's key points from the
    candidates' mean unit key), and cache_dtype 'int8', 'int4', 'int4g16' and 'k8v4g16' (pairs rounded once, when
    first scored), fp32 as above: the same forms, with a far part and without one; the other options decide otherwise
    on the same inputs (for the codes: the rounding is really there, int4's is not int8's, and k8v4g16 rounds its
    keys as int8 does and its values as int4g16 does, so it differs from both)."""
    assert_matches_the_reference_and_differs(far, {"sink_tokens": sinks, **options},
                                             {"sink_tokens": sinks, **other_options}, seed, 14)


def assert_matches_the_reference_and_differs(far: str, options: Options, other_options: Options, seed: int,
                                             seq: int) -> None:
    """fp32 forms of ``make(far, **options)`` within FP32 of the reference on ``seq`` left-padded tokens (the cache
    full at the end), and ``other_options`` on the same weights and inputs deciding otherwise (> 1e-4 apart)."""
    mixer = make(far, **options)
    inputs = checks.random_inputs(SHAPE, seq, seed=seed)
    mask = left_padded(seq, PAD)
    with torch.no_grad():
        parallel, state = checks.assert_forms_agree(mixer, inputs, mask, FP32)
        expected = reference_of(mixer)(inputs, mask)
        by_other = make(far, **other_options)
        by_other.load_state_dict(mixer.state_dict())
        other = by_other.parallel(*inputs[:3], MixerInputs(inputs[3], mask))
    assert rel_err(real_rows(parallel, mask), expected) < FP32
    assert state["cmask"].all()
    assert rel_err(real_rows(other, mask), expected) > 1e-4  # the other options decide something here


@pytest.mark.parametrize(("radius", "slots", "seed"), [(1, 4, 31), (2, 5, 32), (cache_scores.SPAN_RADIUS, 6, 33)])
def test_keydiff_span_matches_the_reference(monkeypatch: pytest.MonkeyPatch, radius: int, slots: int,
                                            seed: int) -> None:
    """cache_score 'keydiff_span' (each candidate takes the highest KeyDiff score among its ``radius`` nearest
    candidates on either side, in token order), fp32, with sinks and left padding: the forms match the per-token
    reference, and plain 'keydiff' decides otherwise on the same inputs."""
    monkeypatch.setattr(cache_scores, "SPAN_RADIUS", radius)
    shape = {"window": 2, "slots": slots, "sink_tokens": 1}
    assert_matches_the_reference_and_differs("none", {**shape, "cache_score": "keydiff_span"},
                                             {**shape, "cache_score": "keydiff"}, seed, 20)


def test_keydiff_span_pools_over_filled_neighbours_only() -> None:
    """A candidate takes the highest score within SPAN_RADIUS filled candidates on either side; the empty slots
    between the cache's pairs and the pending ones neither lend a score nor count as neighbours."""
    torch.manual_seed(0)
    keys = torch.randn(1, 1, 12, 4)
    filled = torch.ones(1, 12, dtype=torch.bool)
    filled[0, 3:5] = False  # two empty cache slots before the pending pairs
    decision = cache_scores.Decision(keys, keys, {}, keys, filled, filled)
    parts = cache_scores.ScoreParts(None, None)
    own = cache_scores.key_diversity(parts, decision)[0, 0]
    pooled = cache_scores.key_diversity_span(parts, decision)[0, 0]
    real = [i for i in range(12) if filled[0, i]]
    r = cache_scores.SPAN_RADIUS
    for n, i in enumerate(real):
        assert pooled[i] == max(own[j] for j in real[max(n - r, 0) : n + r + 1])
    assert torch.equal(pooled[3:5], own[3:5])


@pytest.mark.parametrize(("far", "score"), [("linear-elu", "far"), ("linear-relu-l2", "far"), ("taylor2", "far"),
                                            ("toy", "far"), ("delta", "far"), ("linear-elu", "novelty"),
                                            ("delta", "novelty"), ("linear-elu", "recent")])
def test_float64_forms_match_the_reference_closely(far: str, score: str) -> None:
    assert_float64_forms_match(make(far, torch.float64, window=2, slots=3, sink_tokens=1, cache_score=score), seed=2)


@pytest.mark.parametrize(("far", "score"), [("delta", "far"), ("none", "keydiff")])
def test_a_recent_reserve_matches_the_reference_with_gradients(far: str, score: str) -> None:
    """cache_recent (the newest pairs kept first), float64: the forms within FP64 of the reference and the parallel
    form's gradients within GRAD."""
    mixer = make(far, torch.float64, window=2, slots=3, sink_tokens=1, cache_score=score, cache_recent=1)
    assert_float64_forms_match(mixer, seed=4)
    unused = () if far == "delta" else ("x", "mix_logit")  # without a far part nothing mixes
    checks.assert_gradients_match(mixer, reference_of(mixer), 11, GRAD, unused=unused)


def test_a_recent_reserve_is_checked() -> None:
    """More reserved slots than the cache has, a reserve with the cache off, or beside cache_score 'recent' (which
    reserves every slot): an error naming the option."""
    for options, says in (({"cache_slots": 2, "cache_recent": 3}, "reserves more slots than the exact cache has"),
                          ({"cache_recent": 1}, "'cache_recent'=1 reserves slots of the exact cache for the newest "
                           "pairs, which is off"),
                          ({"cache_slots": 2, "cache_recent": 1, "cache_score": "recent"}, "already holds the newest"),
                          ({"cache_slots": 2, "cache_recent": -1}, "cache_recent")):
        with pytest.raises(ValueError, match=says):
            validate_spec({"mixer": "hybrid", "far": "none", **options}, "layer 3")


def assert_float64_forms_match(mixer: Mixer, seed: int) -> None:
    """The parallel and chunked forms of a float64 ``mixer`` against the reference within FP64, on 13 left-padded
    tokens drawn with ``seed``."""
    inputs = checks.random_inputs(SHAPE, 13, torch.float64, seed=seed)
    mask = left_padded(13, PAD)
    with torch.no_grad():
        expected = reference_of(mixer)(inputs, mask)
        for form in ("parallel", "chunked"):
            assert rel_err(real_rows(checks.outputs_of(mixer, form, inputs, mask), mask), expected) < FP64, form


@pytest.mark.parametrize(("far", "score"), [("linear-elu", "far"), ("linear-hedgehog", "far"), ("taylor2", "far"),
                                            ("delta", "far"), ("linear-hedgehog", "novelty"), ("delta", "novelty"),
                                            ("linear-elu", "recent")])
def test_parallel_gradients_match_the_reference(far: str, score: str) -> None:
    """float64 gradients of q, k, v, x and every parameter through the parallel form (the choice itself is discrete:
    no gradient through the ranking, in either)."""
    mixer = make(far, torch.float64, window=2, slots=2, sink_tokens=1, cache_score=score)
    unused = () if far == "delta" else ("x",)
    checks.assert_gradients_match(mixer, reference_of(mixer), 11, GRAD, unused=unused)


@pytest.mark.parametrize("score", ["far", "novelty"])
@pytest.mark.parametrize("far", ["linear-hedgehog", "delta"])
def test_decisions_equal_across_forms_and_chunk_sizes(far: str, score: str) -> None:
    """Chunks of any size (those not dividing the 17 tokens included) and token steps end in the same cache,
    pending buffer and window, bit for bit; the far state too for a far part reading leaving keys."""
    assert_chunks_end_as_steps(make(far, window=3, slots=2, cache_score=score), seed=3, sizes=(1, 2, 3, 5, 7, 17, 64))


def assert_chunks_end_as_steps(mixer: Mixer, seed: int, sizes: tuple[int, ...]) -> None:
    """``test_decisions_equal_across_forms_and_chunk_sizes``'s check on ``mixer``, over 17 left-padded tokens."""
    q, k, v, x = checks.random_inputs(SHAPE, 17, seed=seed)
    mask = left_padded(17, PAD)
    with torch.no_grad():
        _, want = run_steps(mixer, q, k, v, x, mask)
        for size in sizes:
            mixer.chunk_size = size
            _, got = run_chunked(mixer, q, k, v, x, mask)
            for name in want:
                if name.startswith("far.") and mixer.far.name == "delta":
                    assert rel_err(got[name], want[name]) < FP32, (size, name)
                else:
                    assert torch.equal(got[name], want[name]), (size, name)


@pytest.mark.parametrize("far", ["linear-elu", "delta"])
def test_a_masked_decision_at_every_step_changes_nothing(far: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a decode step runs the decision every step, masked to the rows whose pending buffer is full
    (no wait for the host); forced here on the CPU, the steps give the same outputs and states."""
    q, k, v, x = checks.random_inputs(SHAPE, 14, seed=7)
    mask = left_padded(14, PAD)
    mixer = make(far, sink_tokens=1)
    with torch.no_grad():
        want, want_state = run_steps(mixer, q, k, v, x, mask)
        monkeypatch.setattr(hybrid_cached, "decision_spans", lambda decide: [(0, 1, True)])
        got, got_state = run_steps(mixer, q, k, v, x, mask)
    assert torch.equal(got, want)
    for name in want_state:
        assert torch.equal(got_state[name], want_state[name]), name


@pytest.mark.parametrize(("far", "sinks", "score"), [("linear-hedgehog", 0, "far"), ("linear-hedgehog", 2, "far"),
                                                     ("delta", 0, "far"), ("delta", 2, "far"),
                                                     ("linear-hedgehog", 2, "novelty"), ("delta", 0, "novelty")])
def test_one_token_step_is_the_general_block(far: str, sinks: int, score: str) -> None:
    """The decode step's shortcut (one token, sinks settled) gives the general block's outputs and states bit for
    bit over 40 tokens, decisions every 3 real tokens per row (the second row left-padded by 5, so the rows decide
    at different steps and their oldest window tokens leave at different steps): a far part reading leaving keys
    (combine='shared') and one reading arriving tokens (combine='sum'). It is taken once the sinks settle, and the
    decisions run inside it."""
    seq, pad = 40, 5
    q, k, v, x = checks.random_inputs(SHAPE, seq, seed=9)
    mask = left_padded(seq, pad)
    mixer = make(far, window=3, slots=2, sink_tokens=sinks, cache_score=score)
    general = make(far, window=3, slots=2, sink_tokens=sinks, cache_score=score)
    general.load_state_dict(mixer.state_dict())
    general.step = lambda q, k, v, inputs, state: general._block(q, k, v, inputs, state, general._far_step)  # type: ignore
    taken, decided = [], []
    shortcut, evict = mixer._cached_step_one, mixer._evict
    mixer._cached_step_one = lambda *args: taken.append(1) or shortcut(*args)  # type: ignore
    mixer._evict = lambda *args: decided.append(1) or evict(*args)  # type: ignore
    with torch.no_grad():
        fast, fast_state = run_steps(mixer, q, k, v, x, mask)
        slow, slow_state = run_steps(general, q, k, v, x, mask)
    assert len(taken) >= seq - pad - sinks  # every step after the last sink of the padded row
    assert len(decided) >= 2 * ((seq - pad - sinks) // 3 - 2)  # both rows' decisions, at their own steps
    assert torch.equal(fast, slow)
    assert fast_state.keys() == slow_state.keys()
    for name in fast_state:
        assert torch.equal(fast_state[name], slow_state[name]), name


def test_rwkv7_far_part_forms_agree() -> None:
    """RWKV-7 (arriving, scored by its removal key): every form gives the parallel outputs and the same cache."""
    mixer = make("rwkv7", sink_tokens=1)
    inputs = checks.random_inputs(SHAPE, 14, seed=8)
    with torch.no_grad():
        _, state = checks.assert_forms_agree(mixer, inputs, left_padded(14, PAD), FP32)
    assert state["cmask"].all()


def test_left_padding_changes_nothing() -> None:
    mixer = make("linear-elu", sink_tokens=1)
    checks.assert_left_padding_changes_nothing(mixer, checks.random_inputs(SHAPE, 15, seed=4), 4, FP32)


def test_state_size_is_fixed() -> None:
    """Window, pending buffer, cache and sinks (keys, values, masks) and the far state, whatever the context."""
    mixer = make("linear-elu", window=3, slots=5, sink_tokens=2)
    plain = make("linear-elu", window=3, slots=0, sink_tokens=2)
    assert mixer.state_size(7) == mixer.state_size(10**6) == plain.state_size(1) + (3 + 5) * (2 * HK * D + 1)
    state = mixer.init_state(3, torch.device("cpu"), torch.float32)
    assert sum(t.numel() for t in state.values()) == 3 * mixer.state_size(1)
    q, k, v, x = checks.random_inputs(SHAPE, 20, seed=5)
    with torch.no_grad():
        _, later = run_chunked(mixer, q, k, v, x, left_padded(20, PAD))
    assert {n: t.shape for n, t in later.items()} == {n: t.shape for n, t in mixer.init_state(2, q.device,
                                                                                               q.dtype).items()}


def test_without_slots_the_state_is_as_before() -> None:
    mixer = make("linear-elu", slots=0)
    assert set(mixer.init_state(1, torch.device("cpu"), torch.float32)) == {"wk", "wv", "wmask", "far.S", "far.z"}


# ----- the eviction order, on hand-made sequences ------------------------------------------------------------------
SEQ = 12
NEW_AT = 5  # the one token with a new key; every other token is the same pair


def hand_made(dtype: torch.dtype = torch.float32) -> checks.Inputs:
    """Every token the same pair (k0, v0) but token 5, (k1, v1 = v0 + a unit step): once the far state holds k0, it
    recalls k0 exactly (score ~ eps) and k1 as v0 (score 1), while |v0| = 4 is what any pair scores against an empty
    state."""
    q, _, _, x = checks.random_inputs(SHAPE, SEQ, dtype, seed=6)
    k = torch.zeros(2, HK, SEQ, D, dtype=dtype)
    v = torch.zeros(2, HK, SEQ, D, dtype=dtype)
    k[..., 0], v[..., 0] = 3.0, 4.0
    k[:, :, NEW_AT, 0], k[:, :, NEW_AT, 1] = 0.0, 3.0
    v[:, :, NEW_AT, 1] = 1.0
    return q, k, v, x


def assert_keeps_the_new_key(far: str = "linear-elu", score: str = "far") -> None:
    """W = 2, G = 1: the first decision (empty state, all tied) keeps the oldest k0 pair; once the state predicts
    k0, the cached k0 pair is re-scored and dropped for k1, which then stays: every form, both rows (the second
    left-padded by 3, so its decisions fall later). With ``novelty`` every v0 pair scores 0 against a window of v0
    pairs (ties: the oldest stays) until v1 leaves the window, and v1 then scores 1 / |v1| in every later window."""
    mixer = make(far, window=2, slots=1, cache_score=score)
    q, k, v, x = hand_made()
    mask = left_padded(SEQ, PAD)
    with torch.no_grad():
        for _, state in (run_steps(mixer, q, k, v, x, mask), run_chunked(mixer, q, k, v, x, mask)):
            assert state["cmask"].all()
            assert torch.equal(state["ck"][:, :, 0], k[:, :, NEW_AT]), "the new key is cached"
            assert torch.equal(state["cv"][:, :, 0], v[:, :, NEW_AT])


@pytest.mark.parametrize("far", ["linear-elu", "toy", "taylor2"])
def test_a_pair_the_state_predicts_is_dropped_and_a_new_key_kept(far: str) -> None:
    assert_keeps_the_new_key(far)


@pytest.mark.parametrize("far", ["linear-elu", "delta-noconv"])
def test_novelty_keeps_the_value_the_window_does_not_hold(far: str) -> None:
    assert_keeps_the_new_key(far, "novelty")


def test_novelty_drops_a_kept_value_once_the_window_holds_it_again() -> None:
    """G = 1, W = 2: v1 at token 5 is cached; when v1 comes back at token 10 the re-scored copy scores 0 against
    the window holding it, and the newer distinct value at token 8 (v0 + 2 e2) takes the slot."""
    mixer = make("linear-elu", window=2, slots=1, cache_score="novelty")
    q, k, v, x = hand_made()
    k[:, :, 8, 0], k[:, :, 8, 2], v[:, :, 8, 2] = 0.0, 3.0, 2.0
    k[:, :, 10], v[:, :, 10] = k[:, :, NEW_AT], v[:, :, NEW_AT]
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    with torch.no_grad():
        _, before = run_steps(mixer, q[:, :, :10], k[:, :, :10], v[:, :, :10], x[:, :10], mask[:, :10])
        _, after = run_steps(mixer, q, k, v, x, mask)
    assert torch.equal(before["cv"][:, :, 0], v[:, :, NEW_AT])
    assert torch.equal(after["cv"][:, :, 0], v[:, :, 8])


def test_a_predicted_pair_is_never_kept_over_new_keys() -> None:
    """G = 2 and two new keys: at the end the cache holds exactly the two new keys, no copy of the repeated pair."""
    mixer = make("linear-elu", window=2, slots=2)
    q, k, v, x = hand_made()
    k[:, :, 8, 0], k[:, :, 8, 2], v[:, :, 8, 2] = 0.0, 3.0, 1.0  # a second new key at token 8
    with torch.no_grad():
        _, state = run_steps(mixer, q, k, v, x, torch.ones(2, SEQ, dtype=torch.bool))
    assert torch.equal(state["ck"], k[:, :, [NEW_AT, 8]])


def test_a_delta_far_part_keeps_what_its_state_misses() -> None:
    """Arriving far part (DeltaNet, no convolution): the state holds every token; the repeated pair is recalled
    better and better, the new key poorly, so after its decisions the cache holds it."""
    mixer = make("delta-noconv", window=2, slots=1)
    q, k, v, x = hand_made()
    with torch.no_grad():
        _, state = run_steps(mixer, q, k, v, x, torch.ones(2, SEQ, dtype=torch.bool))
    assert torch.equal(state["ck"][:, :, 0], k[:, :, NEW_AT])


def _negated(original: Callable) -> Callable:
    def score(self: Any, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        return -original(self, k, v, state)

    return score


def _stale_cache(original: Callable, slots: int) -> Callable:
    """The G cached pairs keep the score they entered with: here, against the empty state of the first decision."""
    def score(self: Any, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        fresh = original(self, k, v, state)
        empty = original(self, k, v, {name: torch.zeros_like(x) for name, x in state.items()})
        return torch.cat([empty[..., :slots], fresh[..., slots:]], dim=-1)

    return score


def _never_evicts(score: torch.Tensor, filled: torch.Tensor, slots: int) -> tuple[torch.Tensor, ...]:
    """The cache keeps its pairs: the first G filled candidates stay, the pending ones only fill empty slots."""
    order = torch.argsort((~filled).to(torch.int8), dim=-1, stable=True)[:, None, :slots].expand(-1, score.shape[1],
                                                                                                  -1)
    kept = torch.zeros_like(score, dtype=torch.bool).scatter(-1, order, True)
    cmask = torch.arange(slots)[None, :] < filled.sum(1, keepdim=True).clamp_max(slots)
    return order, filled[:, None, :] & ~kept, cmask


@pytest.mark.parametrize("broken", ["negated novelty", "never evicts"])
def test_broken_novelty_rules_are_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check catches a novelty score negated and a cache that never evicts."""
    novelty = cache_scores.CACHE_SCORES["novelty"]
    if broken == "negated novelty":
        negated = novelty._replace(score=lambda far, d: -novelty.score(far, d))
        monkeypatch.setitem(cache_scores.CACHE_SCORES, "novelty", negated)
    else:
        monkeypatch.setattr(hybrid_cached, "keep_slots", _never_evicts)
    with pytest.raises(AssertionError):
        assert_keeps_the_new_key("linear-elu", "novelty")


@pytest.mark.parametrize("broken", ["negated score", "no re-scoring", "never evicts"])
def test_broken_rules_are_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule broken on purpose fails the eviction-order check above (that is the test that catches it)."""
    cls = MIXERS["linear"]
    if broken == "negated score":
        monkeypatch.setattr(cls, "far_recall_error", _negated(cls.far_recall_error))
    elif broken == "no re-scoring":
        monkeypatch.setattr(cls, "far_recall_error", _stale_cache(cls.far_recall_error, 1))
    else:
        monkeypatch.setattr(hybrid_cached, "keep_slots", _never_evicts)
    with pytest.raises(AssertionError, match="the new key is cached"):
        assert_keeps_the_new_key()


# ----- through the model: generation, packing, variants ----------------------------------------------------------
MODEL_SPECS = {
    "linear": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "sink_tokens": 1,
               "far": {"mixer": "linear", "feature_map": "hedgehog"}},
    "taylor": {"mixer": "hybrid", "window": 2, "cache_slots": 3, "far": {"mixer": "taylor", "order": 2}},
    "delta": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "combine": "sum", "far": {"mixer": "delta"}},
    "rwkv7": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "combine": "sum", "far": "rwkv7"},
    "delta-novelty": {"mixer": "hybrid", "window": 2, "cache_slots": 2, "combine": "sum", "far": {"mixer": "delta"},
                      "sink_tokens": 1, "cache_score": "novelty"},
    "retrieval": {"mixer": "retrieval_heads", "heads": [1], "others": {
        "mixer": "hybrid", "window": 2, "cache_slots": 1, "far": {"mixer": "linear", "feature_map": "elu"}}},
}


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_cached_generation_equals_uncached(name: str) -> None:
    """Greedy tokens with the cache equal the full forward's at every step; logits within 1e-4; left-padded rows
    of 6, 8 and 9 tokens and 8 new ones (decisions every 2 tokens, so several fall in prefill and in decoding)."""
    assert_cached_generation_equals_uncached(tiny_model(Case(name, MODEL_SPECS[name])))


def assert_cached_generation_equals_uncached(model: RecAttnForCausalLM) -> None:
    """``test_cached_generation_equals_uncached``'s check on ``model``."""
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, pad_token_id=PAD_ID, max_new_tokens=8, do_sample=False)
    plain = model.generate(ids, use_cache=False, **kwargs)
    cached = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(cached.sequences, plain)
    full_mask = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        full = model(cached.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(cached.logits, 1), full[:, ids.shape[1] - 1 : -1], rtol=0, atol=1e-4)


def test_packed_documents_reset_the_cache() -> None:
    """Documents packed in one row (position ids restarting) give their logits alone: each starts with an empty
    cache, pending buffer and far state."""
    model = tiny_model(Case("linear", MODEL_SPECS["linear"]))
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 64, (n,), generator=gen) for n in (9, 5, 11)]
    ids, positions = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits[0]
        alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_variants_drop_the_cache() -> None:
    """window-only is softmax over the window (the cache is the far state's choice, so it goes with it); far-only is
    the far mixer alone."""
    model = tiny_model(Case("linear", MODEL_SPECS["linear"]))
    variants = variant_models(model)
    window = variants["window-only"].config.layer_spec(0)
    assert window["far"] == "none" and window["cache_slots"] == 0 and window["sink_tokens"] == 1
    assert variants["far-only"].config.layer_spec(0)["mixer"] == "linear"


# ----- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ({"cache_slots": -1}, r"layer 2: option 'cache_slots' must be >= 0"),
        ({"cache_slots": 1.5}, r"layer 2: option 'cache_slots' must be int"),
        ({"cache_slots": 2, "far": "none"},
         r"layer 2: option 'cache_slots' with cache_score='far' needs a far part .* got far='none'"),
        ({"cache_slots": 2, "far": "toy_mute", "combine": "sum"},
         r"layer 2: option 'cache_slots' needs a far part that scores recall \(far_recall_error\); a toy_mute far "
         r"part declares none"),
        ({"cache_slots": 2, "far": {"mixer": "taylor", "denominator": "l2"}, "combine": "sum"},
         r"layer 2: option 'cache_slots' needs a taylor far part with denominator='exact'"),
        ({"cache_slots": 2, "far": "heinsen"}, r"layer 2: option 'far' must be a linear or taylor"),
        ({"cache_slots": 2, "cache_score": "attention"},
         r"layer 2: option 'cache_score' must be one of \['far', 'novelty', 'keydiff', 'keydiff_span', 'recent', "
         r"'learned'\], "
         r"got 'attention'"),
        ({"cache_score": "novelty"},
         r"layer 2: option 'cache_score'='novelty' scores the exact cache, which is off \(cache_slots: 0\)"),
    ],
)
def test_bad_specs_name_layer_and_option(spec: dict, pattern: str) -> None:
    checks.assert_specs_rejected([({"mixer": "hybrid", **spec}, "layer 2", pattern)])


def test_more_slots_than_positions_is_refused() -> None:
    config = RecAttnConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                           attention={"mixer": "hybrid", "window": 2, "cache_slots": 17})
    with pytest.raises(ValueError, match=r"layer 0: option 'cache_slots'=17 exceeds max_position_embeddings=16"):
        RecAttnForCausalLM(config)
