"""The softmax-family mixers of Su, "A Brief History of Linear Attention", kexue.fm/archives/11033 on the embedded
teacher with no training: the converted model at init.

For each spec the teacher's weights are copied into an hf_recattn model whose every layer uses that spec
(``from_teacher``), and the converted model is compared with the teacher on the same held-out tokens as
``benchmarks/convert_smollm2.py``: held-out perplexity, its ratio to the teacher's, and the largest absolute
logit difference on the first held-out block. FoX at init must reproduce the teacher (its gate starts at f = 1 up
to fp32 rounding); ALiBi, DeltaFormer and PaTH change the function from the start, and the table says by how much.

    nice python benchmarks/training_free.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.data.corpus import load_splits, token_blocks
from hf_recattn.evaluation import perplexity

SPECS: dict[str, dict[str, Any]] = {
    "softmax (copy)": {"mixer": "softmax"},
    "fox, lossless init": {"mixer": "softmax", "forget": "fox"},
    "alibi + rope": {"mixer": "softmax", "forget": "alibi"},
    "alibi, no rope": {"mixer": "softmax", "forget": "alibi", "rope": False},
    "deltaformer, b = 0.01": {"mixer": "softmax_delta", "write_strength": "sigmoid", "init": "convert"},
    "deltaformer (paper form, b = 1)": {"mixer": "deltaformer"},
    "path + rope, b = 0.01": {"mixer": "softmax_householder", "init": "convert"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--teacher", default="embedded")
    parser.add_argument("--specs", nargs="+", default=list(SPECS), help=f"rows to run: {list(SPECS)}")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="torch seed set before each conversion (random inits)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.specs) - set(SPECS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {list(SPECS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher(args.teacher)
    _, heldout_texts = load_splits()
    blocks = token_blocks(tokenizer, heldout_texts, args.block_size, max_tokens=args.heldout_tokens, seed=0)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=blocks[:1]).logits
    teacher_ppl = perplexity(teacher, blocks)
    print(f"command: python benchmarks/training_free.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"teacher {args.teacher}: perplexity {teacher_ppl:.3f} on {blocks.numel()} held-out tokens "
          f"(blocks of {args.block_size}), torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| spec | perplexity | × teacher | max abs logit difference (block 1) | seconds |")
    print("|---|---:|---:|---:|---:|")
    for name in args.specs:
        start = time.perf_counter()
        torch.manual_seed(args.seed)  # each row's random init is the same whatever rows run before it
        model = from_teacher(teacher, attention=SPECS[name]).eval()
        with torch.no_grad():
            diff = (model(input_ids=blocks[:1]).logits - teacher_logits).abs().max().item()
        ppl = perplexity(model, blocks)
        print(f"| {name} | {ppl:.3f} | {ppl / teacher_ppl:.4f} | {diff:.2e} | {time.perf_counter() - start:.0f} |",
              flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
