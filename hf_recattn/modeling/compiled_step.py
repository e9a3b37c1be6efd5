"""Optional compiled decode steps: a mixer family's ``step`` through ``torch.compile``.

What it does: one compiled function per family, shared by all the layers of that family (their weights are inputs
to it, not constants), fuses the many small ops of a decode step (gates, norms, feature maps, the state update,
a solver's iterations) into a few generated kernels; matrix products still run in torch's BLAS. What it costs:
compilation on first use, again for each new batch size, dtype or padding layout (seconds per family on a CPU, up
to half a minute for MesaNet's solver), which is why it is off by default: it pays off in long generations with
op-heavy mixers (docs/benchmarks.md has the numbers). Outputs equal the eager step up to float rounding, since the
compiler may reorder sums. Layers with a growing KV cache keep the eager step (their shapes change every token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .mixer_base import Mixer

_COMPILED: dict[type, Callable] = {}


def compiled_step(cls: type[Mixer]) -> Callable:
    """``cls.step`` compiled once per process (``fn(mixer, q, k, v, inputs, state)``)."""
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.step)
    return _COMPILED[cls]


def compile_decode(layers: nn.ModuleList, enable: bool = True) -> list[int]:
    """Route the decode steps of every fixed-state layer through its family's compiled step (or back to the
    eager one); returns the indices of the layers that use it."""
    chosen = []
    for index, layer in enumerate(layers):
        mixer: Mixer = layer.self_attn.mixer
        use = enable and mixer.state_kind != "kv"
        mixer.compiled_step = compiled_step(type(mixer)) if use else None
        if use:
            chosen.append(index)
    return chosen
