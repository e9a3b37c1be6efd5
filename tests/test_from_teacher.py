"""from_teacher: a softmax copy reproduces LlamaForCausalLM; only mixer parameters are new; bad teachers fail.

Tolerance: fp32 logits, max abs diff ``ATOL`` (the issue's 1e-4) on real (non-pad) positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_recattn import RecAttnForCausalLM, from_teacher

ATOL = 1e-4
VOCAB = 100
PAD = 4
NEW_PARAMS = [  # mixers with learnable parameters of their own
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms"},
    {"mixer": "linear", "feature_map": "cosine", "normalize": "layernorm"},
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Tiny tensors: extra threads only add synchronization (very slow on a busy 2-core machine)."""
    torch.set_num_threads(1)


def llama(impl: str = "sdpa", tie: bool = False, **kw: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    values.update(kw)
    cfg = LlamaConfig(**values)
    cfg._attn_implementation = impl
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaky attention and distinct weights, so that a wrong copy or mask shows
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def batch(padded: bool, length: int = 12) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    if not padded:
        return x, None
    mask = torch.ones_like(x)
    mask[1, :PAD] = 0
    x[1, :PAD] = 0
    return x, mask


def max_diff_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> float:
    keep = torch.ones(a.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    return float((a - b).abs()[keep].max())


@pytest.mark.parametrize("source", ["object", "folder"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_softmax_copy_reproduces_llama(impl: str, padded: bool, source: str, tmp_path) -> None:  # noqa: ANN001
    teacher = llama(impl)
    if source == "folder":
        teacher.save_pretrained(tmp_path)
        student = from_teacher(str(tmp_path), attention={"mixer": "softmax"}, attn_implementation=impl)
    else:
        student = from_teacher(teacher, attention={"mixer": "softmax"})
    assert isinstance(student, RecAttnForCausalLM) and not student.training
    assert student.config._attn_implementation == impl
    assert student.model.layers[0].self_attn.mixer._implementation() == impl
    x, mask = batch(padded)
    with torch.no_grad():
        want = teacher(x, attention_mask=mask).logits
        got = student(x, attention_mask=mask).logits
    assert max_diff_real(got, want, mask) <= ATOL
    if padded:  # the padding really matters: ignoring the mask moves the padded row
        with torch.no_grad():
            unmasked = student(x).logits
        assert max_diff_real(unmasked[1:], want[1:], mask[1:]) > 1e-2


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_only_mixer_parameters_are_new(tie: bool) -> None:
    teacher = llama(tie=tie, num_hidden_layers=3)
    student = from_teacher(teacher, attention=["softmax", *NEW_PARAMS])
    t_state, s_state = teacher.state_dict(), student.state_dict()
    assert set(t_state) <= set(s_state)
    for name, tensor in t_state.items():
        assert torch.equal(s_state[name], tensor), name
    new = set(s_state) - set(t_state)
    assert new and all(".mixer." in n for n in new)
    assert {n.split(".")[2] for n in new} == {"1", "2"}  # layer 0 (softmax) has no new parameters
    # the new parameters start at their documented initial values (identity map, unit gains, temperature 1)
    fm = student.model.layers[1].self_attn.mixer.feature_map
    assert torch.equal(fm.q_weight, torch.eye(8).expand_as(fm.q_weight))
    assert torch.equal(student.model.layers[1].self_attn.mixer.output_norm.weight, torch.ones(4, 8))
    assert torch.equal(student.model.layers[2].self_attn.mixer.feature_map.log_temperature, torch.zeros(4))
    tied = student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()
    assert tied is tie


def test_mixed_attention_runs_and_differs_from_teacher() -> None:
    teacher = llama(num_hidden_layers=3)
    student = from_teacher(
        teacher, attention="softmax", attention_overrides={"1": NEW_PARAMS[0], "-1": "linear"}
    )
    assert [s["mixer"] for s in student.config.layer_specs()] == ["softmax", "linear", "linear"]
    x, _ = batch(False)
    with torch.no_grad():
        assert (student(x).logits - teacher(x).logits).abs().max() > 1e-3


def test_non_llama_teacher_is_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(ValueError, match=r"teacher model_type 'gpt2' is not a supported Llama-variant family"):
        from_teacher(gpt2)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'gpt2' is not a supported"):
        from_teacher(str(tmp_path))


def test_heads_not_dividing_is_a_clear_error() -> None:
    teacher = llama(num_key_value_heads=2)
    teacher.config.num_key_value_heads = 3
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"
    ):
        from_teacher(teacher)


@pytest.mark.parametrize(
    "field,value,tensor", [("num_key_value_heads", 1, "k_proj"), ("num_attention_heads", 2, "q_proj")]
)
def test_head_counts_not_matching_the_weights_is_a_clear_error(field: str, value: int, tensor: str) -> None:
    teacher = llama()
    setattr(teacher.config, field, value)  # a config that no longer describes the weights
    with pytest.raises(
        ValueError, match=rf"teacher weights do not match its config .*{field}={value}.*{tensor}"
    ):
        from_teacher(teacher)


def test_bad_attention_spec_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"layer 1: unknown mixer 'lineer'"):
        from_teacher(llama(), attention=["softmax", "lineer"])


@pytest.mark.parametrize(
    "shape",
    [
        {"attention_bias": True, "mlp_bias": True},
        {"head_dim": 16},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1},
    ],
    ids=["biases", "head_dim16", "mha", "mqa"],
)
def test_llama_shape_variants_reproduce_logits(shape: dict) -> None:
    teacher = llama(**shape)
    student = from_teacher(teacher)
    x, mask = batch(True)
    with torch.no_grad():
        assert (
            max_diff_real(
                student(x, attention_mask=mask).logits, teacher(x, attention_mask=mask).logits, mask
            )
            <= ATOL
        )


def test_from_llama_is_the_earlier_name_of_from_teacher() -> None:
    import hf_recattn

    assert hf_recattn.from_llama is hf_recattn.from_teacher


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_float32_student_of_a_bfloat16_teacher_is_the_bfloat16_student_cast(tie: bool) -> None:
    """Built directly in float32 (no bfloat16 copy of the model on the way), the student equals the bfloat16 student
    cast to float32 bit for bit: the teacher's weights, the fresh mixer parameters rounded through bfloat16 in the
    same initialization order, the non-persistent buffers, the tied head, the config and the generator's state."""
    from hf_recattn.conversion.from_teacher import recattn_config_from, student_from_teacher
    from hf_recattn.conversion.recipe import load_recipe

    teacher = llama(tie=tie, num_hidden_layers=4).to(torch.bfloat16)
    gdn = load_recipe("gdn", "quick").attention  # random-init convolutions, gates and feature maps
    config = recattn_config_from(teacher.config, ["softmax", gdn, NEW_PARAMS[0], {"mixer": "linear",
                                                                                 "decay": "retnet"}])
    built = {}
    for name, dtype in (("cast", None), ("direct", torch.float32)):
        torch.manual_seed(1)
        student = student_from_teacher(teacher, config, dtype)
        built[name] = (student.float() if dtype is None else student, torch.get_rng_state())
    (cast, cast_rng), (direct, direct_rng) = built["cast"], built["direct"]
    assert torch.equal(cast_rng, direct_rng)
    tensors = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in (cast, direct)]
    assert tensors[0].keys() == tensors[1].keys() and any("log_gamma" in k for k in tensors[0])
    for name, value in tensors[0].items():
        assert value.dtype == tensors[1][name].dtype == torch.float32 and torch.equal(value, tensors[1][name]), name
    torch.manual_seed(1)
    unrounded = RecAttnForCausalLM(config).model.layers[1].self_attn.mixer.state_dict()  # float32 as initialized
    rounded = direct.model.layers[1].self_attn.mixer.state_dict()
    assert any(not torch.equal(unrounded[k], rounded[k]) for k in rounded)  # the rounding is what is tested
    assert cast.config.to_dict() == direct.config.to_dict()
    assert (direct.lm_head.weight.data_ptr() == direct.model.embed_tokens.weight.data_ptr()) is tie
