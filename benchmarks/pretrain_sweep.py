"""The Taylor-series view of softmax (Mongaras & Larson, arXiv:2507.23632) in miniature: pretrain one tiny Llama per
attention mixer on the same tokens and compare the losses.

The paper (softmax as a sum of RNNs, by its Taylor expansion) claims that the order-N Taylor recurrent softmax
approaches softmax as N grows, ranks its denominators (exact, gate, vector norms) and calls linear attention the
first order. Each run here trains the same model from the same initial weights on the same token blocks in the
same order with the same hyperparameters; only the mixer of every layer differs.

* Model (``--scale 1``): a Llama with hidden 256, 4 layers, 4 heads of 64, 2 KV heads, SwiGLU 768, RoPE,
  tied embeddings: 3.15M non-embedding parameters (+ 1.05M in the tied 4096 x 256 embedding). Parameters shared
  by every mixer (embeddings, norms, projections, MLPs) start from the same seeded values in every run; a
  mixer's own parameters (gates, norms, convolutions) are initialized by the model from the same seed.
* Tokenizer: a byte-level BPE with ``--vocab`` (4096) entries trained with ``tokenizers`` on the first 2M
  characters of the training split, so that the embedding does not dominate the model as SmolLM2's 49k would.
* Data: the embedded corpus (``hf_recattn.data.corpus``), with its fixed held-out split (``load_splits``),
  packed into blocks of 256 tokens (``token_blocks``); the training blocks are shuffled once with the seed and
  read in that order (Trainer's sequential sampler) by every run; 32 held-out blocks (8,192 tokens).
* Training: transformers' Trainer, fp32, batch 8 x 256 = 2,048 tokens per step, 100 steps (205k tokens), AdamW
  (lr 2e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1), linear warmup over 10% of the steps then cosine to 0,
  gradient clipping at 1.0 for every run, seed 0. Train loss is logged every ``--log-every`` steps (the mean
  over those steps), held-out loss at ``--evals`` evenly spaced points (the last at the final step).
  Taylor runs train in their parallel form (``chunk_size`` = the block): the same function as the chunked
  form, which at order >= 2 carries C(64+N, N) x 64 packed states per head (order 3: 47,905 x 64) and is
  slower, or out of memory, at this size. Every other mixer picks its form itself.
* ``--scale N`` multiplies hidden/intermediate size, heads, KV heads and layers by N and the tokens by N^2
  (batch x N, steps x N) for a GPU; ``--quick`` is a smoke run of every mixer for a few steps on a tiny model.

Results go to a JSON (``benchmarks/results/pretrain_sweep.json``), rewritten atomically after each run; a
rerun skips the runs already done with the same configuration (resume) and refuses a file made with another.
A plot (``docs/pretrain_sweep.png``, matplotlib) and a table (final held-out loss and perplexity, ratio to
softmax, training tokens/s) are made from the whole file. Nothing else is saved.

    nice .venv/bin/python benchmarks/pretrain_sweep.py --threads 1         # the sweep: ~50 min on 2 quiet cores
    .venv/bin/python benchmarks/pretrain_sweep.py --quick                  # smoke run, writes under runs/
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BASELINE = "softmax"
TAYLOR_DENOMINATORS = ("exact", "gate", "l2", "rms", "layernorm")
EOS = "<|endoftext|>"
RESULTS = Path("benchmarks/results/pretrain_sweep.json")
PLOT = Path("docs/pretrain_sweep.png")
QUICK_RESULTS = Path("runs/pretrain_sweep_quick.json")
QUICK_PLOT = Path("runs/pretrain_sweep_quick.png")
TOKENIZER_CHARS = 2_000_000


def _runs() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(default runs, extra runs selectable with --runs): label -> mixer spec."""
    runs: dict[str, dict[str, Any]] = {BASELINE: {"mixer": "softmax"}}
    for fm in ("elu", "relu", "cosine"):
        runs[f"linear {fm}"] = {"mixer": "linear", "feature_map": fm}
    for order in (1, 2, 3, 4):
        for den in TAYLOR_DENOMINATORS:
            if den == "exact" and order % 2:  # T_N(x) < 0 somewhere for odd N: the mixer refuses it
                continue
            runs[f"taylor{order} {den}"] = {"mixer": "taylor", "order": order, "denominator": den}
    runs["heinsen"] = {"mixer": "heinsen"}
    runs["deltanet"] = {"mixer": "deltanet"}
    runs["gdn"] = {"mixer": "gdn"}
    extra = {f"taylor exp {den}": {"mixer": "taylor", "order": "exp", "denominator": den}
             for den in TAYLOR_DENOMINATORS[1:]}  # the paper's Gate and Norm models use the exact exponential
    return runs, extra


