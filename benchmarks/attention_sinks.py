"""How much a pretrained softmax model relies on its attention sink: perplexity with restricted attention.

Runs the teacher itself (no conversion, no training) on the same held-out tokens as
``benchmarks/convert_smollm2.py`` with a 4D attention mask that lets each query see only

* every earlier token (full causal attention: the teacher as is),
* the last ``W`` tokens (a sliding window),
* the last ``W`` tokens plus the first ``N`` tokens of the block (StreamingLLM's window + attention sinks),

and, as a check of hf_recattn's own implementation, the same window + sinks through a converted model whose
layers are ``{mixer: hybrid, far: none, sink_tokens: N}`` (it must give the transformers number).

    nice python benchmarks/attention_sinks.py --window 64 --sinks 1 4 --threads 1
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from hf_recattn import from_llama
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_texts, split_heldout, token_blocks


def masked_perplexity(model: torch.nn.Module, blocks: torch.Tensor, allowed: torch.Tensor | None) -> float:
    """exp(mean next-token NLL) over ``blocks`` [N, T]; ``allowed`` [T, T] bool (query, key) or None."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, blocks.shape[0], 2):
            ids = blocks[start : start + 2]
            kwargs = {}
            if allowed is not None:
                bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
                kwargs["attention_mask"] = bias[None, None].expand(ids.shape[0], 1, -1, -1)
            logits = model(input_ids=ids, **kwargs).logits[:, :-1]
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += ids[:, 1:].numel()
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher(args.teacher)
    teacher.eval()
    _, heldout_texts = split_heldout(load_texts(), 0.05, seed=0)
    blocks = token_blocks(tokenizer, heldout_texts, args.block_size, max_tokens=args.heldout_tokens, seed=0)
    t = args.block_size
    query, key = torch.arange(t)[:, None], torch.arange(t)[None, :]
    causal = key <= query
    window = causal & (query - key < args.window)
    rows = [("full causal attention (the teacher)", masked_perplexity(teacher, blocks, None))]
    rows.append((f"window {args.window}", masked_perplexity(teacher, blocks, window)))
    for n in args.sinks:
        rows.append((f"window {args.window} + first {n} tokens",
                     masked_perplexity(teacher, blocks, window | (causal & (key < n)))))
        spec = {"mixer": "hybrid", "window": args.window, "far": "none", "sink_tokens": n}
        student = from_llama(teacher, spec).eval()
        began = time.perf_counter()
        rows.append((f"hf_recattn hybrid(far=none, window={args.window}, sink_tokens={n})",
                     masked_perplexity(student, blocks, None)))
        print(f"  (hybrid pass: {time.perf_counter() - began:.0f} s)", file=sys.stderr)
    full = rows[0][1]
    print(f"held-out tokens: {blocks.numel()} in blocks of {t}\n")
    print("| attention | perplexity | x full |\n|---|---:|---:|")
    for name, ppl in rows:
        print(f"| {name} | {ppl:.2f} | {ppl / full:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
