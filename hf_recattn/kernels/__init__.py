"""Triton kernels for the recurrent ops (optional: ``pip install hf-recattn[kernels]``).

Importing this package registers the kernels with ``hf_recattn.modeling.backends``, which picks them for CUDA
tensors (and, when asked, for any tensor: ``HF_RECATTN_KERNELS=triton``). hf_recattn imports it lazily, the
first time a call could use a kernel. The kernels are not copied beside saved checkpoints: a checkpoint loaded
with ``trust_remote_code`` where hf_recattn is not installed runs the torch forms, which compute the same function.

* ``chunk_linear_attention``: chunked linear attention, plain, with a scalar decay per head and token, or with a
  decay per key dimension (GLA); forward and backward.
* ``chunk_delta_rule``: the chunked delta rule in its general form (DeltaNet, Gated DeltaNet, Comba); forward and
  backward (the backward is registered as not verified on GPU hardware: ``auto`` does not train with it).
* ``fused_linear_step`` / ``fused_delta_step``: one decode step, the state updated in place, in one launch.
"""

from __future__ import annotations

from ..modeling import backends
from .decode import fused_delta_step, fused_linear_step
from .delta import chunk_delta_rule
from .linear import chunk_linear_attention

backends.register("chunk_linear", chunk_linear_attention)
# the backward stops with an illegal memory access on Hopper GPUs (an H200, an H100; triton 3.6): the per-chunk
# gradient kernel in float32 at chunks of 64, also since it was split in two (docs/speed.md). Not verified on
# hardware: ``auto`` runs the torch form where gradients are recorded (``HF_RECATTN_KERNELS=triton`` still runs it)
backends.register("chunk_delta", chunk_delta_rule, backward_verified=False)
backends.register("linear_step", fused_linear_step)
backends.register("delta_step", fused_delta_step)

__all__ = ["chunk_delta_rule", "chunk_linear_attention", "fused_delta_step", "fused_linear_step"]
