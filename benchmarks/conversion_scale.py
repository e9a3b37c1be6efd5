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
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from results_file import RESULTS, add_out_argument, run_record, write_results
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from hf_recattn.conversion.attention_transfer import attention_transfer
from hf_recattn.conversion.from_teacher import from_teacher
from hf_recattn.conversion.recipe import load_recipe
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.training.attention_objective import mixer_parameters
from hf_recattn.training.distill import finetune

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
               device: str = "cpu") -> tuple[list[float], int]:
    """``steps`` optimizer steps of one stage on random token ids: the timed steps' seconds (the first left out,
    synchronized on a GPU) and the number of trained parameters."""
    blocks = torch.randint(0, teacher.config.vocab_size, (settings.tokens // settings.block_size, settings.block_size),
                           generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        if stage == "stage1":
            trainable = sum(p.numel() for group in mixer_parameters(student, tuple(settings.projections)).values()
                            for p in group.values())
            marks: list[float] = []
            attention_transfer(teacher, student, blocks, settings, checkpoint_dir=None, progress=False,
                               on_step=lambda step, model: marks.append(_clock(device)))
            return [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)], trainable
        timer = _StepTimes(device)
        _, result = finetune(teacher, student, blocks, settings, tmp, progress=False, callbacks=[timer])
        return timer.seconds[1:], result.trainable_parameters


def measure(size: str, stage: str, recipe_name: str, steps: int) -> dict[str, Any]:
    """One stage of one size, ``steps`` optimizer steps: seconds per step, tokens per step, memory."""
    recipe = load_recipe(recipe_name, "quick")
    teacher = _teacher(size).requires_grad_(False)
    student = from_teacher(teacher, recipe.attention, recipe.attention_overrides)
    settings, per_step = _stage_settings(recipe_name, stage, steps)
    counts = {"shape": _shape(teacher.config), "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
              "student_parameters": sum(p.numel() for p in student.parameters())}
    loaded = _rss("VmRSS")
    peak_reset = _reset_peak()
    seconds, counts["trainable_parameters"] = _run_stage(teacher, student, stage, settings, steps)
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
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)


def measure_device(name: str, shape: tuple, stage: str, recipe_name: str, steps: int, block: int,
                   device: str) -> dict[str, Any]:
    """One stage of a random-init bf16 Qwen3 teacher of ``shape`` on ``device``, batch 1 at ``block``: seconds
    per step and, on a GPU, the bytes allocated after loading and the peak allocated during the stage."""
    recipe = load_recipe(recipe_name, "quick")
    teacher = qwen3_teacher(shape, device)
    with torch.device(device):
        student = from_teacher(teacher, recipe.attention, recipe.attention_overrides)
    settings, per_step = _stage_settings(recipe_name, stage, steps, block_size=block, batch_size=1)
    where = {str(p.device.type) for model in (teacher, student) for p in model.parameters()}
    if where != {device}:
        raise RuntimeError(f"{name} {stage}: the models are on {sorted(where)}, not {device}")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loaded = torch.cuda.memory_allocated() if cuda else None
    seconds, trainable = _run_stage(teacher, student, stage, settings, steps, device)
    return {"size": name, "stage": stage, "device": device, "dtype": "bfloat16", "tokens_per_step": per_step,
            "block_size": block, "batch_size": 1, "step_seconds": seconds, "shape": list(shape),
            "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
            "student_parameters": sum(p.numel() for p in student.parameters()), "trainable_parameters": trainable,
            "loaded_bytes": loaded, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}


# ----- the arithmetic for larger teachers ----------------------------------------------------------------
def parameters(shape: tuple) -> dict[str, int]:
    """Parameter counts from a shape: all, q + k projections, LoRA r=1 on q/k/v/o."""
    layers, hidden, inter, heads, kv, head_dim, vocab, tied = shape
    q_k = hidden * (heads + kv) * head_dim
    per_layer = q_k + hidden * kv * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    lora = 4 * hidden + 2 * heads * head_dim + 2 * kv * head_dim  # (in + out) of q, k, v, o
    return {"all": vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden, "q_k": layers * q_k,
            "lora_r1": layers * lora}


