"""The objective of attention transfer (LoLCATs; stage 1 of conversion): teach each new mixer to reproduce the
teacher's attention.

The teacher runs frozen with forward hooks on every ``self_attn``: they record what each attention layer received
(the normed hidden states) and what it returned (its output after ``o_proj``); its forward stops after the attention
of the last layer trained (no later layer, no final norm). Each trained student layer then runs
only its attention (``RecAttnAttention.attend``) on the *teacher's* inputs, and the MSE to the teacher's output
trains that layer's new mixer parameters, nothing else (the copied q/k/v/o projections stay frozen, unless some are
named to train: for mixers without parameters of their own). With an ``attention_kl`` weight the loss adds the KL
divergence from the teacher's attention weights (given per layer by a module with ``log_attention_weights``) to the
mixer's. A layer whose hybrid keeps its exact cache by a learned score (``cache_score: learned``) adds its retention
head's loss (retention_objective.py) on the same teacher weights.

``TransferObjective`` is that loss as a module, the model its Trainer trains (``attention_transfer.py``): one
teacher forward per batch, then every trained layer; it returns the sum of the layers' losses. The layers' parameter
sets are disjoint, so each layer's gradient is exactly that of its own loss: the layers stay separate problems.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import parallel
from .forms import decoder_layers
from .retention_objective import answer_retention_targets, retention_loss, retention_targets
from .sharding import copy_full

#: what the retention heads learn to predict (``stage1.retention_target``; see retention_objective.py)
RETENTION_TARGETS = ("later", "answers")


# ----- which parameters attention transfer trains -------------------------------------------------------------
def mixer_parameters(
    student: nn.Module, projections: tuple[str, ...] = ()
) -> dict[int, dict[str, nn.Parameter]]:
    """Per layer, by full name: the new mixer parameters (feature maps, gains, gates, mixing weights), plus
    the weights of the attention ``projections`` named (e.g. ``("q_proj", "k_proj")``) when asked."""
    out: dict[int, dict[str, nn.Parameter]] = {}
    for i, layer in enumerate(decoder_layers(student)):
        prefix = f"model.layers.{i}.self_attn."
        params = {prefix + "mixer." + n: p for n, p in layer.self_attn.mixer.named_parameters()}
        for proj in projections:
            module = getattr(layer.self_attn, proj, None)
            if not isinstance(module, nn.Module):
                raise ValueError(f"layer {i}: the attention has no projection {proj!r}")
            params.update({f"{prefix}{proj}.{n}": p for n, p in module.named_parameters()})
        if params:
            out[i] = params
    return out


def mixer_state_dict(student: nn.Module, projections: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    groups = mixer_parameters(student, projections)
    return {n: p.detach().clone() for params in groups.values() for n, p in params.items()}


def load_mixer_state(
    student: nn.Module, tensors: dict[str, torch.Tensor], projections: tuple[str, ...] = ()
) -> None:
    """Copy saved stage-1 parameters into ``student`` (its shares of them under FSDP); every expected name must be
    present."""
    expected = {n: p for params in mixer_parameters(student, projections).values() for n, p in params.items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            f"saved mixer parameters do not fit the student (missing {missing[:4]}, extra {extra[:4]})"
        )
    for name, param in expected.items():
        copy_full(param, tensors[name])  # this process's share of a parameter sharded by FSDP


def retention_head_of(student: nn.Module, i: int) -> nn.Module | None:
    """Layer ``i``'s retention head (a hybrid with ``cache_score: learned``), or None."""
    return getattr(decoder_layers(student)[i].self_attn.mixer, "retention", None)


# ----- capturing the teacher -------------------------------------------------------------------------------
@contextlib.contextmanager
def capture_attention_io(teacher: nn.Module) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Hooks on every teacher ``self_attn``: ``record[i] = (input hidden states, attention output)``."""
    record: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []

    def make_hook(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            out = output[0] if isinstance(output, tuple) else output
            record[i] = (hidden.detach(), out.detach())

        return hook

    for i, layer in enumerate(decoder_layers(teacher)):
        handles.append(layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


class _LastLayerReached(Exception):
    """Raised by the hook of the last layer needed, to stop the teacher's forward there."""


