"""RWKV-7's generalized delta rule (the ``generalized_delta`` mixer, preset ``rwkv7``) against the float64 per-token
reference (tests/reference_generalized_delta.py).

The reference keeps the paper's values x keys state per key head and applies the decay, the rank-1 removal, the
write, the read and the output LayerNorm token by token: no cumulative sums, no chunks, no triangular solve.
Tolerances (relative to the largest entry): fp32 mixer vs float64 reference ``REL_FP32`` (1e-5); float64 gradients
of q, k, v, the layer input and every parameter ``REL_GRAD`` (1e-8); fp32 chunked / steps / prefill + steps vs fp32
parallel ``REL_FORMS`` (1e-5). Models: greedy tokens with the cache equal those without it exactly, logits within
1e-4.
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
from generation_cases import (
    Case,
    assert_generates_through_the_cache_and_reloads,
    one_thread,
    tiny_model,
)
from mixer_checks import BATCH, HIDDEN, PAD, SHAPE
from mixer_steps import left_padded, run_chunked, run_steps
from reference import real_rows, rel_err
from reference_generalized_delta import RWKV7Params, rwkv7_reference
from reference_recurrent_softmax import hybrid_attention
from transformers import initialization as init

from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
#: (init, output_norm, output_gate)
CASES = [("scratch", True, True), ("convert", False, False), ("convert", True, False)]
CASE_IDS = [f"{i}-{'norm' if n else 'nonorm'}-{'gate' if g else 'nogate'}" for i, n, g in CASES]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def make_mixer(init_kind: str = "scratch", norm: bool = True, gate: bool = True, dtype=torch.float32,
               shape: MixerShape = SHAPE, **options):
    """A mixer in ``dtype`` initialized as the model would, then every parameter moved off its initial value."""
    options = {"init": init_kind, "output_norm": norm, "output_gate": gate, "decay_rank": 4, "iclr_rank": 3,
               "half_life_min": 1.5, "half_life_max": 6.0, **options}
    mixer = build_mixer(validate_spec({"mixer": "generalized_delta", **options}, "test"), shape).to(dtype)
    checks.init_every_module(mixer)
    checks.perturb_parameters(mixer, dtype=dtype)
    return mixer


#: the reference's tensors, by the mixer's parameter names
PARAMETERS = ("decay_down", "decay_up", "decay_bias", "iclr_down", "iclr_up", "iclr_bias", "key_gain", "key_mix")


def params_of(mixer, live: bool = False) -> RWKV7Params:
    """The mixer's parameters for the reference: float64 copies, or the live tensors (gradient checks)."""
    tensors = {name: p if live else p.detach().double() for name, p in mixer.named_parameters()}
    return RWKV7Params(heads=mixer.shape.num_heads, kv_heads=mixer.shape.num_kv_heads, scale=mixer.scale,
                       eps=mixer.spec["eps"], norm_gain=tensors.get("output_norm.weight"),
                       gate_weight=tensors.get("gate_weight"),
                       **{name: tensors[name] for name in PARAMETERS})


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0, shape: MixerShape = SHAPE):
    return checks.random_inputs(shape, seq_len, dtype, seed)


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("init_kind,norm,gate", CASES, ids=CASE_IDS)
def test_forms_match_reference(init_kind: str, norm: bool, gate: bool, padded: bool) -> None:
    """parallel, chunked (chunks of 3 and 16, which do not divide 40, of 5 and 20, which do, and of 64, one chunk;
    chunks longer than 16 tokens hold several sub-chunks) and token steps: outputs and final state."""
    seq_len = 40
    mixer = make_mixer(init_kind, norm, gate)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else None
    expected, final = rwkv7_reference(q, k, v, x, mask, params_of(mixer))
    assert rel_err(real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask), expected) <= REL_FP32
    for chunk in (3, 5, 16, 20, 64):
        mixer.chunk_size = chunk
        out, state = mixer.chunked(q, k, v, MixerInputs(x, mask), mixer.init_state(BATCH, q.device, q.dtype))
        assert rel_err(real_rows(out, mask), expected) <= REL_FP32, chunk
        assert rel_err(state["S"], final) <= REL_FP32, chunk
    full = torch.ones(BATCH, seq_len, dtype=torch.bool) if mask is None else mask
    stepped, state = run_steps(mixer, q, k, v, x, full)
    assert rel_err(real_rows(stepped, mask), expected) <= REL_FP32
    assert rel_err(state["S"], final) <= REL_FP32
    # the removal term matters: without it (a = 0) the function changes
    with torch.no_grad():
        mixer.iclr_bias.fill_(-1e4)
    assert rel_err(real_rows(mixer.parallel(q, k, v, MixerInputs(x, mask)), mask), expected) > 1e-2


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("init_kind,norm,gate", CASES[:2], ids=CASE_IDS[:2])
def test_gradients_match_reference(init_kind: str, norm: bool, gate: bool, form: str) -> None:
    """float64: gradients of q, k, v, the layer input and every parameter, left-padded batch (chunks of 20 over 23:
    sub-chunks of 16 and a ragged one; the parallel form one chunk of two sub-chunks)."""
    mixer = make_mixer(init_kind, norm, gate, torch.float64, chunk_size=20)
    checks.assert_gradients_match(
        mixer, lambda qkvx, mask: rwkv7_reference(*qkvx, mask, params_of(mixer, True))[0], 23, REL_GRAD, form)