RUNS, EXTRA_RUNS = _runs()
ALL_RUNS = {**RUNS, **EXTRA_RUNS}


# ----- configuration ----------------------------------------------------------------------------------------
def sweep_config(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that decides a run's losses (not the threads): a rerun must match it to resume."""
    n = args.scale
    model = dict(hidden_size=256 * n, intermediate_size=768 * n, num_hidden_layers=4 * n,
                 num_attention_heads=4 * n, num_key_value_heads=2 * n, head_dim=64, vocab_size=args.vocab,
                 max_position_embeddings=args.block_size, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 rope_theta=10000.0)
    if args.quick:
        model.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32)
    return {
        "model": model,
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": args.vocab,
                      "trained_on_chars": args.tokenizer_chars},
        "data": {"corpus": "embedded", "heldout_fraction": 0.05, "block_size": args.block_size,
                 "eval_blocks": args.eval_blocks},
        "train": {"steps": args.steps * (1 if args.quick else n), "batch_size": args.batch_size * n,
                  "lr": args.lr, "betas": [0.9, 0.95], "adam_eps": 1e-8, "weight_decay": 0.1,
                  "warmup_ratio": 0.1, "schedule": "cosine", "max_grad_norm": 1.0, "precision": "fp32",
                  "seed": args.seed, "log_every": args.log_every, "evals": args.evals},
        "taylor_form": "parallel (chunk_size = block_size)",
    }


def run_spec(label: str, block_size: int) -> dict[str, Any]:
    """The spec a run trains: Taylor runs in their parallel form (see the module docstring)."""
    spec = copy.deepcopy(ALL_RUNS[label])
    if spec["mixer"] == "taylor":
        spec["chunk_size"] = block_size
    return spec


# ----- results file (pure logic, tested in tests/test_pretrain_sweep.py) ----------------------------------------
def load_results(path: Path) -> dict[str, Any] | None:
    """The results JSON at ``path``, or None when there is none yet."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict) or "config" not in data:
        raise ValueError(f"{path}: not a pretrain_sweep results file (needs 'config' and 'runs')")
    return data


def config_mismatch(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configurations."""
    keys = sorted(set(old) | set(new))
    diffs: list[str] = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_mismatch(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}")
    return diffs


def start_results(existing: dict[str, Any] | None, config: dict[str, Any], fresh: bool, where: str) -> dict[str, Any]:
    """The results to continue: ``existing`` when its configuration matches, a new file when none or ``fresh``."""
    if existing is None or fresh:
        return {"config": config, "runs": {}}
    old = copy.deepcopy(existing["config"])
    old.get("tokenizer", {}).pop("vocab_digest", None)  # known only once the tokenizer is trained
    diffs = config_mismatch(old, config)
    if diffs:
        raise ValueError(f"{where} was made with another configuration (differs in {', '.join(diffs)}); "
                         "pass --fresh to start over or --out for another file")
    return existing


def pending_runs(requested: Sequence[str], results: dict[str, Any]) -> list[str]:
    """The requested runs not finished in ``results`` (a failed run is tried again), in the requested order."""
    done = {label for label, run in results["runs"].items() if run.get("status") == "done"}
    return [label for label in dict.fromkeys(requested) if label not in done]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (indented by 1, keys in their order) through a temporary file and a rename."""
    from hf_recattn.atomic import write_json

    write_json(path, data, indent=1, sort_keys=False)


def parse_labels(labels: Iterable[str] | None) -> list[str]:
    """Run labels, checked; None gives the default runs."""
    if labels is None:
        return list(RUNS)
    labels = list(labels)
    unknown = [label for label in labels if label not in ALL_RUNS]
    if unknown:
        raise ValueError(f"unknown --runs {unknown}; known: {list(ALL_RUNS)}")
    return labels


# ----- data ---------------------------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab_size: int, max_chars: int) -> Any:
    """A byte-level BPE trained on the first ``max_chars`` characters of ``texts``, as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def sample() -> Iterable[str]:
        total = 0
        for text in texts:
            yield text
            total += len(text)
            if total >= max_chars:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def build_data(config: dict[str, Any], seed: int) -> tuple[Any, Any, str]:
    """(train blocks [N, T] in training order, held-out blocks, tokenizer digest)."""
    import torch

    from hf_recattn.data.corpus import load_splits, token_blocks

    data, train = config["data"], config["train"]
    train_texts, heldout_texts = load_splits(None, data["heldout_fraction"])
    tokenizer = train_tokenizer(train_texts, config["tokenizer"]["vocab_size"],
                                config["tokenizer"]["trained_on_chars"])
    digest = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]
    block = data["block_size"]
    wanted = train["steps"] * train["batch_size"] * block
    blocks = token_blocks(tokenizer, train_texts, block, max_tokens=wanted, seed=seed)
    blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))]
    heldout = token_blocks(tokenizer, heldout_texts, block, max_tokens=data["eval_blocks"] * block, seed=seed)
    return blocks, heldout, digest


