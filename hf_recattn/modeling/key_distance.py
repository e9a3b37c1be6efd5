"""Exact keys at a bounded distance: the hybrid's option ``distant_positions`` (mixer_hybrid.py, hybrid_cached.py).

A hybrid's attention sinks and exact cache slots stay softmax keys at any distance back. Under RoPE their logit
against query t is q_t . k_p = q0^T R(p - t) k0 (q0, k0 before the rotation R): past the teacher's context that
is an angle the teacher never saw. With ``distant_positions: clamp`` a key more than D (``clamp_distance``) tokens
back is scored as if it sat exactly D back: q0^T R(-D) k0 = (R(D - t) q_t) . (R(-p) k_p), the query turned back to
position D and the key to position 0, both pure rotations of what the layer already holds (RoPE's attention scale
is a factor of both and passes through). Keys within D keep the logit they had, bit for bit, so within the
teacher's context the layer is the ``absolute`` one.

Positions are counted over real tokens, as the model counts them without ``position_ids`` (modeling.py): the sinks
are the first real tokens (slot j at position j), a query's position is the number of real tokens before it, and
the exact cache keeps its slots' positions in the state (``ppos`` / ``wpos`` / ``cpos`` beside the pending buffer,
the window and the cache). Explicit ``position_ids`` shifted by a constant per row (left padding numbered from the
row's start) give the same relative distances. The frequencies are the layer's own rotary embedding's (the config's
``rope_parameters``: default, linear, llama3, yarn, partial rotary, per-layer groups); a rotary whose frequencies
change with the sequence length (``dynamic``, ``longrope``) is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .architecture import RecAttnRotaryEmbedding
from .mixer_base import MixerInputs, MixerShape, State

ABSOLUTE = "absolute"
CLAMP = "clamp"
DISTANT_POSITIONS = (ABSOLUTE, CLAMP)
#: rotary types that recompute their frequencies from the sequence length: a key cannot be turned back by them
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_distance_spec(spec: dict[str, Any], where: str) -> None:
    """``clamp_distance`` only with ``distant_positions: clamp``, and never inside the window's own reach (keys up to
    W - 1 back, 2W - 1 with the exact cache's pending buffer), where the layer would clamp keys that are not
    distant."""
    limit = spec["clamp_distance"]
    if limit is None:
        return
    if spec["distant_positions"] != CLAMP:
        raise ValueError(f"{where}: option 'clamp_distance'={limit} needs distant_positions='clamp', got "
                         f"{spec['distant_positions']!r}")
    reach = (2 if spec["cache_slots"] else 1) * spec["window"] - 1
    if limit < reach:
        raise ValueError(f"{where}: option 'clamp_distance'={limit} is below the {reach} tokens back that the window"
                         f"{' and the pending buffer' if spec['cache_slots'] else ''} reach (window={spec['window']})")


def rope_frequencies(config: Any, layer_idx: int, where: str) -> torch.Tensor:
    """[F] float64: the rotation frequencies of layer ``layer_idx``'s rotary embedding (its group's, with
    ``rope_layer_groups``); ValueError naming ``where`` for one whose frequencies change with the length."""
    flat = config
    groups = getattr(config, "rope_layer_groups", None)
    if groups:
        flat = copy.copy(config)
        flat.rope_parameters = config.rope_parameters[groups[layer_idx]]
    kind = (flat.rope_parameters or {}).get("rope_type", "default")
    if kind in LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"{where}: option 'distant_positions'='clamp' cannot turn keys back under rope_type "
                         f"{kind!r}, whose frequencies change with the sequence length")
    with torch.device("cpu"):  # from_pretrained builds layers on the meta device; these are no weights to load
        return RecAttnRotaryEmbedding(config=flat).inv_freq.to(torch.float64)


def key_distance(spec: dict[str, Any], shape: MixerShape, config: Any) -> KeyDistance | None:
    """The hybrid layer's clamp (None unless ``distant_positions: clamp`` with RoPE on): D is ``clamp_distance`` or
    the config's ``max_position_embeddings`` - 1; ValueError naming the layer when D is past that, or without a
    config to read the rotary embedding from."""
    if spec["distant_positions"] != CLAMP or not spec.get("rope", True):
        return None
    where = f"layer {shape.layer_idx}"
    if config is None:
        raise ValueError(f"{where}: option 'distant_positions'='clamp' needs the model's config (its rotary "
                         "embedding and max_position_embeddings)")
    context = int(config.max_position_embeddings)
    limit = context - 1 if spec["clamp_distance"] is None else int(spec["clamp_distance"])
    if limit > context - 1:
        raise ValueError(f"{where}: option 'clamp_distance'={limit} is past max_position_embeddings - 1 = "
                         f"{context - 1}, the farthest distance the teacher's rotary was trained on")
    return KeyDistance(limit, rope_frequencies(config, shape.layer_idx, where))


def query_positions(inputs: MixerInputs, t: int, device: torch.device) -> torch.Tensor:
    """[B or 1, T] long: the positions of the block's T tokens, counted over real tokens (padding: anything)."""
    mask = inputs.padding_mask
    if mask is None:
        return torch.arange(inputs.past_length, inputs.past_length + t, device=device)[None]
    return mask.long().cumsum(1)[:, -t:] - 1


