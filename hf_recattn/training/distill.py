"""A finetune with a distillation loss: transformers' Trainer (LoRA adapters merged at the end, or every
weight), cross-entropy and/or KL to a frozen teacher. Conversion's stage 2 is this finetune.

The loss is a *sum* over predicted tokens divided by ``num_items_in_batch``, the number of predicted tokens
in the whole accumulated batch that Trainer counts before the micro-batches run. The division makes each
micro-batch's loss already scaled for gradient accumulation, so the trainer says so
(``loss_is_scaled_for_ga = True``) and Trainer does not divide again. The gradient of one optimizer step is
then the same for 1 micro-batch of 4 and for 4 micro-batches of 1, whatever the padding
(tests/test_finetune.py checks this). Under ``torchrun`` each process takes ``batch_size / processes`` blocks
of every micro-batch and Trainer counts the tokens over all of them, so the step is the one process's step.

Batches carry ``shift_labels`` (the next-token targets), which is what Trainer counts when present.

With ``loss_chunk_size`` the loss is taken over chunks of that many predicted positions from the student's and the
teacher's final hidden states (``distill_loss.chunked_loss_sum``): one chunk's logits alive at a time, the same
loss and gradient up to floating-point rounding. ``loss_kernel`` takes it from the hidden states on Liger Kernel's
fused ops instead where it chooses them (``fused_loss.py``). ``gradient_checkpointing`` recomputes the student's
decoder layers in the backward (Trainer's ``activation_checkpointing``).

With ``fsdp`` (or accelerate launch's FSDP config) the trained model is sharded by accelerate's FSDP2 (each decoder
layer a unit: its weights, LoRA adapters, gradients and optimizer states split over the processes); the frozen
teacher is not Trainer's model and stays whole on every process. At the end every process gets the trained model
back whole and plain (``CausalLMTrainer.trained_model``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments, default_data_collator

from .arguments import build_training_arguments
from .distill_loss import chunked_loss_sum, distill_loss_sum
from .distill_settings import DistillSettings
from .forms import fastest_forms
from .fused_loss import fused_loss_sum, use_liger
from .lm_outputs import causal_lm, final_logits, hidden_forward
from .parallel import local_share
from .runner import (
    CausalLMTrainer,
    NonFiniteLossError,
    latest_trainer_checkpoint,
    quiet_gradient_checkpointing_notice,
    train_with_resume,
)
from .sharding import check_flag, fsdp_arguments
from .trainable import finished_model, is_mixer_parameter, set_trainable


# ----- data -------------------------------------------------------------------------------------------------
class BlockDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks as causal-LM examples: ``input_ids``, ``labels`` and ``shift_labels``; with
    ``weights`` ([N, block_size], weight i for the prediction of token i) also ``shift_weights``."""

    def __init__(
        self, blocks: torch.Tensor, attention_mask: torch.Tensor | None = None, weights: torch.Tensor | None = None
    ) -> None:
        if blocks.dim() != 2:
            raise ValueError(f"stage 2: blocks must be [N, block_size], got {tuple(blocks.shape)}")
        if weights is not None and weights.shape != blocks.shape:
            raise ValueError(f"stage 2: weights {tuple(weights.shape)} must match blocks {tuple(blocks.shape)}")
        self.blocks = blocks.long()
        self.attention_mask = attention_mask
        self.weights = weights

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        labels = ids.clone()
        item = {"input_ids": ids}
        if self.attention_mask is not None:
            mask = self.attention_mask[index].long()
            item["attention_mask"] = mask
            labels = labels.masked_fill(mask == 0, -100)
        item["labels"] = labels
        item["shift_labels"] = torch.cat([labels[1:], labels.new_full((1,), -100)])
        if self.weights is not None:
            weights = self.weights[index].float()
            item["shift_weights"] = torch.cat([weights[1:], weights.new_ones(1)])
        return item


