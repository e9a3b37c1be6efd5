"""Stage 1 of conversion, attention transfer (LoLCATs): teach each new mixer to reproduce softmax attention.

The teacher runs frozen with forward hooks on every ``self_attn``: they record what each attention layer
received (the normed hidden states) and what it returned (its output after ``o_proj``). Each student layer
then runs only its attention on the *teacher's* inputs, and the MSE to the teacher's output trains that
layer's new mixer parameters, nothing else (the copied q/k/v/o projections stay frozen, unless
``Stage1Settings.projections`` names some: for mixers without parameters of their own).

All layers share one teacher forward per batch, but each layer is its own problem: its loss reaches only
its own parameters, it has its own AdamW parameter group and its own gradient clipping, so the result equals
training the layers one at a time on the same batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..atomic import atomic_folder
from ..modeling.mixer_base import MixerInputs
from ..modeling.modeling import rotate_queries_and_keys
from ..training import parallel
from ..training.forms import decoder_layers as _decoder_layers
from ..training.forms import fastest_forms
from ..training.runner import NonFiniteLossError
from .checkpoints import (
    latest_step_dir,
    load_tensors,
    prune_step_dirs,
    save_tensors,
    step_dir,
)
from .settings import Stage1Settings


@dataclass
class TransferResult:
    """What stage 1 did: steps, tokens, per-layer MSE at the start and the end, time."""

    steps: int
    tokens: int
    first_loss: dict[int, float] = field(default_factory=dict)  # MSE of the first step
    last_loss: dict[int, float] = field(default_factory=dict)  # MSE at the end (moving average, beta 0.8)
    relative_last: dict[int, float] = field(default_factory=dict)  # MSE / mean(target^2), moving average
    attention_kl_last: dict[int, float] = field(default_factory=dict)  # stage1.attention_kl's term, moving average
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
            "seconds": self.seconds,
            "resumed_from": self.resumed_from,
            "trainable_parameters": self.trainable_parameters,
            "forms": self.forms,
        }


# ----- which parameters stage 1 trains ----------------------------------------------------------------------
def mixer_parameters(
    student: nn.Module, projections: tuple[str, ...] = ()
) -> dict[int, dict[str, nn.Parameter]]:
    """Per layer, by full name: the new mixer parameters (feature maps, gains, gates, mixing weights), plus
    the weights of the attention ``projections`` named (e.g. ``("q_proj", "k_proj")``) when asked."""
    out: dict[int, dict[str, nn.Parameter]] = {}
    for i, layer in enumerate(_decoder_layers(student)):
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
    """Copy saved stage-1 parameters into ``student``; every expected name must be present."""
    expected = {n: p for params in mixer_parameters(student, projections).values() for n, p in params.items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            f"saved mixer parameters do not fit the student (missing {missing[:4]}, extra {extra[:4]})"
        )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name].to(param.dtype))


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

    for i, layer in enumerate(_decoder_layers(teacher)):
        handles.append(layer.self_attn.register_forward_hook(make_hook(i), with_kwargs=True))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_attention_io(
    teacher: nn.Module, input_ids: torch.Tensor
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run the teacher's decoder stack (not its LM head); return every layer's attention input and output."""
    base = getattr(teacher, "model", teacher)
    with capture_attention_io(teacher) as record:
        base(input_ids=input_ids, use_cache=False)
    return dict(record)


