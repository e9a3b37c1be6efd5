"""The built-in presets: a spec written once under a name, usable wherever a spec is accepted.

Data only: ``mixers.py`` registers each through ``registry.register_preset`` (which validates it). Every preset
names a family and states each architectural option explicitly, so that a later change of a family's defaults
does not change what a preset means; the validated spec names the family, never the preset. A string spec names
a family or a preset; a dict whose ``mixer`` is a preset overrides the preset's options (see registry.py).
"""

from __future__ import annotations

from typing import Any

from .registry import PRESET_DOCS, PRESETS, expand_preset, register_preset

__all__ = ["BUILTIN_PRESETS", "BUILTIN_PRESET_DOCS", "PRESETS", "PRESET_DOCS", "expand_preset", "register_preset"]

_GDN: dict[str, Any] = {
    "mixer": "delta",
    "rule": "gated",
    "householder_steps": 1,
    "conv_size": 4,
    "activation": "silu",
    "qk_norm": "l2",
    "negative_eigenvalues": False,
    "output_norm": True,
    "output_gate": True,
    "rope": False,
    "init": "scratch",
}

#: preset name -> spec (its ``mixer`` is always a family)
BUILTIN_PRESETS: dict[str, dict[str, Any]] = {
    "deltanet": {**_GDN, "rule": "delta", "output_gate": False},
    "gdn": dict(_GDN),
    "comba": {**_GDN, "rule": "comba"},
    "deltaproduct": {**_GDN, "householder_steps": 2, "negative_eigenvalues": True},
    # softmax with forget factors (Su, "A Brief History of Linear Attention", kexue.fm/archives/11033, eq. 22)
    "alibi": {"mixer": "softmax", "forget": "alibi", "alibi_slopes": None, "fox_bias_init": None, "rope": False},
    "fox": {"mixer": "softmax", "forget": "fox", "alibi_slopes": None, "fox_bias_init": 0.0, "rope": False},
    "mesanet": {"mixer": "mesa", "solver": "cg", "cg_steps": 30, "lambda_min": 0.25, "lambda_init": 1.0,
                "conv_size": 4, "activation": "silu", "qk_norm": "l2", "output_norm": True, "output_gate": False,
                "rope": False, "init": "scratch"},
    # the softmax families fed back from DeltaNet (Su's text): DeltaFormer (family softmax_delta)
    # and PaTH (family softmax_householder)
    "deltaformer": {"mixer": "softmax_delta", "write_strength": "none", "scale": None, "key_scale": None,
                     "rope": True},
    "path": {"mixer": "softmax_householder", "rope": False, "scale": None, "eps": 1e-6, "init": "scratch"},
    # fixed and gated decays: RetNet (family linear), GLA (family gated_linear)
    "retnet": {"mixer": "linear", "feature_map": "identity", "normalize": "layernorm", "decay": "retnet",
               "gamma_min": 1.0 - 2.0**-5, "gamma_max": None, "sink": False, "causal": True, "rope": True},
    "gla": {"mixer": "gated_linear", "gate_rank": 16, "gate_temperature": 16.0, "output_norm": True,
            "output_gate": True, "scale": None, "causal": True, "rope": False, "init": "scratch"},
    "rwkv7": {"mixer": "generalized_delta", "decay_rank": 64, "iclr_rank": 64, "output_norm": True,
              "output_gate": True, "scale": 1.0, "causal": True, "rope": False, "init": "scratch"},
    "kimi_linear": {"mixer": "kda", "decay_rank": None, "conv_size": 4, "activation": "silu", "feature_map": "identity",
                    "qk_norm": "l2", "output_norm": True, "output_gate": True, "scale": None, "causal": True,
                    "rope": False, "init": "scratch"},
}

