"""The MesaNet mixer (family ``mesa``, preset ``mesanet``) against the float64 reference.

tests/reference_mesa.py updates G and H per key head token by token in Su's form and solves every read
with torch.linalg.solve; no cumulative sum, no chunk, no Cholesky, no conjugate gradients.
Tolerances: fp32 mixer (exact solve) vs float64 reference ``REL_FP32`` = 1e-5, as for the other families. The
solve needs no looser bound here: H_t + Lambda has its eigenvalues in [Lambda_min, Lambda_max + sum of beta]
(Lambda_min >= 0.25, keys of norm <= 1 with qk_norm, ~10 tokens), so the fp32 Cholesky error stays within a few
ulps times a small condition number (measured 3e-7 .. 9e-7, also without the q/k norm); float64 gradients
(q, k, v, the layer input and every parameter) ``REL_GRAD`` = 1e-8; fp32 chunked / steps
/ prefill vs fp32 parallel ``REL_FORMS`` = 1e-5, for either solver; conjugate gradients (float64, head_dim 16) reach
``REL_CG`` = 1e-6 of the exact solve with enough steps, and their error never grows with more steps.
"""

from __future__ import annotations

import math

import mixer_checks as checks
import pytest
import torch
from mixer_checks import BATCH, HIDDEN, PAD, SHAPE
from mixer_steps import left_padded, run_steps
from reference import real_rows, rel_err
from reference_mesa import MesaParams, mesa_reference

from hf_recattn.modeling import ops_mesa
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixers import build_mixer, validate_spec

REL_FP32 = 1e-5
REL_GRAD = 1e-8
REL_FORMS = 1e-5
REL_CG = 1e-6
#: (conv_size, output_gate, qk_norm)
COMBOS = [(0, False, "l2"), (3, True, "l2"), (3, False, "none")]
COMBO_IDS = [f"conv{c}-{'gate' if g else 'nogate'}-{n}" for c, g, n in COMBOS]


def make_mixer(conv_size: int = 3, output_gate: bool = True, qk_norm: str = "l2", dtype=torch.float32,
               shape: MixerShape = SHAPE, **options):
    """A mesa mixer (exact solve unless told) with every parameter moved off its initial value."""
    spec = validate_spec({"mixer": "mesanet", "solver": "exact", "conv_size": conv_size, "output_gate": output_gate,
                          "qk_norm": qk_norm, "init": "convert", "half_life_min": 2.0, "half_life_max": 8.0,
                          **options}, "test")
    mixer = build_mixer(spec, shape)
    checks.init_every_module(mixer)
    checks.perturb_parameters(mixer)
    return mixer.to(dtype)


def params_of(mixer, live: bool = False) -> MesaParams:
    """The mixer's parameters for the reference: float64 copies, or the live tensors (gradient checks)."""

    def get(param):
        return param if live else param.detach().double()

    return MesaParams(
        heads=mixer.shape.num_heads, kv_heads=mixer.shape.num_kv_heads, head_dim=mixer.shape.head_dim,
        forget_weight=get(mixer.forget_weight), forget_bias=get(mixer.forget_bias),
        beta_weight=get(mixer.beta_weight), beta_bias=get(mixer.beta_bias), lambda_param=get(mixer.lambda_param),
        lambda_min=mixer.spec["lambda_min"], conv={n: get(c.weight) for n, c in mixer.convs.items()},
        activation=mixer.spec["activation"] == "silu", qk_norm=mixer.spec["qk_norm"] == "l2",
        norm_gain=None if mixer.output_norm is None else get(mixer.output_norm.weight),
        gate_weight=get(mixer.gate_weight) if hasattr(mixer, "gate_weight") else None, eps=mixer.spec["eps"],
    )


def make_inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0, shape: MixerShape = SHAPE):
    return checks.random_inputs(shape, seq_len, dtype, seed)


