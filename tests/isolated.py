"""A Python child process in which hf_recattn cannot be imported, for tests of what works without the package.

``HIDE_HF_RECATTN`` is the child's preamble: it drops meta-path finders that can find hf_recattn (the editable
install's finder) and sys.path entries that hold it, asserts ``importlib.util.find_spec('hf_recattn') is None``,
and puts a blocker first on ``sys.meta_path``. Run the child with ``python -I`` from an empty folder.
``save_tiny_recattn`` writes a tiny checkpoint for such a child to load with ``trust_remote_code=True``;
``save_tiny_chat_recattn`` adds a tokenizer with a chat template (for servers and evaluation harnesses).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from tiny_lm import tiny_tokenizer
from transformers import PreTrainedTokenizerFast

from hf_recattn import RecAttnConfig, RecAttnForCausalLM

#: a chat template for the tiny tokenizer (roles and contents between its <s> and </s>)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

HIDE_HF_RECATTN = textwrap.dedent(
    r"""
    import importlib.machinery, importlib.util, json, sys

    def _finds(finder):
        try:
            return finder.find_spec("hf_recattn", None) is not None
        except Exception:
            return False

    # 1. hide hf_recattn: meta-path finders that find it (editable installs), then path entries that hold it
    sys.meta_path[:] = [f for f in sys.meta_path if f is importlib.machinery.PathFinder or not _finds(f)]
    sys.path[:] = [p for p in sys.path if importlib.machinery.PathFinder.find_spec("hf_recattn", [p]) is None]
    importlib.invalidate_caches()
    assert importlib.util.find_spec("hf_recattn") is None, "hf_recattn is still importable"

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == "hf_recattn" or name.startswith("hf_recattn."):
                raise ModuleNotFoundError(f"blocked in this test: {name}")
            return None

    sys.meta_path.insert(0, _Blocker())
    """
)


def save_tiny_recattn(folder: Path, layers: list[dict], seed: int = 0) -> RecAttnForCausalLM:
    """A tiny random model (hidden 32, vocab 100, one layer per spec in ``layers``) seeded with ``seed``, its mixer
    parameters moved off their initial values (a re-initialized load would show), saved to ``folder``."""
    torch.manual_seed(seed)
    config = RecAttnConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention=layers,
    )
    model = RecAttnForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def save_tiny_chat_recattn(folder: Path, layers: list[dict],
                           seed: int = 0) -> tuple[RecAttnForCausalLM, PreTrainedTokenizerFast]:
    """``save_tiny_recattn`` plus tests/tiny_lm.py's tokenizer (100 tokens) with ``CHAT_TEMPLATE``, in ``folder``."""
    model = save_tiny_recattn(folder, layers, seed)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    assert len(tokenizer) == model.config.vocab_size
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return model, tokenizer
