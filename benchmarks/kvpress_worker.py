"""Runs NVIDIA kvpress presses on an unchanged teacher: the half of ``benchmarks/kv_compression.py`` that lives in
its own environment (kvpress 0.5.5 needs transformers < 5.3). It imports only torch, transformers and kvpress.

    .venv-kvpress/bin/python benchmarks/kvpress_worker.py PROBES.json [--threads N]

PROBES.json (written by kv_compression.py) names the model folder, holds token ids (passkey contexts and
questions, perplexity contexts and continuations, plain blocks) and the runs: a press, its kept tokens and its
compression ratio for each context length. Each run prints one JSON line on stdout when it ends: the answers,
the summed negative log-likelihood of the continuations, the cache length after each prefill, or the error
that stopped it. The first line gives the package versions.

A probe file of kind ``needles`` holds cells of needle prompts instead (each a context, its question and the
answer's lead-in) and runs that also name a mode. Each prompt is prefilled once without a press, the attention
layers' inputs recorded; every run then compresses a copy of that cache by calling its press's own hook on each
layer's recorded inputs, as a prefill with the press would (a press changes the cache, never a layer's output):
``question-agnostic`` over the context alone (the question follows uncompressed), ``question-aware`` over the
context and the question, as kvpress's ``query_aware`` evaluation puts it (the answer's lead-in follows). The
answers are greedy as kvpress's ``generate_answer`` decodes them, the caches of runs that compress the same tokens
to the same length decoded as one batch. The first ``verify`` prompts of a cell also run each press inside a real
prefill, answered by ``generate_answer`` itself: its cache and answer must match. A prompt whose keys are asked in
turn (``later`` queries, ``multi_query``) is answered one cache at a time, each answer left in the cache before the
next question (``answers_in_turn``). One JSON line per run and cell, then one for the cell. A run with
``cache_dtype: int8`` holds what it keeps (the press's choice, or the whole cache without a press) as int8 codes
with a float32 scale per key and per value, rounded as hf_recattn's ``cache_dtype: int8`` rounds (symmetric, the
largest magnitude to 127); ``int4`` as its ``cache_dtype: int4`` does (a scale per 32 dimensions, the largest
magnitude to 7); what follows the compressed part is not rounded.

A teacher with sliding-window layers (Gemma 3: ``window_layers`` and ``window`` in PROBES.json) is pressed as
kvpress presses Gemma 3: in its full-attention layers only. Its sliding-window layers keep what the teacher keeps
there, the last ``window - 1`` tokens, so the layers of one cache differ in length; transformers then cannot tell
a token's position from its index in the cache, and every forward after the prefill gets its masks from
``attention_masks`` (a press may also reorder the tokens it keeps, which only full attention tolerates); the real
prefills that check the replay are answered by this worker's decoder instead of ``generate_answer``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kvpress
import torch
import torch.nn.functional as F
from kvpress import KVPressTextGenerationPipeline
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

#: press names of kv_compression.py -> kvpress classes
PRESSES = {
    "StreamingLLM": kvpress.StreamingLLMPress,
    "SnapKV": kvpress.SnapKVPress,
    "KeyDiff": kvpress.KeyDiffPress,
    "ExpectedAttention": kvpress.ExpectedAttentionPress,
    "KNorm": kvpress.KnormPress,
    "DuoAttention": kvpress.DuoAttentionPress,
}


def make_press(run: dict[str, Any], length: int) -> Any:
    """The run's press for a context of ``length`` tokens; None for no press or when the budget holds it all."""
    ratio = run["ratios"].get(str(length)) if run["press"] else None
    if ratio is None:
        return None
    if run["press"] == "DuoAttention":  # a share of streaming heads, their patterns scored on the fly
        return kvpress.DuoAttentionPress(head_compression_ratio=ratio, on_the_fly_scoring=True)
    return PRESSES[run["press"]](compression_ratio=ratio)


