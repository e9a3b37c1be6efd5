"""Retrieval heads: exact softmax on a few key/value heads, another mixer on the rest.

In a pretrained softmax model, fetching a fact from far back in the context is the work of a few heads; most
heads attend locally and lose little when they see only a window (DuoAttention's "retrieval" and "streaming"
heads, Xiao et al. 2024). This mixer keeps the whole key/value cache for the KV heads listed in ``heads``
(each brings the query heads of its group) and runs the ``others`` spec, any causal mixer (by default a 64-token
window with 4 attention sinks), on the remaining KV heads. The cache then grows by ``2 * len(heads) * head_dim``
elements per token instead of ``2 * num_kv_heads * head_dim``; ``hf_recattn.conversion.retrieval_heads``
picks the heads from a teacher.

``retrieval`` replaces the listed heads' exact softmax by another causal mixer, so that their memory stops
growing too: e.g. a ``hybrid`` with a long window, sinks and an exact cache (``far: none``) holds a fixed number
of pairs per head, every pair exact until the context outgrows it, then the ones its ``cache_score`` keeps.

The two parts are the retrieval mixer (by default ``softmax``) and the ``others`` mixer built for their share of
the heads, so their forms, states and proofs are theirs: the parallel form runs each part's uncached form (its own
choice of parallel or chunked), the chunked and step forms each part's (the default softmax part always its
chunked form). The state holds the retrieval part's tensors under ``full.`` and the other part's under ``rest.``;
``heads=[]`` is the ``others`` mixer alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .mixer_base import KeyMap, Mixer, MixerInputs, MixerShape, State
from .mixer_softmax import SoftmaxMixer
from .options import Option
from .registry import build_mixer, mixer_class, validate_spec

FULL_PREFIX = "full."
REST_PREFIX = "rest."
FULL_SPEC = {"mixer": "softmax", "forget": "none", "alibi_slopes": None, "fox_bias_init": None, "rope": True}
#: a continuing form of a mixer: (q, k, v, inputs, state) -> (output, state)
Form = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MixerInputs, State], tuple[torch.Tensor, State]]
DEFAULT_OTHERS = {"mixer": "hybrid", "window": 64, "sink_tokens": 4, "far": "none"}


def _prefixed(prefix: str, state: State) -> State:
    return {prefix + name: x for name, x in state.items()}


def _part(prefix: str, state: State) -> State:
    return {name[len(prefix) :]: x for name, x in state.items() if name.startswith(prefix)}


def _combined_kind(kinds: list[str]) -> str:
    """The state kind of the parts together: growing if one grows, else bounded if one is a window."""
    return next((kind for kind in ("kv", "window") if kind in kinds), kinds[0])


def _rest_keys(key_map: KeyMap) -> KeyMap:
    """A variant's key map of the ``others`` mixer applied under ``rest.``; the softmax heads' keys stay."""

    def mapped(key: str) -> str | None:
        if not key.startswith(REST_PREFIX):
            return key
        inner = key_map(key[len(REST_PREFIX) :])
        return None if inner is None else REST_PREFIX + inner

    return mapped


class RetrievalHeadsMixer(Mixer):
    """Exact softmax on the KV heads in ``heads`` (whole context), the ``others`` mixer on the rest.

    Paper: DuoAttention, Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
    Streaming Heads", arXiv:2410.10819. Retrieval heads themselves: Wu et al., "Retrieval Head
    Mechanistically Explains Long-Context Factuality", arXiv:2404.15574.
    """

    name = "retrieval_heads"
    options = {
        "heads": Option((list,), [], "KV head indices that keep exact softmax over the whole context"),
        "others": Option((dict, str), dict(DEFAULT_OTHERS), "spec of the mixer on the other KV heads"),
        "retrieval": Option(
            (dict, str, type(None)), None,
            "spec of the mixer on the listed KV heads; None: exact softmax over the whole context",
        ),
    }
    state_kind = "kv"  # with heads listed; heads=[] takes the other mixer's kind

    def rollback_problem(self) -> str | None:
        """Each part's: exact softmax heads can drop tokens."""
        for part, label in ((self.full, "retrieval heads'"), (self.rest, "other heads'")):
            problem = part.rollback_problem() if part is not None else None
            if problem is not None:
                return f"its {label} {part.name} mixer: {problem}"
        return None

    @classmethod
    def layer_type(cls, spec: dict[str, Any]) -> str:
        """Softmax heads beside another mixer's: "hybrid" (the other mixer's type without softmax heads)."""
        others = mixer_class(spec["others"]["mixer"], "others")
        return others.layer_type(spec["others"]) if not spec["heads"] else "hybrid"
    has_chunked = True

    @classmethod
    def softmax_reach(cls, spec: dict[str, Any]) -> str | None:
        """The listed heads' reach: every earlier key with exact softmax, else their mixer's; the other heads'
        mixer answers for itself (as a part: ``registry.position_need``)."""
        if not spec["heads"]:
            return None
        retrieval = spec["retrieval"]
        return "context" if retrieval is None else mixer_class(retrieval["mixer"], "retrieval").softmax_reach(retrieval)

    @classmethod
    def position_need(cls, spec: dict[str, Any]) -> str | None:
        """The listed heads' need (a ``retrieval`` spec is asked as a part by ``registry.position_need``)."""
        if spec["heads"] and spec["retrieval"] is None and spec.get("rope", True):
            return f"its KV heads {spec['heads']} keep exact softmax over every earlier key, compared through RoPE"
        return None

    @classmethod
    def check_spec(cls, spec: dict[str, Any], where: str) -> None:
        heads = spec["heads"]
        if any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in heads):
            raise ValueError(f"{where}: option 'heads' takes KV head indices (ints >= 0), got {heads!r}")
        if len(set(heads)) != len(heads):
            raise ValueError(f"{where}: option 'heads' lists a KV head twice: {heads!r}")
        spec["heads"] = sorted(heads)
        spec["others"] = cls._part(spec["others"], "others", where)
        if spec["retrieval"] is not None:
            spec["retrieval"] = cls._part(spec["retrieval"], "retrieval", where)

    @classmethod
    def _part(cls, part: dict[str, Any] | str, option: str, where: str) -> dict[str, Any]:
        """A part's spec validated: any causal mixer but this one."""
        spec = validate_spec(part, f"{where}: option {option!r}")
        if spec["mixer"] == cls.name:
            raise ValueError(f"{where}: option {option!r} cannot be another {cls.name!r} mixer")
        if not spec.get("causal", True):
            raise ValueError(f"{where}: option {option!r} must be causal")
        return spec

    @classmethod
    def variants(cls, spec: dict[str, Any]) -> dict[str, tuple[dict[str, Any], KeyMap]]:
        """The ``others`` mixer's variants, the softmax heads kept exact in each."""
        others = spec["others"]
        return {
            name: ({**spec, "others": part}, _rest_keys(key_map))
            for name, (part, key_map) in mixer_class(others["mixer"], "others").variants(others).items()
        }

    def __init__(self, spec: dict[str, Any], shape: MixerShape, config: Any = None) -> None:
        super().__init__(spec, shape, config)
        heads = list(spec["heads"])
        if heads and heads[-1] >= shape.num_kv_heads:
            raise ValueError(
                f"layer {shape.layer_idx} ({self.name}): option 'heads' names KV head {heads[-1]}, but the layer "
                f"has {shape.num_kv_heads} KV heads (0..{shape.num_kv_heads - 1})"
            )
        if len(heads) == shape.num_kv_heads:
            raise ValueError(
                f"layer {shape.layer_idx} ({self.name}): option 'heads' lists every KV head; use mixer 'softmax'"
            )
        rest = [h for h in range(shape.num_kv_heads) if h not in heads]
        retrieval = spec.get("retrieval")
        self.full: Mixer | None = None
        if heads:
            shape_full = self._shape(len(heads))
            self.full = SoftmaxMixer(FULL_SPEC, shape_full, config) if retrieval is None else build_mixer(
                retrieval, shape_full, config)
        if self.full is not None and self.full.input_weights():
            raise ValueError(f"layer {shape.layer_idx} ({self.name}): option 'retrieval' names a {self.full.name} "
                             "mixer that reads the layer input; the retrieval heads' mixer must work on q, k, v alone")
        #: the default exact softmax runs its chunked form for cached tokens, a step included
        self._full_always_chunked = retrieval is None
        self.rest = build_mixer(spec["others"], self._shape(len(rest)), config)
        self.state_kind = _combined_kind([m.state_kind for m in (self.full, self.rest) if m is not None])
        groups = shape.groups
        order = [h * groups + g for h in heads + rest for g in range(groups)]  # query heads: full part, then rest
        split = len(heads) * groups
        # plain lists, not buffers: a checkpoint loaded on the meta device would leave buffers unset
        self.heads = {"full": (order[:split], heads), "rest": (order[split:], rest)}
        self._unorder = sorted(range(len(order)), key=order.__getitem__)
        self._indices: dict[tuple[str, torch.device], torch.Tensor] = {}

    def input_weights(self) -> dict[str, nn.Parameter]:
        """The ``others`` mixer's (it reads the same layer input)."""
        return self.rest.input_weights()

    def _index(self, name: str, device: torch.device) -> torch.Tensor:
        """One of the head index lists as a tensor on ``device`` (made once per device)."""
        key = (name, device)
        if key not in self._indices:
            part, _, which = name.partition(".")
            values = self._unorder if name == "unorder" else self.heads[part][which == "kv"]
            self._indices[key] = torch.tensor(values, dtype=torch.long, device=device)
        return self._indices[key]

    def _shape(self, kv_heads: int) -> MixerShape:
        s = self.shape
        return MixerShape(s.hidden_size, kv_heads * s.groups, kv_heads, s.head_dim, s.layer_idx)

    def _split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: str) -> tuple[torch.Tensor, ...]:
        qi, ki = self._index(f"{part}.q", q.device), self._index(f"{part}.kv", q.device)
        return q.index_select(1, qi), k.index_select(1, ki), v.index_select(1, ki)

    def _merge(self, full: torch.Tensor | None, rest: torch.Tensor) -> torch.Tensor:
        """[B, T, H, E] in the layer's head order from the two parts' outputs."""
        if full is None:
            return rest
        dtype = torch.promote_types(full.dtype, rest.dtype)
        return torch.cat([full.to(dtype), rest.to(dtype)], dim=2).index_select(2, self._index("unorder", rest.device))

    # ----- forms ------------------------------------------------------------------------------------------
    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs) -> torch.Tensor:
        rest, _ = self.rest(*self._split(q, k, v, "rest"), inputs)
        full = self.full(*self._split(q, k, v, "full"), inputs)[0] if self.full is not None else None
        return self._merge(full, rest)

    def _continue(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State, form: str
    ) -> tuple[torch.Tensor, State]:
        """Both parts through ``form`` (their mixers' chunked or step form; the default softmax part chunked)."""
        rest_form: Form = getattr(self.rest, form)
        rest, rest_state = rest_form(*self._split(q, k, v, "rest"), inputs, _part(REST_PREFIX, state))
        new = _prefixed(REST_PREFIX, rest_state)
        full = None
        if self.full is not None:
            full_form: Form = getattr(self.full, "chunked" if self._full_always_chunked else form)
            full, full_state = full_form(*self._split(q, k, v, "full"), inputs, _part(FULL_PREFIX, state))
            new.update(_prefixed(FULL_PREFIX, full_state))
        return self._merge(full, rest), new

    def chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        return self._continue(q, k, v, inputs, state, "chunked")

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs, state: State
    ) -> tuple[torch.Tensor, State]:
        return self._continue(q, k, v, inputs, state, "step")

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> State:
        state = _prefixed(REST_PREFIX, self.rest.init_state(batch_size, device, dtype))
        if self.full is not None:
            state.update(_prefixed(FULL_PREFIX, self.full.init_state(batch_size, device, dtype)))
        return state

    def state_size(self, context_length: int) -> int:
        full = self.full.state_size(context_length) if self.full is not None else 0
        return full + self.rest.state_size(context_length)

    def backward_numbers(self, tokens: int) -> int:
        full = self.full.backward_numbers(tokens) if self.full is not None else 0
        return full + self.rest.backward_numbers(tokens)
