"""Many streams at once: decode tokens/s and peak memory of 1 to 64 streams at 2k, 8k and 32k tokens of context,
for the teacher (transformers' LlamaForCausalLM with its DynamicCache) against a hybrid and a pure recurrent
conversion, in one run.

Models: SmolLM2-135M-Instruct's architecture (``decode.py``'s SHAPE: 30 layers, hidden 576, 9 heads, 3 KV heads,
head_dim 64, vocab 49152, tied embeddings) with random weights in float32: a step's time and memory do not depend
on the weights' values. The conversions put a recipe's attention spec in every layer over the same weights (stored
in the decode layout that generate() applies to a float32 model on a CPU); by default:

* ``hybrid-w64-sink4-hedgehog``: softmax over the last 64 tokens and the first 4 + Hedgehog linear attention on
  the tokens between them (a bounded window state);
* ``linear-hedgehog-gated-sink``: gated Hedgehog linear attention with a learned sink (a fixed recurrent state).

Each (model, context, streams) runs in a fresh process forked from one that holds only that model's weights:

1. Predict what it needs before allocating anything: the process's resident set now + the cache (from the
   model's config or its mixers' ``state_size``) + the one-stream cache that is repeated + one step's transients
   (a DynamicCache step copies a layer's keys and values) + 0.25 GiB. A configuration that needs more than the
   machine's memory (``MemTotal`` in /proc/meminfo, or ``--memory-gib``) less ``--headroom`` is not run and is
   recorded as "out of memory (needs X GiB)"; one that would fit the machine but not what other processes leave
   free at that moment (``MemAvailable``) is recorded as "not run".
2. Fill one stream's cache to ``context`` tokens as ``decode.py`` does (``filled_cache`` / ``llama_cache``: a real
   ``--prefill-tokens`` prefill for our models, then every KV tensor replaced by random keys / values of the
   context's length; random keys / values for the teacher) and repeat it across the streams.
3. Reset the process's peak resident set (``/proc/self/clear_refs``), run one warm-up step, then time decode steps
   of all streams together (one token per stream, as generate() runs them): up to ``--repeats`` steps, stopping
   after ``--seconds`` once ``--min-repeats`` have run (so the big configurations time fewer steps).
   tokens/s = streams / median step.
4. Peak GiB: the process's peak resident set (``VmHWM``) over those steps: weights, cache, activations and the
   Python / torch runtime. Cache GiB: the cache's tensors (for a configuration not run, what it would hold).

Then (``--no-generate-check`` skips it) a correctness check of batched generate() on conversions of the real
embedded teacher (untrained: the teacher's weights, the recipe's attention, new parameters at their
initialization): prompts of different lengths left-padded into one batch, greedy; each row's new tokens must equal
those of the same prompt generated alone. The exit status is 1 when a row differs or a configuration failed.

The default run takes about 8 minutes on one thread; ``--quick`` is a smoke run (2k context, 1 and 4 streams).
Results: ``benchmarks/results/concurrent_streams_cpu.json``; plot: ``docs/concurrent_streams.png`` (skipped
without matplotlib).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from decode import (
    decode_step,
    dynamic_cache_bytes,
    filled_cache,
    laid_out_weights,
    llama_cache,
    llama_model,
    recattn_model,
)
from transformers import LlamaForCausalLM
from transformers.cache_utils import Cache

from hf_recattn import RecAttnCache, RecAttnForCausalLM, from_teacher
from hf_recattn.atomic import write_text
from hf_recattn.conversion.recipe import load_recipe
from hf_recattn.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "concurrent_streams_cpu.json"
PLOT = ROOT / "docs" / "concurrent_streams.png"
TEACHER = "teacher (Llama + DynamicCache)"
RECIPES = ("hybrid-w64-sink4-hedgehog", "linear-hedgehog-gated-sink")
STREAMS = (1, 4, 16, 64)
CONTEXTS = (2048, 8192, 32768)
GIB = 2**30
#: glibc's malloc_trim (None on a C library without it)
MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)
#: one step's activations and the allocator's slack, beyond the tensors the prediction counts
MARGIN = GIB // 4
#: what a configuration leaves to other processes when it checks MemAvailable
FREE_RESERVE = GIB // 2
#: batched generate() check: prompts whose lengths differ by more than the hybrid's window and a chunk
PROMPTS = (
    "Hi.",
    "The capital of France is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle washed up on the shore.",
    " ".join(f"Step {i}: add {i} to the running total and write it down." for i in range(1, 21)),
)


# ----- memory ------------------------------------------------------------------------------------------------
def _proc_bytes(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{path} has no {field} field")


def meminfo(field: str) -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable) in bytes."""
    return _proc_bytes("/proc/meminfo", field)