class KeyDistance:
    """The clamp of one layer: exact keys farther back than ``limit`` (D) scored as if D back (module docstring)."""

    def __init__(self, limit: int, inv_freq: torch.Tensor) -> None:
        self.limit = limit
        self.inv_freq = inv_freq  # [F] float64, on the device of the last call
        self.rotary_dims = 2 * inv_freq.shape[0]

    def rotate(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [..., S, D] turned by ``offsets`` (long, broadcastable to [..., S]) positions: RoPE's rotation of the
        first 2F dimensions (the halves paired, as the model rotates them), the rest unchanged; in float32 at least."""
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        angle = offsets.to(torch.float64)[..., None] * self.inv_freq  # [..., S, F], exact for any position
        dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = (torch.cat([f, f], dim=-1).to(dtype) for f in (angle.cos(), angle.sin()))
        rot, rest = x[..., : self.rotary_dims].to(dtype), x[..., self.rotary_dims :].to(dtype)
        half = self.rotary_dims // 2
        turned = rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * sin
        return torch.cat([turned, rest], dim=-1)

    def clamp(
        self, scores: torch.Tensor, qg: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
        query_pos: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """``scores`` [B, Hkv, G, T, C] (q.k * scale, the queries ``qg`` [B, Hkv, G, T, D]) with its first S columns,
        the keys ``keys`` [B, Hkv, >= S, D] at positions ``key_pos`` [B or 1, Hkv or 1, S], scored as if D back where
        they are farther from the query (``query_pos`` [B or 1, T]); the other logits as they were."""
        s = key_pos.shape[-1]
        far = (query_pos[:, None, None, :, None] - key_pos[:, :, None, None, :]) > self.limit  # [B, Hkv, 1, T, S]
        if far.device.type == "cpu" and not bool(far.any()):  # within D: nothing to do (a host check on the CPU only)
            return scores
        turned_q = self.rotate(qg, (self.limit - query_pos)[:, None, None, :])
        raw_keys = self.rotate(keys[:, :, :s], -key_pos)
        clamped = torch.einsum("bhgtd,bhsd->bhgts", turned_q, raw_keys).mul_(scale).to(scores.dtype)
        return torch.cat([torch.where(far, clamped, scores[..., :s]), scores[..., s:]], dim=-1)

    def sinks(
        self, scores: torch.Tensor, qg: torch.Tensor, keys: torch.Tensor, inputs: MixerInputs, sinks: int,
        scale: float, candidates: bool = True,
    ) -> torch.Tensor:
        """``clamp`` of the leading sink columns of ``scores`` [B, Hkv, G, T, C]: the N sink slots, then (with
        ``candidates``) the block's T tokens as sink candidates."""
        pos = query_positions(inputs, qg.shape[3], qg.device)
        key_pos = self.sink_positions(sinks, pos)
        return self.clamp(scores, qg, keys, key_pos if candidates else key_pos[..., :sinks], pos, scale)

    @staticmethod
    def sink_positions(sinks: int, query_pos: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, N + T]: the positions of the sink candidates (the N slots, the first N real tokens, then the
        block's tokens)."""
        slots = torch.arange(sinks, device=query_pos.device)[None].expand(query_pos.shape[0], -1)
        return torch.cat([slots, query_pos], dim=1)[:, None]

    @staticmethod
    def exact_positions(sink_pos: torch.Tensor | None, cpos: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, S]: the positions of a cached block's leading exact keys, the sink candidates ``sink_pos``
        [B or 1, 1, N + T] (None without sinks), then the cache's slots ``cpos`` [B, Hkv, G]."""
        if sink_pos is None:
            return cpos
        return torch.cat([sink_pos.expand(cpos.shape[0], cpos.shape[1], -1), cpos], dim=2)

    @staticmethod
    def kept_positions(cpos: torch.Tensor, pending_pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, G]: the positions of the pairs a decision keeps (``keep`` [B, Hkv, G] indexes the candidates:
        the cache's slots at ``cpos`` [B, Hkv, G], then the pending pairs at ``pending_pos`` [B, W])."""
        pending = pending_pos[:, None].expand(-1, cpos.shape[1], -1)
        return torch.cat([cpos, pending], dim=2).gather(2, keep)

    def cached_step(
        self, scores: torch.Tensor, qg: torch.Tensor, keys: torch.Tensor, inputs: MixerInputs, state: State,
        sinks: int, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step with the exact cache: ``scores`` over its columns (the N sinks and the new token as a
        sink candidate when there are sinks, the cache's G slots, then pending, window and new token) clamped, and
        the positions [B, 2W + 1] of pending, window and new token."""
        pos = query_positions(inputs, 1, qg.device).expand(qg.shape[0], -1)
        sink_pos = self.sink_positions(sinks, pos) if sinks else None
        scores = self.clamp(scores, qg, keys, self.exact_positions(sink_pos, state["cpos"]), pos, scale)
        return scores, torch.cat([state["ppos"], state["wpos"], pos], dim=1)

    @staticmethod
    def init_positions(batch_size: int, window: int, kv_heads: int, slots: int, device: torch.device) -> State:
        """The positions the exact cache keeps: of the pending buffer and window slots [B, W] and of the cached
        slots per KV head [B, Hkv, G]."""
        zeros = {"ppos": (batch_size, window), "wpos": (batch_size, window), "cpos": (batch_size, kv_heads, slots)}
        return {name: torch.zeros(size, dtype=torch.long, device=device) for name, size in zeros.items()}
