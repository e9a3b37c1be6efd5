"""Public functional API: recurrent attention ops in the fla / transformers ``[B, T, H, D]`` convention.

    from hf_recattn.ops import chunk_gated_delta_rule
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)

See :mod:`hf_recattn.modeling.functional` for the arguments shared by every function; this module exports
exactly its ``__all__``.
"""

from .modeling.functional import *  # noqa: F403
from .modeling.functional import __all__  # noqa: F401
