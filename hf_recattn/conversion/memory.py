"""Stage 2's memory options where a recipe leaves them unset: ``loss_chunk_size`` and ``gradient_checkpointing``,
chosen from the arithmetic of docs/conversion.md ("Scale"), so that a teacher small enough trains as it always did
(both off, the same result bit for bit) and a large one gets them.

The estimate of stage 2's bytes with given options (``Stage2Shape.terms``): both models' weights, the optimizer's
state of what trains, the activations the backward keeps (every decoder layer's saved tensors, L (6h + 2 n_q d +
2 n_kv d + 4I) numbers per token, and what each mixer's form keeps beyond them, ``Mixer.backward_numbers``; with
checkpointing each layer's input plus one layer's) and the loss's logits
(``LOSS_COPIES`` float32 tensors of V per predicted position: the micro-batch's, one chunk's with
``loss_chunk_size``, none on Liger's fused ops). The budget is half the machine's memory (available RAM on the CPU,
the device's free memory on a GPU) counted up to ``REFERENCE_MEMORY``: 8 GiB on every machine with 16 GiB free,
so that the choice does not depend on the machine there, and less on a smaller one. While the estimate exceeds the
budget, the unset option that saves the most is turned on (chunks of ``CHOSEN_CHUNK`` positions; checkpointing).
A setting the recipe gives (``loss_chunk_size: 0`` and ``gradient_checkpointing: false`` included) is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import write_json
from ..training import parallel
from ..training.distill_settings import DistillSettings
from ..training.forms import decoder_layers
from ..training.fused_loss import liger_misfit, liger_unavailable
from .job import Log, read_json

#: float32 tensors of the vocabulary's size alive per predicted position at the loss's peak (student logits and their
#: masked copy, the log-softmaxes of the cross-entropy and of both tempered distributions, the teacher's
#: probabilities, the log-ratio, the product, and the gradients flowing back through them; docs/conversion.md)
LOSS_COPIES = 10
#: the ``loss_chunk_size`` chosen where a recipe leaves it unset and the logits do not fit
CHOSEN_CHUNK = 256
#: the machine's memory is counted up to this much: above it the choice is the same on every machine
REFERENCE_MEMORY = 16 * 2**30
#: the share of that memory the estimate may take (the formulas are a lower bound: the allocator adds to them)
BUDGET_SHARE = 0.5
#: bytes per trained LoRA weight: its float32 value, gradient and two Adam moments
ADAPTER_BYTES = 16
OPTIONS = ("loss_chunk_size", "gradient_checkpointing")
FP32 = 4
GIB = 2**30


@dataclass(frozen=True)
class Stage2Shape:
    """What stage 2's bytes depend on: the models' weight bytes, the optimizer's bytes, the student's decoder (layers,
    numbers each layer keeps per token for the backward, hidden size), the vocabulary, bytes per student and teacher
    activation, predicted positions per micro-step on this process, and whether Liger's fused ops take the loss."""

    weights: int
    optimizer: int
    layers: int
    per_layer: int
    hidden: int
    vocab: int
    student_bytes: int
    teacher_bytes: int
    tokens: int
    fused_loss: bool = False
    mixer_numbers: tuple[int, ...] = ()  # per layer: what its mixer keeps beyond ``per_layer`` for the micro-batch

    def terms(self, chunk: int | None, checkpointing: bool) -> dict[str, int]:
        """Bytes of each term with ``loss_chunk_size`` ``chunk`` (None: the whole micro-batch's logits) and
        ``checkpointing``."""
        if checkpointing:
            kept = (self.hidden * self.layers + self.per_layer) * self.tokens + max(self.mixer_numbers, default=0)
        else:
            kept = self.per_layer * self.layers * self.tokens + sum(self.mixer_numbers)
        final_hidden = self.hidden * (self.student_bytes + self.teacher_bytes) * self.tokens
        if self.fused_loss:  # no logits kept: the final hidden states and their gradient
            loss = final_hidden + self.hidden * FP32 * self.tokens
        elif chunk:
            loss = final_hidden + LOSS_COPIES * self.vocab * FP32 * min(chunk, self.tokens)
        else:
            loss = LOSS_COPIES * self.vocab * FP32 * self.tokens
        return {"weights": self.weights, "optimizer": self.optimizer,
                "activations": kept * self.student_bytes, "logits": loss}

    def total(self, chunk: int | None, checkpointing: bool) -> int:
        return sum(self.terms(chunk, checkpointing).values())


