"""Public functional API: recurrent attention ops in the fla / transformers ``[B, T, H, D]`` convention.

    from hf_recattn.ops import chunk_gated_delta_rule
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)

See :mod:`hf_recattn.ops.functional` for the arguments shared by every function; this package exports
exactly its ``__all__``.
"""

from .functional import *  # noqa: F403
from .functional import __all__  # noqa: F401
