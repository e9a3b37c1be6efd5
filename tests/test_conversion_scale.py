"""The scale arithmetic of benchmarks/conversion_scale.py: parameter counts, the terms, what fits one GPU."""

from __future__ import annotations

from script_modules import load_script

scale = load_script("benchmarks", "conversion_scale")


def test_parameter_counts_match_transformers_models() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    assert scale.parameters(scale.ARCHS["Llama-3.1-8B"])["all"] == 8_030_261_248  # as published
    shape = (3, 64, 96, 4, 2, 16, 100)
    for tied in (True, False):
        values = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=tied)
        llama = LlamaForCausalLM(LlamaConfig(**values))
        assert scale.parameters((*shape, tied))["all"] == sum(p.numel() for p in llama.parameters())
        qwen3 = Qwen3ForCausalLM(Qwen3Config(**values))  # plus its per-head q / k norms, left out
        assert scale.parameters((*shape, tied))["all"] + 3 * 2 * 16 == sum(p.numel() for p in qwen3.parameters())


def test_terms_scale_with_the_block_and_the_vocabulary() -> None:
    shape = scale.ARCHS["Qwen3-1.7B"]
    one, two = scale.estimate(shape, 1024, 2), scale.estimate(shape, 2048, 2)
    for key in ("captured", "one_layer", "activations", "kl"):
        assert two[key] == 2 * one[key]
    assert one["kl"] == 10 * 151936 * 4 * 1024 and one["stage1_trainable"] == 28 * 2048 * 24 * 128
    assert one["lora_parameters"] == 28 * 8 * (4 * 2048 + 2 * 16 * 128 + 2 * 8 * 128)


def test_what_fits_one_gpu_and_how_many_gpus_sharding_needs() -> None:
    small, big = scale.gpu_estimate("Qwen3-0.6B", 2048), scale.gpu_estimate("Qwen3-8B", 2048)
    assert scale._fits(small, "full").endswith("(fits)") and scale._fits(big, "stage2").endswith("(fits)")
    state, local = big["full_state"], big["full_local"]
    assert state + local > scale.GPU_BYTES  # 16 bytes of Adam per parameter: 131 GB for 8B
    gpus = int(scale._fits(big, "full").split(">= ")[1].split()[0])
    assert state / gpus + local <= scale.GPU_BYTES < state / (gpus - 1) + local
