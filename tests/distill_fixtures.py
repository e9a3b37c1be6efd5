"""Tiny teachers, tokenizers, corpora and recipes for the conversion tests (all offline, all seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

_WORDS = (
    "the cat sat on a mat while river water ran past old mills and birds sang in green hedges "
    "every morning so that quiet hills turned gold in late summer light"
).split()


def tiny_texts(n: int = 60, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences, one document each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 12))) for _ in range(6)]
        docs.append(". ".join(sentences) + ".")
    return docs


def tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """A BPE tokenizer with ~``vocab_size`` tokens trained on ``texts`` (Metaspace, so text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(texts or tiny_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def tiny_teacher(vocab_size: int, seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """A random Llama: hidden 32, 4 query heads and 2 KV heads of dim 8."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper attention than the default init, so that softmax is not ~uniform
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(10.0)
            layer.self_attn.o_proj.weight.mul_(10.0)
    return model.eval()


def tiny_teacher_folder(folder: Path, seed: int = 0) -> Path:
    """A teacher folder (config + safetensors + tokenizer) that ``load_teacher`` reads."""
    tokenizer = tiny_tokenizer()
    model = tiny_teacher(len(tokenizer), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_corpus_file(path: Path, n: int = 60) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in tiny_texts(n)))
    return path


def tiny_recipe_dict(attention: Any = None, **sections: Any) -> dict[str, Any]:
    """A recipe sized for the tiny teacher: a few steps of each stage, a small evaluation."""
    recipe: dict[str, Any] = {
        "description": "tiny test recipe",
        "attention": attention or {"mixer": "linear", "feature_map": "hedgehog"},
        "seed": 0,
        "stage1": {"tokens": 6 * 4 * 32, "lr": 1.0e-2, "block_size": 32, "batch_size": 4, "save_every": 2},
        "stage2": {
            "tokens": 4 * 2 * 32,
            "lr": 1.0e-3,
            "block_size": 32,
            "batch_size": 2,
            "grad_accum": 1,
            "loss": "ce+kl",
            "temperature": 2.0,
            "save_steps": 2,
            "lora": {"r": 4, "alpha": 8},
        },
        "eval": {
            "quick": True,
            "heldout_tokens": 128,
            "block_size": 32,
            "sample_tokens": 6,
            "heldout_fraction": 0.2,
            "probes": {"needle_prompts": 1, "needle_haystacks": ["heldout"]},  # the needles: 2 prompts per model
            "baselines": [],  # no untrained baselines but where a test asks for them
        },
    }
    for key, value in sections.items():
        recipe[key] = value if not isinstance(value, dict) or key not in recipe else {**recipe[key], **value}
    return recipe


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def loss_case(weighted: bool, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Student and teacher final hidden states [2, 9, 32], next-token labels with 13 predicted positions (the rest
    -100) and, if ``weighted``, per-position loss weights: the inputs of the loss-form comparisons."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 32, generator=gen)
    teacher_hidden = torch.randn(2, 9, 32, generator=gen)
    labels = torch.randint(0, vocab, (2, 9), generator=gen)
    labels[0, :3] = -100
    labels[1, 7:] = -100  # 13 predicted positions
    weights = torch.rand(2, 9, generator=gen) * 5 if weighted else None
    return hidden, teacher_hidden, labels, weights