@dataclass(frozen=True)
class MemoryChoice:
    """The options stage 2 runs with, which of them were chosen here and which the recipe gave, and the numbers
    behind the choice (bytes)."""

    loss_chunk_size: int | None
    gradient_checkpointing: bool
    chosen: tuple[str, ...]
    given: dict[str, Any]
    unset_terms: dict[str, int]
    estimate: int
    memory: int
    memory_kind: str
    budget: int
    fused_loss: bool

    def apply(self, settings: DistillSettings) -> DistillSettings:
        """``settings`` with the options to run with (an explicit ``loss_chunk_size: 0`` as None: the whole block)."""
        return dataclasses.replace(settings, loss_chunk_size=self.loss_chunk_size,
                                   gradient_checkpointing=self.gradient_checkpointing)

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON reads it back (lists for tuples)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def line(self) -> str:
        """One log line: what runs, what was chosen or given, and the numbers."""
        unset = self.unset_terms
        parts = " + ".join(f"{key} {value / GIB:.2f}" for key, value in unset.items())
        runs = [f"loss_chunk_size {self.loss_chunk_size}" if self.loss_chunk_size else "loss_chunk_size off",
                f"gradient_checkpointing {'on' if self.gradient_checkpointing else 'off'}"]
        how = [f"chosen: {', '.join(self.chosen)}" if self.chosen else "nothing chosen",
               *(f"{key}: {value!r} as the recipe sets it" for key, value in self.given.items())]
        loss = "; the loss on Liger's fused ops (no logits kept)" if self.fused_loss else ""
        return (f"stage 2 memory: {', '.join(runs)} ({'; '.join(how)}{loss}): estimated {sum(unset.values()) / GIB:.2f}"
                f" GiB with the recipe's settings ({parts}), {self.estimate / GIB:.2f} GiB as run; budget "
                f"{self.budget / GIB:.2f} GiB = {BUDGET_SHARE:g} x min({self.memory / GIB:.2f} GiB {self.memory_kind}, "
                f"{REFERENCE_MEMORY / GIB:g} GiB){self._over()}")

    def _over(self) -> str:
        if self.estimate <= self.budget:
            return ""
        return ("; OVER THE BUDGET as run: the recipe's own settings are kept (leave loss_chunk_size and "
                "gradient_checkpointing unset, or set them on, or shorten stage2.block_size)")


def choose_memory_options(settings: DistillSettings, shape: Stage2Shape, memory: int,
                          memory_kind: str = "available") -> MemoryChoice:
    """The options stage 2 runs with: those ``settings`` give, and the unset ones turned on, the one that saves the
    most first, while the estimate of ``shape`` exceeds the budget that ``memory`` (bytes) allows."""
    given = {key: getattr(settings, key) for key in OPTIONS if getattr(settings, key) is not None}
    chunk, checkpointing = settings.loss_chunk_size or None, bool(settings.gradient_checkpointing)
    unset_terms = shape.terms(chunk, checkpointing)
    budget = int(BUDGET_SHARE * min(memory, REFERENCE_MEMORY))
    open_options = [key for key in OPTIONS if key not in given and not (key == "loss_chunk_size" and shape.fused_loss)]
    chosen: list[str] = []
    while open_options and shape.total(chunk, checkpointing) > budget:
        trials = {key: shape.total(CHOSEN_CHUNK if key == "loss_chunk_size" else chunk,
                                   checkpointing or key == "gradient_checkpointing") for key in open_options}
        best = min(trials, key=trials.__getitem__)
        if trials[best] >= shape.total(chunk, checkpointing):
            break
        if best == "loss_chunk_size":
            chunk = CHOSEN_CHUNK
        else:
            checkpointing = True
        chosen.append(best)
        open_options.remove(best)
    return MemoryChoice(chunk, checkpointing, tuple(chosen), given, unset_terms, shape.total(chunk, checkpointing),
                        memory, memory_kind, budget, shape.fused_loss)