def random_state(mixer, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random G and conv buffers, and a random positive semi-definite H (as any H_t is)."""
    state = checks.random_state(mixer)
    state["H"] = state["H"] @ state["H"].transpose(-1, -2)
    return {n: s.to(dtype) for n, s in state.items()}


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
@pytest.mark.parametrize("conv,gate,qk_norm", COMBOS, ids=COMBO_IDS)
def test_parallel_and_steps_match_reference(conv: int, gate: bool, qk_norm: str, padded: bool) -> None:
    seq_len = 10
    mixer = make_mixer(conv, gate, qk_norm)
    q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, PAD) if padded else torch.ones(BATCH, seq_len, dtype=torch.bool)
    expected, expected_state = mesa_reference(q, k, v, x, mask if padded else None, params_of(mixer))
    out = mixer.parallel(q, k, v, MixerInputs(x, mask if padded else None))
    assert rel_err(real_rows(out, mask), expected) <= REL_FP32
    stepped, state = run_steps(mixer, q, k, v, x, mask)
    assert rel_err(real_rows(stepped, mask), expected) <= REL_FP32
    assert set(state) == set(expected_state)
    for name, want in expected_state.items():
        assert rel_err(state[name], want) <= REL_FP32, name


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("conv,gate,qk_norm", COMBOS, ids=COMBO_IDS)
def test_gradients_match_reference(conv: int, gate: bool, qk_norm: str, form: str) -> None:
    """float64, exact solve: gradients of q, k, v, the layer input and every parameter, left-padded batch."""
    seq_len = 6
    mixer = make_mixer(conv, gate, qk_norm, torch.float64, chunk_size=4)
    checks.assert_gradients_match(mixer, lambda qkvx, mask: mesa_reference(*qkvx, mask, params_of(mixer, True))[0],
                                  seq_len, REL_GRAD, form)
    assert {"lambda_param", "forget_weight", "beta_bias"} <= dict(mixer.named_parameters()).keys()


@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_chunked_steps_and_prefill_match_parallel(solver: str) -> None:
    """Left padding longer than a chunk; chunked, token steps and a cached prefill + steps agree with the parallel
    form, for the exact solve and for few CG steps (the same truncated solve in every form)."""
    seq_len = 11
    mixer = make_mixer(solver=solver, cg_steps=3, chunk_size=4)
    inputs = q, k, v, x = make_inputs(seq_len)
    mask = left_padded(seq_len, 6)
    parallel, _ = checks.assert_forms_agree(mixer, inputs, mask, REL_FORMS)
    if solver == "cg":  # 3 steps on 8 dimensions: not the exact solve
        expected, _ = mesa_reference(q, k, v, x, mask, params_of(mixer))
        assert rel_err(real_rows(parallel, mask), expected) > 1e-4


def test_initial_state_matches_reference() -> None:
    """From a random state (H, G and the convolution buffers), chunked and stepped forms against the reference,
    outputs and final states; the reference is fed the same state."""
    seq_len = 9
    mixer = make_mixer(chunk_size=4)
    inputs = q, k, v, x = make_inputs(seq_len, seed=2)
    state = random_state(mixer)
    expected, expected_state = mesa_reference(q, k, v, x, None, params_of(mixer), initial=state)
    checks.assert_continues_from_state(mixer, inputs, state, expected, expected_state, REL_FP32)


def test_conjugate_gradients_converge_to_the_exact_solve() -> None:
    """float64, head_dim 16, chunked form from a random state: the error against the reference's exact solve
    (values and gradients) falls with the number of CG steps and reaches REL_CG (measured: 0.74 with the Jacobi
    start alone, 7e-2 at 4 steps, 8e-4 at 8, 7e-11 at 16); the fp32 default (30 steps) is within REL_FP32."""
    shape = MixerShape(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=16, layer_idx=0)
    seq_len = 12
    q, k, v, x = (t.requires_grad_() for t in make_inputs(seq_len, torch.float64, seed=5, shape=shape))
    mixer = make_mixer(solver="cg", chunk_size=5, shape=shape, dtype=torch.float64)
    state = random_state(mixer, torch.float64)
    tensors = [q, k, v, x, *mixer.parameters()]
    expected, _ = mesa_reference(q, k, v, x, None, params_of(mixer, live=True), initial=state)
    want = torch.autograd.grad(expected.sum(), tensors)
    errors, grad_errors = [], []
    for steps in (0, 1, 2, 4, 8, 16, 24):
        mixer.cg_steps = steps
        out = mixer.chunked(q, k, v, MixerInputs(x), dict(state))[0]
        errors.append(rel_err(out, expected))
        got = torch.autograd.grad(out.sum(), tensors)
        grad_errors.append(max(rel_err(g, w) for g, w in zip(got, want, strict=True)))
    for errs in (errors, grad_errors):
        assert errs[0] > 1e-2  # the Jacobi start alone is far off
        assert all(b <= a * 1.001 for a, b in zip(errs, errs[1:], strict=False)), errs
        assert errs[3] < 0.2 * errs[0], errs
        assert errs[-1] <= REL_CG, errs
    mixer = mixer.float()
    q, k, v, x, expected = (t.detach() for t in (q, k, v, x, expected))
    mixer.cg_steps = 30
    out = mixer.chunked(*(t.float() for t in (q, k, v)), MixerInputs(x.float()),
                        {n: s.float() for n, s in state.items()})[0]
    assert rel_err(out, expected) <= REL_FP32


@pytest.mark.parametrize("stop_converged", [True, False])
def test_converged_systems_stop_before_their_residuals_underflow(monkeypatch, stop_converged: bool) -> None:
    """fp32 CG, 30 steps, on a batch of an easy system (Lambda-dominated: its residual falls ~50x per step) and a
    harder one (condition ~7). With the convergence check, the easy system's search directions end as exact zeros;
    without it (the check disabled) they stall near 1e-20 and the terms p_i (A p)_i of its dot products are
    subnormal floats, which CPUs compute 10-100x slower. Either way both solutions are within 1e-5 of the float64
    solve: the check changes nothing visible."""
    if not stop_converged:
        monkeypatch.setattr(ops_mesa, "_CHECK_EVERY", 1000)
    d = 16
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3 * d, d, generator=gen, dtype=torch.float64) / d**0.5
    scale = torch.tensor([0.02, 4.0], dtype=torch.float64)[:, None, None]
    lam = torch.rand(2, d, generator=gen, dtype=torch.float64) + 0.5
    systems = scale * keys.transpose(1, 2) @ keys + torch.diag_embed(lam)
    rhs = torch.randn(2, 1, d, generator=gen, dtype=torch.float64)
    a32 = systems.float()
    terms = []

    def matvec(p: torch.Tensor) -> torch.Tensor:
        ap = p @ a32
        terms.append(p[0] * ap[0])  # the easy system's terms of p . Ap
        return ap

    x = ops_mesa.conjugate_gradient(matvec, rhs.float(), a32.diagonal(dim1=-2, dim2=-1)[:, None], 30)
    exact = torch.linalg.solve(systems, rhs.transpose(1, 2)).transpose(1, 2)
    assert rel_err(x[0], exact[0]) < 1e-5 and rel_err(x[1], exact[1]) < 1e-5
    easy = torch.stack(terms)
    subnormal = ((easy != 0) & (easy.abs() < torch.finfo(torch.float32).tiny)).sum().item()
    if stop_converged:
        assert subnormal == 0 and (easy[-1] == 0).all()
    else:  # the test can fail: without the check the same run reaches subnormals
        assert subnormal > 0


@pytest.mark.parametrize("with_hard_system", [False, True])
def test_solver_ends_once_every_system_has_stopped(monkeypatch, with_hard_system: bool) -> None:
    """fp32 CG, 30 steps, on CPU. Easy systems (Lambda-dominated, stopped within a few steps) end the loop at the
    first check after the last one stopped, with the same x, bit for bit, as all 30 steps (the early end
    disabled). A batch that also holds an ill-conditioned system (condition 1e4, not converged in 30 steps) runs
    every step."""
    d = 64
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 2 * d, d, generator=gen, dtype=torch.float64) / d**0.5
    systems = 0.02 * keys.transpose(1, 2) @ keys + torch.diag_embed(torch.rand(3, d, generator=gen) + 0.5)
    if with_hard_system:
        basis = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
        systems[-1] = basis @ torch.diag(torch.logspace(0, 4, d, dtype=torch.float64)) @ basis.T
    a32 = systems.float()
    rhs = torch.randn(3, 1, d, generator=gen)
    diag = a32.diagonal(dim1=-2, dim2=-1)[:, None]
    calls = []

    def matvec(p: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return p @ a32

    x = ops_mesa.conjugate_gradient(matvec, rhs, diag, 30)
    ended_after = len(calls) - 1  # the first product is the start's residual
    monkeypatch.setattr(ops_mesa, "_may_stop_early", lambda t: False)
    assert torch.equal(x, ops_mesa.conjugate_gradient(lambda p: p @ a32, rhs, diag, 30))
    if with_hard_system:
        assert ended_after == 30
    else:
        assert ended_after < 30 and ended_after % ops_mesa._CHECK_EVERY == 0, ended_after
        exact = torch.linalg.solve(systems, rhs.double().transpose(1, 2)).transpose(1, 2)
        assert rel_err(x, exact) < 1e-5


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_a_traced_solve_keeps_every_step() -> None:
    """torch.jit.trace records one run: traced on an easy system (which would end early), the solve still runs
    all its steps and gives the eager result on a hard one."""
    d = 16
    gen = torch.Generator().manual_seed(0)

    def system(scale: float) -> torch.Tensor:
        keys = torch.randn(1, 3 * d, d, generator=gen) / d**0.5
        return scale * keys.transpose(1, 2) @ keys + torch.eye(d)

    def solve(a: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        return ops_mesa.conjugate_gradient(lambda p: p @ a, rhs, a.diagonal(dim1=-2, dim2=-1)[:, None], 30)

    easy, hard, rhs = system(0.02), system(50.0), torch.randn(1, 1, d, generator=gen)
    traced = torch.jit.trace(solve, (easy, rhs), check_trace=False)
    assert torch.equal(traced(hard, rhs), solve(hard, rhs))


def test_left_padding_changes_nothing() -> None:
    """A left-padded row gives the outputs and state (H, G and convolution buffers) of the same tokens alone."""
    checks.assert_left_padding_changes_nothing(make_mixer(solver="cg", chunk_size=4), make_inputs(9), PAD, REL_FORMS)


def test_padded_step_leaves_state_untouched() -> None:
    mixer = make_mixer()
    checks.assert_padded_step_keeps_state(mixer, make_inputs(1), random_state(mixer))


def test_regularizer_and_initializations() -> None:
    """Lambda = softplus(lambda_param) + lambda_min starts at lambda_init and stays above lambda_min; convert:
    identity convolution, zero gate weights, forget half-lives log-uniform, beta = beta_init; scratch: gates near
    1/2. ``init_parameters`` (transformers.initialization) sets them."""
    from transformers import initialization as init

    shape = MixerShape(hidden_size=HIDDEN, num_heads=6, num_kv_heads=3, head_dim=8, layer_idx=0)
    spec = validate_spec({"mixer": "mesa", "init": "convert", "half_life_min": 4, "half_life_max": 64,
                          "beta_init": 0.25, "lambda_min": 0.5, "lambda_init": 2.0}, "t")
    mixer = build_mixer(spec, shape)
    checks.init_every_module(mixer, scramble=True)
    assert torch.allclose(mixer.regularizer(), torch.full((3, 2, 8), 2.0))
    with torch.no_grad():
        mixer.lambda_param.fill_(-200.0)
    assert mixer.regularizer().min() >= 0.5
    assert mixer.forget_weight.abs().max() == 0 and mixer.beta_weight.abs().max() == 0
    assert torch.allclose(torch.sigmoid(mixer.beta_bias), torch.full((3,), 0.25))
    lives = math.log(0.5) / torch.nn.functional.logsigmoid(mixer.forget_bias.double())
    assert torch.allclose(lives, torch.tensor([4.0, 16.0, 64.0], dtype=torch.float64), rtol=1e-4)
    for conv in mixer.convs.values():
        assert torch.equal(conv.weight[:, -1], torch.ones(conv.channels)) and conv.weight[:, :-1].abs().max() == 0
    scratch = build_mixer(validate_spec("mesanet", "t"), shape)
    scratch.init_parameters(init)
    assert scratch.forget_bias.abs().max() == 0 and scratch.forget_weight.std() > 0
    assert torch.allclose(scratch.regularizer(), torch.ones(3, 2, 8))


def test_state_size_counts_every_buffer() -> None:
    mixer = make_mixer()
    state = mixer.init_state(1, torch.device("cpu"), torch.float32)
    assert set(state) == {"H", "G", "conv_q", "conv_k"}
    assert mixer.state_size(10) == mixer.state_size(10**6) == sum(t.numel() for t in state.values())
    hk, h, d = SHAPE.num_kv_heads, SHAPE.num_heads, SHAPE.head_dim
    assert mixer.state_size(1) == 2 * hk * d * d + 2 * (h * d + hk * d)
    assert make_mixer(conv_size=0).state_size(1) == 2 * hk * d * d


def test_preset_and_bad_specs() -> None:
    spec = validate_spec("mesanet", "layer 0")
    published = {"mixer": "mesa", "solver": "cg", "cg_steps": 30, "lambda_min": 0.25, "lambda_init": 1.0,
                 "conv_size": 4, "activation": "silu", "qk_norm": "l2", "output_norm": True, "output_gate": False,
                 "rope": False, "init": "scratch"}
    assert {name: spec[name] for name in published} == published
    checks.assert_specs_rejected([
        ({"mixer": "mesanet", "causal": False}, "layer 3", r"layer 3: option 'causal' must be True for mixer 'mesa'"),
        ({"mixer": "mesa", "solver": "lu"}, "layer 3", r"layer 3: option 'solver' must be one of"),
        ({"mixer": "mesa", "cg_steps": -1}, "layer 1", r"layer 1: option 'cg_steps' must be >= 0"),
        ({"mixer": "mesa", "lambda_init": 0.25}, "layer 1",
         r"layer 1: option 'lambda_init' \(0.25\) must be above 'lambda_min'"),
        ({"mixer": "mesa", "lambda_min": 0.0}, "layer 1", r"layer 1: option 'lambda_min' must be >= 1e-06"),
        ({"mixer": "mesa", "output_gate": True, "output_norm": False}, "layer 0",
         r"layer 0: option 'output_gate' needs output_norm=True"),
        ({"mixer": "mesa", "beta_init": 0.0}, "layer 0", r"layer 0: option 'beta_init' must be in \(0, 1\)"),
    ])