@torch.no_grad()
def teacher_attention_io(
    teacher: nn.Module, input_ids: torch.Tensor, last_layer: int | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run the teacher's decoder stack (not its LM head); return every layer's attention input and output. With
    ``last_layer``, the forward stops once that layer's attention has run: layers 0..``last_layer`` only."""
    base = getattr(teacher, "model", teacher)
    with capture_attention_io(teacher) as record:
        handle = None
        if last_layer is not None:
            handle = decoder_layers(teacher)[last_layer].self_attn.register_forward_hook(_stop_forward)
        try:
            base(input_ids=input_ids, use_cache=False)
        except _LastLayerReached:
            pass
        finally:
            if handle is not None:
                handle.remove()
    return dict(record)


def _stop_forward(module: nn.Module, args: tuple, output: Any) -> None:
    raise _LastLayerReached


def attention_kl_divergence(log_p: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over batch, heads and queries of KL(p || ``weights``) in nats, both [B, H, T, T] (``log_p`` the
    teacher's log weights); the student's weights are floored at the smallest normal float where p is not 0."""
    p = log_p.exp()
    log_a = weights.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    terms = torch.where(p > 0, p * (log_p - log_a), 0.0)
    return terms.sum(-1).mean()


# ----- the objective ----------------------------------------------------------------------------------------
@dataclass
class LayerValues:
    """One step's numbers per layer, each the whole batch's (the mean over the processes): the output MSE, the MSE
    relative to the target's mean square, the attention KL (layers that have it), the loss the layer trains on and
    the retention head's loss (layers with ``cache_score: learned``)."""

    mse: dict[int, float] = field(default_factory=dict)
    relative: dict[int, float] = field(default_factory=dict)
    kl: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    retention: dict[int, float] = field(default_factory=dict)


class TransferObjective(nn.Module):
    """The attention-transfer loss of ``student``'s ``layers`` against ``teacher``: ``forward(input_ids)`` returns
    the summed per-layer loss and leaves the step's ``LayerValues`` in ``values``.

    Only the student is a submodule (the model Trainer moves, wraps and trains); the teacher and the modules giving
    its attention weights per layer (``teacher_attention``, needed with an ``attention_kl`` weight) are plain
    attributes. The KL term is weighted in units of the output MSE relative to the target's power, so one weight
    suits every layer: loss = MSE + attention_kl * mean(target^2) * KL.
    """

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        layers: list[int],
        attention_kl: float | None = None,
        teacher_attention: Mapping[int, nn.Module] | None = None,
        retention_target: str = "later",
    ) -> None:
        super().__init__()
        if retention_target not in RETENTION_TARGETS:
            raise ValueError(f"stage1.retention_target: {retention_target!r} is not one of {list(RETENTION_TARGETS)}")
        self.retention_target = retention_target
        self.student = student
        object.__setattr__(self, "teacher", teacher)  # not registered: Trainer must not move, wrap or save it
        self.teacher_attention = dict(teacher_attention or {})  # a plain dict: not registered either
        self.layers = list(layers)
        self.attention_kl = float(attention_kl or 0.0)
        needed = [i for i in self.layers if self.attention_kl or retention_head_of(student, i) is not None]
        missing = [i for i in needed if i not in self.teacher_attention]
        if missing:
            raise ValueError(f"stage 1: attention_kl and learned cache scores need the teacher's attention weights "
                             f"of layers {missing}")
        first = next(student.parameters())
        self.dtype = first.dtype  # a bfloat16 teacher's activations are cast to it
        self.rotary = getattr(student, "model", student).rotary_emb
        self.values = LayerValues()

    def forward(self, input_ids: torch.Tensor, answers: torch.Tensor | None = None) -> torch.Tensor:
        """``answers`` [B, T] (bool): the tokens that answer a question, which the ``answers`` retention target
        reads."""
        if self.retention_target == "answers" and answers is None:
            raise ValueError("stage1.retention_target: answers needs the blocks' answer tokens "
                             "(stage1.retrieval_share)")
        io = teacher_attention_io(self.teacher, input_ids, max(self.layers))
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        position_embeddings = self.rotary(io[0][0].to(self.dtype), position_ids=positions)
        values = LayerValues()
        total = None
        for i in self.layers:
            hidden, target = io[i]
            loss = self._layer_loss(i, hidden, target, position_embeddings, values, answers)
            total = loss if total is None else total + loss
        self.values = values
        return total

    def _layer_loss(
        self, i: int, hidden: torch.Tensor, target: torch.Tensor, position_embeddings: Any, values: LayerValues,
        answers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s loss on the teacher's input ``hidden`` and output ``target``; its numbers into ``values``
        (``answers``: the blocks' answer tokens, for the ``answers`` retention target).

        The layer's terms are recomputed in the backward (``torch.utils.checkpoint``): the same operations on the
        same inputs give the same gradient bit for bit, while only one layer's activations are alive at a time
        instead of every trained layer's until the step's backward."""
        head = retention_head_of(self.student, i)
        log_p = None
        if self.attention_kl or head is not None:
            with torch.no_grad():
                log_p = self.teacher_attention[i].log_attention_weights(hidden, position_embeddings)
        kl_log_p = log_p if self.attention_kl else None
        mse, kl = checkpoint(self._layer_terms, i, hidden, target, position_embeddings, kl_log_p, use_reentrant=False)
        mse_value, power, kl_value = _batch_means(mse, target.float().pow(2).mean(), kl)
        values.mse[i] = mse_value
        values.relative[i] = mse_value / max(power, 1e-12)
        loss, values.loss[i] = mse, mse_value
        if kl is not None:
            values.kl[i] = kl_value
            values.loss[i] += self.attention_kl * power * kl_value
            loss = loss + self.attention_kl * power * kl
        if head is not None:
            retention = self._retention_term(i, head, hidden, position_embeddings, log_p, answers)
            values.retention[i] = _batch_means(retention, retention.new_zeros(()), None)[0]  # its mean alone
            loss = loss + retention
        return loss

    def _retention_term(
        self, i: int, head: nn.Module, hidden: torch.Tensor, position_embeddings: Any, log_p: torch.Tensor,
        answers: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer ``i``'s retention-head loss: its predictions from the student's keys and values against the importance
        the teacher's attention ``log_p`` gives each key (training/retention_objective.py)."""
        attention = decoder_layers(self.student)[i].self_attn
        mixer = attention.mixer
        with torch.no_grad():
            _, keys, values = attention.project(hidden.to(self.dtype), position_embeddings)
        if self.retention_target == "answers":
            target, counted = answer_retention_targets(log_p, answers, mixer.window, mixer.sink_tokens,
                                                       mixer.shape.groups)
        else:
            target, counted = retention_targets(log_p, mixer.window, mixer.sink_tokens, mixer.shape.groups)
        return retention_loss(head, keys, values, target, counted)

    def _layer_terms(
        self, i: int, hidden: torch.Tensor, target: torch.Tensor, position_embeddings: Any,
        log_p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s output MSE to ``target`` and, given the teacher's log attention weights ``log_p`` (an
        ``attention_kl`` weight), its attention-weight KL."""
        attention = decoder_layers(self.student)[i].self_attn
        pred, weights = attention.attend(hidden.to(self.dtype), position_embeddings, mixer_weights=log_p is not None)
        kl = None
        if log_p is not None:
            if weights is None:
                raise ValueError(
                    f"stage 1: layer {i}: mixer {attention.mixer.name!r} ({attention.mixer.extra_repr()}) has no "
                    "attention weights to match; set stage1.attention_kl to 0 or use a mixer whose output is a "
                    "weighted mean of the values (linear with the denominator, softmax)"
                )
            kl = attention_kl_divergence(log_p, weights)
        return F.mse_loss(pred.float(), target.float()), kl


def _batch_means(
    mse: torch.Tensor, power: torch.Tensor, kl: torch.Tensor | None
) -> tuple[float, float, float]:
    """The MSE, the target's mean square and the KL term of the whole batch, as floats: this process's values
    with one process, their mean over the processes with several."""
    if parallel.world_size() == 1:
        return float(mse.detach()), float(power), 0.0 if kl is None else float(kl.detach())
    values = torch.stack([mse.detach(), power.detach(), mse.new_zeros(()) if kl is None else kl.detach().float()])
    parallel.average([values])
    return float(values[0]), float(values[1]), float(values[2])
