"""Triton chunked linear attention (plain, scalar decay ``g``, per-key decay ``gk``) against the torch forms.

The kernels run through Triton's interpreter on machines without a GPU (``conftest.py``). References are the
chunked torch forms (``ops_linear.linear_chunked``, ``ops_gated_linear.gla_chunked``) and an independent per-token loop,
all in float64, differentiated with autograd on random upstream gradients of ``o`` and of the final state.

Tolerances: float32 values and gradients agree with the float64 references within 1e-5 times the largest
reference magnitude (or of 1 when that is smaller); bfloat16 / float16 inputs within 3e-2 / 5e-3 of the float64
result on the rounded inputs. Tensors live on the GPU when there is one (the interpreter computes its dots in
exact float32, a GPU float32 dots in three tf32 passes).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from bounds import checked_memory, interpreted_only

from hf_recattn.kernels import linear as kernel
from hf_recattn.kernels.linear import chunk_linear_attention
from hf_recattn.modeling.ops_gated_linear import gla_chunked
from hf_recattn.modeling.ops_linear import linear_chunked

Tensor = torch.Tensor
TOL = 1e-5
MODES = ("none", "g", "gk")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _on_device() -> Iterator[None]:
    """Create every tensor of a test where the kernels run (the interpreter reads CPU tensors, a GPU its own)."""
    with torch.device(DEVICE):
        yield


def _inputs(mode: str, B: int, H: int, T: int, K: int, V: int, log_gate: float | None = None) -> dict:
    """Random float32 inputs; gates in [-1, 0] (or all equal to ``log_gate``)."""
    inputs = {"q": torch.randn(B, H, T, K), "k": torch.randn(B, H, T, K), "v": torch.randn(B, H, T, V)}
    shape = {"g": (B, H, T), "gk": (B, H, T, K)}.get(mode)
    if shape is not None:
        inputs[mode] = torch.full(shape, log_gate) if log_gate is not None else -torch.rand(shape)
    return inputs


def _torch_forms(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gk: Tensor | None, h0: Tensor | None,
                 chunk: int) -> tuple[Tensor, Tensor]:
    """(o, final state) from the package's chunked torch forms (one query head per key head)."""
    B, H, _, K = q.shape
    S = h0 if h0 is not None else q.new_zeros(B, H, K, v.shape[-1])
    if gk is not None:
        o, S = gla_chunked(q.unsqueeze(2), k, v, gk, S, chunk)
    else:
        o, _, S, _ = linear_chunked(q.unsqueeze(2), k, v, S, q.new_zeros(B, H, K), chunk, g)
    return o[:, :, 0], S


