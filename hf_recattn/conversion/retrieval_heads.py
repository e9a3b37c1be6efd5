"""Find a converted model's retrieval heads and keep exact softmax on exactly those (``retrieval_heads`` mixer).

``select_retrieval_heads`` blends, in every layer and for every KV head h, the layer's own mixer with exact
softmax: ``a_h * softmax + (1 - a_h) * mixer`` (a = 0: the model as it is). Starting from a = 0 it repeats: score
the recall prompts (mean log-probability of the answers, every earlier token given), take the gradient of that
score with respect to every a still at 0, switch to exact softmax (a = 1) the heads with the largest gradient,
until every prompt is answered or ``max_heads`` are chosen; then it drops each chosen head again whose removal
keeps every prompt answered. The gradient is a first-order estimate of what restoring a head gains, so the
greedy search needs one forward and backward per prompt per round instead of one forward per head.

``with_retrieval_heads`` then builds the model that keeps those heads' whole KV cache: each such layer becomes
``{"mixer": "retrieval_heads", "heads": [...], "others": <the layer's spec>}`` with the layer's weights (the
mixer's per-head parameters split between the parts).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..modeling.mixer_base import Mixer, MixerInputs
from ..modeling.mixer_retrieval_heads import FULL_PREFIX, FULL_SPEC, REST_PREFIX, RetrievalHeadsMixer
from ..modeling.mixer_softmax import SoftmaxMixer
from ..prompting.haystack import Haystack
from ..prompting.recall import RecallPrompt, recall_prompt
from ..prompting.templates import templates
from .retrieval_data import needle_prompt, retrieval_prompt

HeadSet = dict[int, list[int]]


@dataclass(frozen=True)
class Selection:
    """The chosen KV heads by layer (sorted), the score after each round, and how many prompts the choice answers."""

    heads: HeadSet
    rounds: list[dict[str, Any]]
    answered: int
    prompts: int

    @property
    def count(self) -> int:
        return sum(len(h) for h in self.heads.values())


class _Blend(nn.Module):
    """A layer's mixer blended per KV head with exact softmax: ``a * softmax + (1 - a) * mixer`` (no cache)."""

    def __init__(self, mixer: Mixer, alpha: torch.Tensor, layer_idx: int) -> None:
        super().__init__()
        self.inner = mixer
        self.spec = mixer.spec
        self.alpha = alpha  # [layers, Hkv]: the selection's blend weights, row ``layer_idx`` for this layer
        self.layer_idx = layer_idx
        self.softmax = SoftmaxMixer(FULL_SPEC, mixer.shape, mixer.config)

    def input_weights(self) -> dict[str, nn.Parameter]:
        return self.inner.input_weights()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: MixerInputs,
                state: Any = None, use_cache: bool = False) -> tuple[torch.Tensor, None]:
        if use_cache or state is not None:
            raise ValueError("retrieval-head selection scores whole sequences; it does not use a cache")
        own, _ = self.inner(q, k, v, inputs)
        a = self.alpha[self.layer_idx].to(own.dtype).repeat_interleave(self.inner.shape.groups)[:, None]  # [H, 1]
        if not bool((a > 0).any()) and not self.alpha.requires_grad:
            return own, None
        exact = self.softmax.parallel(q, k, v, inputs)
        return a * exact.to(own.dtype) + (1 - a) * own, None


#: the kinds of prompt ``recall_objective`` alternates when it is given none
DEFAULT_OBJECTIVE_KINDS = ("passkey", "codes")


