"""fla's kernels against the torch forms on a CUDA device (skipped without one, or without fla): the GPU half of
tests/test_fla_equality.py, run by ``scripts/gpu_checks.sh``.

Every computation ``fla_adapters`` hands to fla, through the op with ``HF_RECATTN_KERNELS=fla`` (chunk kernels
for the chunked forms, fused-recurrent ones for decode steps), against the op's torch form in float64 on the same
inputs: values and the gradients of every input, at 64, 1000 and 4096 tokens, in float32 and with bfloat16 inputs
beside a float32 state (as a bfloat16 model keeps it), and whole tiny models on packed documents. Tolerance: the
relative error ||x - ref|| / ||ref|| of each tensor at most 1e-2 (fla multiplies in TF32 / bfloat16 on tensor
cores; a wrong mapping is off by O(1)).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from hf_recattn.modeling import backends
from hf_recattn.modeling.ops_delta import delta_chunked, delta_step
from hf_recattn.modeling.ops_gated_linear import gla_chunked, gla_step
from hf_recattn.modeling.ops_kda import kda_chunked, kda_step
from hf_recattn.modeling.ops_linear import linear_chunked, linear_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("fla")

REL_TOL = 1e-2
LENGTHS = (64, 1000, 4096)
DTYPES = ("float32", "bfloat16")
B, HK, G, D, E = 1, 2, 2, 64, 64


def _inputs(t: int, dtype: str, gate_width: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(t)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    gate_shape = (B, HK, t) if gate_width is None else (B, HK, t, gate_width)
    low = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    x = {
        "q": (rand(B, HK, G, t, D) * D**-0.5).to(low),
        "k": F.normalize(rand(B, HK, t, D), dim=-1).to(low),
        "v": rand(B, HK, t, E).to(low),
        "log_a": F.logsigmoid(rand(*gate_shape) + 3.0),
        "beta": torch.rand(B, HK, t, generator=gen, device="cuda"),
        "S": rand(B, HK, D, E) * 0.1,
        "z": torch.rand(B, HK, D, generator=gen, device="cuda"),
    }
    return x


def _outputs_and_grads(run: Callable, inputs: dict[str, torch.Tensor], choice: str, wide: bool) -> list:
    cast = (lambda x: x.double()) if wide else (lambda x: x)
    leaves = {name: cast(x.detach().clone()).requires_grad_(True) for name, x in inputs.items()}
    with backends.use_kernels(choice):
        outs = run(**leaves)
    gen = torch.Generator(device="cuda").manual_seed(7)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, device="cuda", dtype=torch.float64)).sum()
               for o in outs)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return [*outs, *(g for g in grads if g is not None)]


def _report_at_once(err: BaseException) -> None:
    """One line naming the case and the failure, past pytest's capture: a run stopped at its time limit keeps it."""
    case = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    first = (str(err).strip().splitlines() or [""])[0]
    print(f"FAILED AT ONCE {case}: {type(err).__name__}: {first}", file=sys.__stderr__, flush=True)


def _check(run: Callable, inputs: dict[str, torch.Tensor]) -> None:
    try:
        expected = _outputs_and_grads(run, inputs, "torch", wide=True)
        got = _outputs_and_grads(run, inputs, "fla", wide=False)
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            error = (a.double() - b).norm() / b.norm().clamp_min(1e-12)
            assert error < REL_TOL, f"tensor {i}: relative error {error:.2e}"
    except Exception as err:
        _report_at_once(err)
        raise


def _delta(rule: str, t: int, chunked: bool) -> Callable:
    def run(q, k, v, log_a, beta, S, z):
        log_alpha = torch.zeros_like(log_a) if rule == "delta" else log_a
        erase = beta if rule == "delta" else beta * log_a.exp()
        if chunked:
            return delta_chunked(q, k, v, log_alpha, beta, erase, S, 64, rule=rule)
        outs = []
        for i in range(t):
            sl = slice(i, i + 1)
            o, S = delta_step(q[:, :, :, sl], k[:, :, sl], v[:, :, sl], log_alpha[..., sl], beta[..., sl],
                              erase[..., sl], S, rule=rule)
            outs.append(o)
        return torch.cat(outs, dim=3), S

    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_chunked_delta_rules(rule: str, t: int, dtype: str) -> None:
    _check(_delta(rule, t, chunked=True), _inputs(t, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_delta_decode_steps(rule: str, dtype: str) -> None:
    _check(_delta(rule, 8, chunked=False), _inputs(8, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", LENGTHS)
def test_chunked_gla(t: int, dtype: str) -> None:
    _check(lambda q, k, v, log_a, beta, S, z: gla_chunked(q, k, v, log_a, S, 64), _inputs(t, dtype, gate_width=D))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gla_decode_steps(dtype: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs = []
        for i in range(8):
            o, S = gla_step(q[:, :, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], log_a[:, :, i : i + 1], S)
            outs.append(o)
        return torch.cat(outs, dim=3), S

    _check(run, _inputs(8, dtype, gate_width=D))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("decayed", [False, True])
def test_chunked_linear_attention(decayed: bool, t: int, dtype: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        return linear_chunked(F.elu(q) + 1, F.elu(k) + 1, v, S, z, 64, log_g=log_a if decayed else None)

    _check(run, _inputs(t, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decayed", [False, True])
def test_linear_decode_steps(decayed: bool, dtype: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs = []
        for i in range(8):
            log_g = log_a[:, :, i : i + 1] if decayed else None
            num, den, S, z = linear_step(F.elu(q[:, :, :, i : i + 1]) + 1, F.elu(k[:, :, i : i + 1]) + 1,
                                         v[:, :, i : i + 1], S, z, log_g)
            outs += [num, den]
        return (*outs, S, z)

    _check(run, _inputs(8, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", LENGTHS)
def test_chunked_kda(t: int, dtype: str) -> None:
    _check(lambda q, k, v, log_a, beta, S, z: kda_chunked(q, k, v, log_a, beta, S, 64),
           _inputs(t, dtype, gate_width=D))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_decode_steps(dtype: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs = []
        for i in range(8):
            sl = slice(i, i + 1)
            o, S = kda_step(q[:, :, :, sl], k[:, :, sl], v[:, :, sl], log_a[:, :, sl], beta[:, :, sl], S)
            outs.append(o)
        return torch.cat(outs, dim=3), S

    _check(run, _inputs(8, dtype, gate_width=D))


MODEL_CASES = ["linear(feature_map=elu)", "linear(decay=learned)", "gated_linear", "delta", "kda"]


@pytest.mark.parametrize("case_id", MODEL_CASES)
def test_models_on_packed_documents(case_id: str) -> None:
    from generation_cases import all_cases, tiny_model

    model = tiny_model(next(c for c in all_cases() if c.id == case_id)).cuda()
    gen = torch.Generator().manual_seed(0)
    lengths = (300, 1000, 700)
    ids = torch.randint(3, model.config.vocab_size, (1, sum(lengths)), generator=gen).cuda()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    results = {}
    for choice in ("torch", "fla"):
        model.zero_grad()
        try:
            with backends.use_kernels(choice):
                out = model(ids, position_ids=positions, labels=ids)
            out.loss.backward()
        except Exception as err:
            _report_at_once(err)
            raise
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[choice] = [out.logits.detach(), *grads]
    for i, (a, b) in enumerate(zip(results["fla"], results["torch"], strict=True)):
        error = (a - b).double().norm() / b.double().norm().clamp_min(1e-12)
        message = f"{case_id} tensor {i}: relative error {error:.2e}"
        if error >= REL_TOL:
            _report_at_once(AssertionError(message))
        assert error < REL_TOL, message