def passkey_answers(pipe: Any, run: dict[str, Any], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy answers through the pipeline's own prefill-then-question path, and the cache length each left."""
    answers: dict[str, list[str]] = {}
    kept: dict[str, list[int]] = {}
    for case in cases:
        context = torch.tensor([case["context_ids"]])
        cache = DynamicCache()
        inputs = {"context_ids": context, "questions_ids": [torch.tensor([case["question_ids"]])]}
        (answer,) = pipe._forward(inputs, max_new_tokens=case["max_new_tokens"],
                                  press=make_press(run, context.shape[1]), cache=cache)
        answers.setdefault(str(case["length"]), []).append(answer)
        kept.setdefault(str(case["length"]), []).append(cache.get_seq_length())
    return {"passkey_answers": answers, "passkey_cache_tokens": kept}


@torch.no_grad()
def continuation_nll(model: Any, run: dict[str, Any], contexts: list[list[int]],
                     continuations: list[list[int]]) -> dict[str, Any]:
    """Prefill each context (through the press), then score its continuation teacher-forced through that cache:
    the summed NLL of every continuation token after the first, their count, the cache length after prefill."""
    total, count, kept = 0.0, 0, []
    for context_ids, continuation_ids in zip(contexts, continuations, strict=True):
        context = torch.tensor([context_ids])
        continuation = torch.tensor([continuation_ids])
        cache = DynamicCache()
        press = make_press(run, context.shape[1])
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        kept.append(cache.get_seq_length())
        start = context.shape[1]
        positions = torch.arange(start, start + continuation.shape[1]).unsqueeze(0)
        logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits
        total += float(F.cross_entropy(logits[0, :-1].float(), continuation[0, 1:], reduction="sum"))
        count += continuation.shape[1] - 1
    return {"continuation_nll": total, "continuation_tokens": count, "continuation_cache_tokens": kept}


@torch.no_grad()
def block_perplexity(model: Any, blocks: list[list[int]]) -> float:
    """exp(mean next-token NLL) over the plain blocks, no cache: the teacher's own perplexity."""
    total, count = 0.0, 0
    for block in blocks:
        ids = torch.tensor([block])
        logits = model(input_ids=ids, use_cache=False).logits
        total += float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count)


def measure(pipe: Any, run: dict[str, Any], probes: dict[str, Any]) -> dict[str, Any]:
    """One run's record; the error text instead when the press cannot run."""
    row: dict[str, Any] = {"name": run["name"]}
    began = time.perf_counter()
    try:
        row.update(passkey_answers(pipe, run, probes["passkey"]))
        ppl = probes["perplexity"]
        row.update(continuation_nll(pipe.model, run, ppl["contexts"], ppl["continuations"]))
        if run["press"] is None:
            row["block_perplexity"] = block_perplexity(pipe.model, ppl["blocks"])
    except Exception as err:  # a press that cannot run here is reported, not dropped
        traceback.print_exc(limit=-3)
        row = {"name": run["name"], "error": f"{type(err).__name__}: {err}".strip()}
    row["seconds"] = time.perf_counter() - began
    return row


# ----- needles: one prefill per prompt, every press replayed on it ---------------------------------------------
AGNOSTIC, AWARE = "question-agnostic", "question-aware"


