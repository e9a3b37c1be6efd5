"""Seconds and peak memory of attention kernels on the CPU or a GPU: our chunked gated delta rule against others'.

One SmolLM2-135M-shaped attention layer's worth of heads (batch 1, 9 heads of dimension 64), fp32 (``--dtype``), at
several sequence lengths, forward (under ``torch.no_grad``, as in prefill) and forward+backward (gradients of every
input, as in training). Implementations:

* ``ours gdr``: ``hf_recattn.ops.chunk_gated_delta_rule`` (chunk 64; on a GPU through fla's kernel by way of
  ``modeling/fla_adapters.py``, forced with ``HF_RECATTN_KERNELS=fla``, backward included);
* ``hf gdr``: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's torch path, chunk 64; unwrapped, since
  transformers replaces it with fla's kernel where fla imports);
* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)``, causal softmax attention;
* ``ours linear``: ``hf_recattn.ops.chunk_linear_attn`` (chunk 64), plain causal linear attention (on a GPU
  through fla's ``chunk_linear_attn``, forced, its denominator as one more value column);
* ``ours gdr torch``: ``ours gdr`` with the torch forms forced (differs from ``ours gdr`` only on a GPU);
* ``fla gdr``: flash-linear-attention's Triton ``chunk_gated_delta_rule`` called directly (its own chunk, 64;
  CUDA only, when fla imports): what the adapter costs over it.

Inputs: q, k, v ~ N(0, 1); for the delta rules the kernels l2-normalize q and k (``use_qk_l2norm_in_kernel``, as
Qwen3-Next calls them), g = logsigmoid(N(0, 1)) and beta = sigmoid(N(0, 1)). Every implementation gets the same
values, each in its own layout, built before timing.

Time: every (length, mode, implementation) cell runs ``--warmup`` untimed calls, then ``--repeats`` rounds, each
round calling every cell once in turn (interleaved, so that load from other processes hits all alike); the table
gives medians. Ratios (hf / ours, sdpa / ours) are of medians from the same run.

Peak memory: each cell runs once more in a fresh subprocess that builds its inputs, warms up at 256 tokens, resets
the kernel's peak-RSS counter (``/proc/self/clear_refs``), makes one call and reads ``VmHWM``; the table gives the
peak resident memory above the resident memory before the call (inputs included in the baseline, so it is what the
call itself needs: outputs, intermediates, saved tensors, gradients). Linux only; ``--no-memory`` skips it. On a
GPU: ``torch.cuda.max_memory_allocated`` during one more call of each cell, above what was allocated before it.

Threads: OpenMP's waiting policy matters on a 2-core machine. With its default (spin, then sleep), two threads
stall at every parallel region when another busy process shares a core (an 8k forward of either gated delta rule
took seconds instead of a fifth of one); ``OMP_WAIT_POLICY=PASSIVE`` avoids that, but on an idle machine it makes
every small op pay a thread wake-up (our 8k forward+backward: 1.4 s instead of 0.45 s). Run on an idle machine
with the default, or export ``OMP_WAIT_POLICY=PASSIVE`` when the cores are shared; the notes print the setting.

``python benchmarks/kernel_speed.py --help`` lists the flags; ``--quick`` is a short smoke run.
The results and their provenance go to ``--out`` (default ``benchmarks/results/kernel_speed_DEVICE.json``);
``scripts/render_docs.py`` renders the docs' tables from that file with ``render_markdown``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from results_file import add_out_argument, run_record, write_results

from hf_recattn.modeling.backends import use_kernels
from hf_recattn.ops import chunk_gated_delta_rule, chunk_linear_attn

LENGTHS = (1024, 4096, 8192, 16384, 32768)
MODES = ("fwd", "fwd+bwd")
IMPLS = ("ours gdr", "hf gdr", "sdpa", "ours linear", "ours gdr torch", "fla gdr")
DEFAULT_IMPLS = IMPLS[:4]  # "ours gdr torch" (the torch forms forced) differs from "ours gdr" only on a GPU
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASELINE = "ours gdr"
Call = Callable[[], object]


def _hf_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    from transformers.utils import logging

    logging.set_verbosity_error()  # it warns on every call that flash-linear-attention is not installed
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # transformers swaps in flash-linear-attention's kernel where fla imports: unwrap to its torch code
    return inspect.unwrap(torch_chunk_gated_delta_rule)


def _fla_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """flash-linear-attention's Triton gated delta rule (``pip install flash-linear-attention``; CUDA only)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdr
    except ImportError as error:
        raise SystemExit(f"fla gdr: flash-linear-attention does not import ({error})") from error

    def run(q, k, v, g, beta, chunk_size: int, use_qk_l2norm_in_kernel: bool):  # fla picks its own chunk (64)
        return fla_gdr(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return run


# ----- cells ------------------------------------------------------------------------------------------------
def make_cell(impl: str, length: int, mode: str, args: argparse.Namespace) -> Call:
    """A no-argument call running `impl` once on fresh-per-cell inputs of `length` tokens."""
    gen = torch.Generator().manual_seed(length)
    b, h, d = args.batch, args.heads, args.head_dim
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    q, k, v = (torch.randn(b, length, h, d, generator=gen).to(dev, dtype) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, length, h, generator=gen)).to(dev)
    beta = torch.sigmoid(torch.randn(b, length, h, generator=gen)).to(dev)
    if impl == "sdpa":  # [B, H, T, D]
        tensors = [x.transpose(1, 2).contiguous() for x in (q, k, v)]

        def run(x: list[torch.Tensor]) -> torch.Tensor:
            return F.scaled_dot_product_attention(*x, is_causal=True)
    elif impl == "ours linear":
        tensors = [q, k, v]

        def run(x: list[torch.Tensor]) -> torch.Tensor:
            with use_kernels("fla" if dev.type == "cuda" else "auto"):
                return chunk_linear_attn(*x, chunk_size=args.chunk_size)[0]
    elif impl == "ours gdr torch":
        tensors = [q, k, v, g, beta]

        def run(x: list[torch.Tensor]) -> torch.Tensor:
            with use_kernels("torch"):
                return chunk_gated_delta_rule(*x, chunk_size=args.chunk_size, use_qk_l2norm_in_kernel=True)[0]
    else:
        tensors = [q, k, v, g, beta]
        builders = {"ours gdr": lambda: chunk_gated_delta_rule, "hf gdr": _hf_chunk_gated_delta_rule,
                    "fla gdr": _fla_chunk_gated_delta_rule}
        fn = builders[impl]()
        # on a GPU, "ours gdr" times fla's kernels, backward included (which auto leaves out while unverified)
        choice = "fla" if dev.type == "cuda" and impl == "ours gdr" else "auto"

        def run(x: list[torch.Tensor]) -> torch.Tensor:
            with use_kernels(choice):
                return fn(*x, chunk_size=args.chunk_size, use_qk_l2norm_in_kernel=True)[0]

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if mode == "fwd":

        def call() -> object:
            with torch.no_grad():
                out = run(tensors)
            sync()
            return out
    else:
        leaves = [x.requires_grad_() for x in tensors]

        def call() -> object:
            grads = torch.autograd.grad(run(leaves).sum(), leaves)
            sync()
            return grads

    return call