# ----- the trainer ------------------------------------------------------------------------------------------
class DistillTrainer(CausalLMTrainer):
    """Trainer with cross-entropy and/or KL to a frozen teacher, normalized over the accumulated batch."""

    loss_is_scaled_for_ga = True
    loss_kernel_setting = "stage2.loss_kernel"

    def __init__(
        self,
        *args: Any,
        teacher: nn.Module | None = None,
        loss: str = "ce",
        temperature: float = 1.0,
        kl_weight: float = 1.0,
        mixer_lr: float | None = None,
        mixer_eps: float | None = None,
        loss_chunk_size: int | None = None,
        loss_kernel: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, loss_chunk_size=loss_chunk_size, loss_kernel=loss_kernel, **kwargs)
        self.mixer_lr = mixer_lr
        self.mixer_eps = mixer_eps
        if loss != "ce" and teacher is None:
            raise ValueError(f"stage 2: loss {loss!r} needs a teacher model")
        self.teacher = teacher
        if teacher is not None:
            teacher.eval()
            teacher.requires_grad_(False)
            teacher.to(self.args.device)
        self.distill_loss = loss
        self.temperature = temperature
        self.kl_weight = kl_weight
        self.model_accepts_loss_kwargs = True  # so that Trainer counts num_items_in_batch for us

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer; with ``mixer_lr`` or ``mixer_eps`` set, the mixer parameters in a group of their own."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if fresh and (self.mixer_lr is not None or self.mixer_eps is not None):
            lr = self.args.learning_rate if self.mixer_lr is None else self.mixer_lr
            group: dict[str, Any] = {"lr": lr, "weight_decay": 0.0}
            if self.mixer_eps is not None:
                group["eps"] = self.mixer_eps
            separate_mixer_group(optimizer, self.model if model is None else model, group)
        return optimizer

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        forward = {"input_ids": inputs["input_ids"]}
        if "attention_mask" in inputs:
            forward["attention_mask"] = inputs["attention_mask"]
        fused = self.uses_liger(causal_lm(self.accelerator.unwrap_model(model)), "shift_weights" in inputs)
        if self.loss_chunk_size or fused:
            total, count, outputs = self._chunked_loss_sum(model, forward, inputs, fused)
        else:
            outputs = model(**forward, use_cache=False)
            teacher_logits = None
            if self.distill_loss != "ce":
                with torch.no_grad():
                    teacher_logits = self.teacher(**forward, use_cache=False).logits
            total, count = distill_loss_sum(
                outputs.logits, inputs["shift_labels"], teacher_logits, self.distill_loss, self.temperature,
                self.kl_weight, inputs.get("shift_weights"),
            )
        if num_items_in_batch is not None:  # a count over every process: scaled back as Trainer does
            denominator = float(num_items_in_batch) / self.process_scale()
        else:  # no count from Trainer (outside train()): this micro-batch's mean, scaled for accumulation
            steps = self.current_gradient_accumulation_steps if model.training else 1
            denominator = max(count, 1) * steps
        value = total / max(denominator, 1.0)
        if not torch.isfinite(value.detach()):
            last = latest_trainer_checkpoint(self.args.output_dir)
            raise NonFiniteLossError(
                f"stage 2: loss is {float(value.detach())} at step {self.state.global_step}"
                f" (last good checkpoint: {last or 'none yet'}); lower stage2.lr or check stage 1"
            )
        return (value, outputs) if return_outputs else value

    def uses_liger(self, lm: nn.Module, weighted: bool = False) -> bool:
        """Whether the loss of the student ``lm`` (and the teacher) runs on the Liger ops (``fused_loss.use_liger``)."""
        return use_liger(self.loss_kernel, self.loss_kernel_setting, lm, self.teacher, self.distill_loss, weighted)

    def _chunked_loss_sum(
        self, model: nn.Module, forward: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], fused: bool
    ) -> tuple[torch.Tensor, int, Any]:
        """The summed loss from the final hidden states, its count and the student's outputs (logits of no
        position): on the Liger ops if ``fused``, else over chunks of ``loss_chunk_size`` positions."""
        student = causal_lm(self.accelerator.unwrap_model(model))
        hidden, outputs = hidden_forward(model, student, forward)
        teacher_head = teacher_hidden = None
        if self.distill_loss != "ce":
            with torch.no_grad():
                teacher_hidden, _ = hidden_forward(self.teacher, self.teacher, forward)
            teacher_head = partial(final_logits, self.teacher)
        if fused:
            total, count = fused_loss_sum(student, hidden, inputs["shift_labels"], self.teacher, teacher_hidden,
                                          self.distill_loss, self.temperature, self.kl_weight,
                                          inputs.get("shift_weights"))
            return total, count, outputs
        total, count = chunked_loss_sum(
            partial(final_logits, student), hidden, inputs["shift_labels"], self.loss_chunk_size, teacher_head,
            teacher_hidden, self.distill_loss, self.temperature, self.kl_weight, inputs.get("shift_weights"),
        )
        return total, count, outputs


def separate_mixer_group(optimizer: torch.optim.Optimizer, model: nn.Module, group: dict[str, Any]) -> int:
    """Move the trainable mixer parameters out of ``optimizer``'s groups into a new group with the settings
    ``group`` (others from the optimizer's defaults), before any step. Returns how many tensors moved."""
    mixer = [p for n, p in model.named_parameters() if p.requires_grad and is_mixer_parameter(n)]
    if not mixer:
        return 0
    moving = {id(p) for p in mixer}
    for existing in optimizer.param_groups:
        existing["params"] = [p for p in existing["params"] if id(p) not in moving]
    optimizer.add_param_group({**group, "params": mixer})
    return len(mixer)


