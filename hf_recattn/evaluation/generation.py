"""Running any causal LM for evaluation: its device and length limit, prompts, greedy generation through the cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..modeling.cache import CACHE_NAME, cache_of

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's (first) parameters, where its inputs go."""
    return next(model.parameters()).device


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block, back in the mode it had after it (also on an error)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def max_positions(model: Any) -> int | None:
    """The longest sequence the model supports, or None when unbounded: an hf_recattn model's
    ``config.length_limit()`` (``max_position_embeddings`` only where a layer needs positions), any other model's
    ``max_position_embeddings``. Every probe skips the lengths beyond it."""
    config = getattr(model, "config", None)
    length_limit = getattr(config, "length_limit", None)
    if callable(length_limit):
        return length_limit()
    return getattr(config, "max_position_embeddings", None)


def pad_id(tokenizer: Any) -> int | None:
    """The id that pads generated rows: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass(frozen=True)
class Continuation:
    """A greedy continuation: the new token ids ([N]) and the cache after them (it holds the prompt and every new
    token but the last)."""

    tokens: torch.Tensor
    cache: Any


@torch.no_grad()
def greedy_continuation(
    model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, cache: Any = None, stop_at_eos: bool = True
) -> Continuation:
    """Greedy decoding of one prompt ([1, T]) through the model's cache: every greedy generation of the package.

    ``cache`` continues an earlier continuation (``ids`` then holds its tokens too, the new ones follow); without
    ``stop_at_eos`` exactly ``max_new_tokens`` are decoded, whatever the model predicts. Rows are padded with the
    tokenizer's pad token, else its EOS (``pad_id``)."""
    ids = ids.to(model_device(model))
    options: dict[str, Any] = {} if cache is None else {CACHE_NAME: cache}
    if not stop_at_eos:
        options["eos_token_id"] = None
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad_id(tokenizer),
        return_dict_in_generate=True,
        **options,
    )
    return Continuation(out.sequences[0, ids.shape[1] :], cache_of(out))


def prompt_ids(tokenizer: Any, prompt: str, chat: bool | None = None) -> torch.Tensor:
    """[1, T] ids of ``prompt``, in the chat template when the tokenizer has one (or ``chat=True``)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def generation_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 40,
) -> list[str]:
    """Greedy continuations (new text only) of each prompt, one prompt at a time, through the cache."""
    with eval_mode(model):
        outputs = []
        for prompt in prompts:
            new = greedy_continuation(model, tokenizer, prompt_ids(tokenizer, prompt), max_new_tokens).tokens
            outputs.append(tokenizer.decode(new, skip_special_tokens=True).strip())
        return outputs