# ----- timing -----------------------------------------------------------------------------------------------
def time_cells(cells: dict[tuple, Call], repeats: int, warmup: int) -> dict[tuple, float]:
    """Median seconds per cell; every cell runs once per round, rounds interleave all cells."""
    for call in cells.values():
        for _ in range(warmup):
            call()
    samples: dict[tuple, list[float]] = {key: [] for key in cells}
    for _ in range(repeats):
        for key, call in cells.items():
            gc.collect()
            start = time.perf_counter()
            call()
            samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(s) for key, s in samples.items()}


# ----- memory -----------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def memory_cell(impl: str, length: int, mode: str, args: argparse.Namespace) -> float:
    """In this (fresh) process: MiB of peak resident memory one call adds above the resident memory before it."""
    make_cell(impl, 256, mode, args)()  # load libraries, first-call allocations
    call = make_cell(impl, length, mode, args)
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    call()
    return (_status_kib("VmHWM") - before) / 1024


def cuda_memory(call: Call) -> float:
    """MiB of GPU memory one call allocates at its peak above what was allocated before it (outputs,
    intermediates, saved tensors, gradients; the inputs are in the baseline)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def measure_memory(impl: str, length: int, mode: str, args: argparse.Namespace) -> float | None:
    cmd = [sys.executable, __file__, "--memory-cell", impl, str(length), mode, "--threads", str(args.threads),
           "--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
           "--chunk-size", str(args.chunk_size), "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"memory cell {impl} {length} {mode} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["mib"]


# ----- report -----------------------------------------------------------------------------------------------
def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def render_markdown(results: dict) -> str:
    """The table (one row per length and mode, one column per implementation) and the notes of a results file."""
    impls, cells = results["impls"], results["cells"]
    secs = {(c["impl"], c["length"], c["mode"]): c["seconds"] for c in cells}
    mem = {(c["impl"], c["length"], c["mode"]): c["mib"] for c in cells if "mib" in c}
    head = ["T", "mode", *(f"{i} s" for i in impls)]
    others = [i for i in ("hf gdr", "sdpa") if i in impls and BASELINE in impls]
    head += [f"{i} / ours" for i in others]
    if mem:
        head += [f"{i} MiB" for i in impls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for length in results["lengths"]:
        for mode in results["modes"]:
            row = [str(length), mode, *(_fmt_s(secs.get((i, length, mode))) for i in impls)]
            row += [_ratio(secs.get((i, length, mode)), secs.get((BASELINE, length, mode))) for i in others]
            if mem:
                row += ["-" if mem.get((i, length, mode)) is None else f"{mem[(i, length, mode)]:.0f}" for i in impls]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join([*lines, "", *results["notes"]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths")
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS))
    add("--device", default="cpu", help="cpu or cuda (on cuda: fla's kernels where they apply)")
    add("--repeats", type=int, default=5, help="timed rounds (median)")
    add("--warmup", type=int, default=1, help="untimed calls per cell first")
    add("--threads", type=int, default=2, help="torch threads")
    add("--batch", type=int, default=1)
    add("--heads", type=int, default=9)
    add("--head-dim", type=int, default=64)
    add("--chunk-size", type=int, default=64, help="chunk size of the chunked kernels")
    add("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of q, k, v")
    add("--leave-out", nargs="+", action="extend", default=[], metavar="IMPL/MODE",
        help="cells not run (e.g. 'ours gdr/fwd+bwd'); say why with --note")
    add("--note", action="append", default=[], help="a line added to the results' notes")
    add("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    add("--quick", action="store_true", help="smoke run: lengths 1024 4096, 3 repeats")
    add("--memory-cell", nargs=3, metavar=("IMPL", "T", "MODE"), help=argparse.SUPPRESS)
    add_out_argument(p, "kernel_speed_DEVICE.json")
    args = p.parse_args(argv)
    if args.out.name == "kernel_speed_DEVICE.json":
        args.out = args.out.with_name(f"kernel_speed_{args.device}.json")
    if args.quick:
        args.lengths, args.repeats = [1024, 4096], 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_cell:
        impl, length, mode = args.memory_cell
        print(json.dumps({"mib": memory_cell(impl, int(length), mode, args)}))
        return 0
    record = run_record()
    left_out = {tuple(cell.split("/", 1)) for cell in args.leave_out}
    cells = {(i, t, m): make_cell(i, t, m, args) for t in args.lengths for m in args.modes for i in args.impls
             if (i, m) not in left_out}
    secs = time_cells(cells, args.repeats, args.warmup)
    if args.no_memory:
        mem = {}
    elif args.device == "cpu":
        cells.clear()
        mem = {key: measure_memory(*key, args) for key in secs}
    else:
        mem = {key: cuda_memory(call) for key, call in cells.items()}
    cells.clear()
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}" if args.device != "cpu" else
             f"torch {torch.__version__}, {args.threads} thread(s) (OMP_WAIT_POLICY {policy})")
    peak = ("peak GPU memory one call allocates above its inputs" if args.device != "cpu" else
            "peak RSS one call adds (fresh process per cell)")
    note = (f"{where}, {args.dtype}, batch {args.batch}, {args.heads} heads x "
            f"{args.head_dim}, chunk {args.chunk_size}; seconds: median of {args.repeats} interleaved rounds after "
            f"{args.warmup} warm-up call(s) per cell; MiB: {peak}")
    results = write_results(args.out, "kernel_speed", record, {
        "settings": {key: value for key, value in vars(args).items() if key not in ("out", "memory_cell")},
        "impls": args.impls, "lengths": args.lengths, "modes": args.modes,
        "cells": [{"impl": i, "length": t, "mode": m, "seconds": seconds, **({"mib": mem[i, t, m]} if mem else {})}
                  for (i, t, m), seconds in secs.items()],
        "notes": [note, *args.note],
    })
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
