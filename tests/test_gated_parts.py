"""The gated families' shared parts (``hf_recattn/modeling/gated_parts.py``).

Properties a wrong implementation would break: the checkpoint keys and input weights of every gated family stay
the ones saved checkpoints and the decode layout name (a gated output moved into a child module renames
``gate_weight``); the options keep their order; ``finish_output`` is norm(o) * act(x W_g^T) as written out here
in float64 (exact up to float32 rounding, 1e-5), with the gate activation and norm kind a family chooses; the
shared checks name the option at fault.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_recattn.modeling.gated_parts import GatedMixer, logit, qk_norm
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixer_delta import DeltaMixer
from hf_recattn.modeling.mixers import MIXERS, validate_spec

SHAPE = MixerShape(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4, layer_idx=0)

#: spec -> (parameter names, input weight names): the layout saved checkpoints hold
LAYOUTS = [
    ({"mixer": "delta", "householder_steps": 2, "conv_size": 2},
     {"gates.beta_weight", "gates.beta_bias", "gates.decay_weight", "gates.dt_bias", "gates.A_log",
      "extra_kv_weight", "convs.conv_q.weight", "convs.conv_k.weight", "convs.conv_v.weight",
      "output_norm.weight", "gate_weight"},
     {"extra_kv", "output_gate"}),
    ({"mixer": "mesa", "output_gate": True, "conv_size": 0},
     {"forget_weight", "forget_bias", "beta_weight", "beta_bias", "lambda_param", "output_norm.weight",
      "gate_weight"},
     {"output_gate"}),
    ({"mixer": "mesa", "output_norm": False, "conv_size": 0},
     {"forget_weight", "forget_bias", "beta_weight", "beta_bias", "lambda_param"}, set()),
    ({"mixer": "gated_linear"}, {"gate_down", "gate_up", "gate_bias", "output_norm.weight", "gate_weight"},
     {"gate_down", "output_gate"}),
    ({"mixer": "gated_linear", "output_norm": False}, {"gate_down", "gate_up", "gate_bias", "gate_weight"},
     {"gate_down", "output_gate"}),
    ({"mixer": "softmax_delta", "write_strength": "sigmoid"}, {"beta_weight", "beta_bias"}, set()),
    ({"mixer": "softmax_householder"}, {"w_weight", "beta_weight", "beta_bias"}, {"householder"}),
]


def _mixer(spec: dict) -> torch.nn.Module:
    resolved = validate_spec(spec, "layer 0")
    return MIXERS[resolved["mixer"]](resolved, SHAPE)


@pytest.mark.parametrize("spec, names, inputs", LAYOUTS,
                         ids=lambda x: str(sorted(x) if isinstance(x, set) else x)[:60])
def test_checkpoint_keys_and_input_weights_stay(spec: dict, names: set, inputs: set) -> None:
    mixer = _mixer(spec)
    assert set(mixer.state_dict()) == names
    weights = mixer.input_weights()
    assert set(weights) == inputs
    params = dict(mixer.named_parameters())
    for weight in weights.values():  # the very parameters the checkpoint holds, not copies
        assert any(weight is p for p in params.values())


def test_option_fragments_keep_the_family_order() -> None:
    assert list(DeltaMixer.options) == [
        "rule", "householder_steps", "conv_size", "activation", "feature_map", "qk_norm", "negative_eigenvalues",
        "output_norm", "output_gate", "scale", "init", "half_life_min", "half_life_max", "beta_init", "chunk_size",
        "eps", "causal"]
    assert list(MIXERS["mesa"].options)[4:] == [
        "conv_size", "activation", "qk_norm", "output_norm", "output_gate", "init", "half_life_min", "half_life_max",
        "beta_init", "chunk_size", "eps", "causal"]
    assert list(MIXERS["gated_linear"].options) == [
        "gate_rank", "gate_temperature", "output_norm", "output_gate", "scale", "init", "half_life_min",
        "half_life_max", "chunk_size", "eps", "causal"]
    assert MIXERS["gated_linear"].options["output_gate"].default and not MIXERS["mesa"].options["output_gate"].default


def _reference(o: torch.Tensor, product: torch.Tensor, gain: torch.Tensor, act) -> torch.Tensor:
    """float64: RMSNorm per head (eps 1e-6) times the gain, heads in order, times act(product) (product = x W^T)."""
    o = o.double()
    b, hk, g, t, e = o.shape
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * gain.double().view(hk, g, 1, e)
    heads = normed.reshape(b, hk * g, t, e).transpose(1, 2)  # [B, T, H, E]
    return heads * act(product.double()).view(b, t, hk * g, e)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_finish_output_is_norm_times_gate(activation: str) -> None:
    torch.manual_seed(0)
    mixer = _mixer({"mixer": "delta", "eps": 1e-6})
    mixer.gate_activation = activation
    with torch.no_grad():
        mixer.output_norm.weight.normal_()
        mixer.gate_weight.normal_()
    o = torch.randn(2, 2, 2, 3, 4)
    x = torch.randn(2, 3, 16)
    act = F.silu if activation == "silu" else torch.sigmoid
    gain = mixer.output_norm.weight
    want = _reference(o, x.double() @ mixer.gate_weight.double().T, gain, act)
    got = mixer.finish_output(o, MixerInputs(hidden_states=x))
    assert got.shape == (2, 3, 4, 4)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the decode layout's product is read instead of computing it again
    product = torch.randn(2, 3, 16)
    got = mixer.finish_output(o, MixerInputs(hidden_states=x, projected={"output_gate": product}))
    torch.testing.assert_close(got.double(), _reference(o, product, gain, act), rtol=1e-5, atol=1e-5)


def test_norm_kind_is_a_family_setting() -> None:
    class LayerNormed(DeltaMixer):
        output_norm_kind = "layernorm"

    spec = validate_spec({"mixer": "delta"}, "layer 0")
    assert LayerNormed(spec, SHAPE).output_norm.kind == "layernorm"
    assert DeltaMixer(spec, SHAPE).output_norm.kind == "rms"


@pytest.mark.parametrize("spec, message", [
    ({"mixer": "mesa", "beta_init": 1.0}, r"layer 0: option 'beta_init' must be in \(0, 1\)"),
    ({"mixer": "gated_linear", "half_life_min": 9.0, "half_life_max": 8.0},
     r"layer 0: option 'half_life_min' \(9.0\) is above 'half_life_max'"),
    ({"mixer": "delta", "output_norm": False}, r"layer 0: option 'output_gate' needs output_norm=True"),
])
def test_shared_checks_name_the_option(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_spec(spec, "layer 0")


def test_gla_gate_needs_no_norm_and_helpers() -> None:
    assert validate_spec({"mixer": "gated_linear", "output_norm": False}, "layer 0")["output_gate"]
    assert issubclass(MIXERS["gated_linear"], GatedMixer) and not MIXERS["gated_linear"].gate_needs_norm
    assert torch.sigmoid(torch.tensor(logit(0.3), dtype=torch.float64)).item() == pytest.approx(0.3, abs=1e-12)
    x = torch.randn(3, 5, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(qk_norm(x, "l2", 1e-6), want)
    assert qk_norm(x, "none", 1e-6) is x
