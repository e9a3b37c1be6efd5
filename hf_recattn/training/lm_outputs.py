"""A causal LM's last hidden states and its final logits, apart: what a loss over chunks of positions needs
(``distill_loss.chunked_loss_sum``, ``fused_loss.fused_loss_sum``), so that the whole [B, T, V] logits never exist
at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: ``logits_to_keep`` that keeps no position: the model's forward runs its LM head on nothing
_NO_POSITIONS: list[int] = []


def causal_lm(model: nn.Module) -> nn.Module:
    """The causal-LM module inside ``model``'s wrappers (a peft model's base model); ``model`` itself otherwise."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def final_logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``lm``'s logits of ``hidden`` (its last hidden states, any leading shape) as its own forward computes them:
    the LM head, then the config's ``logits_scaling`` (a divisor, Granite) and ``final_logit_softcapping``
    (``cap * tanh(x / cap)``, Gemma 2 / 3) where set. The head's ``forward`` runs without its module hooks: under
    FSDP2 its weight is the one its unit keeps gathered from the model's forward through the backward, not gathered,
    freed and reduced again for each chunk of positions."""
    logits = lm.get_output_embeddings().forward(hidden)
    scaling = getattr(lm.config, "logits_scaling", None)
    if scaling is not None and scaling != 1.0:
        logits = logits / scaling
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass(frozen=True)
class LinearHead:
    """An LM head as a fused linear + loss kernel takes it: ``final_logits(h)`` is
    ``softcap(inputs(h) @ weight.T + scaled_bias())``, ``softcap(x) = cap * tanh(x / cap)`` where ``softcap`` is set."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scaling: float | None  # the config's ``logits_scaling``: a divisor, folded into the hidden states and the bias
    softcap: float | None

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states with the scaling folded in: ``(h / s) W^T + b / s = (h W^T + b) / s`` up to rounding."""
        return hidden if self.scaling is None else hidden / self.scaling

    def scaled_bias(self) -> torch.Tensor | None:
        """The bias with the scaling folded in (``inputs``)."""
        return self.bias if self.bias is None or self.scaling is None else self.bias / self.scaling


def linear_head(lm: nn.Module) -> LinearHead | None:
    """``lm``'s LM head as a ``LinearHead``, or None when it is not a plain ``nn.Linear`` holding its whole weight (a
    peft layer, a sharded head)."""
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear or tuple(head.weight.shape) != (head.out_features, head.in_features):
        return None
    scaling = getattr(lm.config, "logits_scaling", None)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return LinearHead(head.weight, head.bias, None if scaling in (None, 1.0) else float(scaling),
                      None if cap is None else float(cap))


def hidden_forward(model: nn.Module, lm: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """Run ``model`` (``lm`` or a wrapper of it: peft, DDP) on ``inputs`` with its LM head on no position; return
    the last hidden states of ``lm``'s decoder [B, T, H] and the model's outputs (their logits [B, 0, V])."""
    captured: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    device = inputs["input_ids"].device
    handle = lm.get_decoder().register_forward_hook(keep)
    try:
        outputs = model(**inputs, use_cache=False, logits_to_keep=torch.tensor(_NO_POSITIONS, device=device).long())
    finally:
        handle.remove()
    return captured[-1], outputs
