"""Memory and time per token of the two conversion stages, measured here, and the arithmetic for larger teachers.

Measured (CPU, fp32): for each size (``smollm2-135m``: the embedded teacher; ``tiny``: a random Llama of hidden
256, 4 layers, SmolLM2's vocabulary of 49,152), a fresh process loads the teacher, converts it with the recipe's
attention (``gdn`` by default), then runs a few optimizer steps of one stage with the recipe's settings on random
token ids (what they are does not change the cost): stage 1, attention transfer (``attention_transfer``), or
stage 2, LoRA + KL to the teacher through transformers' Trainer (``finetune``). Time per token is the median
step (the first step, with its one-off set-up, left out) over the step's tokens; memory is the peak resident set
of the stage (the kernel's high-water mark, reset after loading) above the resident set before it, beside the
resident set of the loaded teacher and student.

Computed (not run): bytes on one GPU for Qwen3-0.6B / 1.7B / 8B and Llama-3.1-8B from their published shapes,
with the formulas in ``docs/conversion.md``: frozen weights in bf16, trainable parameters with fp32 master
weights, gradients and Adam moments (16 bytes each), saved activations per token at the block size, and the
logits of the KL term.

On a GPU (``--device cuda``): random-init teachers of Qwen3-0.6B's and Qwen3-1.7B's published shapes (their
``Qwen3Config``; memory and time per token do not depend on the weights) in bf16, both stages at the GPU block
size (batch 1), a fresh process per stage: the peak of ``torch.cuda.max_memory_allocated`` (reset after loading
both models) and the median step (synchronized) over its tokens, beside the formulas' bytes for that shape.

    nice .venv/bin/python benchmarks/conversion_scale.py --threads 1
    .venv/bin/python benchmarks/conversion_scale.py --quick               # smoke run: tiny only, 2 steps
    python benchmarks/conversion_scale.py --device cuda                   # writes conversion_scale_cuda.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from results_file import RESULTS, add_out_argument, run_record, write_results
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from hf_recattn.conversion.attention_transfer import attention_transfer
from hf_recattn.conversion.from_teacher import student_from_teacher
from hf_recattn.conversion.memory import LOSS_COPIES
from hf_recattn.conversion.pipeline import STAGES as PIPELINE_STAGES
from hf_recattn.conversion.recipe import (
    check_against_teacher,
    find_recipe,
    load_recipe,
    read_recipe_yaml,
    recipe_from_dict,
)
from hf_recattn.conversion.stage1 import converted_layers
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.embedded_teachers import embedded_gguf_path, gguf_tokenizer
from hf_recattn.heap import DEFAULT_MMAP_THRESHOLD, chosen_threshold, fix_mmap_threshold
from hf_recattn.heap import OPTION as HEAP_OPTION
from hf_recattn.training.attention_objective import mixer_parameters
from hf_recattn.training.distill import finetune
from hf_recattn.training.fused_loss import use_liger

SIZES = ("tiny", "smollm2-135m")
STAGES = ("stage1", "stage2")
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)
MIB = 2**20
GB = 1e9
GPU_BYTES = 80 * GB
#: published shapes (the models' config.json): layers, hidden, intermediate, heads, KV heads, head dim, vocab, tied
ARCHS: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "Qwen3-0.6B": (28, 1024, 3072, 16, 8, 128, 151936, True),
    "Qwen3-1.7B": (28, 2048, 6144, 16, 8, 128, 151936, True),
    "Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, False),
    "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128, 128256, False),
}
BF16, FP32, ADAM = 2, 4, 16  # bytes per element; per trainable parameter: fp32 weight + grad + two moments
#: SmolLM2-135M's published shape, measured as a Qwen3-shaped teacher beside the Qwen3 models
SHAPES = {"SmolLM2-135M": (30, 576, 1536, 9, 3, 64, 49152, True), **ARCHS}
CPU_SHAPES = ("SmolLM2-135M", "Qwen3-0.6B", "Qwen3-1.7B")


# ----- measuring one stage in this process ------------------------------------------------------------------
def _rss(field: str) -> int:
    """VmRSS / VmHWM of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: ``echo 5 > /proc/self/clear_refs``); False when it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _clock(device: str) -> float:
    """``time.perf_counter`` once the device's queued work is done."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class _StepTimes(TrainerCallback):
    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.begin = 0.0
        self.seconds: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin = _clock(self.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(_clock(self.device) - self.begin)


def _teacher(size: str) -> torch.nn.Module:
    if size == "tiny":
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    return load_teacher("embedded")[0]


def _stage_settings(recipe_name: str, stage: str, steps: int, **overrides: Any) -> tuple[Any, int]:
    """The recipe's quick-budget settings of ``stage`` (``overrides`` win) for ``steps`` steps; tokens per step."""
    recipe = load_recipe(recipe_name, "quick")
    settings = replace(recipe.stage1 if stage == "stage1" else recipe.stage2, **overrides)
    per_step = settings.batch_size * settings.block_size * getattr(settings, "grad_accum", 1)
    never = {"save_every": 10**6} if stage == "stage1" else {"save_steps": 10**6}
    return replace(settings, tokens=steps * per_step, **never), per_step


def _shape(config: Any) -> list:
    c = config
    return [c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.vocab_size,
            bool(c.tie_word_embeddings)]


