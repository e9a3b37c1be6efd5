"""Which exact set a hybrid's cache must hold to answer the passkey: the held-out passkey prompts through a
checkpoint whose cache decisions are overridden by prompt position.

    python scripts/cache_oracle.py runs/NAME/model --keep needle --cache-slots 64
    python scripts/cache_oracle.py runs/NAME/model --keep needle+spread --cache-slots 284 --far-off
    python scripts/cache_oracle.py runs/NAME/model --keep needle+spread --cache-slots 284 --far-off \
        --teacher-weights embedded
    python scripts/cache_oracle.py runs/NAME/model --keep as-trained --cache-score novelty

``--keep`` decides what the cache keeps at every decision, in place of the layer's score (``cache_score``: the far
part's recall error unless ``--cache-score`` or the checkpoint says otherwise):

* ``as-trained``: the layer's own score (a baseline through the same code);
* ``needle``: the needle's pairs (its sentence through the key) first, the rest by the layer's own score;
* ``spread``: the pairs of an evenly spread sample of the prompt: priority frac(position x 0.618...), a
  low-discrepancy sequence, so that the top G of the tokens that have left lie about evenly over them;
* ``needle+spread``: the needle first, then the spread sample.

A candidate pair is traced to its prompt position by its key, which the hybrid holds rotary-embedded (so two
positions never share one); a pair that matches no recorded key (none should) keeps the layer's own score.
``--far-off`` sets every hybrid layer's mixing logit to 30, so that the far part enters with weight about 1e-13
while its state still updates. ``--teacher-weights`` loads a teacher's tensors over every tensor of the same name
and shape (the attention projections, MLPs, norms, embeddings): the student's cache and far part with the
teacher's own projections. Evidence for docs/results-log.md, not a benchmark: one greedy answer per prompt.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from hf_recattn.atomic import write_json
from hf_recattn.conversion.teacher import load_causal_lm
from hf_recattn.evaluation.generation import greedy_continuation
from hf_recattn.evaluation.passkey import PASSKEY_DEPTHS, passkey_answered, passkey_ids
from hf_recattn.evaluation.templates import probe_template
from hf_recattn.modeling.cache_scores import CACHE_SCORES, Decision
from hf_recattn.modeling.hybrid_options import with_hybrid_options
from hf_recattn.modeling.mixer_hybrid import HybridMixer

KEEP = ("as-trained", "needle", "spread", "needle+spread")
#: the fractional part of position x this is the spread sample's priority (the golden ratio's, low discrepancy)
SPREAD_STEP = (math.sqrt(5.0) - 1.0) / 2.0
#: a key matches a recorded one when they differ by less than this (the same tensor, copied)
MATCH = 1e-5


def hybrid_mixers(model: Any) -> list[HybridMixer]:
    """The model's hybrid mixers with an exact cache, in layer order."""
    found = [m for m in model.modules() if isinstance(m, HybridMixer) and m.cache_slots]
    if not found:
        raise ValueError("no hybrid layer has an exact cache; pass --cache-slots G")
    return found


def spread_priority(positions: torch.Tensor) -> torch.Tensor:
    """frac(position x SPREAD_STEP) in [0, 1): the top G of any prefix of positions lie about evenly over it."""
    return (positions.double() * SPREAD_STEP).frac()


