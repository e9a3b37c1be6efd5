"""Public functional API: recurrent attention ops in the fla / transformers ``[B, T, H, D]`` convention.

    from hf_recattn.ops import chunk_gated_delta_rule
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)

See :mod:`hf_recattn.modeling.functional` for the arguments shared by every function.
"""

from .modeling.functional import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_linear_attn,
    chunk_simple_gla,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    l2norm,
)

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_linear_attn",
    "chunk_simple_gla",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
]