@pytest.mark.parametrize("chunk_size,seq_len", [(4, 11), (20, 45)], ids=["small-chunks", "sub-chunks"])
def test_chunked_steps_and_prefill_match_parallel(chunk_size: int, seq_len: int) -> None:
    """Left padding longer than a chunk; forward() without a cache takes the chunked form past a chunk."""
    mixer = make_mixer(chunk_size=chunk_size)
    inputs = q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, chunk_size + 2)
    parallel, state = checks.assert_forms_agree(mixer, inputs, mask, REL_FORMS, whole_rows={"chunked"})
    assert set(state) == {"S"}
    auto, _ = mixer(q, k, v, MixerInputs(x, mask))
    assert rel_err(real_rows(auto, mask), real_rows(parallel, mask)) <= REL_FORMS


def test_continues_from_a_state_and_padding_leaves_it() -> None:
    """From a random state, chunks and steps give the reference's outputs and final state; a row left-padded by
    PAD gives its real tokens' outputs and state; a padded step leaves its row's state as it was."""
    mixer = make_mixer(chunk_size=4)
    inputs = q, k, v, x = make_inputs(9, seed=2)
    state = checks.random_state(mixer)
    expected, final = rwkv7_reference(q, k, v, x, None, params_of(mixer), initial=state["S"].clone())
    checks.assert_continues_from_state(mixer, inputs, state, expected, {"S": final}, REL_FP32)
    checks.assert_left_padding_changes_nothing(mixer, make_inputs(9), PAD, REL_FORMS)
    checks.assert_padded_step_keeps_state(mixer, make_inputs(1), state)


def test_gqa_equals_repeated_key_heads() -> None:
    """Two query heads per key head give what one key head per query head gives with each key head's keys,
    values and per-key-head parameters repeated (the query heads of a group read one state)."""
    mha_shape = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=4, head_dim=8, layer_idx=5)
    gqa, mha = make_mixer(), make_mixer(shape=mha_shape)
    repeat = {"decay_up", "decay_bias", "iclr_up", "iclr_bias", "key_gain", "key_mix"}
    with torch.no_grad():
        for name, param in mha.named_parameters():
            source = gqa.get_parameter(name)
            if name in repeat:
                source = source.view(2, -1, *source.shape[1:]).repeat_interleave(2, dim=0).reshape(param.shape)
            param.copy_(source)
    q, k, v, x = make_inputs(8)
    out = gqa.parallel(q, k, v, MixerInputs(x))
    expected = mha.parallel(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), MixerInputs(x))
    assert rel_err(out, expected) <= REL_FORMS
    assert gqa.state_size(10) == 2 * 8 * 8 and mha.state_size(10) == 4 * 8 * 8


