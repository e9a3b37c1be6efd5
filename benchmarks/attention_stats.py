"""Which of the teacher's heads reach far back: per layer and head, on held-out text of the embedded corpus,

* **copy score**: a segment of ``--segment`` tokens is repeated after ``--gap`` tokens of other text; the
  attention that each token of the copy pays to the token that followed it in the original (what a retrieval
  or induction head does), averaged over the copy;
* **far mass**: the attention mass on keys more than ``--window`` tokens back, the first ``--sinks`` tokens left
  out (what a sliding window with sinks drops), averaged over queries past the first ``--block / 4`` positions.

Layers are ranked by their best head's copy score; the table shows the top ``--top`` layers. Exact softmax kept
in those layers is what ``benchmarks/pareto.py`` measures as a training-free swap.

    nice python benchmarks/attention_stats.py --threads 2
"""

from __future__ import annotations

import argparse
import sys

import torch

from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_splits, token_blocks


@torch.no_grad()
def attention_maps(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every layer's attention probabilities [heads, T, T] for one sequence (the model set to eager attention)."""
    return tuple(a[0] for a in model(ids.unsqueeze(0), output_attentions=True).attentions)


def copy_scores(model: torch.nn.Module, bos: int, blocks: torch.Tensor, segment: int, gap: int) -> torch.Tensor:
    """[layers, heads]: attention from each token of a repeated segment to its original's successor."""
    pairs = blocks.shape[0] // 2
    copy_start = 1 + segment + gap
    queries = torch.arange(copy_start, copy_start + segment - 1)
    successors = torch.arange(2, segment + 1)
    scores = []
    for b in range(pairs):
        source, other = blocks[b, :segment], blocks[pairs + b, :gap]
        ids = torch.cat([torch.tensor([bos]), source, other, source])
        scores.append(torch.stack([a[:, queries, successors].mean(-1) for a in attention_maps(model, ids)]))
    return torch.stack(scores).mean(0)


def far_mass(model: torch.nn.Module, blocks: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """[layers, heads]: attention mass beyond ``window`` tokens back, sinks excluded."""
    length = blocks.shape[1]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    far = ((i - j) >= window) & (j >= sinks)
    skip = length // 4
    return torch.stack([torch.stack([(a * far).sum(-1)[:, skip:].mean(-1) for a in attention_maps(model, ids)])
                        for ids in blocks]).mean(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--segment", type=int, default=128)
    parser.add_argument("--gap", type=int, default=384)
    parser.add_argument("--pairs", type=int, default=4, help="repeated-segment sequences")
    parser.add_argument("--block", type=int, default=2048, help="length of the far-mass sequences")
    parser.add_argument("--sequences", type=int, default=2, help="far-mass sequences")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher(args.teacher)
    teacher.config._attn_implementation = "eager"  # attention probabilities come back only from eager attention
    _, heldout = load_splits()
    short = token_blocks(tokenizer, heldout, max(args.segment, args.gap), max_tokens=None, seed=0)
    if short.shape[0] < 2 * args.pairs:
        raise SystemExit(f"the held-out text gives {short.shape[0]} blocks, fewer than 2 x --pairs")
    copy = copy_scores(teacher, tokenizer.bos_token_id or 0, short[: 2 * args.pairs], args.segment, args.gap)
    long = token_blocks(tokenizer, heldout, args.block, max_tokens=args.block * args.sequences, seed=0)
    far = far_mass(teacher, long, args.window, args.sinks)
    heads = copy.shape[1]
    print(f"copy score (segment {args.segment}, gap {args.gap}) and far mass (beyond {args.window} tokens, "
          f"{args.sinks} sinks left out, {args.block}-token text), per head; layers by best copy score\n")
    print("| layer | best copy score | copy score per head | far mass (mean) | far mass per head |")
    print("|---:|---:|---|---:|---|")
    for layer in copy.max(-1).values.argsort(descending=True)[: args.top].tolist():
        per_copy = " ".join(f"{v:.2f}" for v in copy[layer].tolist())
        per_far = " ".join(f"{v:.2f}" for v in far[layer].tolist())
        print(f"| {layer} | {copy[layer].max():.3f} | {per_copy} | {far[layer].mean():.3f} | {per_far} |")
    print(f"\nmean far mass by layer ({heads} heads each): "
          + ", ".join(f"{i}: {v:.2f}" for i, v in enumerate(far.mean(-1).tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
