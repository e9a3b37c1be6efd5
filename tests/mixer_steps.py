"""Shared test harness: drive a mixer token by token, and a left-padded mask."""

from __future__ import annotations

import torch

from hf_recattn.modeling.mixer_base import Mixer, MixerInputs, State


def left_padded(seq_len: int, pad: int = 3) -> torch.Tensor:
    """[2, T] bool mask: row 0 all real, row 1 with `pad` padding tokens on the left."""
    mask = torch.ones(2, seq_len, dtype=torch.bool)
    mask[1, :pad] = False
    return mask


def run_steps(
    mixer: Mixer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    state: State | None = None,
    start: int = 0,
    past: int = 0,
) -> tuple[torch.Tensor, State]:
    """Run `mixer.step` from token `start` to the end, after `past` tokens already in `state` (the mask spans them
    too); returns the outputs [B, T, H, E] and the final state."""
    state = mixer.init_state(q.shape[0], q.device, q.dtype) if state is None else state
    outs = []
    for t in range(start, q.shape[2]):
        o, state = mixer.step(
            q[:, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            MixerInputs(x[:, t : t + 1], mask[:, : past + t + 1], past + t),
            state,
        )
        outs.append(o)
    return torch.cat(outs, dim=1), state


def run_chunked(
    mixer: Mixer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, State]:
    """Run `mixer.chunked` over the whole sequence from a fresh state; returns the outputs and the final state."""
    return mixer.chunked(q, k, v, MixerInputs(x, mask), mixer.init_state(q.shape[0], q.device, q.dtype))