@torch.no_grad()
def recorded_prefill(model: Any, ids: torch.Tensor) -> tuple[DynamicCache, list[dict[str, Any]]]:
    """A prefill without a press: its cache, and each attention layer's inputs that a press's hook reads."""
    seen: list[dict[str, Any]] = []

    def keep(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        seen.append({"hidden_states": kwargs["hidden_states"], "position_embeddings": kwargs["position_embeddings"]})

    hooks = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in model.model.layers]
    cache = DynamicCache()
    try:
        model.model(input_ids=ids, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return cache, seen


@dataclass(frozen=True)
class Layout:
    """Which layers keep a sliding window of ``window`` tokens (the current one included) instead of being
    pressed; none for a teacher of full-attention layers only."""

    window_layers: frozenset[int] = frozenset()
    window: int | None = None

    def held_window(self, cache: DynamicCache) -> DynamicCache:
        """The cache with each sliding-window layer cut to what the teacher keeps there: its last window - 1
        tokens."""
        for index in self.window_layers:
            layer = cache.layers[index]
            layer.keys, layer.values = layer.keys[:, :, 1 - self.window:], layer.values[:, :, 1 - self.window:]
        return cache


class FullAttentionRotary(torch.nn.Module):
    """A Gemma 3 model's rotary embedding, which transformers 5.2 computes per layer type, answering calls that
    name none (kvpress 0.5.5's ExpectedAttention makes them) with the full-attention layers' RoPE: the layers it
    presses."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str = "full_attention") -> Any:
        return self.rotary(x, position_ids, layer_type)


def only_full_attention(press: Any, layout: Layout) -> Any:
    """``press`` with its hook passing over the sliding-window layers, as kvpress passes over Gemma 3's."""
    if not layout.window_layers:
        return press
    pressing = press.forward_hook

    def forward_hook(module: Any, inputs: Any, kwargs: dict[str, Any], output: Any) -> Any:
        return output if module.layer_idx in layout.window_layers else pressing(module, inputs, kwargs, output)

    press.forward_hook = forward_hook  # what press(model) registers on every layer
    return press


@torch.no_grad()
def replayed_cache(model: Any, press: Any, full: DynamicCache, seen: list[dict[str, Any]], n: int,
                   layout: Layout) -> DynamicCache:
    """The cache a prefill of the first ``n`` tokens leaves with ``press`` (None: the whole cache): the recorded
    keys and values of each layer, compressed by the press's hook called on that layer's recorded inputs (the
    sliding-window layers of ``layout`` are not pressed: they keep their window)."""
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        for index, (layer, inputs) in enumerate(zip(model.model.layers, seen, strict=True)):
            cache.update(full.layers[index].keys[:, :, :n], full.layers[index].values[:, :, :n], index)
            if press is None or index in layout.window_layers:
                continue
            cos, sin = inputs["position_embeddings"]
            kwargs = {"hidden_states": inputs["hidden_states"][:, :n], "position_embeddings": (cos[:, :n], sin[:, :n]),
                      "past_key_values": cache, "cache_position": torch.arange(n)}
            press.forward_hook(layer.self_attn, [], kwargs, (None, None))
    return layout.held_window(cache)


@torch.no_grad()
def hooked_cache(model: Any, press: Any, ids: torch.Tensor, layout: Layout) -> DynamicCache:
    """The cache of a real prefill of ``ids`` with ``press`` hooked in (what the replay must give)."""
    cache = DynamicCache()
    with only_full_attention(press, layout)(model):
        model.model(input_ids=ids, past_key_values=cache)
    return layout.held_window(cache)


def attention_masks(layout: Layout, kept: int, n: int, fed: int, queries: int, rows: int) -> dict[str, Any] | None:
    """The masks of a forward of ``queries`` tokens at positions n + fed ... after a prefill of ``n`` tokens and
    ``fed`` tokens since, by layer type (None for a teacher without sliding-window layers): a full-attention layer
    holds the ``kept`` tokens of the press (all before position n, in any order) and sees each of them; a
    sliding-window layer holds the positions from n - window + 1 and sees the last ``window`` up to the query."""
    if not layout.window_layers:
        return None
    query = torch.arange(n + fed, n + fed + queries)[:, None]
    since = torch.arange(n, n + fed + queries)
    full = torch.cat([torch.full((kept,), -1), since])[None]
    sliding = torch.cat([torch.arange(max(0, n + 1 - layout.window), n), since])[None]
    masks = {"full_attention": full <= query,
             "sliding_attention": (sliding <= query) & (sliding > query - layout.window)}
    return {kind: mask.expand(rows, 1, -1, -1) for kind, mask in masks.items()}


def coded_round_trip(x: torch.Tensor, levels: int, group: int | None, half_scales: bool = False) -> torch.Tensor:
    """Each group of ``group`` dimensions of x [..., D] (None, or a vector shorter than that: the whole vector) as
    symmetric integer codes with a float32 scale hold it: its largest magnitude -> ``levels``; ``half_scales``: the
    scale rounded up to a float16 (at most float16's largest)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    grouped = x32.unflatten(-1, (-1, min(group or x.shape[-1], x.shape[-1])))
    scale = grouped.abs().amax(-1, keepdim=True) / levels
    if half_scales:
        largest = torch.finfo(torch.float16).max
        half = scale.clamp(max=largest).to(torch.float16)
        up = torch.nextafter(half, torch.full_like(half, torch.inf)).clamp(max=largest)
        scale = torch.where(half.to(scale.dtype) < scale, up, half).to(scale.dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(grouped / safe).clamp(-levels, levels) * scale).flatten(-2).to(x.dtype)


#: (levels, dimensions per scale, float16 scales) of the keys' and of the values' codes of each coded cache_dtype,
#: as hf_recattn's modeling/cache_precision.py codes them
CODES: dict[str, tuple[tuple[int, int | None, bool], tuple[int, int | None, bool]]] = {
    "int8": ((127, None, False), (127, None, False)), "int4": ((7, 32, False), (7, 32, False)),
    "int4g16": ((7, 16, True), (7, 16, True)), "k8v4g16": ((127, None, False), (7, 16, True))}


def held_as(cache: DynamicCache, cache_dtype: str) -> DynamicCache:
    """The cache as the run holds it: its keys and values rounded in place to a coded ``cache_dtype``."""
    if cache_dtype in CODES:
        key_codes, value_codes = CODES[cache_dtype]
        for layer in cache.layers:
            layer.keys = coded_round_trip(layer.keys, *key_codes)
            layer.values = coded_round_trip(layer.values, *value_codes)
    return cache


def cache_difference(one: DynamicCache, other: DynamicCache) -> float:
    """The largest difference between a kept token of ``one`` and its nearest kept token of ``other`` in the same
    head (keys by Euclidean distance, then the values of the pair): a press may keep its tokens in the order of
    their scores, which near ties reorder. inf when the caches' shapes differ."""
    worst = 0.0
    for a, b in zip(one.layers, other.layers, strict=True):
        if a.keys.shape != b.keys.shape:
            return math.inf
        distance = torch.cdist(a.keys, b.keys)
        nearest = distance.argmin(dim=-1, keepdim=True)
        values = b.values.gather(2, nearest.expand_as(b.values))
        worst = max(worst, float(distance.gather(-1, nearest).max()), float((a.values - values).abs().max()))
    return worst


def run_inputs(case: dict[str, Any], mode: str) -> tuple[int, list[int]]:
    """What the press compresses (the first n tokens of context + question) and the ids that follow it."""
    query, split = case["query_ids"], case["split"]
    if mode == AWARE:
        return len(case["context_ids"]) + split, query[split:]
    return len(case["context_ids"]), query


def compressed(pipe: Any, run: dict[str, Any], case: dict[str, Any], recorded: tuple[Any, Any, torch.Tensor],
               verify: bool, layout: Layout) -> tuple[DynamicCache, dict[str, Any]]:
    """One prompt's cache under one run (the press replayed on the recorded prefill) and its record; with
    ``verify``, the same press in a real prefill too, answered by kvpress's ``generate_answer`` (by
    ``batched_answers`` for a teacher with sliding-window layers, whose masks ``generate_answer`` cannot give)."""
    full, seen, ids = recorded
    n, follow = run_inputs(case, run["mode"])
    press = make_press(run, n)
    cache = replayed_cache(pipe.model, press, full, seen, n, layout)
    out: dict[str, Any] = {"cache_tokens": pressed_length(cache, layout)}
    held = run.get("cache_dtype", "model")
    if verify and press is not None:
        real = hooked_cache(pipe.model, make_press(run, n), ids[:, :n], layout)
        out["difference"] = cache_difference(cache, real)
        real = held_as(real, held)
        if layout.window_layers:  # kvpress's generate_answer cannot mask layers of different lengths
            out["hooked_answer"] = batched_answers(pipe, [real], follow, n, case["max_new_tokens"], layout)[0]
        else:
            out["hooked_answer"] = pipe.generate_answer(torch.tensor([follow]), real, n, case["max_new_tokens"])
    return held_as(cache, held), out


def pressed_length(cache: DynamicCache, layout: Layout) -> int:
    """The tokens a pressed layer of ``cache`` holds (every layer's, for a teacher without sliding windows)."""
    index = next(i for i in range(len(cache.layers)) if i not in layout.window_layers)
    return cache.layers[index].keys.shape[2]


@torch.no_grad()
def greedy_rows(model: Any, batch: DynamicCache, kept: int, follow: list[int], start: int, fed: int, max_new: int,
                layout: Layout) -> list[list[int]]:
    """Greedy tokens of every row of ``batch`` (a prefill of ``start`` tokens, pressed to ``kept``, then ``fed``
    tokens since): ``follow`` at positions from start + fed, then up to ``max_new`` tokens, each row ending at its
    first EOS (kept, as kvpress's ``generate_answer`` and transformers' ``generate`` keep it)."""
    rows = batch.layers[0].keys.shape[0]
    positions = torch.arange(start + fed, start + fed + len(follow)).expand(rows, -1)
    logits = model(input_ids=torch.tensor([follow] * rows), past_key_values=batch, position_ids=positions,
                   attention_mask=attention_masks(layout, kept, start, fed, len(follow), rows),
                   logits_to_keep=1).logits
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens = [logits[:, -1].argmax(-1)]
    for step in range(max_new - 1):
        if all(any(int(t[r]) in eos for t in tokens) for r in range(rows)):
            break
        since = fed + len(follow) + step
        position = torch.full((rows, 1), start + since)
        tokens.append(model(input_ids=tokens[-1][:, None], past_key_values=batch, position_ids=position,
                            attention_mask=attention_masks(layout, kept, start, since, 1, rows),
                            ).logits[:, -1].argmax(-1))
    out = []
    for row in torch.stack(tokens, dim=1).tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


def batched_answers(pipe: Any, caches: list[DynamicCache], follow: list[int], start: int, max_new: int,
                    layout: Layout) -> list[str]:
    """Greedy answers (as kvpress's ``generate_answer``: ``follow`` at positions from ``start``, up to ``max_new``
    tokens, each row ending at its first EOS) of caches of one length, decoded as one batch."""
    batch = DynamicCache()
    for index in range(len(caches[0].layers)):
        batch.update(torch.cat([c.layers[index].keys for c in caches]),
                     torch.cat([c.layers[index].values for c in caches]), index)
    rows = greedy_rows(pipe.model, batch, pressed_length(caches[0], layout), follow, start, 0, max_new, layout)
    return [pipe.tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def answers_in_turn(pipe: Any, cache: DynamicCache, case: dict[str, Any], start: int, layout: Layout) -> list[str]:
    """Greedy answers of a prompt's queries asked in turn through one compressed cache of ``start`` tokens, as
    hf_recattn's ``needle_answers`` asks them: each query follows the answers before it, which stay in the cache
    (the last token of an answer is fed with the next query)."""
    kept, fed, carried, answers = pressed_length(cache, layout), 0, [], []
    for query in [case, *case.get("later", [])]:
        follow = carried + query["query_ids"]
        (tokens,) = greedy_rows(pipe.model, cache, kept, follow, start, fed, query["max_new_tokens"], layout)
        answers.append(pipe.tokenizer.decode(tokens, skip_special_tokens=True))
        fed += len(follow) + len(tokens) - 1
        carried = tokens[-1:]
    return answers


def answer_prompt(pipe: Any, runs: list[dict[str, Any]], case: dict[str, Any], recorded: tuple[Any, Any, Any],
                  verify: bool, layout: Layout) -> dict[str, dict[str, Any]]:
    """Every run's record of one prompt (or its error): the caches of runs that compress the same tokens to the
    same length are answered as one batch."""
    out: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[int, int], list[tuple[str, DynamicCache]]] = {}
    for run in runs:
        try:
            cache, out[run["name"]] = compressed(pipe, run, case, recorded, verify, layout)
        except Exception as err:  # a press that cannot run here is reported, not dropped
            traceback.print_exc(limit=-3)
            out[run["name"]] = {"error": f"{type(err).__name__}: {err}".strip()}
            continue
        n, _ = run_inputs(case, run["mode"])
        groups.setdefault((n, pressed_length(cache, layout)), []).append((run["name"], cache))
    if case.get("later"):  # queries in turn: each cache answers on its own, its answers' lengths its own
        for (n, _), members in groups.items():
            for name, cache in members:
                out[name]["answer"], *out[name]["later_answers"] = answers_in_turn(pipe, cache, case, n, layout)
        return out
    for (n, _), members in groups.items():
        follow = run_inputs(case, AWARE if n > len(case["context_ids"]) else AGNOSTIC)[1]
        got = batched_answers(pipe, [cache for _, cache in members], follow, n, case["max_new_tokens"], layout)
        for (name, _), answer in zip(members, got, strict=True):
            out[name]["answer"] = answer
    return out


def needle_cell(pipe: Any, cell: dict[str, Any], runs: list[dict[str, Any]], verify: int,
                layout: Layout) -> Iterator[dict[str, Any]]:
    """The records of one cell: one per run (its answers, or the error that stopped it), then the cell's with the
    seconds its prompts took. ``verify``: how many of its first prompts also run each press in a real prefill."""
    got: dict[str, dict[str, Any]] = {run["name"]: {"answers": []} for run in runs}
    began = time.perf_counter()
    for index, case in enumerate(cell["cases"]):
        ids = torch.tensor([case["context_ids"] + case["query_ids"][: case["split"]]])
        recorded = (*recorded_prefill(pipe.model, ids), ids)
        live = [run for run in runs if "error" not in got[run["name"]]]
        for name, record in answer_prompt(pipe, live, case, recorded, index < verify, layout).items():
            if "error" in record:
                got[name]["error"] = record["error"]
            else:
                got[name]["answers"].append(record)
    for name, record in got.items():
        yield {"cell": cell["key"], "name": name, **record}
    yield {"cell": cell["key"], "seconds": time.perf_counter() - began, "prompts": len(cell["cases"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", help="the JSON file written by kv_compression.py")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.probes) as file:
        probes = json.load(file)
    versions = {name: importlib.metadata.version(name) for name in ("kvpress", "transformers", "torch")}
    print(json.dumps({"versions": versions}), flush=True)
    model = AutoModelForCausalLM.from_pretrained(probes["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(probes["model"])
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
    if probes.get("kind") == "needles":
        runs = {run["name"]: run for run in probes["runs"]}
        layout = Layout(frozenset(probes.get("window_layers", [])), probes.get("window"))
        if layout.window_layers:
            model.model.rotary_emb = FullAttentionRotary(model.model.rotary_emb)
        for cell in probes["cells"]:
            for record in needle_cell(pipe, cell, [runs[name] for name in cell["runs"]], cell["verify"], layout):
                print(json.dumps(record), flush=True)
        return 0
    for run in probes["runs"]:
        print(json.dumps(measure(pipe, run, probes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