def own(field: str) -> int:
    """This process's VmRSS (resident now) or VmHWM (peak resident since the last reset) in bytes."""
    return _proc_bytes("/proc/self/status", field)


def reset_peak() -> None:
    """Set VmHWM back to the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (glibc's malloc_trim), so that the resident
    set counts live tensors, not what building a model or filling a cache freed."""
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def cache_elements(model: torch.nn.Module, streams: int, context: int) -> int:
    """What `streams` caches of `context` tokens hold, from the config (teacher) or the mixers' ``state_size``."""
    if isinstance(model, LlamaForCausalLM):
        cfg = model.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * streams
    return sum(block.self_attn.mixer.state_size(context) for block in model.model.layers) * streams


def cache_bytes(model: torch.nn.Module, streams: int, context: int) -> int:
    """`cache_elements` in the model's dtype (an upper bound: a state may keep a small mask in a smaller one)."""
    return cache_elements(model, streams, context) * next(model.parameters()).element_size()


def held(cache: Cache) -> tuple[int, int]:
    """Elements and bytes the cache's tensors hold."""
    if isinstance(cache, RecAttnCache):
        return sum(t.numel() for layer in cache.layers for t in layer.state.values()), cache.nbytes()
    return sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values)), dynamic_cache_bytes(cache)


def predicted_bytes(model: torch.nn.Module, streams: int, context: int) -> int:
    """The process's peak if this configuration ran: resident now + cache + the one-stream cache it is repeated
    from + a DynamicCache step's copy of one layer's keys and values (torch.cat) + MARGIN."""
    cache = cache_bytes(model, streams, context)
    step_copy = cache // model.config.num_hidden_layers if isinstance(model, LlamaForCausalLM) else 0
    return own("VmRSS") + cache + cache // streams + step_copy + MARGIN


# ----- one configuration -------------------------------------------------------------------------------------
def timed_steps(step: Callable[[], object], args: argparse.Namespace) -> list[float]:
    """Seconds per step after one warm-up: up to --repeats, stopping after --seconds once --min-repeats ran."""
    step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < args.repeats and (
        len(times) < args.min_repeats or time.perf_counter() - start < args.seconds
    ):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def measure(model: torch.nn.Module, fill: Callable[[int], Cache], streams: int, context: int,
            args: argparse.Namespace, limit: int) -> dict[str, Any]:
    """One configuration's row; run it in a process of its own (``in_fork``)."""
    cache_need = cache_bytes(model, streams, context)
    need = predicted_bytes(model, streams, context)
    row: dict[str, Any] = {"cache_gib": cache_need / GIB, "needs_gib": need / GIB}
    if need > limit:
        return {**row, "status": "out of memory"}
    free = meminfo("MemAvailable")
    if need - own("VmRSS") > free - FREE_RESERVE:
        return {**row, "status": "not run", "free_gib": free / GIB}
    with torch.inference_mode():
        cache = fill(context)
        cache.batch_repeat_interleave(streams)
        elements, nbytes = held(cache)
        if elements != cache_elements(model, streams, context):
            raise RuntimeError(f"the cache holds {elements} elements, the prediction said "
                               f"{cache_elements(model, streams, context)}")
        release_free_memory()
        reset_peak()
        times = timed_steps(decode_step(model, cache, cache.get_seq_length, batch=streams), args)
        peak = own("VmHWM")
    step = statistics.median(times)
    return {**row, "cache_gib": nbytes / GIB, "status": "ok", "step_ms": step * 1e3, "steps": len(times),
            "tokens_per_s": streams / step, "peak_gib": peak / GIB}