def test_strong_decays_over_long_sequences_stay_finite() -> None:
    """w at its floor e^{-e^{-1/2}} (log w = -0.61 per token, -240 over 400 tokens: e^{240} overflows fp32): no
    overflow in the chunked form (chunks of 200: 13 sub-chunks, whose factors seen from the first sub-chunk would
    reach e^{120}) or its gradients, and over the last 70 tokens chunks, steps and the parallel form agree."""
    mixer = make_mixer(chunk_size=200)
    with torch.no_grad():
        mixer.decay_bias.fill_(40.0)
    inputs = [t.requires_grad_() for t in make_inputs(400)]
    chunked, state = run_chunked(mixer, *inputs, torch.ones(BATCH, 400, dtype=torch.bool))
    grads = torch.autograd.grad(chunked.square().sum(), [*inputs, *mixer.parameters()])
    assert all(torch.isfinite(t).all() for t in (chunked, state["S"], *grads))
    q, k, v, x = (t.detach()[..., -70:, :] for t in inputs)
    stepped, _ = run_steps(mixer, q, k, v, x, torch.ones(BATCH, 70, dtype=torch.bool))
    assert rel_err(mixer.chunked(q, k, v, MixerInputs(x), mixer.init_state(BATCH, q.device, q.dtype))[0],
                   stepped) <= REL_FORMS
    assert rel_err(mixer.parallel(q, k, v, MixerInputs(x)), stepped) <= REL_FORMS


def test_convert_and_scratch_init() -> None:
    """convert: input-independent decay at the configured half-lives, a = beta_init, the teacher's keys written
    unchanged; scratch: RWKV-7's values."""
    shape = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=3, layer_idx=1)
    spec = validate_spec({"mixer": "generalized_delta", "init": "convert", "half_life_min": 4, "half_life_max": 64,
                          "beta_init": 0.25}, "t")
    mixer = build_mixer(spec, shape)
    for param in mixer.parameters():
        param.data.normal_()
    mixer.init_parameters(init)
    assert mixer.decay_up.abs().max() == 0 and mixer.iclr_up.abs().max() == 0 and mixer.decay_down.abs().max() > 0
    log_w = -math.exp(-0.5) * torch.sigmoid(mixer.decay_bias.double())
    lives = (math.log(0.5) / log_w).view(2, 3)
    assert torch.allclose(lives, torch.tensor([[4.0, 16.0, 64.0]] * 2, dtype=torch.float64), rtol=1e-4)
    assert torch.allclose(torch.sigmoid(mixer.iclr_bias), torch.full((6,), 0.25))
    assert (mixer.key_mix == 0).all() and (mixer.key_gain == 1).all()
    config = type("Config", (), {"num_hidden_layers": 3, "initializer_range": 0.02})()
    scratch = build_mixer(validate_spec("rwkv7", "t"), shape, config)
    scratch.init_parameters(init)
    assert scratch.decay_down.abs().max() == 0 and scratch.iclr_down.abs().max() == 0
    for up in (scratch.decay_up, scratch.iclr_up):  # orthogonal columns of norm 0.1 (64 > 6 rows)
        assert torch.allclose(up @ up.T, 0.01 * torch.eye(6), atol=1e-6)
    channels = torch.arange(6, dtype=torch.float64) / 5
    expected = 0.5 - 7 + 5 * channels ** (0.85 + 0.5**0.5)  # layer 1 of 3
    assert torch.allclose(scratch.decay_bias.double(), expected, atol=1e-6)
    assert (scratch.iclr_bias == 0).all() and (scratch.key_gain == 0.85).all() and (scratch.key_mix == 1).all()


def test_preset_and_state_size() -> None:
    spec = validate_spec("rwkv7", "t")
    assert spec == {**validate_spec({"mixer": "generalized_delta"}, "t"), "rope": False, "scale": 1.0,
                    "output_gate": True}
    mixer = make_mixer()
    state = mixer.init_state(1, torch.device("cpu"), torch.bfloat16)
    assert state["S"].dtype == torch.float32  # an accumulating state stays float32 in a half-precision model
    assert mixer.state_size(1) == mixer.state_size(10**6) == state["S"].numel() == 2 * 8 * 8


