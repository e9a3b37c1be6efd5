"""What a hybrid's exact cache (``cache_slots``) holds after a passkey prompt: per layer and KV head, how many of
the needle's tokens are among the cached pairs, and the spread of the cached tokens' positions.

    python scripts/cache_contents.py runs/NAME/model --length 4096 --depth 0.9
    python scripts/cache_contents.py runs/NAME/model --length 4096 --depth 0.9 --hybrid-option cache_slots=2048

It answers whether a missed passkey was evicted (the needle is not cached) or cached and not used. The prompt is
the held-out passkey probe's (``hf_recattn.evaluation.passkey``). A cached pair is traced to its token by its
value, the nearest of the layer's value projections over the prompt (the state may round it, e.g. to bf16); in
the first layer equal tokens have equal values, so a repeated filler token may count for the needle.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from hf_recattn.atomic import write_json
from hf_recattn.cli.evaluate import hybrid_options
from hf_recattn.conversion.teacher import load_causal_lm
from hf_recattn.evaluation.passkey import passkey_ids
from hf_recattn.modeling.cache import cache_of
from hf_recattn.modeling.hybrid_options import with_hybrid_options

#: the key planted in every prompt (its digits are part of the needle)
KEY = "60494"


def cached_positions(model: Any, ids: list[int]) -> dict[int, torch.Tensor]:
    """Prefill ``ids`` (one row) through the cache; per layer with an exact cache, the prompt positions [Hkv, G]
    of the cached pairs (-1 for an empty slot)."""
    values: dict[int, list[torch.Tensor]] = {}
    hooks = [
        layer.self_attn.v_proj.register_forward_hook(
            lambda _m, _a, out, i=i: values.setdefault(i, []).append(out.detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    found = {}
    for i, layer in enumerate(cache_of(out).layers):
        state = layer.state or {}
        if "cv" not in state:
            continue
        cached, filled = state["cv"][0].float(), state["cmask"][0]  # [Hkv, G, D], [G]
        prompt = torch.cat(values[i], dim=1)[0].float().view(len(ids), cached.shape[0], cached.shape[-1])
        nearest = torch.stack([torch.cdist(cached[h], prompt[:, h]).argmin(1) for h in range(cached.shape[0])])
        found[i] = torch.where(filled[None, :], nearest, -1)
    return found


def summary(found: dict[int, torch.Tensor], needle: range) -> dict[str, Any]:
    """Per layer and head: needle tokens cached, cached pairs, and the quartiles of their positions."""
    rows = {}
    for layer, positions in found.items():
        heads = []
        for row in positions:
            kept = row[row >= 0]
            quartiles = kept.float().quantile(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])) if kept.numel() else None
            heads.append({
                "needle": int(((kept >= needle.start) & (kept < needle.stop)).sum()),
                "cached": int(kept.numel()),
                "positions": None if quartiles is None else [int(q) for q in quartiles.tolist()],
            })
        rows[layer] = heads
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="an hf_recattn checkpoint folder with hybrid layers")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--depth", type=float, default=0.9, help="the needle's place in the prompt, 0 to 1")
    parser.add_argument("--hybrid-option", action="append", metavar="KEY=VALUE",
                        help="evaluate with this option on every hybrid layer (as hf-recattn eval)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.checkpoint)
    options = hybrid_options(args.hybrid_option)
    if options:
        model = with_hybrid_options(model, options)
    ids, at = passkey_ids(tokenizer, args.length, KEY, args.depth)
    span = range(at, at + _needle_length(tokenizer, ids, at))
    found = cached_positions(model.eval(), ids)
    if not found:
        raise ValueError(f"{args.checkpoint}: no layer has an exact cache; pass --hybrid-option cache_slots=G")
    rows = summary(found, span)
    print(f"needle: tokens {span.start}-{span.stop - 1} of {len(ids)} (its sentence through the key)")
    print("| layer | " + " | ".join(f"head {h}: needle / cached, positions (min q1 median q3 max)"
                                   for h in range(len(next(iter(rows.values()))))) + " |")
    for layer, heads in rows.items():
        cells = [f"{h['needle']} / {h['cached']}, {h['positions']}" for h in heads]
        print(f"| {layer} | " + " | ".join(cells) + " |")
    held = sum(h["needle"] > 0 for heads in rows.values() for h in heads)
    total = sum(len(heads) for heads in rows.values())
    print(f"heads holding a needle token: {held} of {total}")
    if args.json:
        write_json(args.json, {"needle": [span.start, span.stop], "tokens": len(ids), "options": options,
                               "layers": rows})
    return 0


def _needle_length(tokenizer: Any, ids: list[int], at: int) -> int:
    """Tokens from ``at`` through the end of the key (the needle sentence up to its last digit)."""
    for n in range(1, len(ids) - at + 1):
        if KEY in tokenizer.decode(ids[at : at + n]).replace(" ", ""):
            return n
    raise ValueError("the needle's key was not found in the prompt")


if __name__ == "__main__":
    sys.exit(main())