def _per_token(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gk: Tensor | None, h0: Tensor | None,
               chunk: int) -> tuple[Tensor, Tensor]:
    """(o, final state) from the recurrence itself, one token at a time."""
    B, H, T, K = q.shape
    S = h0 if h0 is not None else q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t, None, None].exp()
        if gk is not None:
            S = S * gk[:, :, t, :, None].exp()
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def _values_and_grads(fn, inputs: dict, h0: Tensor | None, final: bool, chunk: int, do: Tensor, dS: Tensor,
                      dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
    """([o, final state], gradients of sum(o * do) + sum(S * dS) for every input) with inputs cast to dtype."""
    leaves = {name: x.detach().to(dtype).requires_grad_(True) for name, x in inputs.items()}
    if h0 is not None:
        leaves["initial_state"] = h0.detach().to(dtype).requires_grad_(True)
    if fn is chunk_linear_attention:
        o, S = fn(**leaves, output_final_state=final, chunk_size=chunk)
    else:
        o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), leaves.get("gk"),
                  leaves.get("initial_state"), chunk)
    loss = (o * do.to(o.dtype)).sum()
    if final:
        loss = loss + (S * dS.to(S.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return [o, S] if final else [o], list(grads)


def _check(inputs: dict, h0: Tensor | None = None, final: bool = True, chunk: int = 16, reference=_torch_forms,
           dtype: torch.dtype = torch.float32, tol: float = TOL, floor: float = 1.0) -> float:
    """Compare the kernel's values and gradients with the float64 reference; return the worst relative error.

    Errors are relative to max(largest reference magnitude, ``floor``).
    """
    B, H, T, K = inputs["q"].shape
    V = inputs["v"].shape[-1]
    do, dS = torch.randn(B, H, T, V), torch.randn(B, H, K, V)
    got, got_grads = _values_and_grads(chunk_linear_attention, inputs, h0, final, chunk, do, dS, dtype)
    rounded = {name: x.to(dtype) for name, x in inputs.items()}
    h0r = None if h0 is None else h0.to(dtype)
    want, want_grads = _values_and_grads(reference, rounded, h0r, final, chunk, do.to(dtype), dS, torch.float64)
    assert got[0].dtype == dtype and got[0].shape == want[0].shape
    if final:
        assert got[1].dtype == torch.float32
    worst = 0.0
    for a, b in zip(got + list(got_grads), want + list(want_grads), strict=True):
        assert a.shape == b.shape and torch.isfinite(a).all()
        error = ((a.double() - b).abs().max() / b.abs().max().clamp_min(floor)).item()
        assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"
        worst = max(worst, error)
    return worst


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("T", "chunk"), [(1, 16), (5, 16), (37, 16), (64, 32), (100, 32)])
def test_matches_torch_forms(mode: str, T: int, chunk: int) -> None:
    """Values and gradients, with and without an initial state and a final state, T not a multiple of C."""
    inputs = _inputs(mode, 2, 2, T, 16, 32)
    with_state = T % 2 == 1
    h0 = torch.randn(2, 2, 16, 32) if with_state else None
    _check(inputs, h0, final=with_state or T == 64, chunk=chunk)


@pytest.mark.parametrize("mode", MODES)
def test_matches_per_token_recurrence(mode: str) -> None:
    _check(_inputs(mode, 1, 2, 37, 32, 16), torch.randn(1, 2, 32, 16), chunk=16, reference=_per_token)


@pytest.mark.parametrize("mode", MODES)
def test_sizes_that_are_not_powers_of_two(mode: str) -> None:
    _check(_inputs(mode, 2, 1, 21, 24, 40), torch.randn(2, 1, 24, 40), chunk=16)


@pytest.mark.parametrize("mode", MODES)
def test_several_key_and_value_blocks(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16 over K = 40 and V = 48: partial outputs and gradients are summed across programs."""
    for name in ("BLOCK_K", "BLOCK_V", "GK_BLOCK_K"):
        monkeypatch.setattr(kernel, name, 16)
    _check(_inputs(mode, 1, 2, 23, 40, 48), torch.randn(1, 2, 40, 48), chunk=16)


@interpreted_only
@pytest.mark.parametrize("mode", MODES)
def test_kernels_stay_inside_their_tensors(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load and store of the forward and both backward kernels lies inside one of its tensor arguments
    (tests/bounds.py): blocks of 16 over K = 40 and V = 24, a last partial chunk, an initial state and the final
    state's gradient."""
    for name in ("BLOCK_K", "BLOCK_V", "GK_BLOCK_K"):
        monkeypatch.setattr(kernel, name, 16)
    with checked_memory(monkeypatch) as checker:
        _check(_inputs(mode, 2, 2, 23, 40, 24), torch.randn(2, 2, 40, 24), chunk=16)
    assert checker.accesses > 0


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("mode", ["g", "gk"])
def test_strong_gates_stay_finite(mode: str, final: bool) -> None:
    """Log gates of -30 per token over 120 tokens: no overflow, same values and gradients as the torch forms.

    Without a final state every gradient, tiny ones included (the gates' are about 1e-11), is checked relative to
    its own size against the per-token loop (differentiating the chunked torch forms cancels terms of size 1 in
    float64, too coarse here); a gradient on the final state leaves float32 rounding of k_T (dS_T v_T) in the
    gate's.
    """
    inputs = _inputs(mode, 1, 2, 120, 16, 16, log_gate=-30.0)
    h0 = torch.randn(1, 2, 16, 16)
    _check(inputs, h0, final=final, chunk=32, reference=_per_token, floor=1.0 if final else 0.0)
    _check(inputs, h0, final=final, chunk=32, floor=1.0)


def test_heads_of_256() -> None:
    _check(_inputs("gk", 1, 1, 18, 256, 256), torch.randn(1, 1, 256, 256), chunk=64)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("mode", ["g", "gk"])
def test_half_precision_inputs(mode: str, dtype: torch.dtype, tol: float) -> None:
    """Half inputs give half outputs and gradients (float32 final state), accumulated in float32."""
    _check(_inputs(mode, 1, 2, 37, 16, 16), torch.randn(1, 2, 16, 16), chunk=16, dtype=dtype, tol=tol)


def test_chunk_size_does_not_change_the_result() -> None:
    inputs = _inputs("g", 1, 2, 70, 16, 16)
    o16, s16 = chunk_linear_attention(**inputs, output_final_state=True, chunk_size=16)
    o64, s64 = chunk_linear_attention(**inputs, output_final_state=True, chunk_size=64)
    torch.testing.assert_close(o16, o64, rtol=0, atol=1e-4)
    torch.testing.assert_close(s16, s64, rtol=0, atol=1e-4)


def test_final_state_only_when_asked() -> None:
    o, S = chunk_linear_attention(**_inputs("gk", 1, 1, 9, 16, 16))
    assert S is None and o.shape == (1, 1, 9, 16)


def test_gradient_of_the_final_state_alone() -> None:
    """A loss on the final state only (no upstream gradient for o) still reaches every input."""
    inputs = {name: x.requires_grad_(True) for name, x in _inputs("gk", 1, 1, 20, 16, 16).items()}
    _, S = chunk_linear_attention(**inputs, output_final_state=True)
    grads = torch.autograd.grad(S.square().sum(), list(inputs.values()))
    ref = {name: x.detach().double().requires_grad_(True) for name, x in inputs.items()}
    _, S_ref = _torch_forms(ref["q"], ref["k"], ref["v"], None, ref["gk"], None, 16)
    want = torch.autograd.grad(S_ref.square().sum(), list(ref.values()), allow_unused=True)
    assert grads[0].abs().max() == 0 and want[0] is None  # q does not reach the state
    for a, b in zip(grads[1:], want[1:], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=TOL * b.abs().max().item())


@pytest.mark.parametrize("mode", ["g", "gk"])
def test_constant_gate_and_initial_state(mode: str) -> None:
    """Gate and initial state without gradients: q, k, v get the same gradients as when all are differentiated."""
    inputs, h0 = _inputs(mode, 1, 2, 21, 16, 16), torch.randn(1, 2, 16, 16)
    do = torch.randn(1, 2, 21, 16)
    _, want = _values_and_grads(chunk_linear_attention, inputs, h0, False, 16, do, do, torch.float32)
    leaves = [inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v")]
    o, _ = chunk_linear_attention(*leaves, **{mode: inputs[mode]}, initial_state=h0, chunk_size=16)
    got = torch.autograd.grad((o * do).sum(), leaves)
    for a, b in zip(got, want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_non_contiguous_inputs() -> None:
    inputs = _inputs("gk", 2, 2, 19, 16, 32)
    views = {name: x.transpose(1, 2).contiguous().transpose(1, 2) for name, x in inputs.items()}
    assert not views["q"].is_contiguous()
    o, S = chunk_linear_attention(**views, output_final_state=True)
    o_ref, S_ref = chunk_linear_attention(**inputs, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=0)


def _bad(**changes) -> dict:
    args = {**_inputs("none", 1, 2, 8, 16, 16)}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (_bad(q=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "q has dtype torch.float64"),
        (_bad(g=-torch.rand(1, 2, 8, dtype=torch.float64)), "g has dtype torch.float64"),
        (_bad(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64)), "initial_state has dtype"),
        (_bad(k=torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)), "share a dtype"),
        (_bad(q=torch.randn(2, 8, 16)), "q must be"),
        (_bad(k=torch.randn(1, 2, 8, 8)), "k must be"),
        (_bad(v=torch.randn(1, 2, 7, 16)), "v must be"),
        (_bad(g=-torch.rand(1, 2, 8, 1)), "g must be"),
        (_bad(gk=-torch.rand(1, 2, 8)), "gk must be"),
        (_bad(g=-torch.rand(1, 2, 8), gk=-torch.rand(1, 2, 8, 16)), "at most one of g"),
        (_bad(initial_state=torch.zeros(1, 2, 16, 8)), "initial_state must be"),
        (_bad(chunk_size=24), "chunk_size"),
        (_bad(chunk_size=8), "chunk_size"),
        (_bad(v=None), "v must be a tensor"),
        (_bad(gk=[0.0]), "gk must be a tensor"),
    ],
)
def test_bad_input(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunk_linear_attention(**args)