def position_score(keep: str, needle: range) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """score(positions [.., N] (-1: unknown), own [.., N]) -> the score that decides what stays cached."""
    if keep not in KEEP:
        raise ValueError(f"--keep: unknown {keep!r}; use one of {KEEP}")

    def score(positions: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        known = positions >= 0
        out = own.double()
        if keep.endswith("spread"):
            out = torch.where(known, spread_priority(positions), out)
        if keep.startswith("needle"):
            inside = (positions >= needle.start) & (positions < needle.stop)
            out = out + 4.0 * inside.double() * (1.0 + out.abs().amax(-1, keepdim=True))
        return out.to(own.dtype)

    return score


def override_cache_decisions(model: Any, keep: str, needle: range, layers: list[int] | None = None) -> None:
    """Make the cached hybrid layers of ``model`` (all, or those of ``layers``; one row at a time) decide by prompt
    position: each records the keys it is given, in order, and its cache score is replaced by ``position_score``."""
    score = position_score(keep, needle)
    mixers = hybrid_mixers(model)
    chosen = range(len(mixers)) if layers is None else layers
    unknown = sorted(set(chosen) - set(range(len(mixers))))
    if unknown:
        raise ValueError(f"--layers: {unknown} are not among the {len(mixers)} cached hybrid layers")
    for mixer in (mixers[i] for i in chosen):
        recorded: list[torch.Tensor] = []
        _record_keys(mixer, recorded)
        own = mixer.cache_score

        def decide(far: Any, decision: Decision, own: Any = own, recorded: list = recorded) -> torch.Tensor:
            if decision.keys.shape[0] != 1:
                raise ValueError("cache_oracle traces one prompt at a time (batch 1)")
            positions = key_positions(decision.keys[0], torch.cat(recorded, dim=1))
            return score(positions, own(far, decision)[0])[None]

        mixer.cache_score = decide


def _record_keys(mixer: HybridMixer, recorded: list[torch.Tensor]) -> None:
    """Wrap the mixer's block and one-token step so that the keys [Hkv, T, D] they are given land in ``recorded``."""
    block, step_one = mixer._block, mixer._cached_step_one

    def recording_block(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> Any:
        recorded.append(k[0].detach())
        return block(q, k, *rest)

    def recording_step(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> Any:
        recorded.append(k[0].detach())
        return step_one(q, k, *rest)

    mixer._block, mixer._cached_step_one = recording_block, recording_step


def key_positions(keys: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """The prompt position [Hkv, N] of each candidate key [Hkv, N, D] among the recorded ones [Hkv, P, D]
    (-1 where none is within MATCH)."""
    # the direct form: the matrix-product one cancels to ~1e-4 for equal vectors, above MATCH
    distance = torch.cdist(keys.float(), recorded.float(), compute_mode="donot_use_mm_for_euclid_dist")
    nearest = distance.min(-1)
    return torch.where(nearest.values < MATCH, nearest.indices, -1)


def switch_far_off(model: Any) -> None:
    """Every hybrid layer's mixing logit to 30: the far part's weight becomes about 1e-13 (its state still runs)."""
    with torch.no_grad():
        for mixer in hybrid_mixers(model):
            mixer.mix_logit.fill_(30.0)


def take_weights(model: Any, teacher: Any) -> int:
    """Load the teacher's tensors over the model's of the same name and shape; how many were taken."""
    own = model.state_dict()
    taken = {name: x for name, x in teacher.state_dict().items() if name in own and own[name].shape == x.shape}
    model.load_state_dict(taken, strict=False)
    return len(taken)


def needle_span(tokenizer: Any, key: str, at: int) -> range:
    """The needle's prompt positions: its whole sentence, which starts at ``at``."""
    fact = probe_template("passkey").fill("fact", value=key)
    return range(at, at + len(tokenizer(fact, add_special_tokens=False)["input_ids"]))


def trial(model: Any, tokenizer: Any, length: int, key: str, depth: float, args: argparse.Namespace) -> dict[str, Any]:
    """One prompt through a fresh copy of ``model`` with the decisions overridden; its greedy answer."""
    ids, at = passkey_ids(tokenizer, length, key, depth)
    span = needle_span(tokenizer, key, at)
    fresh = copy.deepcopy(model)
    if args.far_off:
        switch_far_off(fresh)
    if args.keep != "as-trained":
        override_cache_decisions(fresh, args.keep, span, args.layers)
    with torch.no_grad():
        answer = tokenizer.decode(
            greedy_continuation(fresh, tokenizer, torch.tensor([ids]), args.new_tokens).tokens, skip_special_tokens=True
        ).strip()
    return {"length": length, "key": key, "depth": depth, "needle": [span.start, span.stop],
            "back": len(ids) - span.start, "answer": answer, "correct": passkey_answered(answer, key)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="an hf_recattn checkpoint folder with hybrid layers")
    parser.add_argument("--keep", choices=KEEP, default="needle", help="what every decision keeps (see above)")
    parser.add_argument("--cache-slots", type=int, default=None, help="cache slots per KV head (default: as saved)")
    parser.add_argument("--cache-score", choices=tuple(CACHE_SCORES), default=None,
                        help="the layers' own score (default: as saved; see modeling/cache_scores.py)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="override only these cached hybrid layers (counted from 0); the others decide as trained")
    parser.add_argument("--far-off", action="store_true", help="the far part's mixing weight to about 1e-13")
    parser.add_argument("--teacher-weights", metavar="TEACHER", help="load this teacher's tensors of equal shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096], help="prompt tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=list(PASSKEY_DEPTHS))
    parser.add_argument("--keys", nargs="+", default=["60494"], help="the 5-digit keys to plant")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy answer tokens")
    args = parser.parse_args(argv)
    model, tokenizer = load_causal_lm(args.checkpoint)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {name: value for name, value in (("cache_slots", args.cache_slots), ("cache_score", args.cache_score))
               if value is not None}
    if options:
        model = with_hybrid_options(model, options)
    hybrid_mixers(model)  # a checkpoint without a cache is refused before any trial
    if args.teacher_weights:
        teacher, _ = load_causal_lm(args.teacher_weights)
        print(f"tensors taken from {args.teacher_weights}: {take_weights(model, teacher)}")
    rows = []
    print("| tokens | key | depth | needle, tokens back | answer |")
    print("|---:|---|---:|---:|---|")
    for length in args.lengths:
        for key in args.keys:
            for depth in args.depths:
                row = trial(model.eval(), tokenizer, length, key, depth, args)
                rows.append(row)
                verdict = "right" if row["correct"] else "wrong"
                print(f"| {length} | {key} | {depth:g} | {row['back']} | {verdict}: {row['answer'][:40]!r} |",
                      flush=True)
    print(f"right: {sum(r['correct'] for r in rows)} of {len(rows)}")
    if args.json:
        names = ("keep", "layers", "cache_slots", "cache_score", "far_off", "teacher_weights")
        settings = {name: getattr(args, name) for name in names}
        write_json(args.json, {"checkpoint": args.checkpoint, "settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
