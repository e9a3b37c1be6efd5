"""Linear attention with a feature map: o_t = phi(q_t) S_t / phi(q_t) z_t, or a vector norm of the numerator.

With ``decay`` the state forgets: S_t = g_t S_{t-1} + phi(k_t) v_t^T (see decay.py); with ``sink`` every query
also sees one learned key/value pair outside the state (see sink.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .decay import DECAYS, RETNET_GAMMA_MIN, Decay
from .far_part import LEAVING, FarPart, FarTerms, shared_needs
from .feature_maps import FEATURE_MAPS, FeatureMap
from .mixer_base import Mixer, MixerInputs, MixerShape, State, group_queries, state_dtype, ungroup_output, writable
from .ops_linear import linear_chunked, linear_parallel, linear_scores, linear_step, noncausal_linear
from .ops_taylor import taylor_chunked
from .options import Option, check_not_above, check_open_unit
from .output_norms import OUTPUT_NORMS, OutputNorm
from .sink import AttentionSink

NORMALIZATIONS = ("denominator", *OUTPUT_NORMS)
#: feature maps whose features are never negative (so the denominator is >= 0)
NONNEGATIVE_MAPS = ("elu", "relu", "exp", "hedgehog", "taylor2")


class LinearMixer(Mixer, FarPart):
    """Kernelized attention phi(q) . phi(k) with a fixed-size state S = sum phi(k) v^T (and z = sum phi(k)).

    Paper: Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive Transformers with Linear
    Attention", arXiv:2006.16236 (the default ``feature_map="elu"``, elu(x) + 1, is theirs).

    Options from other papers:

    * ``feature_map="hedgehog"``: Zhang et al., "The Hedgehog & the Porcupine: Expressive Linear Attentions
      with Softmax Mimicry", arXiv:2402.04347;
    * ``feature_map="taylor2"``: the second-order Taylor map of Based, Arora et al., "Simple linear attention
      language models balance the recall-throughput tradeoff", arXiv:2402.18668;
    * ``decay="retnet"``: Sun et al., "Retentive Network: A Successor to Transformer for Large Language
      Models", arXiv:2307.08621;
    * ``decay="gated"``: a scalar data-dependent decay as in Mamba-2, Dao & Gu, "Transformers are SSMs:
      Generalized Models and Efficient Algorithms Through Structured State Space Duality", arXiv:2405.21060;
    * ``sink``: a learned stand-in for the attention sinks of Xiao et al., "Efficient Streaming Language
      Models with Attention Sinks", arXiv:2309.17453.

    The equations follow Su, "A Brief History of Linear Attention", https://kexue.fm/archives/11033 (forget gates).
    """

    name = "linear"
    options = {
        "feature_map": Option((str,), "elu", "phi applied to q and k", choices=FEATURE_MAPS),
        "normalize": Option((str,), "denominator", "how the numerator is normalized", choices=NORMALIZATIONS),
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        "eps": Option((float,), 1e-6, "added to denominators / norms", minimum=0.0),
        "causal": Option((bool,), True, "causal (decoder) or bidirectional attention"),
        "decay": Option((str,), "none", "forget factor of the state: none, learned (per key head), gated "
                        "(from the layer input) or retnet (fixed, per key head)", choices=DECAYS),
        "half_life_min": Option((float,), 8.0, "shortest initial decay half-life in tokens", minimum=1e-3),
        "half_life_max": Option((float,), 1024.0, "longest initial decay half-life in tokens", minimum=1e-3),
        "gamma_min": Option((float,), RETNET_GAMMA_MIN, "decay=retnet: the first key head's factor, in (0, 1)"),
        "gamma_max": Option((float,), None, "decay=retnet: the last key head's factor, in (0, 1); None: "
                            "1 - 2^-(5 + Hkv - 1), RetNet's schedule 1 - 2^(-5 - h)", nullable=True),
        "sink": Option((bool,), False, "a learned key/value pair every query sees, outside the state"),
    }
    state_kind = "recurrent"
    has_chunked = True

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        if spec["decay"] != "none" and not spec["causal"]:
            raise ValueError(f"{where}: option 'decay' needs causal=True (a decayed state has a direction)")
        check_not_above(spec, where, "half_life_min", "half_life_max")
        for name in ("gamma_min", "gamma_max"):
            check_open_unit(spec, where, name, " (a decay factor)")
        check_not_above(spec, where, "gamma_min", "gamma_max")

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.feature_map = FeatureMap(spec["feature_map"], shape)
        self.normalize = spec["normalize"]
        self.eps = float(spec["eps"])
        self.chunk_size = int(spec["chunk_size"])
        self.causal = bool(spec["causal"])
        self.output_norm = (
            None
            if self.normalize == "denominator"
            else OutputNorm(self.normalize, shape, shape.head_dim, self.eps)
        )
        self.decay = (
            None
            if spec["decay"] == "none"
            else Decay(spec["decay"], shape, spec["half_life_min"], spec["half_life_max"], spec["gamma_min"],
                       spec["gamma_max"])
        )
        self.sink = AttentionSink(shape) if spec["sink"] else None

    # ----- shared pieces ------------------------------------------------------------------------------------
    def features(
        self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """phi(q) grouped by key head [B, Hkv, G, T, F] and phi(k) [B, Hkv, T, F], zero on padded keys."""
        qf = self.feature_map(group_queries(q, self.shape.num_kv_heads), is_query=True)
        kf = self.feature_map(k, is_query=False)
        mask = inputs.token_mask
        if mask is not None:
            kf = kf * mask[:, None, :, None].to(kf.dtype)
        return qf, kf

    def _key_features(self, key: torch.Tensor) -> torch.Tensor:
        """phi of keys alone (the sink's learned key)."""
        return self.feature_map(key, is_query=False)

    def _log_decay(self, inputs: MixerInputs) -> torch.Tensor | None:
        """[B, Hkv, T] log forget factors (0 on padding), or None without decay."""
        if self.decay is None:
            return None
        log_g = self.decay(inputs.hidden_states)
        mask = inputs.token_mask
        return log_g if mask is None else log_g.masked_fill(~mask[:, None, :], 0.0)

    def _with_sink(
        self, qf: torch.Tensor, num: torch.Tensor, den: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sink is None:
            return num, den
        return self.sink(qf, self._key_features, num, den)

    def finish(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """Normalized output [B, T, H, E] from the numerator [B, Hkv, G, T, E] and denominator [B, Hkv, G, T]."""
        if self.output_norm is None:
            out = num / (den[..., None] + self.eps)
        else:
            out = self.output_norm(num)
        return ungroup_output(out)

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs
    ) -> torch.Tensor:
        qf, kf = self.features(q, k, inputs)
        if not self.causal:
            return self.finish(*self._with_sink(qf, *noncausal_linear(qf, kf, v)))
        num, den = linear_parallel(qf, kf, v, log_g=self._log_decay(inputs))
        return self.finish(*self._with_sink(qf, num, den))

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("chunked")
        if self.feature_map.kind == "taylor2" and self.decay is None and self.sink is None:
            return self._taylor2_chunked(q, k, v, inputs, state)
        qf, kf = self.features(q, k, inputs)
        num, den, S, z = linear_chunked(
            qf, kf, v, state["S"], state["z"], self.chunk_size, self._log_decay(inputs)
        )
        return self.finish(*self._with_sink(qf, num, den)), {"S": S, "z": z}

    def _taylor2_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        """The chunked form with taylor2 features, through order-2 Taylor attention's chunked form: taylor2 is
        order-2 Taylor's feature map of x / d^(1/4) (phi(q) . phi(k) = T_2(q . k / sqrt(d))), so the states are
        the same. Intra-chunk weights come from q . k and features are built one chunk at a time."""
        scale = self.shape.head_dim**-0.25
        qg = group_queries(q, self.shape.num_kv_heads) * scale
        num, den, _, new = taylor_chunked(qg, k * scale, v, state, 2, self.chunk_size, inputs.token_mask)
        return self.finish(num, den), new

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        self.require_causal("step")
        qf, kf = self.features(q, k, inputs)
        S, z = state["S"], state["z"]
        num, den, S, z = linear_step(qf, kf, v, S, z, self._log_decay(inputs), in_place=writable(S, z))
        return self.finish(*self._with_sink(qf, num, den)), {"S": S, "z": z}

    # ----- as a hybrid's far part (far_part.py): the keys leaving the window, sums shared with it --------------
    far_reads = LEAVING
    far_shared = True

    @classmethod
    def far_part_problem(cls, spec: dict[str, Any], combine: str) -> str | None:
        if spec["decay"] != "none":
            return "a linear far mixer cannot decay (the window hands keys to the far state undecayed)"
        if spec["sink"]:
            return "a linear far mixer cannot have a sink (the hybrid combines the far state's sums itself)"
        if combine == "shared" and (spec["normalize"] != "denominator" or spec["feature_map"] not in NONNEGATIVE_MAPS):
            return shared_needs(f"linear with normalize='denominator' and feature_map in {list(NONNEGATIVE_MAPS)}")
        return None

    def far_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> FarTerms:
        qf, kf = self.features(q, k, inputs)
        return FarTerms(*linear_parallel(qf, kf, v))

    def far_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        qf, kf = self.features(q, k, inputs)
        num, den, S, z = linear_chunked(qf, kf, v, state["S"], state["z"], self.chunk_size)
        return FarTerms(num, den).to(q.dtype), {"S": S, "z": z}

    def far_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        qf, kf = self.features(q, k, inputs)
        S, z = state["S"], state["z"]
        num, den, S, z = linear_step(qf, kf, v, S, z, in_place=writable(S, z))
        return FarTerms(num, den).to(q.dtype), {"S": S, "z": z}

    def far_output(self, terms: FarTerms, inputs: MixerInputs) -> torch.Tensor:
        return self.finish(terms.num, terms.den)

    # ----- beside the hybrid's exact cache (cache_slots): read, add and score apart -----------------------------
    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        return None

    def far_read(self, q: torch.Tensor, inputs: MixerInputs, state: State) -> FarTerms:
        """phi(q) S and phi(q) z: the queries' terms over the state, which stays as it is."""
        S, z = state["S"], state["z"]
        qf = self.feature_map(group_queries(q, self.shape.num_kv_heads), is_query=True).to(S.dtype)
        num = qf @ S[:, :, None]  # [B, Hkv, G, T, F] @ [B, Hkv, 1, F, E]
        den = (qf @ z[:, :, None, :, None])[..., 0]
        return FarTerms(num, den).to(q.dtype)

    def far_add(self, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, state: State) -> State:
        """S + sum_i w_i phi(k_i) v_i^T and z + sum_i w_i phi(k_i), per key head."""
        S, z = state["S"], state["z"]
        kf = self.feature_map(k, is_query=False).to(S.dtype) * weight[..., None].to(S.dtype)
        return {"S": S + kf.transpose(-1, -2) @ v.to(S.dtype), "z": z + kf.sum(2)}

    def far_recall_error(self, k: torch.Tensor, v: torch.Tensor, state: State) -> torch.Tensor:
        """||v - S^T phi(k) / (z^T phi(k) + eps)||: the state's normalized answer to each key (LoLA's score)."""
        S, z = state["S"], state["z"]
        kf = self.feature_map(k, is_query=False).to(S.dtype)
        recall = (kf @ S) / ((kf @ z[..., None]) + self.eps)
        return (v.to(S.dtype) - recall).norm(dim=-1)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, inputs: MixerInputs) -> torch.Tensor | None:
        """phi(q_t) . phi(k_s) (decayed) over the denominator (+ eps), as the output divides them; None with an
        output norm instead of the denominator."""
        if self.output_norm is not None:
            return None
        qf, kf = self.features(q, k, inputs)
        scores = linear_scores(qf, kf, self.causal, self._log_decay(inputs))
        den = scores.sum(-1)
        if self.sink is not None:
            den = den + self.sink.scores(qf, self._key_features)[..., 0]
        weights = scores / (den[..., None] + self.eps)
        b, hk, g, t, s = weights.shape
        return weights.reshape(b, hk * g, t, s)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        hk, f, e = self.shape.num_kv_heads, self.feature_map.out_dim, self.shape.head_dim
        dtype = state_dtype(dtype)
        return {
            "S": torch.zeros(batch_size, hk, f, e, device=device, dtype=dtype),
            "z": torch.zeros(batch_size, hk, f, device=device, dtype=dtype),
        }

    def state_size(self, context_length: int) -> int:
        f = self.feature_map.out_dim
        return self.shape.num_kv_heads * f * (self.shape.head_dim + 1)