# ----- one run ------------------------------------------------------------------------------------------------
def build_model(config: dict[str, Any], spec: dict[str, Any] | str, shared: dict[str, Any] | None) -> Any:
    """The model with ``spec`` in every layer; shared parameters copied from ``shared`` (softmax init)."""
    import torch

    from hf_recattn import RecAttnConfig, RecAttnForCausalLM

    torch.manual_seed(config["train"]["seed"])
    cfg = RecAttnConfig(**config["model"], attention=spec, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = RecAttnForCausalLM(cfg)
    if shared is not None:
        missing, unexpected = model.load_state_dict(shared, strict=False)
        if unexpected or any(".mixer." not in name for name in missing):
            raise RuntimeError(f"shared weights do not map onto {spec}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model


def _eval_steps(steps: int, evals: int) -> list[int]:
    return sorted({max(1, round(steps * (i + 1) / evals)) for i in range(evals)})


def train_one(config: dict[str, Any], spec: dict[str, Any], shared: dict[str, Any], blocks: Any,
              heldout: Any) -> dict[str, Any]:
    """Train one run with transformers' Trainer; its curves, final held-out loss and tokens/s."""
    import torch
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    train = config["train"]
    model = build_model(config, spec, shared)
    eval_at = set(_eval_steps(train["steps"], train["evals"]))
    step_seconds: list[float] = []

    class Clock(TrainerCallback):
        """Times each optimizer step (forward, backward, clip, AdamW, schedule); asks for the evaluations."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_seconds.append(time.perf_counter() - self.start)
            if state.global_step in eval_at:
                control.should_evaluate = True

    def dataset(x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": row, "labels": row} for row in x]

    with tempfile.TemporaryDirectory(prefix="pretrain-sweep-") as out:
        args = TrainingArguments(
            output_dir=out, max_steps=train["steps"], per_device_train_batch_size=train["batch_size"],
            per_device_eval_batch_size=train["batch_size"], learning_rate=train["lr"],
            adam_beta1=train["betas"][0], adam_beta2=train["betas"][1], adam_epsilon=train["adam_eps"],
            weight_decay=train["weight_decay"], lr_scheduler_type=train["schedule"],
            warmup_steps=train["warmup_ratio"], max_grad_norm=train["max_grad_norm"], optim="adamw_torch",
            logging_strategy="steps", logging_steps=train["log_every"], eval_strategy="no", save_strategy="no",
            report_to="none", seed=train["seed"], data_seed=train["seed"], train_sampling_strategy="sequential",
            dataloader_num_workers=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset(blocks), eval_dataset=dataset(heldout),
                          callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)  # the table and the JSON report the losses
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    history = trainer.state.log_history
    curve = [[h["step"], h["loss"]] for h in history if "loss" in h]
    evals = [[h["step"], h["eval_loss"]] for h in history if "eval_loss" in h]
    tokens = train["steps"] * train["batch_size"] * config["data"]["block_size"]
    final = evals[-1][1] if evals else float("nan")
    return {
        "status": "done", "spec": spec,
        "mixer_parameters": sum(p.numel() for n, p in model.named_parameters() if ".mixer." in n),
        "non_embedding_parameters": sum(p.numel() for n, p in model.named_parameters() if "embed" not in n),
        "train_loss": curve, "heldout_loss": evals, "final_heldout_loss": final,
        "final_perplexity": math.exp(final) if math.isfinite(final) and final < 700 else float("inf"),
        "train_tokens": tokens, "train_seconds": sum(step_seconds), "wall_seconds": wall,
        "tokens_per_second": tokens / sum(step_seconds) if step_seconds else float("nan"),
    }


# ----- report -------------------------------------------------------------------------------------------------
def render_table(results: dict[str, Any]) -> str:
    """Markdown table of every finished run, in the sweep's order, against the softmax run."""
    order = [label for label in ALL_RUNS if label in results["runs"]]
    order += [label for label in results["runs"] if label not in order]
    base = results["runs"].get(BASELINE, {})
    lines = ["| run | final held-out loss | perplexity | ppl / softmax | final train loss | tokens/s "
             "| tokens/s / softmax |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label in order:
        run = results["runs"][label]
        if run.get("status") != "done":
            lines.append(f"| {label} | failed: {run.get('error', '?')} | | | | | |")
            continue
        ppl, tps = run["final_perplexity"], run["tokens_per_second"]
        train_loss = run["train_loss"][-1][1] if run["train_loss"] else float("nan")
        ratio = f"{ppl / base['final_perplexity']:.3f}" if base.get("status") == "done" else "-"
        speed = f"{tps / base['tokens_per_second']:.2f}" if base.get("status") == "done" else "-"
        lines.append(f"| {label} | {run['final_heldout_loss']:.4f} | {ppl:.2f} | {ratio} | {train_loss:.4f} "
                     f"| {tps:,.0f} | {speed} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Loss curves and final held-out loss by Taylor order; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    runs = {k: v for k, v in results["runs"].items() if v.get("status") == "done"}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    styles = {"exact": "-", "gate": ":", "l2": "--", "rms": "-.", "layernorm": (0, (5, 1, 1, 1, 1, 1))}
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green", 4: "tab:red", "exp": "tab:purple"}
    for label, run in runs.items():
        steps, losses = zip(*run["train_loss"], strict=True) if run["train_loss"] else ((), ())
        spec = run["spec"]
        if spec["mixer"] == "taylor":
            axes[1].plot(steps, losses, color=colors.get(spec["order"], "gray"),
                         linestyle=styles.get(spec["denominator"], "-"), label=label, linewidth=1.2)
        else:
            axes[0].plot(steps, losses, label=label, linewidth=1.4,
                         color="black" if label == BASELINE else None)
    if BASELINE in runs and runs[BASELINE]["train_loss"]:
        steps, losses = zip(*runs[BASELINE]["train_loss"], strict=True)
        axes[1].plot(steps, losses, color="black", linewidth=1.6, label=BASELINE)
    for den, style in styles.items():
        points = sorted((run["spec"]["order"], run["final_heldout_loss"]) for run in runs.values()
                        if run["spec"]["mixer"] == "taylor" and run["spec"]["denominator"] == den
                        and isinstance(run["spec"]["order"], int))
        if points:
            axes[2].plot(*zip(*points, strict=True), marker="o", linestyle=style, label=f"taylor {den}")
    for label, run in runs.items():
        if run["spec"]["mixer"] != "taylor":
            axes[2].axhline(run["final_heldout_loss"], linewidth=0.8, color="black" if label == BASELINE else None,
                            linestyle="-" if label == BASELINE else ":", label=label)
    axes[0].set_title("train loss: softmax, linear, heinsen, delta")
    axes[1].set_title("train loss: taylor (colour = order, line = denominator)")
    axes[2].set_title("final held-out loss by Taylor order")
    for ax in axes[:2]:
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
    axes[2].set_xlabel("Taylor order N")
    axes[2].set_ylabel("held-out loss")
    axes[2].set_xticks([1, 2, 3, 4])
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    if any(run["train_loss"] for run in runs.values()):
        low = min(loss for run in runs.values() for _, loss in run["train_loss"])
        high = sorted(loss for run in runs.values() for _, loss in run["train_loss"])
        top = high[int(len(high) * 0.9)] if len(high) > 10 else high[-1]  # cut only the first steps' spike
        for ax in axes[:2]:
            ax.set_ylim(low - 0.1, top + 0.1)
    fig.suptitle(f"pretrain sweep ({results['config']['model']['num_hidden_layers']} layers, hidden "
                 f"{results['config']['model']['hidden_size']}, {results['config']['train']['steps']} steps)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--runs", nargs="+", default=None, help=f"runs to do (default: the {len(RUNS)} of the sweep); also "
        f"{list(EXTRA_RUNS)}; known: {list(ALL_RUNS)}")
    add("--scale", type=int, default=1, help="width/depth x N, tokens x N^2 (for a GPU)")
    add("--steps", type=int, default=100, help="optimizer steps per run (x scale)")
    add("--batch-size", type=int, default=8, help="blocks per step (x scale)")
    add("--block-size", type=int, default=256, help="tokens per block")
    add("--lr", type=float, default=2e-3, help="peak learning rate")
    add("--vocab", type=int, default=4096, help="BPE vocabulary size")
    add("--tokenizer-chars", type=int, default=TOKENIZER_CHARS, help="characters the tokenizer is trained on")
    add("--eval-blocks", type=int, default=32, help="held-out blocks")
    add("--evals", type=int, default=4, help="held-out evaluations per run (evenly spaced, the last at the end)")
    add("--log-every", type=int, default=4, help="log the train loss every N steps")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=1, help="torch threads (1: steadier on a shared 2-core machine)")
    add("--out", type=Path, default=None, help=f"results JSON (default {RESULTS})")
    add("--plot", type=Path, default=None, help=f"plot PNG (default {PLOT})")
    add("--fresh", action="store_true", help="discard the runs already in --out")
    add("--quick", action="store_true", help="smoke run: every run, a tiny model, a few steps, under runs/")
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error("--scale must be >= 1")
    if args.quick:
        args.steps, args.batch_size, args.block_size, args.vocab = 4, 2, 128, 512
        args.tokenizer_chars, args.eval_blocks, args.evals, args.log_every = 200_000, 2, 2, 1
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    args.plot = args.plot or (QUICK_PLOT if args.quick else PLOT)
    try:
        args.labels = parse_labels(args.runs)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/pretrain_sweep.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command}", flush=True)
    config = sweep_config(args)
    try:
        results = start_results(load_results(args.out), config, args.fresh, str(args.out))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    todo = pending_runs(args.labels, results)
    if todo:
        started = time.perf_counter()
        blocks, heldout, digest = build_data(config, args.seed)
        config["tokenizer"]["vocab_digest"] = digest
        if results["config"].get("tokenizer", {}).get("vocab_digest", digest) != digest:
            raise SystemExit(f"{args.out}: the tokenizer came out different from the one of the runs in it; "
                             "pass --fresh")
        results["config"] = config
        print(f"data: {blocks.shape[0]} train blocks x {blocks.shape[1]} tokens, {heldout.shape[0]} held-out "
              f"blocks, tokenizer {digest} ({time.perf_counter() - started:.0f} s)", flush=True)
        shared = build_model(config, {"mixer": "softmax"}, None).state_dict()
    for i, label in enumerate(todo, 1):
        spec = run_spec(label, config["data"]["block_size"])
        print(f"[{i}/{len(todo)}] {label}: {json.dumps(spec)}", flush=True)
        try:
            run = train_one(config, spec, shared, blocks, heldout)
        except (RuntimeError, ValueError) as err:  # a failed run is recorded and tried again next time
            run = {"status": "failed", "spec": spec, "error": f"{type(err).__name__}: {err}"[:500]}
        run.update(threads=torch.get_num_threads(), torch=torch.__version__, command=command,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        results["runs"][label] = run
        write_json_atomic(args.out, results)
        if run["status"] == "done":
            print(f"    held-out loss {run['final_heldout_loss']:.4f}, {run['tokens_per_second']:,.0f} tokens/s, "
                  f"{run['wall_seconds']:.0f} s", flush=True)
        else:
            print(f"    failed: {run['error']}", flush=True)
    skipped = len(args.labels) - len(todo)
    model = config["model"]
    print(f"\ncommand: {command}")
    print(f"model: hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
          f"{model['num_attention_heads']} heads x {model['head_dim']}, {model['num_key_value_heads']} KV heads, "
          f"vocab {model['vocab_size']} (byte-level BPE); {config['train']['steps']} steps x "
          f"{config['train']['batch_size']} x {config['data']['block_size']} tokens; results {args.out}"
          + (f" ({skipped} run(s) already there, skipped)" if skipped else ""))
    print()
    print(render_table(results))
    why = plot(results, args.plot)
    print(f"\n{why}" if why else f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
