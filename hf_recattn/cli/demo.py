"""``hf-recattn demo``: a tiny random model per mixer, generating through the recurrent cache, checked against
no-cache decoding."""

from __future__ import annotations

import argparse

import torch

from ..modeling.cache import cache_of
from ..modeling.configuration import RecAttnConfig
from ..modeling.modeling import RecAttnForCausalLM
from .common import SubParsers, add_command

DEMO_SPECS: list[dict] = [
    {"mixer": "softmax"},
    {"mixer": "sliding_window", "window": 8},
    {"mixer": "linear", "feature_map": "elu"},
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms"},
    {"mixer": "linear", "feature_map": "taylor2"},
]


def tiny_config(attention: object, **overrides: object) -> RecAttnConfig:
    values = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    values.update(overrides)
    return RecAttnConfig(**values, attention=attention)


def run_demo(new_tokens: int = 16) -> None:
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (2, 12))
    mask = torch.ones_like(prompt)
    print(f"{'mixer':<44} {'cache bytes':>11}  same as no-cache  tokens")
    for spec in DEMO_SPECS:
        model = RecAttnForCausalLM(tiny_config(spec)).eval()
        out = model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )
        plain = model.generate(
            prompt, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, use_cache=False
        )
        same = bool(torch.equal(out.sequences, plain))
        label = ", ".join(f"{k}={v}" for k, v in spec.items())
        print(
            f"{label:<44} {cache_of(out).nbytes():>11}  {str(same):<16}  {out.sequences[0, -6:].tolist()}"
        )


def add_demo(sub: SubParsers) -> None:
    p = add_command(sub, "demo", "build a tiny random model per mixer and generate from it through the cache")
    p.add_argument("--tokens", type=int, default=16)

    def run(args: argparse.Namespace) -> int:
        run_demo(args.tokens)
        return 0

    p.set_defaults(handler=run)
