"""Running Trainer: eval perplexity in the logs, the causal-LM loss over chunks of positions or on Liger Kernel's
fused op when asked, resuming from the last checkpoint, the final atomic save; under FSDP (``sharding.py``) the
trained model gathered into a plain one."""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from ..atomic import move_into_place
from .distill_loss import chunked_loss_sum
from .fused_loss import check_loss_kernel, fused_loss_sum, use_liger
from .lm_outputs import causal_lm, final_logits, hidden_forward
from .sharding import FsdpTrainer, PlainCopy, check_resume, full_state_dict

FINAL_MODEL = "model"
_TRAINER_DIR = re.compile(r"^checkpoint-(\d+)$")


class NonFiniteLossError(RuntimeError):
    """A training or distillation loss became NaN or infinite; the message names the stage, step and layer."""


class CausalLMTrainer(FsdpTrainer):
    """Trainer that also logs ``eval_perplexity`` = exp(``eval_loss``) with every evaluation.

    ``loss_chunk_size``: the causal-LM cross-entropy (the model's own, summed over the predicted tokens and divided
    by Trainer's count of them, or their mean) is taken over chunks of that many tokens from the final hidden states
    (``distill_loss.chunked_loss_sum``), so the whole [B, T, V] logits never exist; None: the model's own loss.
    ``loss_kernel``: ``liger`` takes that cross-entropy from the final hidden states on Liger Kernel's fused op
    instead (``fused_loss.py``), ``auto`` where it runs and takes the loss, ``torch`` never.

    Under FSDP, ``plain`` is the model's plain copy made before sharding: checkpoints are saved under its class, and
    ``trained_model`` fills it with the trained weights.
    """

    #: the setting that ``loss_kernel`` errors name
    loss_kernel_setting = "loss_kernel"

    def __init__(
        self, *args: Any, loss_chunk_size: int | None = None, loss_kernel: str = "auto", **kwargs: Any
    ) -> None:
        if loss_chunk_size is not None and loss_chunk_size <= 0:
            raise ValueError(f"loss_chunk_size must be a positive number of tokens, got {loss_chunk_size!r}")
        check_loss_kernel(loss_kernel, self.loss_kernel_setting)
        super().__init__(*args, **kwargs)
        self.loss_chunk_size = loss_chunk_size
        self.loss_kernel = loss_kernel
        self.plain = PlainCopy(self.model) if self.is_fsdp_enabled else None

    def uses_liger(self, lm: nn.Module, weighted: bool = False) -> bool:
        """Whether the loss of the causal LM ``lm`` runs on the Liger ops (``fused_loss.use_liger``)."""
        return use_liger(self.loss_kernel, self.loss_kernel_setting, lm, weighted=weighted)

    def trained_model(self, everywhere: bool = True) -> nn.Module | None:
        """The trained model as a plain module: the Trainer's model unwrapped, or under FSDP the gathered weights in
        ``plain`` (every process takes part; with ``everywhere`` false only the main process gets it, in CPU
        memory, and the others None)."""
        if self.plain is None:
            return self.accelerator.unwrap_model(self.model)
        state = full_state_dict(self.model, everywhere)
        return self.plain.fill(state) if state else None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Under FSDP, the gathered ``state_dict`` saved under the plain model's class (FSDP's class would name
        itself in the checkpoint's ``auto_map``)."""
        if self.plain is None:
            super()._save(output_dir, state_dict)
            return
        if not self.args.should_save:
            return
        folder = Path(output_dir or self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.plain.module.save_pretrained(str(folder), state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(folder))
        torch.save(self.args, folder / TRAINING_ARGS_NAME)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        lm = causal_lm(self.accelerator.unwrap_model(model))
        fused = self.uses_liger(lm)
        if not (self.loss_chunk_size or fused):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        shift_labels = inputs.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        forward = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        hidden, outputs = hidden_forward(model, lm, forward)
        if fused:
            total, count = fused_loss_sum(lm, hidden, shift_labels)
        else:
            total, count = chunked_loss_sum(partial(final_logits, lm), hidden, shift_labels, self.loss_chunk_size)
        if num_items_in_batch is None:
            loss = total / count if count else total
        else:
            loss = total / torch.as_tensor(num_items_in_batch).to(total.device) * self.process_scale()
        return (loss, outputs) if return_outputs else loss

    def process_scale(self) -> int:
        """What a loss divided by Trainer's ``num_items_in_batch`` is multiplied by, as Trainer scales the model's own
        loss: with the count taken over every process (``average_tokens_across_devices``), the number of processes,
        since DDP / FSDP then average the gradients over them; 1 otherwise."""
        if not (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs):
            return 1
        processes = self.accelerator.num_processes // self.get_tp_size()
        return processes if self.args.n_gpu <= 1 else self.args.n_gpu

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for key in [k for k in logs if k.startswith("eval_") and k.endswith("_loss")]:
            logs[key[: -len("loss")] + "perplexity"] = math.exp(min(float(logs[key]), 700.0))
        super().log(logs, start_time)


@dataclass
class RunResult:
    """What a pretrain / finetune run did: where the model is, its steps, the resumed step, final metrics."""

    model_dir: Path
    global_step: int
    resumed_from: int
    train_loss: float | None
    eval_metrics: dict[str, float]
    log_history: list[dict[str, Any]]


@contextmanager
def quiet_gradient_checkpointing_notice() -> Iterator[None]:
    """Hide transformers' own ``is_gradient_checkpointing`` deprecation notice, raised inside its Trainer / peft
    calls, not by our arguments."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def latest_trainer_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete Trainer ``checkpoint-N`` (with ``trainer_state.json``); removes incomplete ones.

    Trainer writes its checkpoint files in place and ``trainer_state.json`` among the last, so a folder
    without it is the remains of an interrupted save.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found: list[tuple[int, Path]] = []
    for child in folder.iterdir():
        match = _TRAINER_DIR.match(child.name)
        if not match or not child.is_dir():
            continue
        if (child / "trainer_state.json").is_file():
            found.append((int(match.group(1)), child))
        else:
            shutil.rmtree(child, ignore_errors=True)
    return max(found)[1] if found else None


def train_with_resume(trainer: Trainer) -> int:
    """``trainer.train()`` from the newest complete ``checkpoint-N`` in ``output_dir`` (0 when none), which must
    have been written with FSDP if and only if this run has it."""
    last = latest_trainer_checkpoint(trainer.args.output_dir)
    if last is not None:
        check_resume(last, trainer.is_fsdp_enabled)
    trainer.train(resume_from_checkpoint=str(last) if last is not None else None)
    return 0 if last is None else int(last.name.rsplit("-", 1)[-1])


def save_final(trainer: CausalLMTrainer, tokenizer: Any,
               finish: Callable[[nn.Module], nn.Module] | None = None) -> Path:
    """Write ``output_dir/model`` atomically: into ``.tmp-model`` first (every process takes part, which
    FSDP needs to gather weights, so the temporary name is one they all know), then moved into place by the
    main process. ``finish``: turns the trained model into the plain model to save (``merge_lora``); under FSDP the
    main process saves the gathered weights (a full checkpoint)."""
    final = Path(trainer.args.output_dir) / FINAL_MODEL
    tmp = final.parent / f".tmp-{FINAL_MODEL}"
    main = trainer.is_world_process_zero()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    if finish is None and trainer.plain is None:
        trainer.save_model(str(tmp))
    else:
        trained = trainer.trained_model(everywhere=False)
        if main:
            (trained if finish is None else finish(trained)).save_pretrained(str(tmp))
    if main:
        tokenizer.save_pretrained(str(tmp))
        (tmp / "training_args.bin").unlink(missing_ok=True)
        move_into_place(tmp, final)
    trainer.accelerator.wait_for_everyone()
    return final


def summarize(trainer: Trainer, model_dir: Path, resumed_from: int) -> RunResult:
    history = list(trainer.state.log_history)
    losses = [row["loss"] for row in history if "loss" in row]
    evals = [row for row in history if "eval_loss" in row]
    return RunResult(model_dir, trainer.state.global_step, resumed_from, losses[-1] if losses else None,
                     {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}, history)