def estimate(shape: tuple, block: int, element: int, lora_r: int = 8) -> dict[str, int]:
    """Bytes of each term at batch 1 (formulas in docs/conversion.md); ``element``: bytes of an activation."""
    layers, hidden, inter, heads, kv, head_dim, vocab, _ = shape
    count = parameters(shape)
    per_layer_token = (6 * hidden + 2 * heads * head_dim + 2 * kv * head_dim + 4 * inter) * element
    return {
        "parameters": count["all"],
        "stage1_trainable": count["q_k"],  # the gdn recipe trains q/k (its mixers' own parameters are ~1% of that)
        "captured": layers * 2 * hidden * element * block,  # the teacher's attention input and output, every layer
        "one_layer": (2 * hidden + 4 * heads * head_dim + 2 * kv * head_dim) * element * block,
        "lora_parameters": lora_r * count["lora_r1"],
        "activations": layers * per_layer_token * block,  # every layer's saved tensors, no recomputation
        "kl": 10 * vocab * FP32 * block,  # the vocab-sized fp32 tensors distill_loss_sum keeps (see the docs)
    }


def cpu_prediction(m: dict[str, Any]) -> int:
    """What a measured stage should add to the loaded process by the formulas (fp32, the measured block)."""
    e = estimate(tuple(m["shape"]), m["block_size"] * m["batch_size"], FP32)
    if m["stage"] == "stage1":  # gradients and two moments of the trained weights; captured I/O; one layer
        return 12 * e["stage1_trainable"] + e["captured"] + e["one_layer"]
    return ADAM * e["lora_parameters"] + e["activations"] + e["kl"]


def gpu_estimate(name: str, block: int, shape: tuple | None = None) -> dict[str, Any]:
    """Bytes per stage on one GPU: ``*_state`` is what FSDP / ZeRO-3 shards, ``*_local`` stays on every GPU
    (``shape``: the model's, by default ``ARCHS[name]``)."""
    e = estimate(shape or ARCHS[name], block, BF16)
    weights = BF16 * e["parameters"]  # one model's weights
    return {
        "model": name, "block_size": block, **e, "weights_bf16": weights,
        "activations_per_token": e["activations"] // block, "kl_per_token": e["kl"] // block,
        "stage1_state": 2 * weights + ADAM * e["stage1_trainable"], "stage1_local": e["captured"] + e["one_layer"],
        "stage2_state": 2 * weights + ADAM * e["lora_parameters"], "stage2_local": e["activations"] + e["kl"],
        # every weight trained: the teacher's and the student's bf16 weights, 16 bytes per student parameter
        "full_state": 2 * weights + ADAM * e["parameters"], "full_local": e["activations"] + e["kl"],
    }


# ----- the table --------------------------------------------------------------------------------------------
def _fits(e: dict[str, Any], part: str) -> str:
    """``X GB (fits)`` on one GPU, else the GPUs FSDP / ZeRO-3 needs: the state shards, the rest stays per GPU."""
    state, local = e[f"{part}_state"], e[f"{part}_local"]
    if state + local <= GPU_BYTES:
        return f"{(state + local) / GB:.1f} (fits)"
    return f"{(state + local) / GB:.0f} (shard: >= {int(-(-state // (GPU_BYTES - local)))} GPUs)"


def gpu_prediction(m: dict[str, Any]) -> int:
    """What a stage measured on a GPU should peak at by the formulas: its state and its per-GPU bytes."""
    e = gpu_estimate(m["size"], m["block_size"], tuple(m["shape"]))
    return e[f"{m['stage']}_state"] + e[f"{m['stage']}_local"]


def _ms_per_token(m: dict[str, Any]) -> float:
    return 1e3 * statistics.median(m["step_seconds"]) / m["tokens_per_step"]


