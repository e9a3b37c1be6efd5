"""Recurrent softmax by a truncated Taylor series (Mongaras & Larson, arXiv:2507.23632): o_t = G_t sum_s T_N(s q_t .
k_s) v_s.

``order`` N is an integer (T_N(x) = sum_{n<=N} x^n/n!) or "exp" (the exact exponential, as in the paper's Gate
and Norm models). ``denominator`` says what replaces / implements G_t:

* ``exact``: the same series without v (softmax's denominator; even N or "exp" only, since T_N of odd N goes
  negative);
* ``l2`` / ``rms`` / ``layernorm``: a vector norm of each head's output with a learnable gain (eq. 6);
* ``gate``: eq. 5, G_t = sigmoid(w_h . x_t + b_h) / t, with x_t the (normed) layer input and t the number of
  real keys the query sees. G_t scales row t of the attention matrix, i.e. the output of query t (appendix E's
  output gate, though its formula labels the row gate G^in). The paper's "up to d extra parameters per layer"
  suggests one gate shared by the heads; we give each query head its own (a Linear(hidden, heads), so
  H * (hidden + 1) parameters), which contains the shared gate as a special case. The paper clamps the
  pre-exponential logit at 5: with order="exp" we clamp the logit s q.k at ``gate_clamp`` from above exactly.
  A finite order has no exponential and its recurrent state cannot clamp a product after the fact, so there
  we bound it in every form by clamping the norms of the scaled query and of the key at sqrt(gate_clamp),
  which by Cauchy-Schwarz keeps |s q.k| <= gate_clamp;
* ``none``: the bare numerator (unbounded; with order="exp" it overflows for large logits).

With order="exp", the exact and norm denominators subtract each row's largest logit before exp (a factor that
cancels, for the norms up to their eps).

Forms: the parallel form evaluates the polynomial of the score matrix (Horner); the recurrent form keeps the
symmetric-packed per-order states (see ops_taylor); the chunked form is exact inside a chunk and passes the
packed states across chunks. With order="exp", or when the packed states would exceed ``state_budget``
elements per sequence (``cache="auto"``), the layer keeps a KV cache instead and reports ``state_kind="kv"``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .far_part import LEAVING, FarPart, FarTerms, shared_needs
from .feature_maps import FeatureMap
from .mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, state_dtype, ungroup_output, writable
from .ops_taylor import packed_dim, packed_powers, quadratic_weights, taylor_chunked, taylor_step
from .options import Option
from .output_norms import OUTPUT_NORMS, OutputNorm

DENOMINATORS = ("exact", *OUTPUT_NORMS, "gate", "none")
TAYLOR_FEATURE_MAPS = ("relu", "elu", "cosine")
CACHE_FORMS = ("auto", "recurrent", "kv")
DEFAULT_STATE_BUDGET = 1 << 24  # elements per sequence and layer (32 MiB in bf16)

Terms = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, State | None]


def _clamp_norm(x: torch.Tensor, bound: float) -> torch.Tensor:
    """Rescale vectors (last dim) whose norm exceeds ``bound`` onto the sphere of that radius."""
    norm = x.norm(dim=-1, keepdim=True)
    return x * (bound / norm.clamp_min(bound))


class TaylorMixer(Mixer, FarPart):
    """Softmax attention with exp replaced by its order-N Taylor polynomial (or exact), any denominator.

    Paper: Mongaras & Larson, "On the Expressiveness of Softmax Attention: A Recurrent Neural Network
    Perspective", arXiv:2507.23632 (``denominator`` options: its eqs. 5-6).
    """

    name = "taylor"
    options = {
        "order": Option(
            (int,), 2, "Taylor order N >= 1, or 'exp' for the exact exponential", minimum=1, literals=("exp",)
        ),
        "denominator": Option(
            (str,), "exact", "what normalizes the numerator (Mongaras & Larson, eqs. 4-6)", choices=DENOMINATORS
        ),
        "gate_clamp": Option(
            (float,), 5.0, "denominator='gate': bound on the pre-exponential logit (None: off)", nullable=True
        ),
        "feature_map": Option(
            (str,),
            None,
            "map applied to q and k before the expansion (appendix F)",
            choices=TAYLOR_FEATURE_MAPS,
            nullable=True,
        ),
        "learn_temperature": Option(
            (bool,), False, "a learnable per-head factor on the scale, starting at 1"
        ),
        "scale": Option((float,), None, "logit scale s (None: 1/sqrt(head_dim))", nullable=True),
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        "state_budget": Option(
            (int,),
            DEFAULT_STATE_BUDGET,
            "max recurrent state elements per sequence; above it the layer keeps a KV cache",
            minimum=1,
        ),
        "cache": Option(
            (str,),
            "auto",
            "auto: packed states within the budget else a KV cache; recurrent: "
            "packed states or an error; kv: always a KV cache",
            choices=CACHE_FORMS,
        ),
        "eps": Option((float,), 1e-6, "floor of the exact denominator / added in norms", minimum=0.0),
        "causal": Option((bool,), True, "causal (decoder) or bidirectional attention"),
    }
    state_kind = "recurrent"
    has_chunked = True

    @classmethod
    def softmax_reach(cls, spec: dict[str, Any]) -> str | None:
        """order 'exp' is exact softmax over a KV cache (every earlier key); a finite order has no softmax logits
        (a polynomial state, or the same polynomial over a KV cache)."""
        return "context" if spec["order"] == "exp" else None

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        order = spec["order"]
        if spec["denominator"] == "exact" and order != "exp" and order % 2 == 1:
            raise ValueError(
                f"{where}: option 'denominator'='exact' needs an even 'order' or 'exp' (T_N(x) goes "
                f"negative for odd N, so the denominator could vanish), got order={order}"
            )
        if spec["cache"] == "recurrent" and order == "exp":
            raise ValueError(
                f"{where}: option 'cache'='recurrent' needs a finite 'order'; order='exp' keeps a KV cache"
            )
        for name in ("gate_clamp", "scale"):
            if spec[name] is not None and spec[name] <= 0:
                raise ValueError(f"{where}: option {name!r} must be > 0 (or None), got {spec[name]!r}")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.order: int | str = spec["order"]
        self.denominator: str = spec["denominator"]
        self.eps = float(spec["eps"])
        self.chunk_size = int(spec["chunk_size"])
        self.causal = bool(spec["causal"])
        self.scale = float(spec["scale"]) if spec["scale"] is not None else shape.head_dim**-0.5
        self.gate_clamp = spec["gate_clamp"] if self.denominator == "gate" else None
        self.feature_map = FeatureMap(spec["feature_map"], shape) if spec["feature_map"] else None
        self.log_temperature = (
            nn.Parameter(torch.zeros(shape.num_heads)) if spec["learn_temperature"] else None
        )
        self.output_norm = (
            OutputNorm(self.denominator, shape, shape.head_dim, self.eps)
            if self.denominator in OUTPUT_NORMS
            else None
        )
        self.gate_proj = nn.Linear(shape.hidden_size, shape.num_heads) if self.denominator == "gate" else None
        self.recurrent = self._choose_recurrent(spec)
        if not self.recurrent:
            self.state_kind = "kv"
            self.has_chunked = False

    def _choose_recurrent(self, spec: dict[str, Any]) -> bool:
        if spec["cache"] == "kv" or self.order == "exp":
            return False
        size = self.recurrent_state_size()
        if size <= spec["state_budget"]:
            return True
        if spec["cache"] == "recurrent":
            raise ValueError(
                f"layer {self.shape.layer_idx}: option 'order'={self.order} needs {size:,} recurrent state "
                f"elements per sequence (head_dim {self.shape.head_dim}, "
                f"{self.shape.num_kv_heads} KV heads) above option 'state_budget'={spec['state_budget']:,}; "
                "lower the order, raise the budget, or use cache='auto' (a KV cache above the budget)"
            )
        return False

    def recurrent_state_size(self) -> int:
        """Elements per sequence of the packed states: Hkv * (C(d+N, N) * (e + [exact]) + [gate])."""
        if self.order == "exp":
            raise ValueError(f"layer {self.shape.layer_idx}: order='exp' has no finite recurrent state")
        d, e = self.shape.head_dim, self.shape.head_dim
        per_head = packed_dim(d, int(self.order)) * (e + (self.denominator == "exact"))
        return self.shape.num_kv_heads * (per_head + (self.denominator == "gate"))

    def init_parameters(self, init: Any) -> None:
        if self.log_temperature is not None:
            init.zeros_(self.log_temperature)

    # ----- shared pieces ------------------------------------------------------------------------------------
    def _prepare(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped, feature-mapped and scaled queries; feature-mapped keys; the gate's norm clamp."""
        qg = group_queries(q, self.shape.num_kv_heads)
        if self.feature_map is not None:
            qg = self.feature_map(qg, is_query=True)
            k = self.feature_map(k, is_query=False)
        qg = qg * self.scale
        if self.log_temperature is not None:
            qg = qg * self.log_temperature.exp().view(self.shape.num_kv_heads, self.shape.groups, 1, 1)
        if self.gate_clamp is not None and self.order != "exp":
            bound = math.sqrt(self.gate_clamp)
            qg, k = _clamp_norm(qg, bound), _clamp_norm(k, bound)
        return qg, k

    def finish(
        self, num: torch.Tensor, den: torch.Tensor | None, cnt: torch.Tensor | None, inputs: MixerInputs
    ) -> torch.Tensor:
        """Apply the denominator to grouped numerators [B,Hkv,G,T,E]; returns [B,T,H,E]."""
        if self.denominator == "exact":
            out = num / den.clamp_min(self.eps)[..., None]
        elif self.output_norm is not None:
            out = self.output_norm(num)
        elif self.denominator == "gate":
            b, t = inputs.hidden_states.shape[:2]
            gate = torch.sigmoid(self.gate_proj(inputs.hidden_states)).to(num.dtype)  # [B, T, H]
            gate = gate.transpose(1, 2).reshape(b, self.shape.num_kv_heads, self.shape.groups, t)
            out = num * (gate / cnt.clamp_min(1.0))[..., None]
        else:
            out = num
        return ungroup_output(out)

    def _quadratic(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_real: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """All-pairs form; the queries are the last T of the S key positions."""
        qg, kf = self._prepare(q, k)
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg, kf)
        if self.order == "exp" and self.gate_clamp is not None:
            scores = scores.clamp(max=self.gate_clamp)
        t, s = scores.shape[-2:]
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device)
        if self.causal:
            visible = visible.tril(s - t)
        visible = visible[None, None, None]
        if key_real is not None:
            visible = visible & key_real[:, None, None, None, :].bool()
        stabilize = self.denominator == "exact" or self.output_norm is not None
        weights = quadratic_weights(scores, visible, self.order, stabilize)
        num = torch.einsum("bhgts,bhse->bhgte", weights, v)
        den = weights.sum(-1) if self.denominator == "exact" else None
        cnt = visible.to(q.dtype).expand_as(weights).sum(-1) if self.denominator == "gate" else None
        return num, den, cnt

    def parallel_terms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> Terms:
        """(numerator, denominator, key count, None) of the parallel form, before ``finish``."""
        return (*self._quadratic(q, k, v, inputs.token_mask), None)

    def chunked_terms(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> Terms:
        """(numerator, denominator, key count, new state) of the chunked form, before ``finish``."""
        self.require_causal("chunked")
        if not self.recurrent:
            return self._cached_terms(q, k, v, inputs, state)
        qg, kf = self._prepare(q, k)
        return taylor_chunked(qg, kf, v, state, int(self.order), self.chunk_size, inputs.token_mask)

    def step_terms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State) -> Terms:
        """(numerator, denominator, key count, new state) of one step, before ``finish``."""
        self.require_causal("step")
        if not self.recurrent:
            return self._cached_terms(q, k, v, inputs, state)
        qg, kf = self._prepare(q, k)
        return taylor_step(qg, kf, v, state, int(self.order), inputs.token_mask, in_place=writable(*state.values()))

    def _cached_terms(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> Terms:
        """A KV cache: all-pairs over the cached keys plus the new ones."""
        keys, values = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)
        real = None if inputs.padding_mask is None else inputs.padding_mask[:, -keys.shape[2] :]
        return (*self._quadratic(q, keys, values, real), {"k": keys, "v": values})

    # ----- as a hybrid's far part (far_part.py): the keys leaving the window, sums shared with it --------------
    far_reads = LEAVING
    far_shared = True

    @classmethod
    def far_part_problem(cls, spec: dict[str, Any], combine: str) -> str | None:
        if spec["order"] == "exp" or spec["cache"] == "kv":
            return "a taylor far mixer needs a finite order and a recurrent state (not order='exp' or cache='kv')"
        if combine == "shared" and spec["denominator"] != "exact":
            return shared_needs("taylor with denominator='exact'")
        return None

    @classmethod
    def far_part_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        """Packed states always: a state over the budget is an error, not a KV cache."""
        return {**spec, "cache": "recurrent"}

    def far_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> FarTerms:
        return FarTerms(*self.parallel_terms(q, k, v, inputs)[:3]).to(q.dtype)

    def far_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        num, den, cnt, state = self.chunked_terms(q, k, v, inputs, state)
        return FarTerms(num, den, cnt).to(q.dtype), state

    def far_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        num, den, cnt, state = self.step_terms(q, k, v, inputs, state)
        return FarTerms(num, den, cnt).to(q.dtype), state

    def far_output(self, terms: FarTerms, inputs: MixerInputs) -> torch.Tensor:
        return self.finish(terms.num, terms.den, terms.count, inputs)

    # ----- beside the hybrid's exact cache (cache_slots): read, add and score apart -----------------------------
    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        if spec["denominator"] != "exact":
            return "needs a taylor far part with denominator='exact' (its recall score is the normalized state's)"
        return None

    def _far_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys [B, Hkv, N, D] as ``_prepare`` makes them (feature map), without queries."""
        return self._prepare(k.new_zeros(k.shape[0], self.shape.num_heads, 0, k.shape[3]), k)[1]

    def far_read(self, q: torch.Tensor, inputs: MixerInputs, state: State) -> FarTerms:
        """Phi(s q) S and Phi(s q) z: the queries' terms over the packed state, which stays as it is."""
        S, z = state["S"], state["z"]
        no_keys = q.new_zeros(q.shape[0], self.shape.num_kv_heads, 0, q.shape[3], dtype=S.dtype)
        qg, _ = self._prepare(q.to(S.dtype), no_keys)
        fq = packed_powers(qg, int(self.order))
        return FarTerms(fq @ S[:, :, None], (fq @ z[:, :, None, :, None])[..., 0]).to(q.dtype)

    def far_add(self, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, state: State) -> State:
        """S + sum_i w_i Phi(k_i) v_i^T and z + sum_i w_i Phi(k_i), per key head."""
        S, z = state["S"], state["z"]
        fk = packed_powers(self._far_keys(k.to(S.dtype)), int(self.order)) * weight[..., None].to(S.dtype)
        return {**state, "S": S + fk.transpose(-1, -2) @ v.to(S.dtype), "z": z + fk.sum(2)}

    def far_recall_error(self, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        """||v - num / den|| for each key read as a query (T_N(s k . k_i) weights; den floored at eps, as
        ``finish`` does)."""
        S, z = state["S"], state["z"]
        fk = packed_powers(self._far_keys(k.to(S.dtype)) * self.scale, int(self.order))
        recall = (fk @ S) / (fk @ z[..., None]).clamp_min(self.eps)
        return (v.to(S.dtype) - recall).norm(dim=-1)

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        num, den, cnt, _ = self.parallel_terms(q, k, v, inputs)
        return self.finish(num, den, cnt, inputs)

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        num, den, cnt, state = self.chunked_terms(q, k, v, inputs, state)
        return self.finish(num, den, cnt, inputs), state

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        num, den, cnt, state = self.step_terms(q, k, v, inputs, state)
        return self.finish(num, den, cnt, inputs), state

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, d = self.shape.num_kv_heads, self.shape.head_dim
        if not self.recurrent:
            empty = (batch_size, hk, 0, d)
            return {
                "k": torch.zeros(empty, device=device, dtype=dtype),
                "v": torch.zeros(empty, device=device, dtype=dtype),
            }
        p = packed_dim(d, int(self.order))
        dtype = state_dtype(dtype)
        state = {"S": torch.zeros(batch_size, hk, p, d, device=device, dtype=dtype)}
        if self.denominator == "exact":
            state["z"] = torch.zeros(batch_size, hk, p, device=device, dtype=dtype)
        if self.denominator == "gate":
            state["n"] = torch.zeros(batch_size, hk, device=device, dtype=dtype)
        return state

    def state_size(self, context_length: int) -> int:
        if not self.recurrent:
            return 2 * self.shape.num_kv_heads * self.shape.head_dim * context_length
        return self.recurrent_state_size()