#: preset name -> one line on where its defaults come from
BUILTIN_PRESET_DOCS: dict[str, str] = {
    "deltanet": "DeltaNet (Yang et al. 2024), as fla's DeltaNet layer defaults: short convolution of 4 taps, "
    "SiLU on q/k/v, L2-normalized q and k, output RMSNorm, no output gate, no RoPE.",
    "gdn": "Gated DeltaNet (Yang et al. 2025): DeltaNet's convolution, SiLU and L2 norm plus Mamba-2's decay "
    "(A ~ U(0, 16), dt log-uniform in [1e-3, 0.1]) and a SiLU output gate after the RMSNorm, no RoPE.",
    "comba": "Comba (Hu et al. 2025): rule comba (see mixer_delta.py), otherwise Gated DeltaNet's convolution, "
    "norms, gates and initialization, no RoPE.",
    "deltaproduct": "Gated DeltaProduct (Siems et al. 2025): 2 Householder steps per token with b in (0, 2) "
    "(eigenvalues in [-1, 1]), otherwise Gated DeltaNet.",
    "alibi": "ALiBi (Press et al. 2022): softmax with logit bias -m_h (i - j), slopes m_h = 2^(-8h/H), no RoPE.",
    "fox": "FoX (no RoPE) (Lin et al. 2025): softmax with logit bias sum log f over (j, i], f_t = sigmoid(w_h . x_t / "
    "sqrt(C) + b_h) per head, bias 0 at init (f = 1/2, the paper's zero-initialized gate bias; w starts at 0 here, "
    "N(0, 0.02) unscaled in the paper). For conversion use {mixer: softmax, forget: fox} (lossless init, RoPE kept).",
    "mesanet": "MesaNet (von Oswald et al. 2025), as fla's MesaNet layer: sigmoid forget and input gates, Lambda = "
    "softplus(.) + 0.25 starting at 1, 30 CG steps, short convolution of 4 taps + SiLU on q and k, L2-normalized "
    "q and k, output RMSNorm without gate, no RoPE.",
    "deltaformer": "DeltaFormer as Su's text writes it (eq. 23): O = A (I + B)^-1 V with softmax A over "
    "keys j <= i and row-softmax B over keys j < i, no write strength (b = 1), both scales head_dim ** -0.5, "
    "RoPE kept.",
    "path": "PaTH (Yang et al. 2025) as its paper trains it: Householder transports replace RoPE, "
    "b = 2 sigmoid(.) in (0, 2), unit w per key head from the layer input, scratch init.",
    "retnet": "RetNet (Sun et al. 2023) retention: no feature map, fixed decays gamma_h = 1 - 2^(-5 - h) over the "
    "key heads, each head's output layer-normalized (RetNet's GroupNorm, here without bias: scale-invariant, so "
    "RetNet's decay-mask normalization is moot), RoPE for its xPos rotation. Not here: RetNet's swish output gate "
    "and its double-width values.",
    "gla": "GLA (Yang et al. 2024) as its paper and fla's layer: gate alpha = sigmoid(W2 W1 x + b)^(1/16) per "
    "key dimension (rank 16), no feature map, no denominator, output RMSNorm and swish gate, no RoPE, fla's "
    "xavier init (gain 2^-2.5).",
    "rwkv7": "RWKV-7 (Peng et al. 2025, arXiv:2503.14456) time mixing as fla's layer: vector decay and in-context "
    "learning rate from rank-64 maps of the layer input, L2-normalized removal key, per-head output LayerNorm times "
    "a sigmoid gate (full rank here, low rank in RWKV-7), unscaled receptance, no RoPE, RWKV-7's init (see "
    "mixer_generalized_delta.py for what is not reproduced).",
    "kimi_linear": "Kimi Delta Attention, the linear layer of Kimi Linear (Kimi Team 2025, arXiv:2510.26692), as fla's "
    "KDA layer: decay per key channel from a rank-head_dim map of the layer input (A ~ U(1, 16), dt log-uniform in "
    "[1e-3, 0.1]), short convolution of 4 taps + SiLU on q/k/v, L2-normalized q and k, output RMSNorm times a "
    "sigmoid gate (full rank here, low rank in Kimi Linear), no RoPE. The KDA layer alone: Kimi Linear's hybrid "
    "interleaves it with MLA layers (attention_overrides).",
}