def recall_objective(tokenizer: Any, texts: Sequence[str], context_length: int, prompts: int = 3,
                     seed: int = 0, kinds: Sequence[str] | None = None) -> list[RecallPrompt]:
    """What the heads are chosen on: ``prompts`` secret numbers hidden in ``texts`` (at depths spread over the
    context) and as many associative-recall prompts (one fact planted, asked at the end), alternating, in the
    words of the first ``passkey`` and ``codes`` training templates (never the probes'). ``kinds``: instead,
    ``prompts`` retrieval prompts of each of these kinds (``retrieval_data.retrieval_prompt``, every training
    template of the kind in turn), taken in turn."""
    haystack = Haystack(tokenizer, texts)
    if kinds is not None:
        return [retrieval_prompt(tokenizer, haystack, context_length, index, seed, kinds=kinds)
                for index in range(prompts * len(kinds))]
    codes = templates("codes", "train")[0]
    out: list[RecallPrompt] = []
    for i in range(prompts):
        depth = (i + 0.5) / prompts
        out.append(needle_prompt(tokenizer, haystack, context_length, depth, f"retrieval-heads-needle-{seed}-{i}"))
        out.append(recall_prompt(tokenizer, haystack, context_length, 1, seed=f"retrieval-heads-{seed}-{i}",
                                 template=codes))
    return out


def _answer_score(model: nn.Module, prompt: RecallPrompt) -> tuple[torch.Tensor, bool]:
    """Mean log-probability of every answer token, every earlier token given, and whether all are the argmax."""
    ids = prompt.ids().to(next(model.parameters()).device)
    positions = torch.tensor([p for span in prompt.answer_spans() for p in span], device=ids.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, positions - 1].float().log_softmax(-1)
    target = ids[0, positions]
    return logits.gather(1, target[:, None]).mean(), bool((logits.argmax(-1) == target).all())


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


@contextlib.contextmanager
def _blending(model: nn.Module, alpha: torch.Tensor) -> Iterator[None]:
    """The model in eval mode with frozen parameters, each layer's mixer blended with exact softmax by ``alpha``;
    mixers, ``requires_grad`` flags and training mode are restored on exit."""
    layers = _layers(model)
    originals = [layer.self_attn.mixer for layer in layers]
    trainable = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    try:
        model.eval()
        for p in trainable:
            p.requires_grad_(False)
        for i, layer in enumerate(layers):
            layer.self_attn.mixer = _Blend(originals[i], alpha, i)
        yield
    finally:
        for layer, mixer in zip(layers, originals, strict=True):
            layer.self_attn.mixer = mixer
        for p, flag in trainable.items():
            p.requires_grad_(flag)
        model.train(was_training)


def _score(model: nn.Module, prompts: Sequence[RecallPrompt], alpha: torch.Tensor, grad: bool) -> tuple[float, int]:
    """Mean answer log-probability over ``prompts`` and how many are answered; with ``grad``, its gradient with
    respect to ``alpha`` lands in ``alpha.grad``."""
    total, answered = 0.0, 0
    alpha.requires_grad_(grad)
    alpha.grad = None
    for prompt in prompts:
        with torch.set_grad_enabled(grad):
            value, hit = _answer_score(model, prompt)
            if grad:
                (value / len(prompts)).backward()
        total += value.item()
        answered += int(hit)
    return total / len(prompts), answered


def _grow(model: nn.Module, prompts: Sequence[RecallPrompt], alpha: torch.Tensor, chosen: list[tuple[int, int]],
          rounds: list[dict[str, Any]], max_heads: int, per_round: int,
          log: Callable[[str], None]) -> tuple[float, int]:
    """Switch the heads with the largest gradient to exact softmax, ``per_round`` at a time, until every prompt is
    answered or ``max_heads`` are chosen; returns the last score."""
    while True:
        value, answered = _score(model, prompts, alpha, grad=True)
        rounds.append({"heads": list(chosen), "log_prob": value, "answered": answered})
        log(f"retrieval heads: {len(chosen)} exact, answer log-prob {value:.3f}, {answered}/{len(prompts)} "
            "answered")
        if answered == len(prompts) or len(chosen) >= max_heads:
            return value, answered
        gain = alpha.grad.detach().clone()
        gain[alpha.detach() > 0] = -float("inf")
        for flat in torch.topk(gain.flatten(), min(per_round, max_heads - len(chosen))).indices.tolist():
            head = divmod(flat, alpha.shape[1])
            alpha.data[head] = 1.0
            chosen.append(head)