def test_bad_specs_name_the_option() -> None:
    checks.assert_specs_rejected([
        ({"mixer": "generalized_delta", "causal": False}, "layer 3",
         r"layer 3: option 'causal' must be True for generalized_delta"),
        ({"mixer": "rwkv7", "beta_init": 1.0}, "layer 1", r"layer 1: option 'beta_init' must be in \(0, 1\)"),
        ({"mixer": "rwkv7", "output_norm": False}, "layer 1", r"layer 1: option 'output_gate' needs output_norm=True"),
        ({"mixer": "rwkv7", "half_life_min": 1.0}, "layer 0", r"layer 0: option 'half_life_min' must be >= 1.14"),
        ({"mixer": "rwkv7", "half_life_min": 9, "half_life_max": 3}, "layer 0",
         r"layer 0: option 'half_life_min' \(9.0\) is above 'half_life_max'"),
        ({"mixer": "rwkv7", "decay_rank": 0}, "layer 2", r"layer 2: option 'decay_rank' must be >= 1"),
    ])


@pytest.mark.parametrize("attention", [
    {"mixer": "rwkv7", "chunk_size": 4}, {"mixer": "generalized_delta", "init": "convert", "chunk_size": 4},
    {"mixer": "hybrid", "window": 3, "combine": "sum", "chunk_size": 4, "far": {"mixer": "rwkv7", "chunk_size": 4}},
], ids=["preset", "convert", "hybrid-far"])
def test_model_generates_through_the_cache_and_reloads(attention, tmp_path) -> None:
    """Greedy decoding with the cache gives the tokens and logits of the full forward, left-padded batch; save /
    load gives the same logits (generation_cases.assert_generates_through_the_cache_and_reloads)."""
    assert_generates_through_the_cache_and_reloads(tiny_model(Case("rwkv7", attention)), tmp_path)


# ----- RWKV-7 as a hybrid's far part: g softmax(window) + (1 - g) generalized_delta over every token ----------------
HYBRID = {"mixer": "hybrid", "window": 4, "combine": "sum",
          "far": {"mixer": "rwkv7", "decay_rank": 4, "iclr_rank": 3, "chunk_size": 5}}


def hybrid_reference(hybrid, live: bool = False):
    """(inputs, mask) -> g * softmax over the window (tests/reference_recurrent_softmax.py) + (1 - g) * the RWKV-7
    reference, real rows."""

    def reference(inputs, mask):
        q, k, v, x = inputs
        share = torch.sigmoid(hybrid.mix_logit if live else hybrid.mix_logit.detach()).double()[:, None]
        near = hybrid_attention(q, k, v, 4, None, share[:, 0].detach(), mask=mask)
        far, _ = rwkv7_reference(q, k, v, x, mask, params_of(hybrid.far, live))
        return real_rows(share * near + (1 - share) * far, mask)

    return reference


def test_hybrid_with_rwkv7_far_part() -> None:
    """``{"mixer": "hybrid", "window": 4, "combine": "sum", "far": {"mixer": "rwkv7"}}``: the far part reads every
    token as it arrives (its decay and rate read the token's own layer input); the hybrid's forms agree, and its
    values and float64 gradients match g * the window reference + (1 - g) * the RWKV-7 reference. combine='shared'
    is refused."""
    hybrid = build_mixer(validate_spec(HYBRID, "layer 1"), SHAPE)
    checks.init_every_module(hybrid)
    checks.perturb_parameters(hybrid)
    inputs = make_inputs(13)
    mask = left_padded(13, PAD)
    parallel, state = checks.assert_forms_agree(hybrid, inputs, mask, REL_FORMS)
    assert rel_err(real_rows(parallel, mask), hybrid_reference(hybrid)(inputs, mask)) <= REL_FP32
    assert {"wk", "wv", "wmask", "far.S"} == set(state)
    hybrid = hybrid.double()
    for form in ("parallel", "chunked"):
        checks.assert_gradients_match(hybrid, hybrid_reference(hybrid, live=True), 9, REL_GRAD, form)
    shared = {**HYBRID, "combine": "shared"}
    checks.assert_specs_rejected([(shared, "layer 2", r"layer 2: option 'far' .*combine='sum'")])