def _run_stage(teacher: torch.nn.Module, student: torch.nn.Module, stage: str, settings: Any, steps: int,
               device: str = "cpu", layers: list[int] | None = None) -> tuple[list[float], int]:
    """``steps`` optimizer steps of one stage on random token ids: the timed steps' seconds (the first left out,
    synchronized on a GPU) and the number of trained parameters (stage 1: of the converted ``layers``)."""
    blocks = torch.randint(0, teacher.config.vocab_size, (settings.tokens // settings.block_size, settings.block_size),
                           generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        if stage == "stage1":
            groups = mixer_parameters(student, tuple(settings.projections))
            trainable = sum(p.numel() for i, group in groups.items() if layers is None or i in layers
                            for p in group.values())
            marks: list[float] = []
            attention_transfer(teacher, student, blocks, settings, checkpoint_dir=None, progress=False,
                               layers=layers, on_step=lambda step, model: marks.append(_clock(device)))
            return [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)], trainable
        timer = _StepTimes(device)
        _, result = finetune(teacher, student, blocks, settings, tmp, progress=False, callbacks=[timer])
        return timer.seconds[1:], result.trainable_parameters


def measure(size: str, stage: str, recipe_name: str, steps: int) -> dict[str, Any]:
    """One stage of one size, ``steps`` optimizer steps: seconds per step, tokens per step, memory."""
    recipe = load_recipe(recipe_name, "quick")
    teacher = _teacher(size).requires_grad_(False)
    student = build_student(teacher, recipe)
    settings, per_step = _stage_settings(recipe_name, stage, steps)
    counts = {"shape": _shape(teacher.config), "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
              "student_parameters": sum(p.numel() for p in student.parameters())}
    loaded = _rss("VmRSS")
    peak_reset = _reset_peak()
    seconds, counts["trainable_parameters"] = _run_stage(teacher, student, stage, settings, steps,
                                                         layers=converted_layers(recipe, teacher.config))
    peak = _rss("VmHWM") if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"size": size, "stage": stage, "tokens_per_step": per_step, "block_size": settings.block_size,
            "batch_size": settings.batch_size, "step_seconds": seconds, "loaded_rss": loaded, "peak_rss": peak,
            "peak_reset": peak_reset, **counts}


def qwen3_teacher(shape: tuple, device: str) -> torch.nn.Module:
    """A random-init Qwen3 teacher of ``shape`` (as in ``ARCHS``) in bf16 on ``device``."""
    layers, hidden, inter, heads, kv, head_dim, vocab, tied = shape
    config = Qwen3Config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(device):  # built in bf16: no float32 copy of the weights on the way
        return Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)


def measure_device(name: str, shape: tuple, stage: str, recipe_data: dict[str, Any], steps: int, device: str,
                   loss_kernel: str) -> dict[str, Any]:
    """One stage of a random-init bf16 Qwen3 teacher of ``shape`` on ``device`` with its student in bf16, the
    recipe's ``scale`` budget (``recipe_data``, stage 2 on ``loss_kernel``): seconds per step and, on a GPU, the
    bytes allocated after loading and the peak allocated during the stage."""
    data = copy.deepcopy(recipe_data)
    data["budgets"]["scale"]["stage2"]["loss_kernel"] = loss_kernel
    recipe = recipe_from_dict(data, "scale", source=str(data.get("name", "recipe")))
    teacher = qwen3_teacher(shape, device)
    with torch.device(device):
        student = build_student(teacher, recipe)
    where = {str(p.device.type) for model in (teacher, student) for p in model.parameters()}
    if where != {device}:
        raise RuntimeError(f"{name} {stage}: the models are on {sorted(where)}, not {device}")
    trained, teacher_layers = stage1_trained(student, recipe, teacher.config)
    settings, s2 = (recipe.stage1 if stage == "stage1" else recipe.stage2), recipe.stage2
    liger = stage == "stage2" and use_liger(loss_kernel, "stage2.loss_kernel", student, teacher, s2.loss)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loaded = torch.cuda.memory_allocated() if cuda else None
    seconds, trainable = _run_stage(teacher, student, stage, settings, steps, device,
                                    converted_layers(recipe, teacher.config))
    return {"size": name, "stage": stage, "device": device, "dtype": "bfloat16", "tokens_per_step": settings.block_size,
            "block_size": settings.block_size, "batch_size": 1, "step_seconds": seconds, "shape": list(shape),
            "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
            "student_parameters": sum(p.numel() for p in student.parameters()), "trainable_parameters": trainable,
            "stage1_trainable": trained, "stage1_layers": teacher_layers, "lora_r": s2.lora.r,
            "loss_chunk_size": s2.loss_chunk_size, "gradient_checkpointing": bool(s2.gradient_checkpointing),
            "loss_kernel": ("liger" if liger else "torch") if stage == "stage2" else None,
            "loaded_bytes": loaded, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}


# ----- Qwen3-shaped teachers on the CPU: each stage, and the whole convert --------------------------------
def scale_recipe(name: str, steps: int, block: int, chunk: int | None) -> dict[str, Any]:
    """The recipe's YAML with a budget ``scale``: its quick budget at ``block`` tokens, batch 1 and ``steps``
    optimizer steps per stage, stage 2 with ``loss_chunk_size: chunk`` and gradient checkpointing (``chunk`` None:
    neither set, as the recipe has them, so that stage 2 chooses them)."""
    data = read_recipe_yaml(find_recipe(name))
    scale = copy.deepcopy((data.get("budgets") or {}).get("quick") or {})
    one = {"block_size": block, "batch_size": 1, "tokens": steps * block}
    scale["stage1"] = {**scale.get("stage1", {}), **one}
    scale["stage2"] = {**scale.get("stage2", {}), **one, "grad_accum": 1}
    if chunk is not None:
        scale["stage2"].update(loss_chunk_size=chunk, gradient_checkpointing=True)
    data["budgets"] = {**(data.get("budgets") or {}), "scale": scale}
    return data


