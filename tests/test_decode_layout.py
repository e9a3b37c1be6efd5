"""The decode layout (``hf_recattn/modeling/decode_layout.py``): q/k/v and gate/up fused, column-major weights.

Properties a wrong layout would break: the same parameters hold the same values (only strides change, ties
kept); forwards give the row-major logits within float rounding (1e-5 relative); one product serves each fused
group; a replaced or PEFT-wrapped weight is never read through a stale fused view; training sees the usual
gradients; generate() applies it on a CPU; save / reload and ``decode_layout(False)`` round-trip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from generation_cases import all_cases, left_padded_batch, one_thread, tiny_model
from torch import nn
from torch.nn import functional as F

from hf_recattn import RecAttnForCausalLM
from hf_recattn.modeling.decode_layout import column_major

TOLERANCE = 1e-5  # relative to the largest logit: fp32 products summed in another order
CASE = next(case for case in all_cases() if case.id.startswith("delta"))  # its output gate reads the layer input
PRODUCT = next(case for case in all_cases() if "householder_steps=2" in case.id)  # extra keys / values too
MESA_GATED = next(case for case in all_cases() if case.id.startswith("mesa") and "output_gate=True" in case.id)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def _biased(model: RecAttnForCausalLM) -> RecAttnForCausalLM:
    """Random biases on q/k/v and gate/up (so that a bias dropped or misplaced by the fusion shows)."""
    config = copy.deepcopy(model.config)
    config.attention_bias = config.mlp_bias = True
    torch.manual_seed(3)
    biased = RecAttnForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in biased.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    return biased


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert ((a - b).abs().max() / b.abs().max()).item() < TOLERANCE


@pytest.mark.parametrize(
    "case, bias", [(CASE, False), (CASE, True), (PRODUCT, False)], ids=["no-bias", "bias", "deltaproduct"]
)
def test_layout_keeps_parameters_values_and_logits(case: object, bias: bool) -> None:
    model = tiny_model(case)
    model = _biased(model) if bias else model
    ids, mask = left_padded_batch()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        model.decode_layout()
        after = model(ids, attention_mask=mask).logits
    assert dict(model.named_parameters()).keys() == params.keys()
    for name, param in model.named_parameters():
        assert param is params[name], name
        assert torch.equal(param, values[name]), name
    layer = model.model.layers[0]
    for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj, model.lm_head):
        assert column_major(linear.weight)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    _close(after, before)


@pytest.mark.parametrize("case", [CASE, PRODUCT, MESA_GATED], ids=lambda case: case.id)
def test_each_fused_group_runs_as_one_product(case: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v with the mixer's own input weights (output gate, DeltaProduct's extra keys / values) as one
    product, gate/up as another; none of them read on its own."""
    model = tiny_model(case)
    model.decode_layout()
    calls: list[tuple[int, int]] = []
    real = F.linear

    def recording(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((weight.shape[0], weight.data_ptr()))
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", recording)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    fused, separate = [], []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        extra = list(attn.mixer.input_weights().values())
        assert extra
        for linears, weights in (((attn.q_proj, attn.k_proj, attn.v_proj), extra), ((mlp.gate_proj, mlp.up_proj), [])):
            width = sum(m.out_features for m in linears) + sum(w.shape[0] for w in weights)
            fused.append((width, linears[0].weight.data_ptr()))
            separate += [(m.out_features, m.weight.data_ptr()) for m in linears]
            separate += [(w.shape[0], w.data_ptr()) for w in weights]
    assert all(calls.count(call) == 1 for call in fused)
    assert not set(separate) & set(calls)


def test_a_replaced_weight_is_read_not_the_stale_fused_buffer() -> None:
    model = tiny_model(CASE)
    ids = torch.tensor([[3, 9, 4, 1]])
    model.decode_layout()
    with torch.no_grad():
        model(ids)  # the fused view is cached now
        attn = model.model.layers[1].self_attn
        attn.k_proj.weight = nn.Parameter(torch.randn_like(attn.k_proj.weight))
        fused = model(ids).logits
        model.decode_layout(False)
        plain = model(ids).logits
    _close(fused, plain)


def test_peft_adapters_are_not_bypassed() -> None:
    peft = pytest.importorskip("peft")
    model = tiny_model(CASE)
    model.decode_layout()
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "up_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config).eval()
    ids = torch.tensor([[3, 9, 4, 1]])
    with torch.no_grad():
        adapted = wrapped(ids).logits
        with wrapped.disable_adapter():
            base = wrapped(ids).logits
        merged = wrapped.merge_and_unload()
        merged.decode_layout(False)
        reference = merged(ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapters do something
    _close(adapted, reference)


def test_training_gradients_are_those_of_the_row_major_model() -> None:
    model = tiny_model(CASE)
    twin = copy.deepcopy(model)
    model.decode_layout()
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    for m in (model, twin):
        m.train()
        m(ids, labels=ids).loss.backward()
    grads = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_generate_applies_the_layout_and_keeps_the_tokens() -> None:
    model = tiny_model(CASE)
    twin = copy.deepcopy(model)
    twin.decode_layout(False)  # row-major, and never laid out
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(ids, **kwargs)
        expected = twin.generate(ids, **kwargs)
    assert column_major(model.model.layers[0].mlp.gate_proj.weight)
    assert not column_major(twin.model.layers[0].mlp.gate_proj.weight)
    assert torch.equal(tokens, expected)
    half = copy.deepcopy(twin).to(torch.bfloat16)
    half._decode_layout_pending = True  # as a freshly built model: only its dtype keeps the layout off
    with torch.no_grad():
        half.generate(ids, **kwargs)
    assert not column_major(half.model.layers[0].mlp.gate_proj.weight), "bfloat16 reads no faster column-major"


def test_save_reload_and_restore(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model(CASE)
    ids = torch.tensor([[3, 9, 4, 1]])
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.decode_layout()
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = RecAttnForCausalLM.from_pretrained(tmp_path).eval()
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name
    model.decode_layout(False)
    for name, param in model.named_parameters():
        assert param.is_contiguous(), name
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        _close(reloaded(ids).logits, logits)
        _close(model(ids).logits, logits)
