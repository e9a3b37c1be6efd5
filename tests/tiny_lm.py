"""Tiny random teachers for fast tests: an in-memory BPE tokenizer, Llama-shaped folders, and a GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TRAIN_TEXT = [
    "The pass key is 12345. Remember it. What is the pass key?",
    "The river runs past the old mill and on toward the town.",
    "Birds sing in the hedges in the morning, and the road climbs through the hills.",
    "A hash table maps keys to values. Write a short poem about the sea.",
    "0123456789 the quick brown fox jumps over the lazy dog.",
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def tiny_tokenizer(vocab_size: int = 120) -> PreTrainedTokenizerFast:
    """A BPE over letters, digits and punctuation trained on a few sentences (other characters: <unk>)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = sorted(set("".join(TRAIN_TEXT)) | set("0123456789abcdefghijklmnopqrstuvwxyz.,?!:'") - {" "})
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def tiny_dims(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def save_tiny_teacher(folder: Path, model_type: str = "llama", **config_overrides: object) -> torch.nn.Module:
    """Save a tiny random ``model_type`` causal LM and the tiny tokenizer to ``folder``; return the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    values = tiny_dims(len(tokenizer))
    values.update(config_overrides)
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases, so that a dropped bias shows in the logits
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def write_tiny_gguf(path: Path, vocab_size: int = 64, seed: int = 0) -> np.ndarray:
    """A tiny F32 Llama GGUF with a byte-level BPE vocabulary; returns the token embedding written."""
    import gguf

    hidden, inter, layers, heads, kv_heads = 32, 64, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(0)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = SPECIALS + letters + list("0123456789") + ["Ġ", ".", "?", "ab"]
    tokens += [f"x{i}" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab_size - len(SPECIALS)))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    rng = np.random.default_rng(seed)

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        value = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        writer.add_tensor(name, value)
        return value

    embedding = tensor("token_embd.weight", (vocab_size, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", (inter, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (inter, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, inter))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding
