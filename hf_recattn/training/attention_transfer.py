"""Attention transfer (stage 1 of conversion) on transformers' Trainer: the loop, resume and checkpoints of every
training run here, with the loss of ``attention_objective.py`` and its own data, optimizer and schedule.

* data: the token blocks in ``batch_schedule`` order (shuffled epochs, deterministic in the seed), read in order;
* optimizer: AdamW with one group per layer (and one for its projections, at ``projection_lr``);
* schedule: linear warm-up, then cosine decay to ``lr * min_lr_fraction`` (``lr_at``);
* clipping: each layer's gradients on their own (Trainer's clipping over all parameters is off);
* checkpoints: Trainer's ``checkpoint-N`` folders every ``save_every`` steps, holding the trained parameters only
  (``mixer.safetensors``), the loss record and Trainer's optimizer / scheduler / RNG / state files; a rerun resumes
  from the newest complete one (``runner.train_with_resume``). A NaN/inf loss stops the run with
  ``NonFiniteLossError`` naming the layer and step, after saving the last good state.

Under ``torchrun`` each process takes its contiguous share of every step's batch (accelerate's ``split_batches``),
DDP averages the gradients and the reported losses are means over the processes: the run equals one process on the
same batches. With FSDP (``fsdp``, or accelerate's FSDP config) the trained layers' attentions are sharded instead
(``transfer_sharding.py``); checkpoints then hold the same gathered ``mixer.safetensors`` and accelerate's optimizer
file. Trainer seeds the global random generators; a run leaves them as it found them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import PrinterCallback, TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer import SCHEDULER_NAME

from . import parallel, sharding
from .attention_objective import LayerValues, TransferObjective, load_mixer_state, mixer_parameters, mixer_state_dict
from .forms import fastest_forms
from .runner import NonFiniteLossError, latest_trainer_checkpoint, train_with_resume
from .transfer_sharding import ShardedAttention

#: a checkpoint's trained parameters and loss record (beside Trainer's own files)
MIXER_FILE = "mixer.safetensors"
RECORD_FILE = "losses.json"


class TransferSettings(Protocol):
    """What attention transfer reads from its settings (conversion's ``Stage1Settings``)."""

    tokens: int
    lr: float
    batch_size: int
    warmup_fraction: float
    min_lr_fraction: float
    max_grad_norm: float
    save_every: int
    projections: tuple[str, ...]
    projection_lr: float
    attention_kl: float | None


@dataclass
class TransferResult:
    """What stage 1 did: steps, tokens, per-layer MSE at the start and the end, time."""

    steps: int
    tokens: int
    first_loss: dict[int, float] = field(default_factory=dict)  # MSE of the first step
    last_loss: dict[int, float] = field(default_factory=dict)  # MSE at the end (moving average, beta 0.8)
    relative_last: dict[int, float] = field(default_factory=dict)  # MSE / mean(target^2), moving average
    attention_kl_last: dict[int, float] = field(default_factory=dict)  # stage1.attention_kl's term, moving average
    retention_last: dict[int, float] = field(default_factory=dict)  # learned cache scores' loss, moving average
    seconds: float = 0.0
    resumed_from: int = 0
    trainable_parameters: int = 0
    forms: dict[str, str] = field(default_factory=dict)  # the form each distinct mixer spec trained in

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "first_loss": {str(k): v for k, v in self.first_loss.items()},
            "last_loss": {str(k): v for k, v in self.last_loss.items()},
            "relative_last": {str(k): v for k, v in self.relative_last.items()},
            "attention_kl_last": {str(k): v for k, v in self.attention_kl_last.items()},
            "retention_last": {str(k): v for k, v in self.retention_last.items()},
            "seconds": self.seconds,
            "resumed_from": self.resumed_from,
            "trainable_parameters": self.trainable_parameters,
            "forms": self.forms,
        }


