"""Parts shared by the gated families (delta, mesa, gated_linear, softmax_delta, softmax_householder, and any later
one): the option vocabularies, option fragments, the q/k norm, the logit of a gate's initial value, and the gated
output, an RMSNorm of each head's output times a gate act(W_g x) read from the layer input.

``GatedMixer`` holds the gated output as a base class of the mixer rather than a child module: its parameters
keep the keys ``output_norm.weight`` and ``gate_weight`` of the mixer, which saved checkpoints and the decode layout
(``Mixer.input_weights``) name. A child module would move the gate to ``<child>.gate_weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_base import Mixer, MixerInputs, MixerShape, ungroup_output
from .options import Option, check_gate_after_norm, check_not_above, check_open_unit
from .output_norms import OutputNorm

#: ``init``: the published initialization, or one that starts a converted softmax layer close to itself
INITS = ("scratch", "convert")
#: applied to q, k (and v) after the short convolution
ACTIVATIONS = ("none", "silu")
#: normalization of q and k: l2 (x / sqrt(|x|^2 + eps)) or none
QK_NORMS = ("l2", "none")


#: the activations a gated output may apply to W_g x (``GatedMixer.gate_activation``)
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


def output_options(gate: bool, activation: str = "silu") -> dict[str, Option]:
    """``output_norm`` and ``output_gate`` (default ``gate``; ``activation``: the family's gate activation), the
    options of ``GatedMixer``'s gated output."""
    return {
        "output_norm": Option((bool,), True, "RMSNorm of each head's output (learnable gain)"),
        "output_gate": Option((bool,), gate, f"multiply the output by {activation}(W_g x) from the layer input"),
    }


def convert_init_options(convert: str, gate: str, beta: str | None = None) -> dict[str, Option]:
    """``init`` (``convert``: what init=convert starts from), ``half_life_min`` / ``half_life_max`` (the initial
    half-lives of the ``gate``) and, with ``beta`` (what b is), ``beta_init``."""
    options = {
        "init": Option((str,), "scratch", "initialization of the new parameters: scratch (published) or "
                       f"convert ({convert})", choices=INITS),
        "half_life_min": Option((float,), 8.0, f"init=convert: shortest initial {gate} half-life in tokens",
                                minimum=1e-3),
        "half_life_max": Option((float,), 1024.0, f"init=convert: longest initial {gate} half-life in tokens",
                                minimum=1e-3),
    }
    if beta is not None:
        options["beta_init"] = Option((float,), 0.5, f"init=convert: initial {beta}, in (0, 1)")
    return options


def chunk_options(eps: str) -> dict[str, Option]:
    """``chunk_size`` of the chunked form and ``eps`` (``eps``: where it is added)."""
    return {
        "chunk_size": Option((int,), 64, "tokens per chunk in the chunked form", minimum=1),
        "eps": Option((float,), 1e-6, f"added inside the {eps}", minimum=0.0),
    }


def conv_options(streams: str) -> dict[str, Option]:
    """``conv_size`` and ``activation`` of the short convolution on ``streams`` (e.g. "q and k")."""
    return {
        "conv_size": Option((int,), 4, f"taps of the short causal convolution on {streams} (0: none)", minimum=0),
        "activation": Option((str,), "silu", f"applied to {streams} after the convolution", choices=ACTIVATIONS),
    }


def logit(p: float) -> float:
    """log(p / (1 - p)): the bias that starts a sigmoid gate at p."""
    return math.log(p / (1.0 - p))


def head_gate_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x W^T + c in x's dtype: the logits of a gate read from x [B, T, C] (the layer input, or a low-rank map of
    it; W [N, C], c [N])."""
    return F.linear(x, weight.to(x.dtype), bias.to(x.dtype))


def init_head_gate(init: Any, weight: nn.Parameter, bias: nn.Parameter, start: float | None, std: float) -> None:
    """A sigmoid gate read from the layer input: with ``start`` (init=convert) W = 0 and c = logit(start), so that
    it starts at ``start`` for every token; without, W ~ N(0, std) and c = 0."""
    if start is not None:
        init.zeros_(weight)
        init.constant_(bias, logit(start))
    else:
        init.normal_(weight, 0.0, std)
        init.zeros_(bias)


def qk_norm(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim for ``kind`` l2 (written as one rms_norm), x for none."""
    if kind != "l2":
        return x
    f = x.shape[-1]
    return F.rms_norm(x, (f,), eps=eps / f) * f**-0.5


class GatedMixer(Mixer):
    """The base of the gated families: the settings every one reads (``chunk_size``, ``eps``, the initializer range,
    ``init``), the checks of ``convert_init_options`` and ``output_options``, and the gated output.

    A family's output [B, Hk, G, T, E] goes through ``finish_output``: a norm of each head (``output_norm_kind``,
    RMSNorm by default, gain per query head; ``output_norm``, None without it) times act(W_g x) (``gate_activation``,
    silu by default; ``gate_weight`` [H E, C], the input weight ``output_gate``). A family calls ``build_output`` in
    ``__init__``, ``init_output_gate`` in ``init_parameters`` and lists ``output_input_weights`` in
    ``input_weights``; its options include ``output_options``, ``convert_init_options`` and ``chunk_options``.
    """

    #: whether ``output_gate`` needs ``output_norm`` (the gate then follows the norm)
    gate_needs_norm: ClassVar[bool] = True
    #: the kind of the output norm (``output_norms.OUTPUT_NORMS``) and the gate's activation (``GATE_ACTIVATIONS``)
    output_norm_kind: ClassVar[str] = "rms"
    gate_activation: ClassVar[str] = "silu"

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        self.chunk_size = int(spec["chunk_size"])
        self.eps = float(spec["eps"])
        self.initializer_range = float(getattr(config, "initializer_range", 0.02))
        self.convert_init = spec["init"] == "convert"

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        """beta_init (if any) in (0, 1), half_life_min <= half_life_max, and the gate after the norm; a family with
        checks of its own runs them first, then this."""
        if "beta_init" in spec:
            check_open_unit(spec, where, "beta_init")
        check_not_above(spec, where, "half_life_min", "half_life_max")
        if cls.gate_needs_norm:
            check_gate_after_norm(spec, where)

    def build_output(self) -> None:
        """Create the norm and gate the spec asks for (where the family creates its parameters: their order is
        the order of initialization)."""
        h, d = self.shape.num_heads, self.shape.head_dim
        kind = self.output_norm_kind
        self.output_norm = OutputNorm(kind, self.shape, d, self.eps) if self.spec["output_norm"] else None
        if self.spec["output_gate"]:
            self.gate_weight = nn.Parameter(torch.zeros(h * d, self.shape.hidden_size))

    @property
    def has_output_gate(self) -> bool:
        return hasattr(self, "gate_weight")

    def output_input_weights(self) -> dict[str, nn.Parameter]:
        """{"output_gate": W_g} when there is a gate, for ``input_weights``."""
        return {"output_gate": self.gate_weight} if self.has_output_gate else {}

    def init_output_gate(self, init: Any, std: float) -> None:
        """W_g ~ N(0, std), when there is a gate."""
        if self.has_output_gate:
            init.normal_(self.gate_weight, 0.0, std)

    def finish_output(self, o: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        """o [B, Hk, G, T, E] -> [B, T, H, E], through the output norm and gate."""
        if self.output_norm is not None:
            o = self.output_norm(o)
        o = ungroup_output(o)
        if self.has_output_gate:
            gate = GATE_ACTIVATIONS[self.gate_activation](inputs.linear("output_gate", self.gate_weight))
            o = o * gate.view(*o.shape)
        return o
