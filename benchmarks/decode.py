"""Per-token decode latency and cache bytes: hf_recattn mixers against transformers' Llama + DynamicCache.

A SmolLM2-135M-shaped model (30 layers, hidden 576, intermediate 1536, 9 heads, 3 KV heads, head_dim 64,
vocab 49152, tied embeddings), random weights, fp32, batch 1. Every model shares one copy of the weights. For
each model and context the cache is filled to that context, then single-token decode steps (what generate()
runs: one token, its position, the cache, logits of the last position) are timed. The table gives the median
step, the cache bytes, the speed-up over transformers' LlamaForCausalLM with its DynamicCache at the same
context, and the ratio to two floors measured in the same run:

* read floor: one streaming pass over every weight (``sum``), the memory-bound time to read them once;
* gemv floor: one matrix-vector product per weight matrix (``mv``), the least arithmetic any decoder does per
  token, at the speed this CPU's BLAS reaches with batch 1 on weights stored as usual (row-major);
* layout floor: the same products as our decode step runs them: in float32 over the decode layout (q/k/v and
  gate/up fused, column-major; ``hf_recattn/modeling/decode_layout.py``), in bfloat16 over the usual storage, so
  the ratio to it is the step's own overhead.

Our float32 models decode over the decode layout (what ``generate()`` applies to a float32 model on a CPU; in
bfloat16 it does not pay on this CPU and is not applied); ``--row-major`` adds float32 rows of the same models on
the usual storage, for the layout's gain in the same run.

Every model, context and floor runs in each of ``--rounds`` rounds (interleaved), so that load from other
processes on a shared machine hits them alike; medians are over all rounds.

Filling a context (``--fill``):

* ``synthetic`` (default): a real chunked prefill of ``--prefill-tokens`` tokens (default 512, so that window
  layers are full and every state has its real shape); then every KV tensor (one whose token axis grew with
  the prompt) is replaced by random keys/values of the target length and each layer's token count is set to
  the context. A fixed-size recurrent state has the same shape after 512 or 32k tokens and a step's work does
  not depend on its values, so the step costs what it would after a real 32k prefill. Each layer's element
  count is checked against its mixer's ``state_size(context)``. The Llama DynamicCache gets random keys and
  values of the context length. One exception: MesaNet's solver ends once every system has converged, so its
  step's work depends on the state it reads; time its rows with ``--fill real``.
* ``real``: prefill every context for real, in chunks of ``--prefill-tokens`` through the cache (slow: many
  minutes per mixer at 32k on two cores).

``python benchmarks/decode.py --help`` lists the flags; ``--quick`` is a short smoke run.
The results and their provenance go to ``--out`` (default ``benchmarks/results/decode_cpu.json``);
``scripts/render_docs.py`` renders the docs' tables from that file with ``render_markdown``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from results_file import add_out_argument, run_record, write_results
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_recattn import RecAttnCache, RecAttnConfig, RecAttnForCausalLM
from hf_recattn.modeling.decode_layout import project
from hf_recattn.modeling.mixers import MIXERS
from hf_recattn.modeling.presets import PRESETS

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)

#: --tiny: the same 30 layers with widths at which the weight products cost next to nothing
TINY_WIDTHS = dict(hidden_size=72, intermediate_size=96, head_dim=8, vocab_size=256)

#: label -> spec (its mixer a family or a preset); a spec whose mixer is not registered (yet) is skipped with a note
MIXER_SPECS: dict[str, dict] = {
    "softmax": {"mixer": "softmax"},
    "sliding_window(64)": {"mixer": "sliding_window", "window": 64},
    "linear elu": {"mixer": "linear", "feature_map": "elu"},
    "linear hedgehog": {"mixer": "linear", "feature_map": "hedgehog"},
    "linear hedgehog gated+sink": {"mixer": "linear", "feature_map": "hedgehog", "decay": "gated", "sink": True},
    "linear taylor2": {"mixer": "linear", "feature_map": "taylor2"},
    "taylor(2)": {"mixer": "taylor", "order": 2},
    "heinsen": {"mixer": "heinsen"},
    "hybrid(64)+hedgehog": {"mixer": "hybrid", "window": 64},
    "hybrid(64,sink4)+hedgehog": {"mixer": "hybrid", "window": 64, "sink_tokens": 4},
    "hybrid(64,cache64)+hedgehog": {"mixer": "hybrid", "window": 64, "cache_slots": 64},
    "hybrid(64,cache64,novelty)+hedgehog": {"mixer": "hybrid", "window": 64, "cache_slots": 64,
                                             "cache_score": "novelty"},
    "deltanet": {"mixer": "deltanet"},  # presets (hf_recattn/modeling/presets.py)
    "gdn": {"mixer": "gdn"},
    "comba": {"mixer": "comba"},
    "deltaproduct": {"mixer": "deltaproduct"},
    "alibi": {"mixer": "alibi"},
    "fox": {"mixer": "fox"},
    "mesanet": {"mixer": "mesanet"},
    "mesanet convert-init": {"mixer": "mesanet", "init": "convert"},  # the gates a conversion starts from
    "deltaformer": {"mixer": "deltaformer"},
    "path": {"mixer": "path"},
    "gla": {"mixer": "gla"},
    "retnet": {"mixer": "retnet"},
    "rwkv7": {"mixer": "rwkv7"},
}
BASELINE = "llama+DynamicCache"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTEXTS = (512, 2048, 8192, 32768)
Step = Callable[[], object]


@dataclass
class Row:
    label: str
    kind: str
    dtype: str
    nbytes: dict[int, int] = field(default_factory=dict)


# ----- timing ---------------------------------------------------------------------------------------------
def _time_once(fn: Step) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def round_robin(steppers: dict[str, Step], repeats: int, warmup: int, rounds: int) -> dict[str, float]:
    """Median ms per stepper; every stepper runs in every round."""
    samples: dict[str, list[float]] = {key: [] for key in steppers}
    for fn in steppers.values():
        for _ in range(warmup):
            fn()
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for key, fn in steppers.items():
            samples[key] += [_time_once(fn) for _ in range(per_round)]
    return {key: statistics.median(s) for key, s in samples.items()}


def weight_passes(model: torch.nn.Module) -> tuple[dict[str, Step], int]:
    """The read and gemv floors over every distinct parameter, and the bytes they read."""
    params = list({p.data_ptr(): p.detach() for p in model.parameters()}.values())
    vectors = {p.shape[1]: torch.randn(p.shape[1]) for p in params if p.dim() == 2}

    def read() -> None:
        for p in params:
            p.sum()

    def gemv() -> None:
        for p in params:
            if p.dim() == 2:
                torch.mv(p, vectors[p.shape[1]])
            else:
                p.sum()

    return {"floor:read": read, "floor:gemv": gemv}, sum(p.numel() * p.element_size() for p in params)


def layout_pass(model: RecAttnForCausalLM) -> Step:
    """The weight products of one decode step as the model stores them: q/k/v, o, gate/up, down, head."""
    layers = [(block.self_attn, block.mlp) for block in model.model.layers]
    dtype = model.lm_head.weight.dtype
    x = torch.randn(1, 1, model.config.hidden_size, dtype=dtype)
    h = torch.randn(1, 1, model.config.intermediate_size, dtype=dtype)
    memos = [({}, {}) for _ in layers]

    def run() -> None:
        for (attn, mlp), (qkv_memo, mlp_memo) in zip(layers, memos, strict=True):
            project((attn.q_proj, attn.k_proj, attn.v_proj), x, qkv_memo)
            attn.o_proj(x)
            project((mlp.gate_proj, mlp.up_proj), x, mlp_memo)
            mlp.down_proj(h)
        model.lm_head(x)

    return run


def decode_step(model: torch.nn.Module, cache: object, seen: Callable[[], int], batch: int = 1) -> Step:
    """One generate()-style decode step: a single token per sequence at its position, no padding mask."""
    token = torch.full((batch, 1), 17)

    def step() -> object:
        pos = torch.full((batch, 1), seen())
        return model(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True,
                     logits_to_keep=1)

    return step


# ----- transformers baseline --------------------------------------------------------------------------------
def llama_model(max_positions: int) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPE, max_position_embeddings=max_positions, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def llama_cache(model: LlamaForCausalLM, context: int) -> DynamicCache:
    """A DynamicCache holding `context` random keys/values per layer (in the model's dtype)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(context)
    for layer in range(cfg.num_hidden_layers):
        shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
        keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        cache.update(keys.to(dtype), values.to(dtype), layer)
    return cache


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


# ----- hf_recattn models ------------------------------------------------------------------------------------
def recattn_model(spec: dict, max_positions: int, weights: dict[str, torch.Tensor],
                  row_major: bool = False) -> RecAttnForCausalLM:
    """Our model with `spec` in every layer, sharing (not copying) `weights`; `row_major` keeps the usual storage
    (no decode layout)."""
    config = RecAttnConfig(**SHAPE, max_position_embeddings=max_positions, attention=spec)
    config._attn_implementation = "sdpa"
    model = RecAttnForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or any(".mixer." not in name for name in missing):
        raise RuntimeError(f"weights do not map onto {spec}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if row_major:
        model.decode_layout(False)
    return model


def laid_out_weights(weights: dict[str, torch.Tensor], max_positions: int) -> dict[str, torch.Tensor]:
    """The shared weights in the decode layout, once: models loaded from them find it in place (no copies)."""
    template = recattn_model({"mixer": "linear", "feature_map": "elu"}, max_positions, weights)
    template.decode_layout()
    return {key: value for key, value in template.state_dict().items() if ".mixer." not in key}


def filled_cache(model: RecAttnForCausalLM, context: int, args: argparse.Namespace) -> RecAttnCache:
    """A cache holding `context` tokens (see the module docstring for the two ways)."""
    cache = model.new_cache()
    chunk = min(args.prefill_tokens, context)
    gen = torch.Generator().manual_seed(context)
    todo = context if args.fill == "real" else chunk
    done = 0
    while done < todo:
        n = min(chunk, todo - done)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=gen)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        done += n
    if context > done:
        for layer in cache.layers:
            if layer.kind == "kv":
                layer.state = {name: _grown(t, done, context, gen) for name, t in layer.state.items()}
            layer.seen_tokens = context
    check_state_sizes(model, cache, context)
    return cache


def _grown(t: torch.Tensor, done: int, context: int, gen: torch.Generator) -> torch.Tensor:
    if t.dim() < 3 or t.shape[2] != done:
        return t
    return torch.randn(*t.shape[:2], context, *t.shape[3:], generator=gen).to(t.dtype)


def check_state_sizes(model: RecAttnForCausalLM, cache: RecAttnCache, context: int) -> None:
    """Every layer must hold what its mixer's state_size says for this context (guards the synthetic fill)."""
    for block, layer in zip(model.model.layers, cache.layers, strict=True):
        mixer = block.self_attn.mixer
        held = sum(t.numel() for t in layer.state.values())
        if held != mixer.state_size(context):
            raise RuntimeError(
                f"layer {layer.layer_idx} ({mixer.name}): cache holds {held} elements at context {context}, "
                f"state_size says {mixer.state_size(context)}; raise --prefill-tokens or use --fill real"
            )


# ----- report -----------------------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def render_markdown(results: dict) -> str:
    """The floors line, the table (one row per model and context) and the notes of a results file."""
    contexts, weight_bytes, floors = results["contexts"], results["weight_bytes"], results["floors"]
    read, gemv, layouts = floors["read"], floors["gemv"], floors["layout"]
    rows = results["rows"]
    base = rows[0]
    speeds = ", ".join(f"layout {ms:.1f} ms ({weight_bytes / ms / 1e6:.1f} GB/s{' ' + d if len(layouts) > 1 else ''})"
                       for d, ms in layouts.items())
    lines = [
        f"floors ({weight_bytes / 2**20:.0f} MiB of weights): read {read:.1f} ms "
        f"({weight_bytes / read / 1e6:.1f} GB/s), gemv {gemv:.1f} ms ({weight_bytes / gemv / 1e6:.1f} GB/s), {speeds}",
        "",
        f"| model | cache | context | ms/token | cache | x faster than {base['label']} | / gemv floor "
        "| / layout floor | / read floor | vs own first context |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        first = row["ms"][0]
        layout = layouts.get(row["dtype"])
        for c, ms, nbytes, base_ms in zip(contexts, row["ms"], row["cache_bytes"], base["ms"], strict=True):
            lines.append(
                f"| {row['label']} | {row['kind']} | {c} | {ms:.1f} | {_fmt_bytes(nbytes)} | "
                f"{base_ms / ms:.2f} | {ms / gemv:.2f} | {ms / layout:.2f} | {ms / read:.2f} | "
                f"{ms / first - 1:+.0%} |"
            )
    lines += ["", *results["notes"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="contexts to decode at")
    add("--repeats", type=int, default=24, help="timed steps per model and context (median)")
    add("--rounds", type=int, default=4, help="interleave all models and floors in this many rounds")
    add("--warmup", type=int, default=3, help="untimed steps per model and context first")
    add("--mixers", nargs="+", default=None, help=f"labels to run (default all): {list(MIXER_SPECS)}")
    add("--fill", choices=("synthetic", "real"), default="synthetic", help="how contexts are filled")
    add("--prefill-tokens", type=int, default=512, help="real prefill (chunk size with --fill real)")
    add("--threads", type=int, default=1,
        help="torch threads (1: two OpenMP threads stall when another process shares a core)")
    add("--no-baseline", action="store_true", help="skip transformers' Llama (ratios vs first row)")
    add("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"],
        help="weight / activation dtypes: each gets its own rows (Llama's included), labelled [bf16]")
    add("--row-major", action="store_true",
        help="also time every model on the usual row-major weights (rows labelled [row-major])")
    add("--compiled", action="store_true",
        help="also time every fixed-state model with model.compile_decode() (rows labelled [compiled])")
    add("--tiny", action="store_true",
        help="every width tiny (hidden 72, intermediate 96, head_dim 8, vocab 256; 30 layers as before): the products "
             "cost next to nothing, so a step's time is its overhead (Python, op dispatch, small ops)")
    add("--quick", action="store_true", help="smoke run: contexts 512 2048, 6 repeats, 2 rounds")
    add_out_argument(p, "decode_cpu.json")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.repeats, args.rounds, args.warmup = [512, 2048], 6, 2, 1
    return args


@dataclass
class Bench:
    """What ``main`` measures: the rows, every step to time (floors first, in the order they interleave) and the
    models those steps need kept alive."""

    args: argparse.Namespace
    contexts: list[int]
    max_positions: int
    notes: list[str]
    steppers: dict[str, Step]
    rows: list[Row] = field(default_factory=list)
    keep_alive: list[object] = field(default_factory=list)

    def add_row(self, label: str, kind: str, model: torch.nn.Module, cache_for: Callable[[int], object],
                dtype: str) -> None:
        row = Row(label, kind, dtype)
        for c in self.contexts:
            cache = cache_for(c)
            row.nbytes[c] = cache.nbytes() if isinstance(cache, RecAttnCache) else dynamic_cache_bytes(cache)
            self.steppers[f"{label}@{c}"] = decode_step(model, cache, cache.get_seq_length)
        self.rows.append(row)

    def add_dtype(self, name: str, llama: LlamaForCausalLM, weights: dict[str, torch.Tensor],
                  labels: list[str]) -> None:
        """The baseline and every mixer row in the dtype ``name``, all models sharing the Llama's weights."""
        dtype, tag = DTYPES[name], "" if name == "fp32" else f" [{name}]"
        base = llama if dtype == torch.float32 else copy.deepcopy(llama).to(dtype)
        with torch.inference_mode(False), torch.no_grad():  # views of inference tensors cannot be weights
            plain = {key: value.to(dtype) for key, value in weights.items()}
            # the layout is what generate() applies to a float32 model; bfloat16 models keep the usual storage
            shared = laid_out_weights(plain, self.max_positions) if dtype == torch.float32 else plain
        self.keep_alive.append(base)
        if not self.args.no_baseline:
            self.add_row(BASELINE + tag, "kv", base, lambda c, base=base: llama_cache(base, c), name)
        for label in labels:
            self.add_mixer(label, name, tag, (plain, shared), first=label == labels[0])

    def add_mixer(self, label: str, name: str, tag: str, weights: tuple[dict[str, torch.Tensor], ...],
                  first: bool) -> None:
        """The row of ``label`` in the dtype ``name`` and its [row-major] / [compiled] twins (``weights``: the plain
        and the laid-out copies); ``first`` also times the layout floor on its model."""
        args, (plain, shared) = self.args, weights
        spec = MIXER_SPECS[label]
        if spec["mixer"] not in MIXERS and spec["mixer"] not in PRESETS:
            self.notes.append(f"skipped {label}: mixer {spec['mixer']!r} is not registered")
            return
        model = recattn_model(spec, self.max_positions, shared).to(DTYPES[name])  # the mixers' own parameters too
        if first:
            self.steppers[f"floor:layout@{name}"] = layout_pass(model)
        self.keep_alive.append(model)
        kinds = sorted({block.self_attn.mixer.state_kind for block in model.model.layers})
        if args.fill == "synthetic" and any(b.self_attn.mixer.name == "mesa" for b in model.model.layers):
            self.notes.append(f"{label}{tag}: its solver's work depends on the state; these rows hold a "
                              f"{args.prefill_tokens}-token state (--fill real for a real one)")
        self.add_row(label + tag, "/".join(kinds), model, lambda c, model=model: filled_cache(model, c, args), name)
        twins = {"[row-major]": args.row_major and shared is not plain, "[compiled]": args.compiled and kinds != ["kv"]}
        for suffix in (key for key, wanted in twins.items() if wanted):
            twin = recattn_model(spec, self.max_positions, plain if suffix == "[row-major]" else shared,
                                 row_major=suffix == "[row-major]").to(DTYPES[name])
            if suffix == "[compiled]":
                twin.compile_decode()
            self.keep_alive.append(twin)
            self.add_row(f"{label}{tag} {suffix}", "/".join(kinds), twin,
                         lambda c, twin=twin: filled_cache(twin, c, args), name)
        print(f"filled {label}{tag}", flush=True)

    def results(self, weight_bytes: int, medians: dict[str, float]) -> dict[str, object]:
        """The results file's measurements (``write_results`` adds the record)."""
        return {
            "settings": {key: value for key, value in vars(self.args).items() if key != "out"},
            "contexts": self.contexts,
            "weight_bytes": weight_bytes,
            "floors": {"read": medians["floor:read"], "gemv": medians["floor:gemv"],
                       "layout": {key.split("@")[1]: ms for key, ms in medians.items()
                                  if key.startswith("floor:layout@")}},
            "rows": [{"label": row.label, "kind": row.kind, "dtype": row.dtype,
                      "ms": [medians[f"{row.label}@{c}"] for c in self.contexts],
                      "cache_bytes": [row.nbytes[c] for c in self.contexts]} for row in self.rows],
            "notes": self.notes,
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        SHAPE.update(TINY_WIDTHS)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = run_record()
    contexts = sorted(args.contexts)
    max_positions = max(contexts) + args.warmup + args.repeats + 64
    labels = args.mixers or list(MIXER_SPECS)
    unknown = [label for label in labels if label not in MIXER_SPECS]
    if unknown:
        raise SystemExit(f"unknown --mixers {unknown}; known: {list(MIXER_SPECS)}")
    notes = [
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fill={args.fill}, median of "
        f"{args.rounds * max(1, args.repeats // args.rounds)} steps per cell, all rows and floors "
        f"interleaved in {args.rounds} rounds"
    ]
    if args.tiny:
        notes.append(f"--tiny: {TINY_WIDTHS}, so ms/token is the steps' overhead; the floor columns mean nothing")
    llama = llama_model(max_positions)
    weights = llama.state_dict()
    floors, weight_bytes = weight_passes(llama)
    bench = Bench(args, contexts, max_positions, notes, dict(floors))
    with torch.inference_mode():
        for name in args.dtypes:
            bench.add_dtype(name, llama, weights, labels)
        medians = round_robin(bench.steppers, args.repeats, args.warmup, args.rounds)
    results = write_results(args.out, "decode", record, bench.results(weight_bytes, medians))
    print()
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