# ----- schedule and data ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, settings: TransferSettings) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_fraction``."""
    warmup = max(1, int(round(settings.warmup_fraction * total))) if settings.warmup_fraction > 0 else 0
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    floor = settings.min_lr_fraction
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch_schedule(num_blocks: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Block indices per step: shuffled epochs (a new permutation each), deterministic in ``seed``."""
    order: list[int] = []
    epoch = 0
    while len(order) < steps * batch_size:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order.extend(torch.randperm(num_blocks, generator=gen).tolist())
        epoch += 1
    flat = torch.tensor(order[: steps * batch_size])
    return list(flat.view(steps, batch_size))


class ScheduledBlocks(torch.utils.data.Dataset):
    """The blocks in the order of ``batch_schedule``: items ``s * B .. s * B + B - 1`` are step ``s``'s batch."""

    def __init__(self, blocks: torch.Tensor, schedule: list[torch.Tensor], answers: torch.Tensor | None = None
                 ) -> None:
        self.blocks, self.answers = blocks, answers
        self.order = torch.cat(schedule).tolist() if schedule else []

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.order[index]
        item = {"input_ids": self.blocks[row]}
        if self.answers is not None:
            item["answers"] = self.answers[row]
        return item


class TransferSchedule(torch.optim.lr_scheduler.LRScheduler):
    """Each group's learning rate at step ``s``: ``rate(s) * group["lr_scale"]`` exactly."""

    def __init__(self, optimizer: torch.optim.Optimizer, rate: Callable[[int], float]) -> None:
        self.rate = rate
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        lr = self.rate(self.last_epoch)
        return [lr * group["lr_scale"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The counters, without the rate function (checkpoints load with ``weights_only``)."""
        return {key: value for key, value in super().state_dict().items() if key != "rate"}


def transfer_optimizer(groups: dict[int, dict[str, nn.Parameter]], settings: TransferSettings) -> torch.optim.AdamW:
    """AdamW with a group per layer (and one for its projections, at ``projection_lr``)."""
    param_groups = []
    for i, params in groups.items():
        mixer = [p for n, p in params.items() if ".mixer." in n]
        projs = [p for n, p in params.items() if ".mixer." not in n]
        if mixer:
            param_groups.append({"params": mixer, "layer": i, "lr_scale": 1.0})
        if projs:
            param_groups.append({"params": projs, "layer": i, "lr_scale": settings.projection_lr / settings.lr})
    return torch.optim.AdamW(param_groups, lr=settings.lr, weight_decay=0.0)


# ----- the trainer ------------------------------------------------------------------------------------------
def _record_step(record: dict[str, Any], values: LayerValues, beta: float = 0.8) -> None:
    """First loss per layer, and exponential moving averages of the loss, the relative loss, the KL term and the
    retention heads' loss."""
    for key, numbers in (("last_loss", values.mse), ("last_rel", values.relative), ("last_kl", values.kl),
                         ("last_retention", values.retention)):
        smoothed = record.setdefault(key, {})
        for i, value in numbers.items():
            old = smoothed.get(str(i))
            smoothed[str(i)] = value if old is None else beta * old + (1 - beta) * value
    for i, value in values.mse.items():
        record["first_loss"].setdefault(str(i), value)
    record["count"] = record.get("count", 0) + 1


class TransferTrainer(sharding.FsdpTrainer):
    """Trainer of a ``TransferObjective``: per-layer AdamW groups and schedule, checkpoints of the trained
    parameters only, the loss record, and the NaN stop."""

    def __init__(
        self, *args: Any, settings: TransferSettings, groups: dict[int, dict[str, nn.Parameter]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.settings, self.groups = settings, groups
        self.record: dict[str, Any] = {"first_loss": {}, "count": 0}

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = transfer_optimizer(self.groups, self.settings)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        if self.lr_scheduler is None:
            rate = functools.partial(lr_at, total=num_training_steps, settings=self.settings)
            self.lr_scheduler = TransferSchedule(optimizer or self.optimizer, rate)
        return self.lr_scheduler

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        loss = model(input_ids=inputs["input_ids"], answers=inputs.get("answers"))
        values: LayerValues = self.model.values
        for layer, value in values.loss.items():
            if not math.isfinite(value):
                self._stop(layer, value)
        _record_step(self.record, values)
        return (loss, None) if return_outputs else loss

    def _stop(self, layer: int, value: float) -> None:
        """A non-finite loss: save the last good state (that of the step about to run), then raise."""
        step = self.state.global_step
        where = ""
        if self.args.save_strategy != "no":
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.accelerator.wait_for_everyone()
            where = f" (last good checkpoint: step {step} in {self.args.output_dir})"
        raise NonFiniteLossError(
            f"stage 1: layer {layer}: attention-transfer loss is {value} at step {step}{where}; "
            "lower stage1.lr or check the mixer spec of this layer"
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP only the trained parameters, gathered (Trainer's own would gather the whole student)."""
        if not self.is_fsdp_enabled:
            super().save_model(output_dir, _internal_call)
            return
        self._save(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A checkpoint's model part: the trained parameters and the loss record (the main process writes; under
        FSDP every process first takes part in gathering the parameters)."""
        if not (self.args.should_save or self.is_fsdp_enabled):
            return
        tensors = mixer_state_dict(self.model.student, tuple(self.settings.projections))
        tensors = {name: sharding.full_tensor(tensor) for name, tensor in tensors.items()}
        if not self.args.should_save:
            return
        folder = Path(output_dir or self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / MIXER_FILE))
        (folder / RECORD_FILE).write_text(json.dumps(self.record, indent=1))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under FSDP accelerate's optimizer file and the schedule, without Trainer's second copy of the model."""
        if not self.is_fsdp_enabled:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        from accelerate.utils import save_fsdp_optimizer

        plugin = self.accelerator.state.fsdp_plugin
        save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        folder = Path(resume_from_checkpoint)
        load_mixer_state(self.model.student, load_file(str(folder / MIXER_FILE)), tuple(self.settings.projections))
        self.record = json.loads((folder / RECORD_FILE).read_text())


class _ClipEachLayer(TrainerCallback):
    """Each layer's gradients clipped on their own before the optimizer step: the layers stay separate problems."""

    def __init__(self, groups: dict[int, dict[str, nn.Parameter]], max_norm: float) -> None:
        self.groups, self.max_norm = groups, max_norm

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for params in self.groups.values():
            torch.nn.utils.clip_grad_norm_(list(params.values()), self.max_norm)


class _ProgressBar(TrainerCallback):
    """One bar on the main process with the last step's mean MSE, relative MSE and KL (instead of Trainer's)."""

    def __init__(self, objective: TransferObjective, enabled: bool) -> None:
        self.objective, self.enabled = objective, enabled
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.enabled and parallel.is_main():
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="stage 1 attention transfer",
                            unit="step", dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is None:
            return
        values = self.objective.values
        extra = {"kl": f"{_mean(values.kl):.3f}"} if values.kl else {}
        if values.retention:
            extra["retention"] = f"{_mean(values.retention):.3f}"
        self.bar.update(1)
        self.bar.set_postfix(mse=f"{_mean(values.mse):.3g}", rel=f"{_mean(values.relative):.3f}", **extra)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _AfterEachStep(TrainerCallback):
    """``on_step(step, student)`` after every optimizer step."""

    def __init__(self, on_step: Callable[[int, nn.Module], None], student: nn.Module) -> None:
        self.on_step, self.student = on_step, student

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_step(state.global_step, self.student)


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / max(len(values), 1)


# ----- the run ----------------------------------------------------------------------------------------------
def run_attention_transfer(
    teacher: nn.Module,
    student: nn.Module,
    blocks: torch.Tensor,
    settings: TransferSettings,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    keep_checkpoints: int = 1,
    pick_forms: bool = True,
    on_step: Callable[[int, nn.Module], None] | None = None,
    layers: Collection[int] | None = None,
    teacher_attention: Mapping[int, nn.Module] | None = None,
    fsdp: bool = False,
    answers: torch.Tensor | None = None,
) -> TransferResult:
    """Train every layer's mixer parameters to match the teacher's attention output; resumable.

    ``blocks`` is a ``[N, block_size]`` LongTensor of training tokens. With ``checkpoint_dir`` a checkpoint is
    saved every ``settings.save_every`` steps and a rerun continues from the newest. ``pick_forms``: train each
    mixer in its faster form (see ``fastest_forms``). ``on_step(step, student)`` runs after every optimizer step
    (the benchmark measures perplexity there). ``layers``: train only these layers (the ones a recipe converts).
    ``teacher_attention``: per trained layer, a module whose ``log_attention_weights(hidden, position_embeddings)``
    gives the teacher's (needed with ``settings.attention_kl``). ``fsdp`` (or accelerate launch's FSDP config):
    shard the trained layers' attentions over the processes (``transfer_sharding.py``). ``answers``: ``[N,
    block_size]`` bool, the tokens that answer a question (for ``settings.retention_target`` ``answers``).
    """
    sharding.check_flag(fsdp, "fsdp")
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"stage 1: need a non-empty [N, block] tensor of token ids, got {tuple(blocks.shape)}")
    groups = mixer_parameters(student, tuple(settings.projections))
    if layers is not None:
        wanted = set(layers)
        groups = {i: params for i, params in groups.items() if i in wanted}
    if not groups or settings.tokens <= 0:
        return TransferResult(steps=0, tokens=0)
    parallel.local_share(settings.batch_size, "stage1.batch_size")
    tokens_per_step = settings.batch_size * blocks.shape[1]
    total = max(1, settings.tokens // tokens_per_step)
    _freeze(teacher, student, groups)
    if answers is not None and answers.shape != blocks.shape:
        raise ValueError(f"stage 1: answers {tuple(answers.shape)} do not match blocks {tuple(blocks.shape)}")
    objective = TransferObjective(teacher, student, list(groups), settings.attention_kl, teacher_attention,
                                  getattr(settings, "retention_target", None) or "later")
    data = ScheduledBlocks(blocks, batch_schedule(blocks.shape[0], settings.batch_size, total, seed), answers)
    shards = ShardedAttention(student, list(groups)) if fsdp or sharding.from_environment() else None
    began = time.perf_counter()
    student.train()
    with _global_rng_kept(), _work_folder(checkpoint_dir) as folder, \
            fastest_forms(student, blocks.shape[1], pick_forms) as forms:
        args = _arguments(settings, folder, checkpoint_dir is not None, seed, total, keep_checkpoints, student, fsdp)
        bar = _ProgressBar(objective, progress)
        extra = [bar, *([_AfterEachStep(on_step, student)] if on_step else [])]
        trainer = _transfer_trainer(objective, args, data, settings, groups, shards, extra)
        _check_resumable(folder, total)
        try:
            resumed = train_with_resume(trainer)
        finally:
            bar.close()
    if shards is not None:
        shards.restore()
    student.eval()
    student.requires_grad_(False)
    return _result(trainer, resumed, tokens_per_step, time.perf_counter() - began, groups, forms)


def _freeze(teacher: nn.Module, student: nn.Module, groups: dict[int, dict[str, nn.Parameter]]) -> None:
    """Teacher and student frozen but for the parameters stage 1 trains."""
    teacher.eval()
    teacher.requires_grad_(False)
    student.requires_grad_(False)
    for params in groups.values():
        for p in params.values():
            p.requires_grad_(True)


def _transfer_trainer(objective: TransferObjective, args: TrainingArguments, data: ScheduledBlocks,
                      settings: TransferSettings, groups: dict[int, dict[str, nn.Parameter]],
                      shards: ShardedAttention | None, callbacks: list[TrainerCallback]) -> TransferTrainer:
    """The Trainer of ``objective``, clipping each layer's gradients; with ``shards`` the trained attentions are
    sharded first, and the optimizer and the clipping hold their shards."""
    if shards is not None:
        shards.shard(objective)
        sharded = mixer_parameters(objective.student, tuple(settings.projections))
        groups = {i: params for i, params in sharded.items() if i in groups}
    trainer = TransferTrainer(model=objective, args=args, train_dataset=data, data_collator=default_data_collator,
                              callbacks=[_ClipEachLayer(groups, settings.max_grad_norm), *callbacks],
                              settings=settings, groups=groups)
    trainer.remove_callback(PrinterCallback)  # the progress bar, or nothing, is all a run prints
    return trainer


def _arguments(settings: TransferSettings, folder: Path, save: bool, seed: int, total: int, keep: int,
               student: nn.Module, fsdp: bool = False) -> TrainingArguments:
    """Trainer's arguments: the whole batch per step split over the processes, no clipping, logging or bar of
    Trainer's own, checkpoints every ``save_every`` steps when saving; with ``fsdp`` FSDP2 (units of our own)."""
    return TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=settings.batch_size,  # the whole batch: accelerate splits it (split_batches)
        accelerator_config={"split_batches": True},
        train_sampling_strategy="sequential",
        max_steps=total,
        learning_rate=settings.lr,
        weight_decay=0.0,
        max_grad_norm=0.0,  # each layer clips its own (_ClipEachLayer)
        save_strategy="steps" if save else "no",
        save_steps=settings.save_every,
        save_total_limit=keep,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        use_cpu=next(student.parameters()).device.type == "cpu",
        **sharding.fsdp_arguments(fsdp),
    )


def _check_resumable(folder: Path, total: int) -> None:
    last = latest_trainer_checkpoint(folder)
    step = 0 if last is None else int(last.name.rsplit("-", 1)[-1])
    if step > total:
        raise ValueError(f"stage 1 checkpoint {last} is at step {step}, beyond this run's {total} steps")


def _result(trainer: TransferTrainer, resumed: int, tokens_per_step: int, seconds: float,
            groups: dict[int, dict[str, nn.Parameter]], forms: dict[str, str]) -> TransferResult:
    record, done = trainer.record, trainer.state.global_step
    return TransferResult(
        steps=done,
        tokens=done * tokens_per_step,
        first_loss={int(k): v for k, v in record["first_loss"].items()},
        last_loss={int(k): v for k, v in record.get("last_loss", {}).items()},
        relative_last={int(k): v for k, v in record.get("last_rel", {}).items()},
        attention_kl_last={int(k): v for k, v in record.get("last_kl", {}).items()},
        retention_last={int(k): v for k, v in record.get("last_retention", {}).items()},
        seconds=seconds,
        resumed_from=resumed,
        trainable_parameters=sum(p.numel() for params in groups.values() for p in params.values()),
        forms=forms,
    )


@contextlib.contextmanager
def _work_folder(checkpoint_dir: str | Path | None) -> Iterator[Path]:
    """``checkpoint_dir``, or without one a temporary folder for Trainer (which then saves nothing)."""
    if checkpoint_dir is not None:
        yield Path(checkpoint_dir)
        return
    with tempfile.TemporaryDirectory(prefix="stage1-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """The global random generators as they were before: Trainer seeds them and its data loader draws from them,
    while the run itself uses none (its order comes from ``batch_schedule``'s own generators)."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