# ----- the stage --------------------------------------------------------------------------------------------
@dataclass
class FinetuneResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float | None
    resumed_from: int
    trainable_parameters: int
    forms: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _StopAfter(TrainerCallback):
    """Stop training after a given global step (used to split a run into resumable pieces)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
            control.should_save = True
        return control


def training_arguments(
    settings: DistillSettings, output_dir: str | Path, seed: int, steps: int, progress: bool, **overrides: Any
) -> TrainingArguments:
    """Trainer's arguments for a distillation finetune of ``steps`` optimizer steps (``overrides`` win)."""
    values: dict[str, Any] = {
        "per_device_train_batch_size": local_share(settings.batch_size, "stage2.batch_size"),
        "gradient_accumulation_steps": settings.grad_accum,
        "learning_rate": settings.lr,
        "max_steps": steps,
        "lr_scheduler_type": "cosine",
        "warmup_steps": int(round(settings.warmup_fraction * steps)),
        "weight_decay": settings.weight_decay,
        "max_grad_norm": settings.max_grad_norm,
        "logging_steps": max(1, min(10, steps // 10)),
        "save_strategy": "steps",
        "save_steps": settings.save_steps,
        "save_total_limit": 1,
        "report_to": "none",
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "remove_unused_columns": False,
        "disable_tqdm": not progress,
        "use_cpu": not torch.cuda.is_available(),
        **({"activation_checkpointing": True} if settings.gradient_checkpointing else {}),
        **overrides,
    }
    return build_training_arguments(values, "stage 2", has_eval=False, output_dir=str(output_dir))


def trainable_student(student: nn.Module, settings: DistillSettings) -> nn.Module:
    """The model Trainer trains: ``student`` itself with every weight trainable (``method: full``), or wrapped
    with LoRA adapters."""
    return set_trainable(student, settings.method or "lora", settings.lora, settings.train_mixer, "stage2")


def finished_student(trained: nn.Module, settings: DistillSettings) -> nn.Module:
    """The plain model after training: adapters merged (LoRA), frozen and in eval mode."""
    return finished_model(trained, settings.method or "lora")


def finetune(
    teacher: nn.Module | None,
    student: nn.Module,
    blocks: torch.Tensor,
    settings: DistillSettings,
    output_dir: str | Path,
    seed: int = 0,
    progress: bool = True,
    stop_after_step: int | None = None,
    pick_forms: bool = True,
    callbacks: list[TrainerCallback] | None = None,
    weights: torch.Tensor | None = None,
    fsdp: bool = False,
) -> tuple[nn.Module, FinetuneResult]:
    """Finetune ``student`` on ``blocks`` (LoRA or every weight, as ``settings.method`` says), resuming from
    Trainer checkpoints in ``output_dir``.

    Returns the plain model (adapters merged) and a summary. ``stop_after_step`` ends the run early at that
    step with a checkpoint (the plain model is still returned). ``pick_forms``: train each mixer in its faster form.
    ``weights`` ([N, block_size]): the loss weight of each token's prediction (``retrieval_data.py``). ``fsdp``:
    shard the trained model over the processes (FSDP2).
    """
    check_flag(fsdp, "fsdp")
    with quiet_gradient_checkpointing_notice():
        return _finetune(teacher, student, blocks, settings, output_dir, seed, progress, stop_after_step,
                         pick_forms, callbacks, weights, fsdp)


def _finetune(
    teacher: nn.Module | None,
    student: nn.Module,
    blocks: torch.Tensor,
    settings: DistillSettings,
    output_dir: str | Path,
    seed: int,
    progress: bool,
    stop_after_step: int | None,
    pick_forms: bool,
    callbacks: list[TrainerCallback] | None,
    weights: torch.Tensor | None,
    fsdp: bool,
) -> tuple[nn.Module, FinetuneResult]:
    tokens_per_step = settings.batch_size * settings.grad_accum * blocks.shape[1]
    steps = max(1, settings.tokens // tokens_per_step)
    trained = trainable_student(student, settings)
    trainable = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    args = training_arguments(settings, output_dir, seed, steps, progress, **fsdp_arguments(fsdp))
    trainer = DistillTrainer(
        model=trained,
        args=args,
        train_dataset=BlockDataset(blocks, weights=weights),
        data_collator=default_data_collator,
        teacher=teacher if settings.loss != "ce" else None,
        loss=settings.loss,
        temperature=settings.temperature,
        kl_weight=settings.kl_weight,
        mixer_lr=settings.mixer_lr if settings.trains_mixer else None,
        mixer_eps=settings.mixer_eps if settings.trains_mixer else None,
        loss_chunk_size=settings.loss_chunk_size or None,  # 0: the whole block's logits
        loss_kernel=settings.loss_kernel or "auto",
        callbacks=[*(callbacks or []), *([_StopAfter(stop_after_step)] if stop_after_step else [])] or None,
    )
    began = time.perf_counter()
    with fastest_forms(student, blocks.shape[1], pick_forms) as forms:
        resumed = train_with_resume(trainer)
    seconds = time.perf_counter() - began
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    final = float(losses[-1]) if losses else None
    if final is not None and not math.isfinite(final):
        raise NonFiniteLossError(f"stage 2: the logged loss is {final} at step {trainer.state.global_step}")
    done = trainer.state.global_step
    result = FinetuneResult(done, done * tokens_per_step, seconds, final, resumed, trainable, forms)
    return finished_student(trainer.trained_model(), settings), result