# ----- the shape and the machine of a run -------------------------------------------------------------------
def layer_numbers(config: Any) -> int:
    """Numbers per token one decoder layer keeps for the backward: the norms' inputs and outputs, q, k, v, the
    attention output, the MLP's gate, up, activation and product: 6h + 2 n_q d + 2 n_kv d + 4I."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 6 * hidden + 2 * (heads + config.num_key_value_heads) * head_dim + 4 * config.intermediate_size


def adapter_parameters(student: nn.Module, settings: DistillSettings) -> int:
    """The LoRA weights stage 2 adds: rank x (in + out) for each linear layer a target names."""
    targets, rank = tuple(settings.lora.targets), settings.lora.r
    return sum(rank * (module.in_features + module.out_features) for name, module in student.named_modules()
               if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


def stage2_shape(teacher: nn.Module, student: nn.Module, settings: DistillSettings, fused_loss: bool) -> Stage2Shape:
    """The ``Stage2Shape`` of training ``student`` against ``teacher`` with ``settings`` on this process."""
    weights = sum(p.numel() * p.element_size() for model in (teacher, student) for p in model.parameters())
    student_bytes = next(student.parameters()).element_size()
    if settings.method == "full":  # a gradient and two moments beside each weight
        optimizer = 3 * sum(p.numel() * p.element_size() for p in student.parameters())
    else:
        optimizer = ADAPTER_BYTES * adapter_parameters(student, settings)
    config = student.config
    sequences = parallel.local_share(settings.batch_size, "stage2.batch_size")
    mixers = tuple(sequences * layer.self_attn.mixer.backward_numbers(settings.block_size)
                   for layer in decoder_layers(student))
    return Stage2Shape(weights, optimizer, config.num_hidden_layers, layer_numbers(config), config.hidden_size,
                       config.vocab_size, student_bytes, next(teacher.parameters()).element_size(),
                       settings.block_size * sequences, fused_loss, mixers)


def training_device() -> torch.device:
    """Where stage 2 trains: this process's CUDA device when there is one (as Trainer's arguments say), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def machine_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this process may use on ``device`` and what they are: the device's free memory, or the available RAM
    (``MemAvailable``, within the cgroup's limit) shared by the processes of this machine."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_room()
    kind = "available RAM" if limit is None or limit >= available else "free in the cgroup's memory limit"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    room = available if limit is None else min(available, limit)
    return room // processes, kind + (f" / {processes} processes" if processes > 1 else "")


def _meminfo_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, or None."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    return found[0] if found else None


def _cgroup_room() -> int | None:
    """What this cgroup (v2) may still take below its ``memory.max``, or None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit, used = (root / "memory.max").read_text().strip(), (root / "memory.current").read_text().strip()
    except OSError:
        return None
    if not limit.isdigit() or not used.isdigit():
        return None
    return max(int(limit) - int(used), 0)


def liger_takes_loss(settings: DistillSettings, student: nn.Module, teacher: nn.Module, weighted: bool,
                     device: torch.device) -> bool:
    """Whether stage 2's loss will run on Liger's fused ops (``fused_loss.use_liger`` as the trainer will ask it,
    before the models move to ``device`` and the adapters wrap them)."""
    choice = settings.loss_kernel or "auto"
    if choice == "torch" or liger_unavailable(choice, device) is not None:
        return False
    if settings.method != "full" and "lm_head" in settings.lora.targets:
        return False
    return liger_misfit(student, None if settings.loss == "ce" else teacher, settings.loss, weighted) is None


def stage2_memory(teacher: nn.Module, student: nn.Module, settings: DistillSettings, weighted: bool, folder: Path,
                  log: Log) -> tuple[DistillSettings, dict[str, Any]]:
    """``settings`` with the memory options stage 2 runs with, and the record of the choice. The choice is logged
    and written to ``folder/memory.json``; a rerun that finds that file (resuming stage 2) keeps its options."""
    device = training_device()
    fused = liger_takes_loss(settings, student, teacher, weighted, device)
    shape = stage2_shape(teacher, student, settings, fused)
    choice = choose_memory_options(settings, shape, *machine_memory(device))
    earlier = read_json(folder / "memory.json")
    chunk, checkpointing = earlier.get("loss_chunk_size"), earlier.get("gradient_checkpointing")
    if earlier.get("given") == choice.given and (chunk, checkpointing) != (choice.loss_chunk_size,
                                                                          choice.gradient_checkpointing):
        choice = dataclasses.replace(choice, loss_chunk_size=chunk, gradient_checkpointing=checkpointing,
                                     chosen=tuple(earlier["chosen"]), estimate=shape.total(chunk, checkpointing))
        log("stage 2 memory: resuming with the options chosen when this stage began (stage2/memory.json)")
    log(choice.line())
    record = choice.as_dict()
    if parallel.is_main():
        write_json(folder / "memory.json", record)
    return choice.apply(settings), record