def student_attention(
    student: nn.Module,
    layer_idx: int,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    target_log_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One student attention layer on given inputs (q/k/v without a graph unless a projection trains): its output,
    and, given the teacher's log attention weights [B, H, T, T], the mean KL divergence from them to the mixer's
    weights (None without them)."""
    attn = _decoder_layers(student)[layer_idx].self_attn
    projections_train = any(
        p.requires_grad for m in (attn.q_proj, attn.k_proj, attn.v_proj) for p in m.parameters()
    )
    with torch.set_grad_enabled(projections_train and torch.is_grad_enabled()):
        q, k, v = attn.project(hidden, position_embeddings)
    inputs = MixerInputs(hidden_states=hidden)
    out, _ = attn.mixer(q, k, v, inputs)
    kl = None
    if target_log_weights is not None:
        weights = attn.mixer.attention_weights(q, k, inputs)
        if weights is None:
            raise ValueError(
                f"stage 1: layer {layer_idx}: mixer {attn.mixer.name!r} ({attn.mixer.extra_repr()}) has no attention "
                "weights to match; set stage1.attention_kl to 0 or use a mixer whose output is a weighted mean of "
                "the values (linear with the denominator)"
            )
        kl = attention_kl_divergence(target_log_weights, weights)
    # the mixer may compute in fp32 (a bf16 student's chunked delta rule): back to the layer's dtype, as its forward
    return attn.o_proj(out.reshape(*hidden.shape[:-1], -1).to(hidden.dtype)), kl


@torch.no_grad()
def teacher_log_weights(
    teacher: nn.Module, layer_idx: int, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """[B, H, T, T]: log of a Llama-shaped teacher layer's causal softmax attention weights on its captured input,
    from its own q/k projections and the rotary embedding (the same for teacher and student)."""
    attn = _decoder_layers(teacher)[layer_idx].self_attn
    b, t, _ = hidden.shape
    q = attn.q_proj(hidden).view(b, t, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, t, -1, attn.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rotate_queries_and_keys(q, k, cos, sin)
    return softmax_log_weights(q, k)


def softmax_log_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, H, T, T] log of causal softmax(q k^T / sqrt(D)) for q [B, H, T, D] and k [B, Hkv, T, D] (grouped)."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    logits = q.float().view(b, k.shape[1], groups, t, d) @ k.float()[:, :, None].transpose(-1, -2) * d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return logits.masked_fill(~causal, float("-inf")).log_softmax(-1).view(b, h, t, t)


def attention_kl_divergence(log_p: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over batch, heads and queries of KL(p || ``weights``) in nats, both [B, H, T, T] (``log_p`` the
    teacher's log weights); the student's weights are floored at the smallest normal float where p is not 0."""
    p = log_p.exp()
    log_a = weights.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    terms = torch.where(p > 0, p * (log_p - log_a), 0.0)
    return terms.sum(-1).mean()


# ----- the training loop ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, settings: Stage1Settings) -> float:
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


def attention_transfer(
    teacher: nn.Module,
    student: nn.Module,
    blocks: torch.Tensor,
    settings: Stage1Settings,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    keep_checkpoints: int = 1,
    pick_forms: bool = True,
    on_step: Callable[[int, nn.Module], None] | None = None,
    layers: Collection[int] | None = None,
) -> TransferResult:
    """Train every layer's mixer parameters to match the teacher's attention output; resumable.

    ``blocks`` is a ``[N, block_size]`` LongTensor of training tokens. With ``checkpoint_dir`` the mixer
    parameters, the optimizer and the per-layer losses are saved every ``settings.save_every`` steps
    (atomically) and a rerun continues from the newest checkpoint. A NaN/inf loss stops the run with a
    ``NonFiniteLossError`` naming the layer and step, after saving the last good parameters.
    ``pick_forms``: train each mixer in its faster form (see ``fastest_forms``). ``on_step(step, student)``
    runs after every optimizer step (the benchmark measures perplexity there). ``layers``: train only these
    layers (the ones a recipe converts; the others keep the teacher's attention and have nothing to learn).

    Under ``torchrun`` (several processes) each process takes ``batch_size / processes`` blocks of every
    step's batch, the gradients and the logged losses are averaged over the processes, and rank 0 writes the
    checkpoints: the run equals one process on the same batches.
    """
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(
            f"stage 1: need a non-empty [N, block] tensor of token ids, got {tuple(blocks.shape)}"
        )
    groups = mixer_parameters(student, tuple(settings.projections))
    if layers is not None:
        wanted = set(layers)
        groups = {i: params for i, params in groups.items() if i in wanted}
    if not groups or settings.tokens <= 0:
        return TransferResult(steps=0, tokens=0)
    run = _Transfer(teacher, student, groups, settings, blocks.shape[1], checkpoint_dir, keep_checkpoints)
    schedule = batch_schedule(blocks.shape[0], settings.batch_size, run.total, seed)
    share = parallel.local_share(settings.batch_size, "stage1.batch_size")
    mine = slice(parallel.rank() * share, (parallel.rank() + 1) * share)
    began = time.perf_counter()
    student.train()
    with fastest_forms(student, blocks.shape[1], pick_forms) as forms, _progress(run, progress) as bar:
        for step in range(run.start, run.total):
            run.step(step, blocks[schedule[step][mine]].to(run.device))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(**run.postfix())
            if on_step is not None:
                on_step(run.done, student)
            if run.done % settings.save_every == 0 or run.done == run.total:
                run.checkpoint(run.done)
    return run.result(time.perf_counter() - began, forms)


class _Transfer:
    """One stage-1 run in named steps: set up (freeze, optimizer groups, resume), ``step``, ``checkpoint``,
    ``result``."""

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        groups: dict[int, dict[str, nn.Parameter]],
        settings: Stage1Settings,
        block_size: int,
        checkpoint_dir: str | Path | None,
        keep: int,
    ) -> None:
        self.teacher, self.student, self.groups, self.settings = teacher, student, groups, settings
        self.layers = sorted(groups)
        self.projections = tuple(settings.projections)
        self.tokens_per_step = settings.batch_size * block_size
        self.total = max(1, settings.tokens // self.tokens_per_step)
        self.folder = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.keep = keep
        self.device = next(student.parameters()).device
        self.dtype = next(student.parameters()).dtype  # a bfloat16 teacher's activations are cast to it
        self.rotary = getattr(student, "model", student).rotary_emb
        self._freeze()
        self.optimizer = self._optimizer()
        self.start, self.history = 0, {"first_loss": {}, "count": 0}
        if self.folder is not None:
            self.start, self.history = _resume(self.folder, student, self.optimizer, self.total, self.projections)
        self.done = self.start
        self.last: tuple[dict[int, float], dict[int, float], dict[int, float]] = ({}, {}, {})

    def _freeze(self) -> None:
        """Teacher and student frozen but for the parameters stage 1 trains."""
        self.teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        for p in self.student.parameters():
            p.requires_grad_(False)
        for i in self.layers:
            for p in self.groups[i].values():
                p.requires_grad_(True)

    def _optimizer(self) -> torch.optim.Optimizer:
        """AdamW with a group per layer (and one for its projections, at ``projection_lr``)."""
        settings = self.settings
        param_groups = []
        for i in self.layers:
            mixer = [p for n, p in self.groups[i].items() if ".mixer." in n]
            projs = [p for n, p in self.groups[i].items() if ".mixer." not in n]
            if mixer:
                param_groups.append({"params": mixer, "layer": i, "lr_scale": 1.0})
            if projs:
                param_groups.append({"params": projs, "layer": i, "lr_scale": settings.projection_lr / settings.lr})
        return torch.optim.AdamW(param_groups, lr=settings.lr, weight_decay=0.0)

    def step(self, step: int, ids: torch.Tensor) -> None:
        """One optimizer step on this process's blocks ``ids``: every layer's loss, backward, gradients averaged
        over the processes, per-layer clipping, AdamW."""
        settings = self.settings
        io = teacher_attention_io(self.teacher, ids)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        position_embeddings = self.rotary(io[0][0].to(self.dtype), position_ids=positions)
        self.optimizer.zero_grad(set_to_none=True)
        losses: dict[int, float] = {}
        relative: dict[int, float] = {}
        kls: dict[int, float] = {}
        for i in self.layers:
            hidden, target = io[i]
            log_p = teacher_log_weights(self.teacher, i, hidden, position_embeddings) if settings.attention_kl else None
            pred, kl = student_attention(self.student, i, hidden.to(self.dtype), position_embeddings, log_p)
            mse = torch.nn.functional.mse_loss(pred.float(), target.float())
            # the batch's values: averaged over the processes (each holds an equal share of the batch)
            mse_value, power, kl_value = _batch_means(mse, target.float().pow(2).mean(), kl)
            # the KL in units of the output MSE relative to the target's power: one weight for every layer
            loss = mse if kl is None else mse + settings.attention_kl * power * kl
            value = mse_value if kl is None else mse_value + settings.attention_kl * power * kl_value
            if not math.isfinite(value):
                self._stop(step, i, value)
            loss.backward()
            losses[i] = mse_value
            relative[i] = losses[i] / max(power, 1e-12)
            if kl is not None:
                kls[i] = kl_value
        parallel.average([p.grad for i in self.layers for p in self.groups[i].values() if p.grad is not None])
        for i in self.layers:  # clip each layer on its own: layers stay independent problems
            torch.nn.utils.clip_grad_norm_(list(self.groups[i].values()), settings.max_grad_norm)
        lr = lr_at(step, self.total, settings)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        self.optimizer.step()
        _accumulate(self.history, losses, relative, kls)
        self.last = (losses, relative, kls)
        self.done = step + 1

    def _stop(self, step: int, layer: int, value: float) -> None:
        """A non-finite loss: save the last good parameters (those of ``step``), then raise."""
        self.checkpoint(step)
        where = f" (last good checkpoint: step {step} in {self.folder})" if self.folder is not None else ""
        raise NonFiniteLossError(
            f"stage 1: layer {layer}: attention-transfer loss is {value} at step {step}{where}; "
            "lower stage1.lr or check the mixer spec of this layer"
        )

    def checkpoint(self, step: int) -> None:
        """Save the resumable state at ``step`` (rank 0 writes; the others wait)."""
        if self.folder is None:
            return
        if parallel.is_main():
            _save(self.folder, step, self.student, self.optimizer, self.history, self.keep, self.projections)
        parallel.barrier()

    def postfix(self) -> dict[str, str]:
        """The progress bar's numbers after the last step."""
        losses, relative, kls = self.last
        extra = {"kl": f"{_mean(kls):.3f}"} if kls else {}
        return {"mse": f"{sum(losses.values()) / len(losses):.3g}", "rel": f"{_mean(relative):.3f}", **extra}

    def result(self, seconds: float, forms: dict[str, str]) -> TransferResult:
        """The student frozen in eval mode, and what the run did."""
        self.student.eval()
        for p in self.student.parameters():
            p.requires_grad_(False)
        history = self.history
        return TransferResult(
            steps=self.done,
            tokens=self.done * self.tokens_per_step,
            first_loss={int(k): v for k, v in history["first_loss"].items()},
            last_loss={int(k): v for k, v in history.get("last_loss", {}).items()},
            relative_last={int(k): v for k, v in history.get("last_rel", {}).items()},
            attention_kl_last={int(k): v for k, v in history.get("last_kl", {}).items()},
            seconds=seconds,
            resumed_from=self.start,
            trainable_parameters=sum(p.numel() for i in self.layers for p in self.groups[i].values()),
            forms=forms,
        )


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


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / max(len(values), 1)


def _accumulate(
    history: dict[str, Any],
    losses: dict[int, float],
    relative: dict[int, float],
    kls: dict[int, float],
    beta: float = 0.8,
) -> None:
    """First loss per layer, and exponential moving averages of the loss, the relative loss and the KL term."""
    for key, values in (("last_loss", losses), ("last_rel", relative), ("last_kl", kls)):
        smoothed = history.setdefault(key, {})
        for i, value in values.items():
            old = smoothed.get(str(i))
            smoothed[str(i)] = value if old is None else beta * old + (1 - beta) * value
    for i, value in losses.items():
        history["first_loss"].setdefault(str(i), value)
    history["count"] = history.get("count", 0) + 1


@contextlib.contextmanager
def _progress(run: _Transfer, enabled: bool) -> Iterator[Any]:
    """A progress bar on the main process (None when off)."""
    if not enabled or not parallel.is_main():
        yield None
        return
    with tqdm(total=run.total, initial=run.start, desc="stage 1 attention transfer", unit="step",
              dynamic_ncols=True) as bar:
        yield bar


def _save(
    folder: Path,
    step: int,
    student: nn.Module,
    optimizer: torch.optim.Optimizer,
    history: dict[str, Any],
    keep: int,
    projections: tuple[str, ...],
) -> None:
    with atomic_folder(step_dir(folder, step)) as tmp:
        save_tensors(tmp / "mixer.safetensors", mixer_state_dict(student, projections))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, "history": history}, indent=1))
    prune_step_dirs(folder, keep)


def _resume(
    folder: Path,
    student: nn.Module,
    optimizer: torch.optim.Optimizer,
    total: int,
    projections: tuple[str, ...],
) -> tuple[int, dict[str, Any]]:
    latest = latest_step_dir(folder)
    if latest is None:
        return 0, {"first_loss": {}, "count": 0}
    state = json.loads((latest / "state.json").read_text())
    step = int(state["step"])
    if step > total:
        raise ValueError(f"stage 1 checkpoint {latest} is at step {step}, beyond this run's {total} steps")
    load_mixer_state(student, load_tensors(latest / "mixer.safetensors"), projections)
    optimizer.load_state_dict(torch.load(latest / "optimizer.pt", weights_only=True))
    return step, state["history"]
