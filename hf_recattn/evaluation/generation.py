"""Running any causal LM for evaluation: its device and length limit, prompts, greedy generation through the cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

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
    """The longest sequence the model supports (``max_position_embeddings``), or None when unbounded."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def pad_id(tokenizer: Any) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@torch.no_grad()
def generate_new_tokens(
    model: Any, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int, **kwargs: Any
) -> torch.Tensor:
    """New token ids for one prompt ([1, T]), decoded through the model's cache."""
    ids = ids.to(model_device(model))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        use_cache=True,
        pad_token_id=pad_id(tokenizer),
        **kwargs,
    )
    return out[0, ids.shape[1] :]


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
            new = generate_new_tokens(model, tokenizer, prompt_ids(tokenizer, prompt), max_new_tokens,
                                      do_sample=False)
            outputs.append(tokenizer.decode(new, skip_special_tokens=True).strip())
        return outputs