def in_fork(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `fn` in a forked child (its own peak resident set, its memory returned when it ends)."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            writer.send(fn())
        except BaseException as err:  # noqa: BLE001 - reported as the row's status
            writer.send({"status": "error", "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})

    proc = ctx.Process(target=child)
    proc.start()
    writer.close()
    try:
        result = reader.recv()
    except EOFError:
        result = None
    proc.join()
    return result if result is not None else {"status": "error", "error": f"the process ended ({proc.exitcode})"}


def model_rows(label: str, model: torch.nn.Module, fill: Callable[[int], Cache], args: argparse.Namespace,
               limit: int) -> list[dict[str, Any]]:
    rows = []
    for context in args.contexts:
        for streams in args.streams:
            row = {"model": label, "streams": streams, "context": context}
            row.update(in_fork(lambda s=streams, c=context: measure(model, fill, s, c, args, limit)))
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            if "trace" in row:
                print(row["trace"], flush=True)
            rows.append(row)
    return rows


def teacher_rows(args: argparse.Namespace, limit: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The teacher's configurations, and its weights in the decode layout for our models (made once it is done)."""
    torch.manual_seed(0)
    llama = llama_model(max_positions(args))
    release_free_memory()
    rows = model_rows(TEACHER, llama, lambda c: llama_cache(llama, c), args, limit)
    with torch.no_grad():
        return rows, laid_out_weights(llama.state_dict(), max_positions(args))


def max_positions(args: argparse.Namespace) -> int:
    return max(args.contexts) + args.repeats + 64


def sweep(args: argparse.Namespace, limit: int) -> list[dict[str, Any]]:
    """Every configuration of the teacher, then of each recipe's model (one model in memory at a time)."""
    rows, shared = teacher_rows(args, limit)
    fill_args = argparse.Namespace(fill="synthetic", prefill_tokens=args.prefill_tokens)
    for recipe in args.recipes:
        torch.manual_seed(0)
        model: RecAttnForCausalLM = recattn_model(load_recipe(recipe).attention, max_positions(args), shared)
        release_free_memory()  # the random parameters the model was built with before it took the shared weights
        rows += model_rows(recipe, model, lambda c, m=model: filled_cache(m, c, fill_args), args, limit)
        del model
    return rows


# ----- batched generate() ------------------------------------------------------------------------------------
def generate_check(args: argparse.Namespace) -> dict[str, Any]:
    """Each left-padded row of a batched greedy generate() against the same prompt alone, per recipe."""
    from hf_recattn.conversion.teacher import load_teacher

    teacher, tokenizer = load_teacher(args.teacher)
    tokenizer.padding_side = "left"
    batch = tokenizer(list(PROMPTS), return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id)
    report: dict[str, Any] = {"teacher": args.teacher, "prompt_tokens": batch["attention_mask"].sum(1).tolist(),
                              "new_tokens": args.new_tokens, "models": {}}
    for recipe in args.recipes:
        torch.manual_seed(0)
        model = from_teacher(teacher, load_recipe(recipe).attention)
        with torch.inference_mode():
            together = model.generate(**batch, **options)[:, width:]
            rows = []
            for i, prompt in enumerate(PROMPTS):
                single = tokenizer([prompt], return_tensors="pt")
                alone = model.generate(**single, **options)[0, single["input_ids"].shape[1]:]
                differ = (together[i] != alone).nonzero()
                rows.append({"equal": not len(differ), "first_difference": int(differ[0]) if len(differ) else None})
        report["models"][recipe] = {"rows": rows, "all_equal": all(r["equal"] for r in rows)}
        print(f"generate check {recipe}: {report['models'][recipe]}", flush=True)
        del model
    return report


# ----- report ------------------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def _cells(row: dict[str, Any]) -> list[str]:
    if row["status"] == "ok":
        return [f"{row['tokens_per_s']:.1f}", _gib(row["peak_gib"]), _gib(row["cache_gib"])]
    if row["status"] == "out of memory":
        return [f"out of memory (needs {row['needs_gib']:.1f} GiB)", "-", _gib(row["cache_gib"])]
    if row["status"] == "not run":
        return [f"not run (needs {row['needs_gib']:.1f} GiB, {row['free_gib']:.1f} GiB free then)", "-",
                _gib(row["cache_gib"])]
    return [f"error: {row.get('error', '?')}", "-", "-"]


def render_markdown(results: dict[str, Any]) -> str:
    """The table (context, then streams, then model) and what it shows."""
    memory, settings = results["memory"], results["settings"]
    models = [TEACHER, *settings["recipes"]]
    rows = sorted(results["rows"], key=lambda r: (r["context"], r["streams"], models.index(r["model"])))
    lines = ["| model | streams | context | tokens/s | peak GiB | cache GiB |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['streams']} | {r['context']} | " + " | ".join(_cells(r)) + " |" for r in rows]
    oom = [r for r in rows if r["status"] == "out of memory"]
    ours_ok = [r for r in rows if r["model"] != TEACHER and r["status"] == "ok"]
    lines += ["", f"Machine memory {memory['total_gib']:.1f} GiB; a configuration predicted to need more than "
              f"{memory['limit_gib']:.1f} GiB ({memory['headroom']:.0%} headroom) is not run. Random weights, float32, "
              f"{results['provenance'].get('threads')} thread; median of up to {settings['repeats']} decode steps "
              f"(at least {settings['min_repeats']}, fewer once {settings['seconds']:g} s have passed)."]
    if oom:
        lines.append("Out of memory: " + ", ".join(f"{r['model']} at {r['streams']} x {r['context']}" for r in oom)
                     + ".")
    if ours_ok:
        top = max(ours_ok, key=lambda r: r["peak_gib"])
        lines.append(f"The converted models ran {len(ours_ok)} configurations; the largest peak was "
                     f"{_gib(top['peak_gib'])} GiB ({top['model']}, {top['streams']} x {top['context']}).")
    check = results.get("generate_check")
    if check:
        verdicts = ", ".join(f"{name}: {'every row equal' if m['all_equal'] else 'ROWS DIFFER'}"
                             for name, m in check["models"].items())
        lines.append(f"Batched generate(), prompts of {check['prompt_tokens']} tokens left-padded into one batch, "
                     f"{check['new_tokens']} greedy tokens against each prompt alone: {verdicts}.")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> str:
    """Peak memory and tokens/s against streams, one column per context; returns what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    models = [TEACHER, *results["settings"]["recipes"]]
    contexts = results["settings"]["contexts"]
    fig, axes = plt.subplots(2, len(contexts), figsize=(4.6 * len(contexts), 7.5), squeeze=False)
    for col, context in enumerate(contexts):
        mem, speed = axes[0][col], axes[1][col]
        for i, model in enumerate(models):
            rows = [r for r in results["rows"] if r["model"] == model and r["context"] == context]
            ran = [r for r in rows if r["status"] == "ok"]
            oom = [r for r in rows if r["status"] == "out of memory"]
            mem.plot([r["streams"] for r in ran], [r["peak_gib"] for r in ran], "o-", color=f"C{i}", label=model)
            needed = ran[-1:] + oom
            mem.plot([r["streams"] for r in needed], [r.get("peak_gib", r["needs_gib"]) for r in needed], ":",
                     color=f"C{i}")
            mem.plot([r["streams"] for r in oom], [r["needs_gib"] for r in oom], "x", ms=9, mew=2, color=f"C{i}",
                     label=f"{model}: would need (not run)" if oom else None)
            speed.plot([r["streams"] for r in ran], [r["tokens_per_s"] for r in ran], "o-", color=f"C{i}",
                       label=model)
        mem.axhline(results["memory"]["total_gib"], color="k", ls="--", lw=1, label="machine memory")
        mem.set(title=f"{context} tokens of context", xscale="log", yscale="log", ylabel="peak GiB")
        speed.set(xscale="log", yscale="log", xlabel="streams", ylabel="tokens/s (all streams)")
        for ax in (mem, speed):
            ax.set_xticks(results["settings"]["streams"], [str(s) for s in results["settings"]["streams"]])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # the columns share colours; collect every label once
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


# ----- main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--streams", type=int, nargs="+", default=list(STREAMS), help="numbers of streams decoded together")
    add("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="tokens every stream's cache holds")
    add("--recipes", nargs="+", default=list(RECIPES), help="recipes whose attention spec the conversions use")
    add("--repeats", type=int, default=12, help="timed decode steps per configuration, at most")
    add("--min-repeats", type=int, default=3, help="timed decode steps per configuration, at least")
    add("--seconds", type=float, default=6.0, help="stop timing a configuration after this long (once "
        "--min-repeats ran): the big configurations time fewer steps")
    add("--prefill-tokens", type=int, default=128, help="real prefill of our models before the synthetic fill "
        "(at least the hybrid's window + sinks)")
    add("--memory-gib", type=float, default=None, help="the machine's memory (default: MemTotal)")
    add("--headroom", type=float, default=0.1, help="fraction of the machine's memory never planned for")
    add("--threads", type=int, default=1, help="torch threads")
    add("--teacher", default="embedded", help="teacher of the generate() check (load_teacher spec)")
    add("--new-tokens", type=int, default=16, help="greedy tokens per row in the generate() check")
    add("--no-generate-check", action="store_true", help="skip the batched generate() check")
    add("--output", type=Path, default=RESULTS, help="results JSON")
    add("--plot", type=Path, default=PLOT, help="plot PNG")
    add("--quick", action="store_true", help="smoke run: 2k context, 1 and 4 streams, 3 steps, 4 new tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.streams, args.repeats, args.new_tokens = [2048], [1, 4], 3, 4
    args.contexts, args.streams = sorted(args.contexts), sorted(args.streams)
    if min(args.streams) < 1 or min(args.contexts) < args.prefill_tokens:
        p.error(f"--streams must be >= 1 and --contexts >= --prefill-tokens ({args.prefill_tokens})")
    if not 0 <= args.headroom < 1:
        p.error(f"--headroom must be in [0, 1), got {args.headroom}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    total = int(args.memory_gib * GIB) if args.memory_gib else meminfo("MemTotal")
    limit = int(total * (1 - args.headroom))
    available, start = meminfo("MemAvailable"), time.time()
    rows = sweep(args, limit)
    check = None if args.no_generate_check else generate_check(args)
    settings = {key: getattr(args, key) for key in ("streams", "contexts", "recipes", "repeats", "min_repeats",
                                                    "seconds", "prefill_tokens")}
    results = {
        "benchmark": "concurrent_streams",
        "provenance": provenance(corpus=False),
        "settings": {**settings, "weights": "random, SmolLM2-135M-Instruct architecture", "dtype": "float32",
                     "fill": "synthetic (decode.py)"},
        "memory": {"total_gib": total / GIB, "limit_gib": limit / GIB, "headroom": args.headroom,
                   "available_gib_at_start": available / GIB},
        "rows": [{k: v for k, v in row.items() if k != "trace"} for row in rows],
        "generate_check": check,
        "seconds": time.time() - start,
    }
    write_text(args.output, json.dumps(results, indent=1) + "\n")
    print()
    print(render_markdown(results))
    print(plot(results, args.plot))
    failed = [r for r in rows if r["status"] == "error"]
    differ = [name for name, m in (check or {}).get("models", {}).items() if not m["all_equal"]]
    if failed or differ:
        print(f"FAILED: {len(failed)} configuration(s) errored; generate() rows differ for {differ}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
