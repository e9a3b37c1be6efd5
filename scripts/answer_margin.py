"""How sure a model is of each held-out passkey answer: the answer teacher-forced after the probe's own prompts.

    python scripts/answer_margin.py runs/NAME/model --lengths 1024 4096 --trials 6
    python scripts/answer_margin.py embedded --lengths 1024 4096 --trials 6      # the teacher, same prompts

The prompts are ``hf-recattn eval``'s passkey prompts (the same keys, depths and ``length - 8`` tokens, drawn by
``passkey_keys`` with the same seed and lengths, in the same order). One forward over prompt + " KEY" gives, for
the answer's first token, its log-probability, the model's best other token and the lead (the first minus the
second, in nats: greedy decoding starts the key only where the lead is positive), and the mean log-probability of
the key's other tokens. ``forced`` says whether every answer token is the model's top choice when the tokens before
it are the right ones. Evidence for docs/results-log.md, not a benchmark.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from hf_recattn.atomic import write_json
from hf_recattn.conversion.teacher import load_causal_lm
from hf_recattn.evaluation.passkey import PASSKEY_ANSWER_TOKENS as ANSWER_ROOM
from hf_recattn.evaluation.passkey import PASSKEY_DEPTHS, passkey_ids, passkey_keys
from hf_recattn.evaluation.progress import progress_bar


def answer_ids(tokenizer: Any, key: str) -> list[int]:
    """The ids of the right answer after the prompt (the template's answer part ends before the space)."""
    return tokenizer(" " + key, add_special_tokens=False)["input_ids"]


def answer_margin(model: Any, prompt: list[int], answer: list[int]) -> dict[str, Any]:
    """Teacher-forced log-probabilities of ``answer`` after ``prompt`` (one forward, float64 log-softmax)."""
    ids = torch.tensor([prompt + answer[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=len(answer)).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    gold = torch.tensor(answer)
    chosen = logp.gather(-1, gold[:, None])[:, 0]
    rival = logp[0].clone()
    rival[answer[0]] = -torch.inf
    best_other = int(rival.argmax())
    return {"first": float(chosen[0]), "rival_id": best_other, "rival": float(rival[best_other]),
            "lead": float(chosen[0] - rival[best_other]),
            "rest": float(chosen[1:].mean()) if len(answer) > 1 else None,
            "forced": bool((logp.argmax(-1) == gold).all())}


def margins(model: Any, tokenizer: Any, lengths: list[int], trials: int, depths: list[float],
            seed: int = 0, progress: str | None = None) -> list[dict[str, Any]]:
    """One row per prompt: length, key, depth, tokens from the needle to the end, and ``answer_margin``'s fields.
    ``progress``: the label of a progress bar over the prompts (None: no bar)."""
    if trials < 1 or not lengths or any(length <= ANSWER_ROOM for length in lengths):
        raise ValueError(f"--lengths must exceed {ANSWER_ROOM} tokens and --trials must be at least 1")
    rows = []
    with progress_bar(len(lengths) * trials, progress, "prompt") as bar:
        for length, keys in passkey_keys(lengths, trials, seed).items():
            for i, key in enumerate(keys):
                depth = depths[i % len(depths)]
                prompt, at = passkey_ids(tokenizer, length - ANSWER_ROOM, key, depth)
                row = answer_margin(model, prompt, answer_ids(tokenizer, key))
                row["rival_token"] = tokenizer.decode([row["rival_id"]])
                rows.append({"length": length, "key": key, "depth": depth, "back": len(prompt) - at, **row})
                bar.update()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder, or an embedded teacher's name")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096],
                        help="the eval's passkey lengths, in its order (the keys depend on it)")
    parser.add_argument("--trials", type=int, default=6, help="prompts per length, as --passkey-trials")
    parser.add_argument("--depths", type=float, nargs="+", default=list(PASSKEY_DEPTHS))
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.checkpoint)
    rows = margins(model.eval(), tokenizer, args.lengths, args.trials, args.depths, progress="margins")
    print("| tokens | key | depth | needle, tokens back | first token | best other | lead (nats) | rest | forced |")
    print("|---:|---|---:|---:|---:|---|---:|---:|---|")
    for r in rows:
        rest = "-" if r["rest"] is None else f"{r['rest']:.2f}"
        print(f"| {r['length']} | {r['key']} | {r['depth']:g} | {r['back']} | {r['first']:.2f} | "
              f"{r['rival_token']!r} {r['rival']:.2f} | {r['lead']:+.2f} | {rest} | {r['forced']} |")
    if args.json:
        write_json(args.json, {"checkpoint": args.checkpoint, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
