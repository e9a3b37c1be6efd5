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
import sys
import time

import torch

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_splits, token_blocks
from hf_recattn.evaluation import perplexity


class RestrictedAttention(torch.nn.Module):
    """The teacher with a fixed [T, T] (query, key) visibility given to every forward as a 4D additive mask."""

    def __init__(self, model: torch.nn.Module, allowed: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("bias", torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min))

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        mask = self.bias[None, None].expand(input_ids.shape[0], 1, -1, -1)
        return self.model(input_ids=input_ids, attention_mask=mask, **kwargs)


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
    _, heldout_texts = load_splits()
    blocks = token_blocks(tokenizer, heldout_texts, args.block_size, max_tokens=args.heldout_tokens, seed=0)
    t = args.block_size
    query, key = torch.arange(t)[:, None], torch.arange(t)[None, :]
    causal = key <= query
    window = causal & (query - key < args.window)
    rows = [("full causal attention (the teacher)", perplexity(teacher, blocks, batch_size=2))]
    rows.append((f"window {args.window}", perplexity(RestrictedAttention(teacher, window), blocks, batch_size=2)))
    for n in args.sinks:
        sinks = RestrictedAttention(teacher, window | (causal & (key < n)))
        rows.append((f"window {args.window} + first {n} tokens", perplexity(sinks, blocks, batch_size=2)))
        spec = {"mixer": "hybrid", "window": args.window, "far": "none", "sink_tokens": n}
        student = from_teacher(teacher, spec).eval()
        began = time.perf_counter()
        rows.append((f"hf_recattn hybrid(far=none, window={args.window}, sink_tokens={n})",
                     perplexity(student, blocks, batch_size=2)))
        print(f"  (hybrid pass: {time.perf_counter() - began:.0f} s)", file=sys.stderr)
    full = rows[0][1]
    print(f"held-out tokens: {blocks.numel()} in blocks of {t}\n")
    print("| attention | perplexity | x full |\n|---|---:|---:|")
    for name, ppl in rows:
        print(f"| {name} | {ppl:.2f} | {ppl / full:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
