"""The teacher's own attention restricted to a kept set, on the held-out passkey prompts: what a sparse exact cache
could at best give without training.

    python scripts/masked_teacher.py --teacher embedded --keep random --fraction 0.05
    python scripts/masked_teacher.py --teacher embedded --keep cache --spread 256

Every query of every layer sees, through a 4D attention mask, the first ``--sinks`` tokens, a recent span and the
kept set:

* ``full``: everything (the unmasked teacher);
* ``needle``: the needle's tokens (its sentence), with the last ``--recent`` tokens;
* ``random``: the needle and a seeded ``--fraction`` of the prompt at random, with the last ``--recent`` tokens;
* ``spread``: the needle and the ``--spread`` positions of highest priority frac(position x 0.618...) (as
  scripts/cache_oracle.py), with the last ``--recent`` tokens;
* ``cache``: what a hybrid with ``window`` W = ``--window`` and ``cache_slots`` = needle + ``--spread`` shows each
  query when its decisions keep the needle, then the spread sample (``cache_oracle.py --keep needle+spread``):
  the window (the last W tokens and itself), the pending buffer (tokens that have left, not yet decided: decisions
  fall every W tokens that leave) and the decided tokens of highest priority.

A trial is teacher-forced: the prompt and the right answer (" KEY.") in one forward; ``first`` is whether the
first answer token is the argmax (what greedy decoding would start with), ``all`` whether every answer token is.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from cache_oracle import needle_span, position_score, spread_priority

from hf_recattn.atomic import write_json
from hf_recattn.conversion.teacher import load_causal_lm
from hf_recattn.evaluation.passkey import PASSKEY_DEPTHS, passkey_ids

KEEP = ("full", "needle", "random", "spread", "cache")


def kept_columns(keep: str, length: int, needle: range, args: argparse.Namespace) -> torch.Tensor:
    """[length] bool: the kept set of a fixed-set rule (every query sees it, causally)."""
    positions = torch.arange(length)
    kept = (positions >= needle.start) & (positions < needle.stop)
    if keep == "random":
        draw = torch.rand(length, generator=torch.Generator().manual_seed(args.seed))
        kept |= draw < args.fraction
    elif keep == "spread":
        candidates = positions[args.sinks :]
        chosen = candidates[spread_priority(candidates).topk(min(args.spread, len(candidates))).indices]
        kept[chosen] = True
    kept[: args.sinks] = True
    return kept


def cache_visible(length: int, needle: range, args: argparse.Namespace) -> torch.Tensor:
    """[length, length] bool: what a hybrid cache keeping the needle, then the spread sample, shows each query (its
    decisions by cache_oracle's own rule)."""
    sinks, window = args.sinks, args.window
    positions = torch.arange(length)
    priority = position_score("needle+spread", needle)(positions, torch.zeros(length, dtype=torch.float64))
    slots = args.spread + len(needle)
    visible = torch.zeros(length, length, dtype=torch.bool)
    for t in range(length):
        visible[t, : min(sinks, t + 1)] = True
        left = max(0, t - window - sinks + 1)  # the tokens sinks .. t - W have left the window
        leaving = int(t - window >= sinks)  # one leaves at this query: it is decided only after it
        decided = (left - leaving) // window * window
        visible[t, max(sinks, sinks + decided) : t + 1] = True  # every undecided token up to the query
        if decided:
            candidates = torch.arange(sinks, sinks + decided)
            visible[t, candidates[priority[candidates].topk(min(slots, decided)).indices]] = True
    return visible


def visible_mask(keep: str, length: int, needle: range, args: argparse.Namespace) -> torch.Tensor:
    """[length, length] bool: which keys each query sees (causal)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if keep == "full":
        return causal
    if keep == "cache":
        return cache_visible(length, needle, args) & causal
    recent = torch.arange(length)[:, None] - torch.arange(length)[None, :] < args.recent
    return causal & (kept_columns(keep, length, needle, args)[None, :] | recent)


def trial(model: Any, tokenizer: Any, key: str, depth: float, args: argparse.Namespace) -> dict[str, Any]:
    """One teacher-forced prompt + answer under the ``args.keep`` mask."""
    ids, at = passkey_ids(tokenizer, args.length, key, depth)
    needle = needle_span(tokenizer, key, at)
    answer = tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
    visible = visible_mask(args.keep, len(ids) + len(answer), needle, args)
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        logits = model(torch.tensor([ids + answer]), attention_mask=bias).logits[0]
    got = logits[len(ids) - 1 : len(ids) + len(answer) - 1].argmax(-1).tolist()
    return {"key": key, "depth": depth, "back": len(ids) - needle.start, "argmax": tokenizer.decode(got),
            "first": got[0] == answer[0], "all": got == answer, "kept_last_query": int(visible[len(ids) - 1].sum())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", default="embedded", help="a teacher spec (Hub id, folder, GGUF, embedded)")
    parser.add_argument("--keep", choices=KEEP, default="spread", help="the kept set (see above)")
    parser.add_argument("--spread", type=int, default=256, help="spread positions (spread, cache)")
    parser.add_argument("--fraction", type=float, default=0.05, help="share kept at random (random)")
    parser.add_argument("--seed", type=int, default=0, help="the random set's seed (random)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--recent", type=int, default=128, help="recent tokens (needle, random, spread)")
    parser.add_argument("--window", type=int, default=64, help="the hybrid's window (cache)")
    parser.add_argument("--length", type=int, default=4080, help="prompt tokens")
    parser.add_argument("--keys", nargs="+", default=["60494", "15306", "82731"])
    parser.add_argument("--depths", type=float, nargs="+", default=list(PASSKEY_DEPTHS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    model, tokenizer = load_causal_lm(args.teacher)
    if args.threads:
        torch.set_num_threads(args.threads)
    model.config._attn_implementation = "eager"  # a float mask of -inf / 0, as given
    print("| key | depth | needle, tokens back | first token | every token | argmax, teacher-forced |")
    print("|---|---:|---:|---|---|---|")
    rows = []
    for key in args.keys:
        for depth in args.depths:
            row = trial(model.eval(), tokenizer, key, depth, args)
            rows.append(row)
            print(f"| {key} | {depth:g} | {row['back']} | {row['first']} | {row['all']} | {row['argmax']!r} |",
                  flush=True)
    print(f"first token right: {sum(r['first'] for r in rows)} of {len(rows)}; "
          f"every token: {sum(r['all'] for r in rows)} of {len(rows)}")
    if args.json:
        write_json(args.json, {"teacher": args.teacher, "settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
