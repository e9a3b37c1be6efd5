"""Stage 1 of conversion, attention transfer (LoLCATs): the training package's run (training/attention_transfer.py)
with what only conversion knows, the teacher's own attention weights for ``stage1.attention_kl``.

Those come from the one decoder block: per layer a softmax twin, a ``RecAttnAttention`` of the student's
architecture (q/k norms, attention scale, soft-cap, rotary groups) with the teacher's own spec for that layer (full
attention or its sliding window, RoPE or NoPE: ``families.teacher_layer_specs``) that shares the teacher's q/k
projection and norm weights. Its ``log_attention_weights`` are the teacher's attention weights, in float32.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import nn

from ..modeling.modeling import RecAttnAttention
from ..training.attention_objective import retention_head_of
from ..training.attention_transfer import TransferResult, run_attention_transfer
from .families import split_fused, teacher_layer_specs
from .settings import Stage1Settings

#: the teacher weights a softmax twin shares: all its attention weights needs
TWIN_WEIGHTS = ("q_proj", "k_proj", "q_norm", "k_norm")


def attention_transfer(
    teacher: nn.Module,
    student: nn.Module,
    blocks: torch.Tensor,
    settings: Stage1Settings,
    layers: Collection[int] | None = None,
    **options: Any,
) -> TransferResult:
    """Train every converted layer's mixer parameters to match the teacher's attention; resumable.

    ``run_attention_transfer`` (see there for ``layers`` and the keyword ``options``: seed, checkpoint folder,
    progress, ...), given the teacher's softmax twins when ``settings.attention_kl`` or a learned cache score (its
    retention head's target) asks for its attention weights.
    """
    needed = _twin_layers(student, layers, bool(settings.attention_kl))
    twins = softmax_twins(teacher, student.config, needed) if needed else None
    return run_attention_transfer(teacher, student, blocks, settings, layers=layers, teacher_attention=twins,
                                  **options)


def _twin_layers(student: nn.Module, layers: Collection[int] | None, attention_kl: bool) -> list[int]:
    """The layers whose teacher attention weights stage 1 needs: every trained one with ``attention_kl``, else those
    whose hybrid learns its cache score (its retention head's target); none for a student that is no model (the run
    itself says what is wrong with it)."""
    config = getattr(student, "config", None)
    if config is None:
        return []
    chosen = range(config.num_hidden_layers) if layers is None else layers
    return [i for i in chosen if attention_kl or retention_head_of(student, i) is not None]


def softmax_twins(teacher: nn.Module, config: Any, layers: Iterable[int]) -> dict[int, RecAttnAttention]:
    """Per layer: the teacher's attention as a ``RecAttnAttention`` of the student's ``config`` with the teacher's
    spec, sharing (not copying) the teacher's q/k projections and norms; its v/o projections stay unallocated."""
    twin_config = copy.deepcopy(config)
    twin_config.attention, twin_config.attention_overrides = teacher_layer_specs(teacher.config), None
    state = split_fused(teacher.config, teacher.state_dict())
    twins = {}
    for i in layers:
        prefix = f"model.layers.{i}.self_attn."
        shared = {name[len(prefix):]: tensor for name, tensor in state.items()
                  if name.startswith(prefix) and name[len(prefix):].split(".")[0] in TWIN_WEIGHTS}
        with torch.device("meta"):
            twin = RecAttnAttention(twin_config, i)
        missing = twin.load_state_dict(shared, strict=False, assign=True).missing_keys
        unshared = [name for name in missing if name.split(".")[0] in TWIN_WEIGHTS]
        if unshared:
            raise ValueError(f"stage1.attention_kl: the teacher's layer {i} has no weights for {unshared} "
                             f"(looked for them under {prefix})")
        twins[i] = twin.requires_grad_(False).eval()
    return twins