def _prune(model: nn.Module, prompts: Sequence[RecallPrompt], alpha: torch.Tensor, chosen: list[tuple[int, int]],
           rounds: list[dict[str, Any]], score: tuple[float, int], log: Callable[[str], None]) -> tuple[float, int]:
    """Drop each chosen head whose removal keeps every prompt answered; returns the score of the choice in force."""
    value, answered = score
    for head in list(chosen):
        alpha.data[head] = 0.0
        with torch.no_grad():
            without = _score(model, prompts, alpha, grad=False)
        if without[1] == len(prompts):
            chosen.remove(head)
            value, answered = without
            log(f"retrieval heads: layer {head[0]} KV head {head[1]} not needed ({len(chosen)} left)")
        else:
            alpha.data[head] = 1.0
    rounds.append({"heads": list(chosen), "log_prob": value, "answered": answered, "pruned": True})
    return value, answered


def select_retrieval_heads(
    model: nn.Module,
    prompts: Sequence[RecallPrompt],
    max_heads: int,
    per_round: int = 1,
    prune: bool = True,
    log: Callable[[str], None] = print,
) -> Selection:
    """Greedy, gradient-guided choice of the KV heads that keep exact softmax (see the module docstring).

    The model is left as it was (its mixers are swapped back and its parameters' ``requires_grad`` restored)."""
    if max_heads < 1 or per_round < 1 or not prompts:
        raise ValueError("select_retrieval_heads needs max_heads >= 1, per_round >= 1 and at least one prompt")
    layers = _layers(model)
    kv_heads = layers[0].self_attn.mixer.shape.num_kv_heads
    if max_heads > len(layers) * kv_heads:
        raise ValueError(f"max_heads={max_heads} exceeds the model's {len(layers) * kv_heads} KV heads")
    alpha = torch.zeros(len(layers), kv_heads, device=next(model.parameters()).device)
    chosen: list[tuple[int, int]] = []
    rounds: list[dict[str, Any]] = []
    with _blending(model, alpha):
        score = _grow(model, prompts, alpha, chosen, rounds, max_heads, per_round, log)
        if prune and score[1] == len(prompts):
            score = _prune(model, prompts, alpha, chosen, rounds, score, log)
    heads: HeadSet = {}
    for layer_idx, head in sorted(chosen):
        heads.setdefault(layer_idx, []).append(head)
    return Selection(heads, rounds, score[1], len(prompts))


# ----- the model that keeps them --------------------------------------------------------------------------
def _split_parameter(name: str, source: torch.Tensor, target: torch.Tensor, mixer: RetrievalHeadsMixer,
                     where: str, part: str = "rest") -> torch.Tensor:
    """The rows of a per-head parameter that belong to ``part``'s heads (dim 0 indexed by query or KV heads,
    possibly several rows per head); a parameter shared by all heads is copied whole."""
    if source.shape == target.shape:
        return source
    shape = mixer.shape
    options = []
    q_part, kv_part = mixer.heads[part]
    for count, index in ((shape.num_heads, q_part), (shape.num_kv_heads, kv_part)):
        rows, rest = divmod(source.shape[0], count)
        if rest == 0 and rows * len(index) == target.shape[0] and source.shape[1:] == target.shape[1:]:
            options.append(source.view(count, rows, *source.shape[1:])[index].reshape(target.shape))
    if len(options) == 1 or (len(options) == 2 and torch.equal(options[0], options[1])):
        return options[0]
    why = "is ambiguous" if options else "has no rows per head"
    heads = "other heads'" if part == "rest" else "retrieval heads'"
    raise ValueError(f"{where}: cannot split parameter {name!r} {tuple(source.shape)} between the heads: its first "
                     f"dimension {why} (the {heads} part needs {tuple(target.shape)})")


def _whole_layer_state(layer: dict[str, torch.Tensor], own: dict[str, torch.Tensor], prefix: str, mixer: nn.Module,
                       where: str) -> dict[str, torch.Tensor]:
    """A layer that runs the retrieval spec as a whole: each parameter of its mixer (``own`` keys under ``prefix``)
    is the layer's own parameter (``layer``) of that name and shape; one without is refused."""
    out = {}
    for target in [n for n in own if n.startswith(prefix)]:
        name = target[len(prefix):]
        if name not in layer or layer[name].shape != own[target].shape:
            raise ValueError(f"retrieval heads: {where}: the retrieval spec's {mixer.name} mixer has a parameter "
                             f"{name!r} that the layer's own mixer does not have in that shape, so nothing would "
                             "set it")
        out[target] = layer[name]
    return out


