"""RecAttnCache: a transformers ``Cache`` whose layers hold each mixer's state, whatever its family.

Every layer keeps a ``dict[str, Tensor]`` (batch first) and the number of tokens it has seen. The mixer
decides what the tensors are (a KV cache, a window of keys, or fixed-size recurrent states); the cache only
stores, reorders, repeats and selects them, so a new family needs no code here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

from .mixer_base import State

KINDS = ("kv", "window", "recurrent")

#: what transformers calls a model's cache, as forward / generate() argument and as output field:
#: ``past_key_values`` up to 5.23, ``cache`` from 5.24
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_of(outputs: Any) -> Cache | None:
    """The cache a forward or ``generate()`` returned, under this transformers release's name for it."""
    return getattr(outputs, CACHE_NAME, None)


def passed_cache(past_key_values: Cache | None, kwargs: dict[str, Any]) -> Cache | None:
    """The cache handed to a forward as ``past_key_values`` or as ``cache`` (taken out of ``kwargs``); both at
    once is an error."""
    cache = kwargs.pop("cache", None)
    if past_key_values is not None and cache is not None and cache is not past_key_values:
        raise ValueError("pass the cache once: as cache or as past_key_values, not both")
    return past_key_values if past_key_values is not None else cache


class MixerStateLayer:
    """One layer's state; ``kind`` says whether it grows (kv), is bounded (window) or is fixed (recurrent).

    KV and window states keep their tokens on axis 2 (``[batch, kv_heads, tokens, head_dim]``), which lets
    ``crop`` remove tokens from them; a recurrent state has absorbed every token and cannot give one back.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, kind: str, layer_idx: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"layer {layer_idx}: unknown cache kind {kind!r}; known: {list(KINDS)}")
        self.kind = kind
        self.layer_idx = layer_idx
        self.state: State | None = None
        self.seen_tokens = 0
        self.is_sliding = kind == "window"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys ``[batch, kv_heads, tokens, head_dim]`` of a layer that keeps them (softmax, sliding
        window: transformers' ``DynamicLayer.keys``); None before the first forward. A layer whose state holds no
        plain keys (recurrent, hybrid) raises AttributeError saying so."""
        return self._cached("k", "keys")

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values, as ``keys``."""
        return self._cached("v", "values")

    def _cached(self, name: str, what: str) -> torch.Tensor | None:
        if self.state is not None and name in self.state:
            return self.state[name]
        if self.state is None and self.kind != "recurrent":
            return None
        held = "a fixed-size recurrent state" if self.state is None else f"a {self.kind} state {sorted(self.state)}"
        raise AttributeError(
            f"layer {self.layer_idx}: this cache layer holds {held}, no {what}: its mixer folds tokens into a "
            "state instead of keeping them; read .state for its tensors"
        )

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` could remove any number of tokens (a KV state that keeps every token)."""
        return self.kind == "kv" and self._holds_every_token()

    def _holds_every_token(self) -> bool:
        """Every tensor keeps one entry per token seen on axis 2 (not a window or a recurrent part)."""
        if self.state is None:
            return True
        return all(t.dim() >= 3 and t.shape[2] == self.seen_tokens for t in self.state.values())

    def update(self, state: State, new_tokens: int) -> None:
        self.state = state
        self.seen_tokens += new_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.state.values())

    @property
    def batch_size(self) -> int | None:
        """Sequences held, or None before the first forward."""
        if not self.state:
            return None
        return next(iter(self.state.values())).shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.state is not None:
            self.state = {name: fn(t) for name, t in self.state.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def _crop_target(self, tokens_to_remove: int) -> int:
        if tokens_to_remove > 0:  # legacy form: the length to keep
            return min(tokens_to_remove, self.seen_tokens)
        if self.seen_tokens + tokens_to_remove < 0:
            raise ValueError(
                f"layer {self.layer_idx}: cannot remove {-tokens_to_remove} tokens from a cache holding "
                f"{self.seen_tokens}"
            )
        return self.seen_tokens + tokens_to_remove

    def crop_refusal(self, tokens_to_remove: int) -> str | None:
        """Why ``crop(tokens_to_remove)`` is impossible here, or None when it can be done."""
        target = self._crop_target(tokens_to_remove)
        if target == self.seen_tokens or self.state is None:
            return None
        if self.kind != "recurrent" and self._holds_every_token():
            return None  # a KV cache, or a window that has not dropped a token yet
        what = "a recurrent state" if self.kind == "recurrent" else "a state whose window already dropped tokens"
        return (
            f"layer {self.layer_idx}: cannot crop {what} from {self.seen_tokens} to {target} tokens: it "
            "has absorbed them and cannot roll back; re-run the prompt up to the wanted length instead"
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens: ``crop(-n)`` removes the last n; ``crop(n)``, n > 0, keeps the first n (legacy form).

        Only a state that holds every token (a KV cache, or a window that has not yet dropped one) can roll back;
        others (recurrent states, windows, a KV cache beside a window) raise.
        """
        refusal = self.crop_refusal(tokens_to_remove)
        if refusal is not None:
            raise ValueError(refusal)
        target = self._crop_target(tokens_to_remove)
        if target < self.seen_tokens:
            self._map(lambda t: t[:, :, :target])
            self.seen_tokens = target

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0

    def offload(self) -> None:  # states are small or already where they are used
        pass

    def prefetch(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"MixerStateLayer(kind={self.kind}, seen={self.seen_tokens}, bytes={self.nbytes()})"


class RecAttnCache(Cache):
    """Per-layer mixer states for hf_recattn models; build one with ``model.new_cache()`` or
    ``RecAttnCache.for_model(model)``."""

    is_compileable = False

    def __init__(self, kinds: list[str], model_id: int | None = None) -> None:
        if not isinstance(kinds, (list, tuple)) or not all(isinstance(kind, str) for kind in kinds):
            raise TypeError(
                f"RecAttnCache takes one cache kind per layer (a list of {list(KINDS)}), not "
                f"{type(kinds).__name__}; for a model, use model.new_cache() or RecAttnCache.for_model(model)"
            )
        super().__init__(layers=[MixerStateLayer(kind, i) for i, kind in enumerate(kinds)])
        self.model_id = model_id

    @property
    def kinds(self) -> list[str]:
        return [layer.kind for layer in self.layers]

    def check_compatible(self, kinds: list[str], model_id: int, batch_size: int) -> None:
        """Raise ValueError unless this cache was made for a model with these layers and holds this batch."""
        if self.model_id not in (None, model_id):
            raise ValueError(
                "past_key_values was built by another model instance; start one with model.new_cache()"
            )
        if len(self.layers) != len(kinds):
            raise ValueError(
                f"past_key_values has {len(self.layers)} layers but the model has {len(kinds)}; it was built "
                "for another model: start a new cache with model.new_cache()"
            )
        for i, (held, wanted) in enumerate(zip(self.kinds, kinds, strict=True)):
            if held != wanted:
                raise ValueError(
                    f"layer {i}: past_key_values holds a {held!r} state but the model's mixer needs "
                    f"{wanted!r}; it was built for another model: start a new cache with model.new_cache()"
                )
        held = self.max_batch_size
        if held is not None and held != batch_size:
            raise ValueError(
                f"past_key_values holds {held} sequences but the input has {batch_size}; select or repeat "
                "its rows (cache.batch_select_indices / batch_repeat_interleave) or start a new cache"
            )

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RecAttnCache:
        """An empty cache for an hf_recattn model (the base model or one with a head, as ``model.new_cache()``)."""
        base = getattr(model, "base_model", model)
        kinds = [layer.self_attn.mixer.state_kind for layer in base.layers]
        return cls(kinds, model_id=id(base))

    # ----- queries ---------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.layers:
            return 0
        return self.layers[min(layer_idx, len(self.layers) - 1)].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def max_batch_size(self) -> int | None:
        """Sequences held, or None before the first forward."""
        return next((b for layer in self.layers if (b := layer.batch_size) is not None), None)

    @property
    def batch_size(self) -> int:
        """Sequences held, or -1 before the first forward (transformers' convention)."""
        held = self.max_batch_size
        return -1 if held is None else held

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    @property
    def is_initialized(self) -> bool:
        return any(layer.is_initialized for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes held by all layers' states."""
        return sum(layer.nbytes() for layer in self.layers)

    def layer_nbytes(self) -> list[int]:
        return [layer.nbytes() for layer in self.layers]

    # ----- batch manipulation (beam search, contrastive search, num_return_sequences) --------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last n tokens (``crop(n > 0)``: keep n); raises if a layer cannot roll back.

        Every layer is checked first, so that a refused crop leaves the cache as it was.
        """
        for layer in self.layers:
            refusal = layer.crop_refusal(tokens_to_remove)
            if refusal is not None:
                raise ValueError(refusal)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def update(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise TypeError(
            "RecAttnCache holds mixer states; hf_recattn layers write them through MixerStateLayer.update, "
            "not through Cache.update(key, value)"
        )
