"""The teacher's own retrieval heads: the KV heads whose queries look at a fact while the teacher copies it.

A retrieval head (Wu et al., "Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574)
puts its attention on the token being copied while the model repeats a fact from far back. ``copy_scores``
measures that on the teacher: for recall prompts hidden in training text (``retrieval_heads.recall_objective``), the
query that predicts each answer token, the share of attention each query head puts on the planted value's tokens,
averaged over the query heads of a KV head and over every answer token. ``top_heads`` keeps the highest.

Unlike the gradient search of ``retrieval_heads.select_retrieval_heads`` it reads only the teacher (one forward per
prompt with its attention weights), so the choice is the same for every student of that teacher and costs no
backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..prompting.recall import RecallPrompt
from .retrieval_heads import HeadSet


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """The model with transformers' eager attention (the one that returns weights), then its own again."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _value_start(prompt: RecallPrompt, query: int) -> int | None:
    """Where the asked fact's answer tokens stand in the context (the first match from where the fact is planted),
    or None when the text does not hold them verbatim."""
    answer, context = list(prompt.facts[query].answer), prompt.context
    start = prompt.positions[query]
    for at in range(start, len(context) - len(answer) + 1):
        if list(context[at : at + len(answer)]) == answer:
            return at
    return None


@torch.no_grad()
def copy_scores(model: nn.Module, prompts: Sequence[RecallPrompt],
                log: Callable[[str], None] | None = None) -> torch.Tensor:
    """[layers, KV heads]: the mean attention the answering queries put on the planted value (see the module
    docstring). ``model``: a transformers causal LM with GQA heads (query head h reads KV head h // group).
    ``log``: told after each prompt how many are scored."""
    config = model.config
    kv_heads = config.num_key_value_heads
    total: torch.Tensor | None = None
    answers = 0
    device = next(model.parameters()).device
    with _eager_attention(model):
        for index, prompt in enumerate(prompts, 1):
            ids = prompt.ids().to(device)
            weights = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
            for query, span in zip(prompt.queries, prompt.answer_spans(), strict=True):
                start = _value_start(prompt, query)
                if start is None:
                    continue
                value = slice(start, start + len(span))
                rows = torch.tensor([p - 1 for p in span], device=device)  # the query before each answer token
                per_layer = [w[0].index_select(1, rows)[:, :, value].sum(-1).mean(-1) for w in weights]  # [H] each
                scores = torch.stack(per_layer).float().view(len(per_layer), kv_heads, -1).mean(-1).cpu()
                total = scores if total is None else total + scores
                answers += 1
            if log is not None:
                log(f"scored {index} of {len(prompts)} prompts ({prompt.length} tokens)")
    if total is None:
        raise ValueError("copy_scores: no prompt holds its answer verbatim in its context; nothing to score")
    return total / answers


def top_heads(scores: torch.Tensor, count: int) -> HeadSet:
    """The ``count`` KV heads of highest score, by layer (sorted)."""
    if not 1 <= count <= scores.numel():
        raise ValueError(f"top_heads: count must be in 1..{scores.numel()}, got {count}")
    heads: HeadSet = {}
    for flat in torch.topk(scores.flatten(), count).indices.tolist():
        layer, head = divmod(flat, scores.shape[1])
        heads.setdefault(layer, []).append(head)
    return {layer: sorted(heads[layer]) for layer in sorted(heads)}


def describe(scores: torch.Tensor, heads: HeadSet) -> dict[str, Any]:
    """What ``retrieval_heads.json`` records of a teacher-scored choice."""
    return {"method": "teacher", "count": sum(map(len, heads.values())),
            "scores": [[round(float(x), 5) for x in row] for row in scores],
            "chosen_scores": {str(layer): [round(float(scores[layer, h]), 5) for h in kv]
                              for layer, kv in heads.items()}}
