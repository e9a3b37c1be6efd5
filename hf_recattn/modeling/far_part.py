"""The far-part protocol: what a family declares so that the ``hybrid`` mixer can use it as its far part.

The hybrid (mixer_hybrid.py) runs softmax over a window of recent keys and a "far" mixer beside it, and knows
no family: it reads what the far family's class declares. A family serves as a far part when it sets
``far_reads`` (usually by subclassing ``FarPart`` next to ``Mixer``) and provides:

* ``far_reads: ClassVar[str]``: which tokens the far part reads.
  ``LEAVING`` ("leaving"): each key / value when it leaves the window (never the window's nor the sinks'), so
  the far part covers exactly the keys the window no longer shows; its inputs then carry the hybrid's layer
  input of the *queries* and a ``padding_mask`` [B, T] of which leaving keys are real tokens.
  ``ARRIVING`` ("arriving"): every token as it arrives, the window's and the sinks' included, with the
  hybrid's own inputs (for a family whose gates or short convolution read the token's own layer input).
* ``far_shared: ClassVar[bool]``: whether the far terms can carry an un-normalized numerator and a
  denominator for ``combine='shared'`` (one normalization over window and far part); False: the hybrid refuses
  ``combine='shared'`` with this far part ("needs combine='sum'").
* ``far_part_problem(spec, combine) -> str | None`` (classmethod): why the validated ``spec`` cannot serve
  as a far part under ``combine`` ("shared" | "sum"), or None. The hybrid prefixes the reason with
  ``option 'far' ``; it already refuses a non-causal far spec and ``far_shared=False`` under 'shared'.
* ``far_part_spec(spec) -> dict`` (classmethod): the spec the hybrid builds its far part from (default: the
  spec unchanged; e.g. a family that would switch to a KV cache pins its recurrent state here).
* ``far_parallel(q, k, v, inputs) -> FarTerms``, ``far_chunked(q, k, v, inputs, state) -> (FarTerms, State)``
  and ``far_step(q, k, v, inputs, state) -> (FarTerms, State)``: the far terms of the queries over the keys
  read (plus the state, for the chunked and step forms), with the same shapes and state as the family's
  ``parallel`` / ``chunked`` / ``step``; the terms' tensors in q's dtype (the state keeps its own).
* ``far_output(terms, inputs) -> Tensor``: the far part's normalized output [B, T, H, E] from its terms, for
  ``combine='sum'`` (``inputs``: those the terms were computed with).

``FarTerms`` is ``(num, den, count)``. Under ``combine='shared'`` the hybrid reads ``num`` [B, Hkv, G, T, E]
(the un-normalized numerator) and ``den`` [B, Hkv, G, T] (the denominator, > 0 where the far part has mass);
otherwise it only hands the terms back to ``far_output``. ``count`` is free for the family's own use (e.g. the
number of real keys each query read).

With the hybrid's ``cache_slots`` (an exact cache of the pairs the far state recalls worst, see docs/mixers.md),
a far family also declares:

* ``far_recall_problem(spec) -> str | None`` (classmethod): why the validated far ``spec`` cannot score recall, or
  None. ``FarPart``'s default says the family declares no score; the hybrid refuses ``cache_slots`` > 0 with the
  reason, prefixed by ``option 'cache_slots' ``.
* ``far_recall_error(k, v, state) -> Tensor [B, Hkv, N]``: how badly ``state`` recalls each pair (k [B, Hkv, N, D],
  v [B, Hkv, N, E], as the hybrid holds them: rotary-embedded, before any of the family's own transforms): the
  larger, the more the pair is worth keeping exactly. It reads only the state, since a cached pair is re-scored
  long after its own layer input has gone. A family reading ``LEAVING`` keys scores the self-recall error of its
  normalized state, ||v - num(k) / den(k)||; a delta-rule family the residual of its update, ||v - S k||.
* ``LEAVING`` families only, as the cache decides which keys enter the far state and when:
  ``far_read(q, inputs, state) -> FarTerms``, the terms of the queries [B, H, T, D] over the state without adding
  anything to it, and ``far_add(k, v, weight, state) -> State``, the state with each pair added with its
  ``weight`` [B, Hkv, N] (0 or 1: the heads keep different pairs). A family reading ``ARRIVING`` tokens keeps
  its forms: every token is in its state anyway, and the cache holds exact copies beside it.

``FarPart`` gives the defaults of a family whose output is its own business (``ARRIVING``, ``combine='sum'``
only): its far forms are its ``parallel`` / ``chunked`` / ``step`` forms, the finished output stands in ``num``
and ``far_output`` returns it. Such a family declares ``far_reads = ARRIVING`` and inherits the rest.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch

from .mixer_base import MixerInputs, State

LEAVING = "leaving"
ARRIVING = "arriving"
FAR_READS = (LEAVING, ARRIVING)


class FarTerms(NamedTuple):
    """What a far part computes for a block of queries before its output is normalized."""

    num: torch.Tensor
    den: torch.Tensor | None = None
    count: torch.Tensor | None = None

    def to(self, dtype: torch.dtype) -> FarTerms:
        """The terms cast to ``dtype`` (None stays None)."""
        return FarTerms(*(None if x is None else x.to(dtype) for x in self))


def shared_needs(what: str) -> str:
    """The reason a far spec cannot serve under combine='shared', naming ``what`` it would need."""
    return f"combine='shared' needs a far mixer with a positive denominator: {what}; use combine='sum' otherwise"


def serves_as_far_part(cls: type) -> bool:
    """Whether the family ``cls`` declares the far-part protocol."""
    return getattr(cls, "far_reads", None) in FAR_READS


class FarPart:
    """The far-part protocol, with the defaults of a family that reads every token as it arrives and whose far
    terms are its finished output (``combine='sum'`` only). Subclass it beside ``Mixer``."""

    far_reads: ClassVar[str]
    far_shared: ClassVar[bool] = False

    @classmethod
    def far_part_problem(cls, spec: dict[str, Any], combine: str) -> str | None:
        """Why the validated ``spec`` cannot serve as a hybrid's far part under ``combine``, or None."""
        return None

    @classmethod
    def far_part_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        """The spec the hybrid builds the far part from."""
        return spec

    @classmethod
    def far_recall_problem(cls, spec: dict[str, Any]) -> str | None:
        """Why the validated ``spec`` cannot score recall for the hybrid's cache, or None (see the module)."""
        name = getattr(cls, "name", cls.__name__)
        return f"needs a far part that scores recall (far_recall_error); a {name} far part declares none"

    def far_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> FarTerms:
        return FarTerms(self.parallel(q, k, v, inputs))

    def far_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        out, state = self.chunked(q, k, v, inputs, state)
        return FarTerms(out), state

    def far_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[FarTerms, State]:
        out, state = self.step(q, k, v, inputs, state)
        return FarTerms(out), state

    def far_output(self, terms: FarTerms, inputs: MixerInputs) -> torch.Tensor:
        """[B, T, H, E]: here the terms are the output itself."""
        return terms.num
