"""RecAttnCache: a transformers ``Cache`` whose layers hold each mixer's state, whatever its family.

Every layer keeps a ``dict[str, Tensor]`` (batch first) and the number of tokens it has seen. The mixer decides
what the tensors are (a KV cache, a window of keys, or fixed-size recurrent states); the cache only stores,
reorders, repeats and selects them, so a new family needs no code here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .mixer_base import State

KINDS = ("kv", "window", "recurrent")


class MixerStateLayer:
    """One layer's state; ``kind`` says whether it grows (kv), is bounded (window) or is fixed (recurrent)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, kind: str, layer_idx: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"layer {layer_idx}: unknown cache kind {kind!r}")
        self.kind = kind
        self.layer_idx = layer_idx
        self.state: State | None = None
        self.seen_tokens = 0
        self.is_sliding = kind == "window"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

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

    def batch_size(self) -> int | None:
        if self.state is None:
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
        self._map(lambda t: t[indices])

    def crop(self, max_length: int) -> None:
        target = max_length if max_length >= 0 else self.seen_tokens + max_length
        if target >= self.seen_tokens:
            return
        if self.kind != "kv":
            raise ValueError(
                f"layer {self.layer_idx}: cannot crop a {self.kind} cache to {target} tokens: its state has "
                f"already absorbed all {self.seen_tokens} tokens and cannot be rolled back"
            )
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
    """Per-layer mixer states for hf_recattn models; build it with ``RecAttnCache.for_model(config)``."""

    is_compileable = False

    def __init__(self, kinds: list[str], model_id: int | None = None) -> None:
        super().__init__(layers=[MixerStateLayer(kind, i) for i, kind in enumerate(kinds)])
        self.model_id = model_id

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RecAttnCache:
        kinds = [layer.self_attn.mixer.state_kind for layer in model.layers]
        return cls(kinds, model_id=id(model))

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
        return next((b for layer in self.layers if (b := layer.batch_size()) is not None), None)

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

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def update(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise TypeError(
            "RecAttnCache holds mixer states; hf_recattn layers write them through MixerStateLayer.update, "
            "not through Cache.update(key, value)"
        )
