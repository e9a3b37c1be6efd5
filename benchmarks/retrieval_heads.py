"""How many retrieval heads a model needs: choose KV heads that keep exact softmax, then run the passkey probe.

For each ``--budgets`` value the greedy search (``hf_recattn.conversion.retrieval_heads``) chooses at most that
many KV heads on the chosen ``--objective``; the model that keeps them runs the passkey probe (seed 0, the
Pareto table's prompts) at ``--passkey-lengths``. Objectives:

* ``training-text`` (what the conversion recipes use): secret numbers and associative-recall facts hidden in
  training text of the embedded corpus, in other words than the probe's;
* ``passkey-format``: the probe's own template and filler with other keys (seed 1): an upper bound on what a
  better objective could reach, not a fair evaluation.

``--model`` is ``window`` (the teacher with a 64-token window and 4 sinks, nothing trained) or a converted
checkpoint folder. Cache: the model's decode state per sequence at 8,192 tokens against the teacher's KV cache.

    python benchmarks/retrieval_heads.py --model runs/hybrid-w64-sink4-hedgehog/model --budgets 7 10 \\
        --objective passkey-format --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from hf_recattn import from_teacher
from hf_recattn.atomic import write_text
from hf_recattn.conversion.retrieval_heads import recall_objective, select_retrieval_heads, with_retrieval_heads
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import embedded_texts
from hf_recattn.evaluation import passkey_ids, passkey_probe
from hf_recattn.evaluation.recall import Fact, RecallPrompt
from hf_recattn.modeling.modeling import RecAttnForCausalLM
from hf_recattn.state_size import state_size_report

WINDOW = {"mixer": "hybrid", "window": 64, "far": "none", "sink_tokens": 4}
OBJECTIVES = ("training-text", "passkey-format")


def passkey_format(tokenizer, length: int, prompts: int, seed: int = 1) -> list[RecallPrompt]:  # noqa: ANN001
    """The probe's prompts with other keys, as one-query ``RecallPrompt``s (the answer: the key's tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(prompts):
        key = str(rng.randrange(10_000, 100_000))
        ids, needle = passkey_ids(tokenizer, length - 8, key, (i + 0.5) / prompts)
        answer = tuple(tokenizer(" " + key, add_special_tokens=False)["input_ids"])
        out.append(RecallPrompt(tuple(ids), (Fact("pass key", key, (), answer, ()),), (needle,), (0,)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="window", help="'window' or a converted checkpoint folder")
    parser.add_argument("--objective", choices=OBJECTIVES, default="training-text")
    parser.add_argument("--budgets", type=int, nargs="+", default=[7])
    parser.add_argument("--context", type=int, default=1024, help="tokens of each selection prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts (of each kind for training-text)")
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--passkey-trials", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, metavar="JSON", help="append the rows to this JSON list")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher("embedded")
    if args.model == "window":
        model = from_teacher(teacher, WINDOW).eval()
    else:
        model = RecAttnForCausalLM.from_pretrained(args.model).eval()
    if args.objective == "passkey-format":
        prompts = passkey_format(tokenizer, args.context, args.prompts)
    else:
        prompts = recall_objective(tokenizer, embedded_texts("train"), args.context, args.prompts)
    rows = []
    print(f"model {args.model}, objective {args.objective}, {len(prompts)} prompts of {args.context} tokens")
    print("| budget | heads kept | selection prompts answered | cache @8192 / teacher | passkey " +
          " | passkey ".join(map(str, args.passkey_lengths)) + " | seconds |")
    print("|---:|---|---:|---:|" + "---:|" * len(args.passkey_lengths) + "---:|")
    for budget in args.budgets:
        began = time.perf_counter()
        selection = select_retrieval_heads(model, prompts, budget, args.per_round, log=lambda _: None)
        kept = with_retrieval_heads(model, selection.heads).eval()
        with torch.no_grad():
            probe = passkey_probe(kept, tokenizer, args.passkey_lengths, trials=args.passkey_trials)
        sizes = state_size_report(kept.config, 8192)
        share = sum(r.state_elements for r in sizes) / sum(r.kv_cache_elements for r in sizes)
        heads = "; ".join(f"{layer}: {kv}" for layer, kv in sorted(selection.heads.items()))
        row = {"model": args.model, "objective": args.objective, "budget": budget, "heads": selection.heads,
               "count": selection.count, "answered": f"{selection.answered}/{selection.prompts}",
               "cache_share": share, "passkey": probe["accuracy"], "seconds": time.perf_counter() - began}
        rows.append(row)
        cells = " | ".join(f"{probe['accuracy'][str(n)]:.0%}" for n in args.passkey_lengths)
        print(f"| {budget} | {selection.count} ({heads}) | {row['answered']} | {share:.3f} | {cells} | "
              f"{row['seconds']:.0f} |", flush=True)
    if args.out:
        path = Path(args.out)
        earlier = json.loads(path.read_text()) if path.is_file() else []
        write_text(path, json.dumps(earlier + rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