def _split_layer_state(layer: dict[str, torch.Tensor], own: dict[str, torch.Tensor], prefix: str, mixer: nn.Module,
                       where: str) -> dict[str, torch.Tensor]:
    """A layer split into retrieval heads and the rest: the rest takes the other heads' rows of every parameter of
    the layer (``layer``), the retrieval spec's own parameters the listed heads' rows of the layer's parameter of
    the same name; one the layer lacks is refused."""
    out = {prefix + REST_PREFIX + name: _split_parameter(name, source, own[prefix + REST_PREFIX + name], mixer, where)
           for name, source in layer.items()}
    for target in [n for n in own if n.startswith(prefix + FULL_PREFIX)]:  # a retrieval spec's own parameters
        name = target[len(prefix + FULL_PREFIX):]
        if name not in layer:
            raise ValueError(f"retrieval heads: {where}: the retrieval spec's {mixer.full.name} mixer has a "
                             f"parameter {name!r} that the layer's own mixer does not, so nothing would set it")
        out[target] = _split_parameter(name, layer[name], own[target], mixer, where, "full")
    return out


def config_with_retrieval_heads(config: Any, heads: HeadSet,
                                retrieval: dict[str, Any] | None = None) -> tuple[Any, set[int]]:
    """A copy of ``config`` whose layers in ``heads`` keep ``retrieval`` (exact softmax when None) on those KV heads
    and their own spec on the others, and the layers whose every KV head is listed (they run ``retrieval`` whole).
    ValueError for a layer out of range or one that already keeps retrieval heads."""
    config = copy.deepcopy(config)
    specs = config.layer_specs()
    count = len(specs)
    overrides = {}
    whole = set()
    for layer_idx, kv in heads.items():
        if not 0 <= layer_idx < count:
            raise ValueError(f"retrieval heads: layer {layer_idx} does not exist (the model has {count} layers)")
        if specs[layer_idx]["mixer"] == RetrievalHeadsMixer.name:
            raise ValueError(f"retrieval heads: layer {layer_idx} already keeps retrieval heads")
        if len(set(kv)) == config.num_key_value_heads:
            whole.add(layer_idx)
            overrides[str(layer_idx)] = dict(retrieval or {"mixer": "softmax"})
            continue
        overrides[str(layer_idx)] = {"mixer": RetrievalHeadsMixer.name, "heads": sorted(kv),
                                     "others": specs[layer_idx], "retrieval": retrieval}
    config.attention = specs
    config.attention_overrides = overrides or None
    return config, whole


def with_retrieval_heads(model: nn.Module, heads: HeadSet, retrieval: dict[str, Any] | None = None) -> nn.Module:
    """A copy of ``model`` whose layers in ``heads`` keep exact softmax on those KV heads (their other heads
    keep the layer's own mixer and weights). ``retrieval``: the spec those heads run instead of exact softmax (the
    mixer's option of that name); its parameters take those heads' rows of the layer's parameters of the same
    name (e.g. a hybrid's mixing weight), and a parameter the layer lacks is refused. A layer whose every KV head
    is listed runs ``retrieval`` (or softmax) as a whole, with the layer's parameters of the same names."""
    config, whole = config_with_retrieval_heads(model.config, heads, retrieval)
    student = type(model)(config).to(next(model.parameters()).dtype)
    state = model.state_dict()
    own = student.state_dict()
    for layer_idx in heads:
        prefix = f"model.layers.{layer_idx}.self_attn.mixer."
        mixer = student.model.layers[layer_idx].self_attn.mixer
        layer = {name[len(prefix):]: state.pop(name) for name in [n for n in state if n.startswith(prefix)]}
        layer_state = _whole_layer_state if layer_idx in whole else _split_layer_state
        state.update(layer_state(layer, own, prefix, mixer, f"layer {layer_idx}"))
    student.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        student.tie_weights()
    student.generation_config = copy.deepcopy(model.generation_config)
    return student.train(model.training)