def build_student(teacher: torch.nn.Module, recipe: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The student as ``hf-recattn convert`` builds it: the recipe's attention on the layers it selects, the
    teacher's weights copied (in ``dtype``, by default the teacher's)."""
    return student_from_teacher(teacher, check_against_teacher(recipe, teacher.config), dtype)


def stage1_trained(student: torch.nn.Module, recipe: Any, teacher_config: Any) -> tuple[int, int]:
    """The parameters stage 1 trains (the converted layers' mixers and projections) and the teacher layers it runs."""
    layers = converted_layers(recipe, teacher_config)
    groups = mixer_parameters(student, tuple(recipe.stage1.projections))
    chosen = set(groups) if layers is None else set(layers) & set(groups)
    return sum(p.numel() for i in chosen for p in groups[i].values()), max(chosen) + 1


def shape_run(m: dict[str, Any]) -> Run:
    """The formulas' ``Run`` of a measured Qwen3-shaped CPU stage: bf16 teacher, fp32 student (12 optimizer bytes
    per trained parameter: gradient and two moments), the recipe's settings as measured."""
    return Run(m["block_size"], BF16, FP32, 3 * FP32, m["stage1_layers"], m["stage1_trainable"], m["lora_r"],
               m["loss_chunk_size"], m["gradient_checkpointing"], m.get("checkpoint_kept", 0))


def checkpoint_kept(student: torch.nn.Module, block: int) -> int:
    """Numbers per token that stage 2's gradient checkpointing keeps in ``student`` besides each layer's input: the
    chunked delta rule (its torch form, the CPU's) recomputes its groups of chunks under a checkpoint of its own,
    and that inner checkpoint holds its inputs (q and k after the feature map, v) until the backward, in every
    layer (measured: 56 MiB per layer of Qwen3-0.6B's shape at block 2048). Counted where the chunked form can
    run (``block`` above the mixer's chunk), as it did in the measured stages."""
    kept = 0
    for layer in student.model.layers:
        mixer = layer.self_attn.mixer
        if mixer.name == "delta" and block > mixer.chunk_size:
            shape, width = mixer.shape, mixer.feature_map.out_dim
            kept += shape.num_heads * width + mixer.steps * shape.num_kv_heads * (width + shape.head_dim)
    return kept


def shape_prediction(m: dict[str, Any]) -> int:
    """A measured Qwen3-shaped CPU stage's bytes by the formulas: both models' weights and the stage's terms."""
    state, local = stage_bytes(estimate(tuple(m["shape"]), shape_run(m)), m["stage"])
    return state + local


def measure_shape(name: str, stage: str, recipe_data: dict[str, Any], steps: int) -> dict[str, Any]:
    """One stage of a random-init bf16 Qwen3 teacher of ``SHAPES[name]`` with its student in fp32 (as
    ``hf-recattn convert --teacher-dtype bfloat16`` trains it), the recipe's ``scale`` budget: the resident set
    before the models (the baseline), with them (loaded), its peak during the stage, seconds per step."""
    baseline = _rss("VmRSS")
    recipe = recipe_from_dict(copy.deepcopy(recipe_data), "scale", source=f"{recipe_data.get('name', 'recipe')}")
    teacher = qwen3_teacher(SHAPES[name], "cpu")
    build_reset = _reset_peak()
    student = build_student(teacher, recipe, torch.float32)  # trained in float32 whatever the teacher's dtype
    build_peak = _rss("VmHWM") if build_reset else None
    trained, teacher_layers = stage1_trained(student, recipe, teacher.config)
    settings = recipe.stage1 if stage == "stage1" else recipe.stage2
    loaded = _rss("VmRSS")
    peak_reset = _reset_peak()
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds, trainable = _run_stage(teacher, student, stage, settings, steps, layers=converted_layers(
        recipe, teacher.config))
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak = _rss("VmHWM") if peak_reset else after.ru_maxrss * 1024
    s2 = recipe.stage2
    return {"size": name, "stage": stage, "device": "cpu", "dtype": "bfloat16 teacher, float32 student",
            "tokens_per_step": settings.block_size, "block_size": settings.block_size, "batch_size": 1,
            "step_seconds": seconds, "shape": list(SHAPES[name]),
            "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
            "student_parameters": sum(p.numel() for p in student.parameters()), "trainable_parameters": trainable,
            "stage1_trainable": trained, "stage1_layers": teacher_layers, "lora_r": s2.lora.r,
            "loss_chunk_size": s2.loss_chunk_size, "gradient_checkpointing": bool(s2.gradient_checkpointing),
            "checkpoint_kept": checkpoint_kept(student, s2.block_size), "baseline_rss": baseline,
            "loaded_rss": loaded, "peak_rss": peak, "peak_reset": peak_reset,
            "build_peak_rss": build_peak, "process_peak_rss": after.ru_maxrss * 1024,
            "stage_user_seconds": after.ru_utime - before.ru_utime,
            "stage_system_seconds": after.ru_stime - before.ru_stime,
            "stage_minor_faults": after.ru_minflt - before.ru_minflt}


def save_shaped_teacher(name: str, folder: Path) -> None:
    """A random-init bf16 Qwen3 teacher of ``SHAPES[name]`` saved to ``folder`` (safetensors) with the embedded
    SmolLM2 tokenizer (its 49,152 tokens fit every shape's vocabulary)."""
    qwen3_teacher(SHAPES[name], "cpu").save_pretrained(folder)
    gguf_tokenizer(embedded_gguf_path()).save_pretrained(folder)


class _PeakByStage:
    """The resident set of a running process sampled every ``every`` seconds, the peak kept per pipeline stage
    (the ``[n/N] ...`` lines of ``hf-recattn convert``'s log)."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every = pid, every
        self.stage = "start"
        self.peaks: dict[str, int] = {}
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def line(self, text: str) -> None:
        step = re.match(r"\[(\d+)/\d+\] ", text)
        if step:
            self.stage = PIPELINE_STAGES[int(step.group(1)) - 1]

    def _sample(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
            except OSError:
                return
            rss = int(fields["VmRSS"].split()[0]) * 1024 if "VmRSS" in fields else 0
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            time.sleep(self.every)


def measure_convert(name: str, recipe_data: dict[str, Any], threads: int, heap: int | None,
                    evaluate: bool = True) -> dict[str, Any]:
    """The whole ``hf-recattn convert`` (both stages and, if ``evaluate``, the evaluation) of a random-init bf16
    Qwen3 teacher of ``SHAPES[name]`` saved as safetensors, in a fresh process (``heap``: its
    ``--malloc-mmap-threshold``, None for the command's default): its peak resident set (the kernel's), the peak
    sampled in each pipeline stage and stage 2's memory options (``stage2/memory.json``)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="conversion-scale-") as tmp:
        teacher, recipe = Path(tmp) / "teacher", Path(tmp) / "recipe.yaml"
        subprocess.run([sys.executable, __file__, "--save-teacher", name, str(teacher)], check=True, env=env)
        recipe.write_text(yaml.safe_dump(recipe_data, sort_keys=False))
        command = [sys.executable, "-m", "hf_recattn.cli", "convert", "--teacher", str(teacher), "--teacher-dtype",
                   "bfloat16", "--recipe", str(recipe), "--budget", "scale", "--output", str(Path(tmp) / "run"),
                   "--no-progress", "--threads", str(threads)] + ([HEAP_OPTION, str(heap)] if heap is not None else [])
        command += [] if evaluate else ["--no-eval"]
        began = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        peaks, log = _PeakByStage(child.pid), []
        for text in child.stdout:
            peaks.line(text)
            log.append(text.rstrip())
        _, status, usage = os.wait4(child.pid, 0)
        if status != 0:
            raise RuntimeError(f"{name} convert failed:\n" + "\n".join(log[-40:]))
        memory = json.loads((Path(tmp) / "run" / "stage2" / "memory.json").read_text())
    def shown(text: str) -> str:  # the temporary folder's paths named by their role
        return text.replace(str(teacher), "TEACHER").replace(str(recipe), "RECIPE").replace(tmp, "OUT")

    return {"size": name, "command": shown(" ".join(["hf-recattn", *command[3:]])), "shape": list(SHAPES[name]),
            "seconds": time.perf_counter() - began, "peak_rss": usage.ru_maxrss * 1024,
            "stage_peak_rss": dict(peaks.peaks), "evaluated": evaluate, "stage2_memory": memory,
            "log": [shown(line) for line in log if line.startswith(("[", "stage"))]}


# ----- the arithmetic for larger teachers ----------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """How a conversion runs, as far as its memory goes: the block (batch 1), bytes per weight and activation of
    the teacher and the student, the optimizer's bytes per trained parameter beside its weight, stage 1's teacher
    layers and trained parameters, stage 2's LoRA rank, ``loss_chunk_size`` and ``gradient_checkpointing``, and
    what checkpointed layers keep besides their inputs (``checkpoint_kept``, see ``checkpoint_kept``)."""

    block: int
    teacher_bytes: int = BF16
    student_bytes: int = BF16
    state_bytes: int = ADAM  # fp32 master weight, gradient and two moments; 12 for an fp32 student (no master)
    stage1_layers: int | None = None  # the last converted layer + 1 (stage 1 stops the teacher there); None: all
    stage1_trained: int | None = None  # None: the q / k projections (the mixers' own parameters left out)
    lora_r: int = 8
    loss_chunk: int | None = None
    checkpointing: bool = False
    checkpoint_kept: int = 0  # numbers per token that checkpointing keeps in all layers besides their inputs


#: [n_q, T, T] fp32 matrices alive while ``fastest_forms`` times the delta rule's parallel form on one layer's shape
#: (measured: 0.9 GB for 9 heads at T = 2048), before each stage trains
FORM_TIMING_COPIES = 6
#: one converted layer's attention in stage 1, forward and backward: its input and output, q / k / v and their
#: feature-mapped copies, and their gradients, in units of (2h + 4 n_q d + 2 n_kv d) activations per token
STAGE1_LAYER_COPIES = 3


def parameters(shape: tuple) -> dict[str, int]:
    """Parameter counts from a shape: all, q + k projections, LoRA r=1 on q/k/v/o."""
    layers, hidden, inter, heads, kv, head_dim, vocab, tied = shape
    q_k = hidden * (heads + kv) * head_dim
    per_layer = q_k + hidden * kv * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    lora = 4 * hidden + 2 * heads * head_dim + 2 * kv * head_dim  # (in + out) of q, k, v, o
    return {"all": vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden, "q_k": layers * q_k,
            "lora_r1": layers * lora}


def estimate(shape: tuple, run: Run) -> dict[str, int]:
    """Bytes of each term at batch 1 (formulas in docs/conversion.md)."""
    layers, hidden, inter, heads, kv, head_dim, vocab, _ = shape
    count, tokens, a = parameters(shape), run.block, run.student_bytes
    per_layer_token = 6 * hidden + 2 * heads * head_dim + 2 * kv * head_dim + 4 * inter  # saved per layer
    trained = count["q_k"] if run.stage1_trained is None else run.stage1_trained
    kept = hidden * layers + run.checkpoint_kept + per_layer_token if run.checkpointing else per_layer_token * layers
    return {
        "parameters": count["all"],
        "teacher_weights": run.teacher_bytes * count["all"],
        "student_weights": run.student_bytes * count["all"],
        "stage1_trainable": trained,
        "stage1_optimizer": run.state_bytes * trained,
        # the teacher's attention input and output of every layer it runs
        "captured": (run.stage1_layers or layers) * 2 * hidden * run.teacher_bytes * tokens,
        "one_layer": STAGE1_LAYER_COPIES * (2 * hidden + 4 * heads * head_dim + 2 * kv * head_dim) * a * tokens,
        "lora_parameters": run.lora_r * count["lora_r1"],
        "lora_optimizer": ADAM * run.lora_r * count["lora_r1"],  # LoRA weights are not among the parameters
        "activations": kept * a * tokens,  # every layer's saved tensors, or with checkpointing the layer inputs + one
        "final_hidden": hidden * (a + run.teacher_bytes) * tokens,  # both models' last hidden states (the loss's)
        "loss": LOSS_COPIES * vocab * FP32 * (run.loss_chunk or tokens),  # one chunk's logits, or the block's
        "form_timing": FORM_TIMING_COPIES * heads * tokens * tokens * FP32,  # transient, before training
    }


def stage_bytes(e: dict[str, int], stage: str) -> tuple[int, int]:
    """A stage's bytes by the formulas: (weights + optimizer state, which FSDP / ZeRO-3 shards; what every GPU
    keeps: activations and logits)."""
    weights, timing = e["teacher_weights"] + e["student_weights"], e["form_timing"]
    if stage == "stage1":
        return weights + e["stage1_optimizer"], max(timing, e["captured"] + e["one_layer"])
    local = max(timing, e["activations"] + e["final_hidden"] + e["loss"])
    if stage == "full":  # every weight trained
        return weights + ADAM * e["parameters"], local
    return weights + e["lora_optimizer"], local


def cpu_prediction(m: dict[str, Any]) -> int:
    """What a measured fp32 stage should add to the loaded process by the formulas (the stage's terms, without
    the two models' weights, which the process held before)."""
    e = estimate(tuple(m["shape"]), Run(m["block_size"] * m["batch_size"], FP32, FP32, 3 * FP32))
    state, local = stage_bytes(e, m["stage"])
    return state + local - e["teacher_weights"] - e["student_weights"]


def gpu_estimate(name: str, block: int, shape: tuple | None = None, **options: Any) -> dict[str, Any]:
    """Bytes per stage on one GPU, both models in bf16: ``*_state`` is what FSDP / ZeRO-3 shards, ``*_local`` stays
    on every GPU (``shape``: the model's, by default ``ARCHS[name]``; ``options``: ``Run``'s stage-2 options)."""
    e = estimate(shape or ARCHS[name], Run(block, **options))
    out = {"model": name, "block_size": block, **e, "weights_bf16": e["teacher_weights"],
           "activations_per_token": e["activations"] // block, "loss_per_token": e["loss"] // block}
    for stage in ("stage1", "stage2", "full"):
        out[f"{stage}_state"], out[f"{stage}_local"] = stage_bytes(e, stage)
    return out


def computed_table(block: int, chunk: int) -> list[dict[str, Any]]:
    """Each model of ``ARCHS`` on one GPU: stage 2 with the defaults and with ``loss_chunk_size`` + checkpointing."""
    return [{"model": name, "defaults": gpu_estimate(name, block),
             "scale": gpu_estimate(name, block, loss_chunk=chunk, checkpointing=True)} for name in ARCHS]


# ----- the tables -------------------------------------------------------------------------------------------
def _fits(e: dict[str, Any], part: str) -> str:
    """``X GB (fits)`` on one GPU, else the GPUs FSDP / ZeRO-3 needs: the state shards, the rest stays per GPU."""
    state, local = e[f"{part}_state"], e[f"{part}_local"]
    if state + local <= GPU_BYTES:
        return f"{(state + local) / GB:.1f} (fits)"
    return f"{(state + local) / GB:.0f} (shard: >= {int(-(-state // (GPU_BYTES - local)))} GPUs)"


def gpu_prediction(m: dict[str, Any]) -> int:
    """What a stage measured on a GPU should peak at by the formulas: its state and its per-GPU bytes (stage 2 with
    the options it ran with: the defaults where the results do not say)."""
    options = {"loss_chunk": m.get("loss_chunk_size"), "checkpointing": bool(m.get("gradient_checkpointing")),
               "stage1_layers": m.get("stage1_layers"), "stage1_trained": m.get("stage1_trainable")}
    e = gpu_estimate(m["size"], m["block_size"], tuple(m["shape"]), **options)
    return e[f"{m['stage']}_state"] + e[f"{m['stage']}_local"]


def _ms_per_token(m: dict[str, Any]) -> float:
    return 1e3 * statistics.median(m["step_seconds"]) / m["tokens_per_step"]


def render_device(results: dict) -> str:
    """The table of a ``--device cuda`` run: memory and time per token of each stage beside the formulas."""
    rows = ["| teacher (random init, bf16) | parameters | stage | tokens / step | ms / token | loaded GB | peak GB "
            "| formulas GB | peak / formulas |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in results["measured"]:
        predicted = gpu_prediction(m)
        stage = f"{m['stage']} ({m['loss_kernel']} loss)" if m.get("loss_kernel") else m["stage"]
        rows.append(f"| {m['size']} | {m['teacher_parameters'] / 1e9:.2f}B | {stage} | {m['tokens_per_step']} | "
                    f"{_ms_per_token(m):.3f} | {m['loaded_bytes'] / GB:.2f} | {m['peak_bytes'] / GB:.2f} | "
                    f"{predicted / GB:.2f} | {m['peak_bytes'] / predicted:.2f} |")
    rows += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(rows)


def _heap(row: dict[str, Any]) -> str:
    threshold = row.get("malloc_mmap_threshold")
    return f"mmap from {threshold / MIB:g} MiB" if threshold else "glibc default"


def _per_step(m: dict[str, Any]) -> tuple[str, str]:
    """A CPU stage's median timed step and its system (kernel) CPU seconds per optimizer step, as shown; "-" where
    the run had no timed step or did not record them."""
    timed = f"{statistics.median(m['step_seconds']):.0f}" if m["step_seconds"] else "-"
    system = m.get("stage_system_seconds")
    return timed, "-" if system is None else f"{system / (len(m['step_seconds']) + 1):.1f}"


def render_shapes(results: dict) -> str:
    """The table of a ``--shapes`` / ``--convert`` run: each stage's resident set beside the formulas, then the
    whole conversions."""
    rows = ["| teacher shape (random init) | parameters | heap | stage | s / step | system s / step | baseline MiB "
            "| loaded MiB | stage peak MiB | peak above baseline MiB | formulas MiB | measured / formulas |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in results["measured"]:
        above, predicted = m["peak_rss"] - m["baseline_rss"], shape_prediction(m)
        timed, system = _per_step(m)
        rows.append(f"| {m['size']} | {m['teacher_parameters'] / 1e9:.3f}B | {_heap(m)} | {m['stage']} | {timed} | "
                    f"{system} | {m['baseline_rss'] / MIB:.0f} | {m['loaded_rss'] / MIB:.0f} | "
                    f"{m['peak_rss'] / MIB:.0f} | {above / MIB:.0f} | {predicted / MIB:.0f} | "
                    f"{above / predicted:.2f} |")
    if results.get("convert"):
        names = list(PIPELINE_STAGES)
        rows += ["", "| whole `hf-recattn convert` | heap | stage 2 memory options | steps per stage | "
                 + " | ".join(f"{n} MiB" for n in names) + " | peak RSS MiB | minutes |",
                 "|---|---|---|---:|" + "---:|" * (len(names) + 2)]
        for c in results["convert"]:
            peaks = " | ".join(_stage_peak(c, n) for n in names)
            rows.append(f"| {c['size']} | {_heap(c)} | {_memory_options(c)} | {c.get('steps', 2)} | {peaks} | "
                        f"{c['peak_rss'] / MIB:.0f} | {c['seconds'] / 60:.0f} |")
    rows += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(rows)


def _stage_peak(row: dict[str, Any], stage: str) -> str:
    """A whole convert's peak in one pipeline stage, MiB ("-" for an evaluation the run left out)."""
    if stage == "evaluation" and not row.get("evaluated", True):
        return "- (--no-eval)"
    return f"{row['stage_peak_rss'].get(stage, 0) / MIB:.0f}"


def _memory_options(row: dict[str, Any]) -> str:
    """How a whole convert's stage 2 ran: the options the recipe set, or those stage 2 chose where it left them."""
    memory = row.get("stage2_memory")
    if memory is None:  # the rows measured before stage 2 chose them: the scale budget set both
        return "set: loss_chunk_size 256, checkpointing"
    options = [f"loss_chunk_size {memory['loss_chunk_size']}" if memory["loss_chunk_size"] else None,
               "checkpointing" if memory["gradient_checkpointing"] else None]
    shown = ", ".join(option for option in options if option) or "both off"
    return f"{'unset, chosen' if row.get('memory_options') == 'unset' else 'set'}: {shown}"


def render_computed(computed: list[dict[str, Any]], chunk: int) -> list[str]:
    """The computed table: each model's stages on one GPU, stage 2 with the defaults and with the options."""
    rows = ["| teacher (computed, not run) | parameters | weights bf16 GB | stage 1 GB | stage 2 LoRA GB, defaults | "
            f"stage 2 LoRA GB, loss_chunk_size {chunk} + checkpointing | activations MB / token, defaults / "
            "checkpointing | loss MB / token, whole block / chunked | stage 2 every weight GB, chunked + "
            "checkpointing |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in computed:
        plain, e = row["defaults"], row["scale"]
        rows.append(
            f"| {row['model']} | {e['parameters'] / 1e9:.2f}B | {e['weights_bf16'] / GB:.1f} | "
            f"{_fits(e, 'stage1')} | {_fits(plain, 'stage2')} | {_fits(e, 'stage2')} | "
            f"{plain['activations_per_token'] / 1e6:.2f} / {e['activations_per_token'] / 1e6:.3f} | "
            f"{plain['loss_per_token'] / 1e6:.2f} / {e['loss_per_token'] / 1e6:.3f} | {_fits(e, 'full')} |")
    return rows


def render_markdown(results: dict) -> str:
    if results.get("device") == "cuda":
        return render_device(results)
    if results.get("mode") == "shapes":
        return render_shapes(results)
    rows = ["| teacher | parameters | stage | tokens / step | ms / token | loaded MiB | stage peak above loaded MiB "
            "| formulas (fp32) MiB | measured / formulas |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in results["measured"]:
        ms = _ms_per_token(m)
        above, predicted = max(0, m["peak_rss"] - m["loaded_rss"]), cpu_prediction(m)
        rows.append(f"| {m['size']} | {m['teacher_parameters'] / 1e6:.1f}M | {m['stage']} | {m['tokens_per_step']} | "
                    f"{ms:.2f} | {m['loaded_rss'] / MIB:.0f} | {above / MIB:.0f} | {predicted / MIB:.0f} | "
                    f"{above / predicted:.2f} |")
    chunk = results.get("loss_chunk_size", 256)  # the computed table is the formulas' as they stand now
    rows += [""] + render_computed(computed_table(results.get("gpu_block", 2048), chunk), chunk)
    rows += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(rows)


# ----- running -----------------------------------------------------------------------------------------------
GPU_SIZES = tuple(name for name in ARCHS if name.startswith("Qwen3"))
SHAPES_OUT = "conversion_scale_shapes_cpu.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    p.add_argument("--recipe", default="gdn", help="the recipe whose attention and stage settings are measured")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (the first is not timed)")
    p.add_argument("--gpu-block", type=int, default=2048,
                   help="block size of the GPU rows (computed and measured) and of the Qwen3-shaped CPU rows")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny only, 2 steps")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: measure random-init Qwen3 shapes (--gpu-sizes) in bf16 on the GPU")
    p.add_argument("--gpu-sizes", nargs="+", choices=GPU_SIZES, default=["Qwen3-0.6B", "Qwen3-1.7B"])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=[],
                   help="measure each stage of random-init Qwen3-shaped teachers on the CPU (bf16 teacher, fp32 "
                        "student, stage 2 with loss_chunk_size and gradient checkpointing)")
    p.add_argument("--convert", nargs="+", choices=list(SHAPES), default=[],
                   help="run the whole hf-recattn convert of these shapes (saved random-init teachers)")
    p.add_argument("--loss-chunk", type=int, default=256,
                   help="stage2.loss_chunk_size of --shapes / --convert / --device cuda")
    p.add_argument("--unset-memory-options", action="store_true",
                   help="--convert: leave stage2.loss_chunk_size and gradient_checkpointing unset, as the recipe "
                        "has them, so that stage 2 chooses them")
    p.add_argument("--no-eval", action="store_true", help="--convert: without the evaluation (hf-recattn's --no-eval)")
    p.add_argument("--gpu-loss-kernel", choices=("auto", "torch", "liger"), default="auto",
                   help="stage2.loss_kernel of --device cuda (auto: Liger Kernel's fused ops where installed)")
    p.add_argument(HEAP_OPTION, type=int, default=None, metavar="BYTES",
                   help="CPU runs: glibc's mmap threshold of the measured processes, as hf-recattn convert's "
                        f"{HEAP_OPTION} sets it (default: the command's default; 0: glibc's own)")
    p.add_argument("--child", nargs=2, metavar=("SIZE", "STAGE"), help=argparse.SUPPRESS)
    p.add_argument("--child-shape", nargs=2, metavar=("SHAPE", "STAGE"), help=argparse.SUPPRESS)
    p.add_argument("--save-teacher", nargs=2, metavar=("SHAPE", "FOLDER"), help=argparse.SUPPRESS)
    add_out_argument(p, "conversion_scale_cpu.json")
    args = p.parse_args(argv)
    try:
        chosen_threshold(args.malloc_mmap_threshold, {})
    except ValueError as err:
        p.error(str(err))
    if args.out == RESULTS / "conversion_scale_cpu.json":
        if args.device == "cuda":
            args.out = RESULTS / "conversion_scale_cuda.json"
        elif args.shapes or args.convert:
            args.out = RESULTS / SHAPES_OUT
    return args


def _child(args: argparse.Namespace, size: str, stage: str, flag: str = "--child") -> dict[str, Any]:
    """One stage of one size measured in a fresh process: its memory is this stage's alone."""
    command = [sys.executable, __file__, flag, size, stage, "--recipe", args.recipe, "--steps", str(args.steps),
               "--threads", str(args.threads), "--device", args.device, "--gpu-block", str(args.gpu_block),
               "--loss-chunk", str(args.loss_chunk), "--gpu-loss-kernel", args.gpu_loss_kernel]
    if args.malloc_mmap_threshold is not None:
        command += [HEAP_OPTION, str(args.malloc_mmap_threshold)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{size} {stage} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{size} {stage}: {result['step_seconds']}", file=sys.stderr)
    return result


def main_device(args: argparse.Namespace) -> int:
    """``--device cuda``: both stages of each GPU size; the results file is rewritten after each stage."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    record = run_record()
    data: dict[str, Any] = {"device": "cuda", "gpu": torch.cuda.get_device_name(0),
                            "gpu_memory": torch.cuda.get_device_properties(0).total_memory, "recipe": args.recipe,
                            "steps": args.steps, "block_size": args.gpu_block, "measured": [], "notes": [
        f"Measured on one {torch.cuda.get_device_name(0)}: random-init teachers of the models' published shapes "
        f"(transformers' Qwen3Config) in bf16, the student in bf16, recipe `{args.recipe}` (quick budget's "
        f"settings at block {args.gpu_block}, batch 1; stage 2: LoRA, loss_chunk_size {args.loss_chunk}, gradient "
        f"checkpointing, loss_kernel {args.gpu_loss_kernel}), {args.steps} optimizer steps per stage, the first "
        "not timed: ms / token is the median synchronized step over its tokens.",
        "Loaded: torch.cuda.memory_allocated with teacher and student on the GPU; peak: max_memory_allocated "
        "during the stage (reset after loading), both models included; formulas: the GPU table's state + "
        "per-GPU bytes for that shape."]}
    for size in args.gpu_sizes:
        for stage in STAGES:
            data["measured"].append(_child(args, size, stage))
            results = write_results(args.out, "conversion_scale", record, data)
    print(render_markdown(results))
    return 0


def _shapes_notes(data: dict[str, Any]) -> list[str]:
    """The notes under the ``--shapes`` / ``--convert`` tables, the steps per stage read from the rows."""
    steps: dict[str, set[int]] = {}
    for m in data["measured"]:
        steps.setdefault(m["size"], set()).add(len(m["step_seconds"]) + 1)
    counts = ", ".join(f"{size} {'/'.join(map(str, sorted(n)))}" for size, n in steps.items())
    return [
        f"Measured on the CPU: random-init teachers of the published shapes (transformers' Qwen3Config) in bf16, "
        f"the student in float32 as `hf-recattn convert --teacher-dtype bfloat16` trains it, recipe "
        f"`{data['recipe']}` (quick budget's settings at block {data['block_size']}, batch 1; stage 2: LoRA, "
        f"loss_chunk_size {data['loss_chunk_size']}, gradient checkpointing), {data['threads']} thread(s), a fresh "
        f"process per stage; optimizer steps per stage: {counts}, the first not timed (s / step: the median of the "
        "others; system s / step: the stage's kernel CPU time over its steps, mostly page faults).",
        f"Heap: glibc's mmap threshold as `{HEAP_OPTION}` set it in the measuring process (the commands' default "
        f"is {DEFAULT_MMAP_THRESHOLD / MIB:g} MiB). Baseline: the resident set before the models were built; stage "
        "peak: the kernel's high-water mark during the stage (reset after building); formulas: both models' "
        "weights and the stage's terms (docs/conversion.md), compared with the peak above the baseline.",
        "Whole convert: `hf-recattn convert` of the teacher saved as safetensors with the embedded SmolLM2 "
        "tokenizer, both stages and the quick evaluation (unless `--no-eval`); stage 2 memory options: set in the "
        "recipe, or unset and chosen by stage 2 (`--unset-memory-options`); peak: the process's maximum resident "
        "set (the kernel's); per pipeline stage: the resident set sampled every 0.1 s.",
    ]


def main_shapes(args: argparse.Namespace) -> int:
    """``--shapes`` / ``--convert``: the Qwen3-shaped CPU rows, merged into the results file (a row per shape and
    stage, the newest kept) and the file rewritten after each."""
    record = run_record()
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data: dict[str, Any] = {"mode": "shapes", "recipe": args.recipe, "steps": args.steps, "threads": args.threads,
                            "block_size": args.gpu_block, "loss_chunk_size": args.loss_chunk,
                            "measured": old.get("measured", []), "convert": old.get("convert", [])}
    for size in args.shapes:
        for stage in STAGES:
            row = {**_child(args, size, stage, "--child-shape"), "provenance": record}  # rows of several runs
            data["measured"] = _merged(data["measured"], row, CPU_SHAPES, ("size", "stage", "malloc_mmap_threshold"))
            results = write_results(args.out, "conversion_scale", record, {**data, "notes": _shapes_notes(data)})
    chunk = None if args.unset_memory_options else args.loss_chunk
    recipe = scale_recipe(args.recipe, args.steps, args.gpu_block, chunk)
    for size in args.convert:
        row = measure_convert(size, recipe, args.threads, args.malloc_mmap_threshold, not args.no_eval)
        row.update(malloc_mmap_threshold=chosen_threshold(args.malloc_mmap_threshold, os.environ), provenance=record,
                   memory_options="unset" if args.unset_memory_options else "recipe", steps=args.steps)
        data["convert"] = _merged(data["convert"], row, CPU_SHAPES, ("size", "malloc_mmap_threshold",
                                                                     "memory_options"))
        results = write_results(args.out, "conversion_scale", record, {**data, "notes": _shapes_notes(data)})
    print(render_markdown(results))
    return 0


def _merged(rows: list[dict], row: dict, order: tuple[str, ...], keys: tuple[str, ...]) -> list[dict]:
    """``rows`` with ``row`` in place of the one with the same ``keys``, sorted by size (``order``), then stage."""
    kept = [r for r in rows if any(r.get(k) != row.get(k) for k in keys)] + [row]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(kept, key=lambda r: (rank.get(r["size"], len(order)), r.get("malloc_mmap_threshold") or 0,
                                       r.get("stage", "")))


def _run_child(args: argparse.Namespace) -> int:
    """A measurement in this fresh process: its JSON on the last line of stdout. A CPU measurement runs with the
    heap as ``hf-recattn convert`` sets it (``--malloc-mmap-threshold``: its option)."""
    if args.save_teacher:
        save_shaped_teacher(args.save_teacher[0], Path(args.save_teacher[1]))
        return 0
    heap = {"malloc_mmap_threshold": fix_mmap_threshold(args.malloc_mmap_threshold)} if args.device == "cpu" else {}
    if args.child_shape:
        recipe = scale_recipe(args.recipe, args.steps, args.gpu_block, args.loss_chunk)
        print(json.dumps({**measure_shape(*args.child_shape, recipe, args.steps), **heap}))
    elif args.device != "cpu":
        size, stage = args.child
        recipe = scale_recipe(args.recipe, args.steps, args.gpu_block, args.loss_chunk)
        print(json.dumps(measure_device(size, ARCHS[size], stage, recipe, args.steps, args.device,
                                        args.gpu_loss_kernel)))
    else:
        print(json.dumps({**measure(*args.child, args.recipe, args.steps), **heap}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child or args.child_shape or args.save_teacher:
        return _run_child(args)
    if args.shapes or args.convert:
        return main_shapes(args)
    if args.device != "cpu":
        return main_device(args)
    sizes, steps = (["tiny"], 2) if args.quick else (args.sizes, args.steps)
    record = run_record()
    measured = []
    for size in sizes:
        for stage in STAGES:  # a fresh process each: its memory is this stage's alone
            measured.append(_child(argparse.Namespace(**{**vars(args), "steps": steps}), size, stage))
    notes = [
        f"Measured on the CPU in fp32, recipe `{args.recipe}` (quick budget's settings), {steps} optimizer steps per "
        "stage, the first not timed: ms / token is the median step over its tokens; heap: "
        f"{_heap({'malloc_mmap_threshold': chosen_threshold(args.malloc_mmap_threshold, os.environ)})}.",
        f"Computed for one {GPU_BYTES / GB:.0f} GB GPU at block {args.gpu_block}, batch 1 (formulas in the text); "
        "arithmetic, not measured (`--device cuda` measures on a GPU).",
    ]
    results = write_results(args.out, "conversion_scale", record, {
        "recipe": args.recipe, "steps": steps, "threads": args.threads, "measured": measured,
        "gpu_block": args.gpu_block, "loss_chunk_size": args.loss_chunk, "notes": notes})
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