def render_device(results: dict) -> str:
    """The table of a ``--device cuda`` run: memory and time per token of each stage beside the formulas."""
    rows = ["| teacher (random init, bf16) | parameters | stage | tokens / step | ms / token | loaded GB | peak GB "
            "| formulas GB | peak / formulas |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in results["measured"]:
        predicted = gpu_prediction(m)
        rows.append(f"| {m['size']} | {m['teacher_parameters'] / 1e9:.2f}B | {m['stage']} | {m['tokens_per_step']} | "
                    f"{_ms_per_token(m):.3f} | {m['loaded_bytes'] / GB:.2f} | {m['peak_bytes'] / GB:.2f} | "
                    f"{predicted / GB:.2f} | {m['peak_bytes'] / predicted:.2f} |")
    rows += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(rows)


def render_markdown(results: dict) -> str:
    if results.get("device") == "cuda":
        return render_device(results)
    rows = ["| teacher | parameters | stage | tokens / step | ms / token | loaded MiB | stage peak above loaded MiB "
            "| formulas (fp32) MiB | measured / formulas |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in results["measured"]:
        ms = _ms_per_token(m)
        above, predicted = max(0, m["peak_rss"] - m["loaded_rss"]), cpu_prediction(m)
        rows.append(f"| {m['size']} | {m['teacher_parameters'] / 1e6:.1f}M | {m['stage']} | {m['tokens_per_step']} | "
                    f"{ms:.2f} | {m['loaded_rss'] / MIB:.0f} | {above / MIB:.0f} | {predicted / MIB:.0f} | "
                    f"{above / predicted:.2f} |")
    rows += ["", "| teacher (computed, not run) | parameters | weights bf16 GB | stage 1 GB | stage 2 LoRA GB | "
             "activations MB / token | KL logits MB / token | stage 2 every weight GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in results["computed"]:
        rows.append(
            f"| {e['model']} | {e['parameters'] / 1e9:.2f}B | {e['weights_bf16'] / GB:.1f} | "
            f"{_fits(e, 'stage1')} | {_fits(e, 'stage2')} | {e['activations_per_token'] / 1e6:.2f} | "
            f"{e['kl_per_token'] / 1e6:.2f} | {_fits(e, 'full')} |")
    rows += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(rows)


# ----- running -----------------------------------------------------------------------------------------------
GPU_SIZES = tuple(name for name in ARCHS if name.startswith("Qwen3"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    p.add_argument("--recipe", default="gdn", help="the recipe whose attention and stage settings are measured")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (the first is not timed)")
    p.add_argument("--gpu-block", type=int, default=2048, help="block size of the GPU rows (computed and measured)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny only, 2 steps")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: measure random-init Qwen3 shapes (--gpu-sizes) in bf16 on the GPU")
    p.add_argument("--gpu-sizes", nargs="+", choices=GPU_SIZES, default=["Qwen3-0.6B", "Qwen3-1.7B"])
    p.add_argument("--child", nargs=2, metavar=("SIZE", "STAGE"), help=argparse.SUPPRESS)
    add_out_argument(p, "conversion_scale_cpu.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and args.out == RESULTS / "conversion_scale_cpu.json":
        args.out = RESULTS / "conversion_scale_cuda.json"
    return args


def _child(args: argparse.Namespace, size: str, stage: str) -> dict[str, Any]:
    """One stage of one size measured in a fresh process: its memory is this stage's alone."""
    command = [sys.executable, __file__, "--child", size, stage, "--recipe", args.recipe, "--steps", str(args.steps),
               "--threads", str(args.threads), "--device", args.device, "--gpu-block", str(args.gpu_block)]
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
        f"(transformers' Qwen3Config) in bf16, recipe `{args.recipe}` (quick budget's settings at block "
        f"{args.gpu_block}, batch 1), {args.steps} optimizer steps per stage, the first not timed: ms / token is "
        "the median synchronized step over its tokens.",
        "Loaded: torch.cuda.memory_allocated with teacher and student on the GPU; peak: max_memory_allocated "
        "during the stage (reset after loading), both models included; formulas: the GPU table's state + "
        "per-GPU bytes for that shape."]}
    for size in args.gpu_sizes:
        for stage in STAGES:
            data["measured"].append(_child(args, size, stage))
            results = write_results(args.out, "conversion_scale", record, data)
    print(render_markdown(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child and args.device != "cpu":
        size, stage = args.child
        print(json.dumps(measure_device(size, ARCHS[size], stage, args.recipe, args.steps, args.gpu_block,
                                        args.device)))
        return 0
    if args.child:
        print(json.dumps(measure(*args.child, args.recipe, args.steps)))
        return 0
    if args.device != "cpu":
        return main_device(args)
    sizes, steps = (["tiny"], 2) if args.quick else (args.sizes, args.steps)
    record = run_record()
    measured = []
    for size in sizes:
        for stage in STAGES:  # a fresh process each: its memory is this stage's alone
            measured.append(_child(argparse.Namespace(**{**vars(args), "steps": steps}), size, stage))
    computed = [gpu_estimate(name, args.gpu_block) for name in ARCHS]
    notes = [
        f"Measured on the CPU in fp32, recipe `{args.recipe}` (quick budget's settings), {steps} optimizer steps per "
        "stage, the first not timed: ms / token is the median step over its tokens.",
        f"Computed for one {GPU_BYTES / GB:.0f} GB GPU at block {args.gpu_block}, batch 1 (formulas in the text); "
        "arithmetic, not measured (`--device cuda` measures on a GPU).",
    ]
    results = write_results(args.out, "conversion_scale", record, {
        "recipe": args.recipe, "steps": steps, "threads": args.threads, "measured": measured,
        "computed": computed, "notes": notes})
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
