"""Triton kernels of the delta rule (chunked, forward and backward) and the fused decode steps, against the torch
forms of ``hf_recattn.modeling``: ``delta_chunked`` / ``delta_step`` (ops_delta) and ``linear_step`` (ops_linear).

The kernels run in float32 (through Triton's interpreter on machines without a GPU), the references in float64.
Inputs are in the stable regime of the rule: L2-normalized keys, beta and erase in (0, 1), log decays in [-1, 0].
Tolerance: max |kernel - reference| <= 1e-5 * max |reference| + 1e-7 for outputs, states and every gradient
(random upstream gradients on o and on the final state); half precision inputs: 3e-2 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bounds import OutOfBounds, checked_memory, interpreted_only  # noqa: E402

from hf_recattn.kernels.decode import fused_delta_step, fused_linear_step  # noqa: E402
from hf_recattn.kernels.delta import _split_tf32, chunk_delta_rule  # noqa: E402
from hf_recattn.modeling.ops_delta import delta_chunked, delta_step  # noqa: E402
from hf_recattn.modeling.ops_linear import linear_step  # noqa: E402

Tensor = torch.Tensor
RTOL, ATOL = 1e-5, 1e-7
NAMES = ("q", "k", "v", "log_alpha", "beta", "erase", "initial_state")


def _close(name: str, got: Tensor, ref: Tensor, rtol: float = RTOL) -> None:
    err = (got.double() - ref.double()).abs().max().item()
    bound = rtol * ref.abs().max().item() + ATOL
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _inputs(b: int, h: int, t: int, dk: int, dv: int, initial: bool) -> dict[str, Tensor | None]:
    """Random inputs of the general rule (erase independent of beta and the decay)."""
    return {
        "q": torch.randn(b, h, t, dk),
        "k": F.normalize(torch.randn(b, h, t, dk), dim=-1),
        "v": torch.randn(b, h, t, dv),
        "log_alpha": -torch.rand(b, h, t),
        "beta": torch.rand(b, h, t),
        "erase": torch.rand(b, h, t),
        "initial_state": torch.randn(b, h, dk, dv) if initial else None,
    }


def _reference(x: dict[str, Tensor | None], chunk_size: int) -> tuple[Tensor, Tensor]:
    """delta_chunked with one query head per state: (o [B, H, T, V], final state)."""
    q, v = x["q"], x["v"]
    state = x["initial_state"]
    if state is None:
        state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    o, final = delta_chunked(q.unsqueeze(2), x["k"], v, x["log_alpha"], x["beta"], x["erase"], state, chunk_size)
    return o[:, :, 0], final


def _step_reference(x: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
    """delta_step token after token: (o [B, H, T, V], final state)."""
    q, k, v = x["q"], x["k"], x["v"]
    state = x["initial_state"]
    if state is None:
        state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        gates = (x[name][:, :, t : t + 1] for name in ("log_alpha", "beta", "erase"))
        o, state = delta_step(q[:, :, None, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], *gates, state)
        outs.append(o[:, :, 0])
    return torch.cat(outs, dim=2), state


def _check_against(x: dict[str, Tensor | None], chunk_size: int, reference, rtol: float = RTOL) -> None:
    """Values and gradients of the kernel (float32) against reference(float64 inputs)."""
    names = [n for n in NAMES if x[n] is not None]
    ours = {n: x[n].clone().requires_grad_() for n in names}
    o, final = chunk_delta_rule(**ours, output_final_state=True, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    grad_o, grad_final = torch.randn_like(o), torch.randn_like(final)
    ((o * grad_o).sum() + (final * grad_final).sum()).backward()

    theirs = {n: x[n].double().requires_grad_() for n in names}
    ref_o, ref_final = reference({**dict.fromkeys(NAMES), **theirs})
    ((ref_o * grad_o.double()).sum() + (ref_final * grad_final.double()).sum()).backward()
    _close("o", o, ref_o, rtol)
    _close("final state", final, ref_final, rtol)
    for n in names:
        _close(f"d {n}", ours[n].grad, theirs[n].grad, rtol)


# ----- chunked kernel -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("t", [1, 7, 64, 100])
def test_chunked_matches_torch(t: int, chunk_size: int, initial: bool) -> None:
    x = _inputs(1, 2, t, 16, 32, initial)
    _check_against(x, chunk_size, lambda y: _reference(y, chunk_size))


@pytest.mark.parametrize(("dk", "dv"), [(32, 16), (24, 20)])
def test_head_dims_and_masking(dk: int, dv: int) -> None:
    """Key / value sizes other than the block sizes (non powers of two are masked), T not a multiple of C."""
    _check_against(_inputs(2, 1, 37, dk, dv, True), 16, lambda y: _reference(y, 16))


@pytest.mark.parametrize("rule", ["gated", "delta"])
def test_named_rules_against_steps(rule: str) -> None:
    """Gated DeltaNet (erase = beta exp(log_alpha)) and DeltaNet (no decay, erase = beta) against delta_step token
    by token; the gradients reach log_alpha and beta through erase too."""
    x = _inputs(1, 2, 20, 16, 16, True)
    names = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    if rule == "delta":
        x["log_alpha"] = torch.zeros_like(x["log_alpha"])
        names = ("q", "k", "v", "beta", "initial_state")

    def run(y: dict[str, Tensor], fn) -> tuple[Tensor, Tensor]:
        erase = y["beta"] * y["log_alpha"].exp() if rule == "gated" else y["beta"]
        return fn({**y, "erase": erase})

    ours = {n: x[n].clone().requires_grad_() if n in names else x[n] for n in NAMES}
    o, final = run(ours, lambda y: chunk_delta_rule(**y, output_final_state=True, chunk_size=16))
    theirs = {n: x[n].double().requires_grad_() if n in names else x[n].double() for n in NAMES if x[n] is not None}
    ref_o, ref_final = run(theirs, _step_reference)
    grad_o, grad_final = torch.randn_like(o), torch.randn_like(final)
    ((o * grad_o).sum() + (final * grad_final).sum()).backward()
    ((ref_o * grad_o.double()).sum() + (ref_final * grad_final.double()).sum()).backward()
    _close("o", o, ref_o)
    _close("final state", final, ref_final)
    for n in names:
        _close(f"d {n}", ours[n].grad, theirs[n].grad)


def test_default_chunk_and_output_only() -> None:
    """chunk_size 64 (the default), no final state asked for: None, and gradients from o alone."""
    x = _inputs(1, 1, 70, 16, 16, True)
    ours = {n: x[n].clone().requires_grad_() for n in NAMES}
    o, final = chunk_delta_rule(**ours)
    assert final is None
    grad_o = torch.randn_like(o)
    (o * grad_o).sum().backward()
    theirs = {n: x[n].double().requires_grad_() for n in NAMES}
    ref_o, _ = _reference(theirs, 64)
    (ref_o * grad_o.double()).sum().backward()
    _close("o", o, ref_o)
    for n in NAMES:
        _close(f"d {n}", ours[n].grad, theirs[n].grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    """Half inputs: o in their dtype, the final state in float32, gradients in each input's dtype, all close to
    the float64 reference of the rounded inputs."""
    x = _inputs(1, 2, 40, 16, 16, True)
    x = {n: t.to(dtype) if n in ("q", "k", "v") else t for n, t in x.items()}
    ours = {n: x[n].clone().requires_grad_() for n in NAMES}
    o, final = chunk_delta_rule(**ours, output_final_state=True, chunk_size=16)
    assert o.dtype == dtype and final.dtype == torch.float32
    (o.float().sum() + final.sum()).backward()
    for n in NAMES:
        assert ours[n].grad.dtype == x[n].dtype
    theirs = {n: x[n].double().requires_grad_() for n in NAMES}
    ref_o, ref_final = _reference(theirs, 16)
    (ref_o.sum() + ref_final.sum()).backward()
    _close("o", o, ref_o, 3e-2)
    _close("final state", final, ref_final, 3e-2)
    for n in NAMES:
        _close(f"d {n}", ours[n].grad, theirs[n].grad, 3e-2)


@pytest.mark.parametrize(("dk", "dv"), [(16, 64), (24, 20), (32, 16)])
def test_wider_gradient_blocks(monkeypatch: pytest.MonkeyPatch, dk: int, dv: int) -> None:
    """The per-chunk gradient kernels with 32 value columns per pass (a hardware-check variant): same gradients;
    a value width under 32 keeps one block of its padded width."""
    from hf_recattn.kernels import delta

    monkeypatch.setattr(delta, "BLOCK_V_GRAD", 32)
    x = _inputs(1, 2, 100, dk, dv, True)
    _check_against(x, 32, lambda y: _reference(y, 32))


@pytest.mark.parametrize("setting", ["GRAD_FLOAT32_PRECISION", "FLOAT32_PRECISION"])
def test_split_products(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """Products as three one-pass TF32 products of split operands (``split``, a hardware-check variant), in the
    gradient kernels or everywhere: the interpreter runs the split algebra (its TF32 products are exact), which
    drops only low x low (under 2^-20 relative), so the float32 tolerance holds."""
    from hf_recattn.kernels import delta

    monkeypatch.setattr(delta, setting, "split")
    plan = delta._plan(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16), 16)
    assert (plan.grad_precision, plan.precision)[setting == "FLOAT32_PRECISION"] == "split"
    x = _inputs(1, 2, 70, 32, 24, True)
    _check_against(x, 32, lambda y: _reference(y, 32))


@triton.jit
def _split_kernel(x_ptr, high_ptr, low_ptr, N: tl.constexpr):
    rows = tl.arange(0, N)
    high, low = _split_tf32(tl.load(x_ptr + rows))
    tl.store(high_ptr + rows, high)
    tl.store(low_ptr + rows, low)


@interpreted_only
def test_split_tf32_parts() -> None:
    """The high part keeps the sign, exponent and 10 mantissa bits (13 low bits clear); high + low is x exactly."""
    x = torch.cat([torch.randn(60) * 1e3, torch.tensor([0.0, -0.0, 1.0, -3.1415927])])
    high, low = torch.empty_like(x), torch.empty_like(x)
    _split_kernel[(1,)](x, high, low, N=64)
    assert (high.view(torch.int32) & 0x1FFF).eq(0).all()
    assert torch.equal(high + low, x)
    assert (low.abs() <= x.abs() * 2.0**-10).all()


def test_set_gradient_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' one setter of the gradient kernels' settings: the next call plans with them."""
    from hf_recattn.kernels import delta

    for name in ("GRAD_FLOAT32_PRECISION", "BLOCK_V_GRAD", "GRAD_WARPS"):  # restored after the test
        monkeypatch.setattr(delta, name, getattr(delta, name))
    delta.set_gradient_variant("split", 32, 2)
    plan = delta._plan(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 40), 16)
    assert (plan.grad_precision, plan.grad_block, delta.GRAD_WARPS) == ("split", 32, 2)


def test_kernel_settings_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_recattn.kernels import delta

    x = _inputs(1, 1, 8, 16, 16, False)
    for name, value in (("BLOCK_V_GRAD", 64), ("GRAD_FLOAT32_PRECISION", "tf64"), ("GRAD_WARPS", 3)):
        with monkeypatch.context() as patch:
            patch.setattr(delta, name, value)
            with pytest.raises(ValueError, match="BLOCK_V_GRAD must be 16 or 32"):
                chunk_delta_rule(**x)


def test_chunked_bad_input() -> None:
    x = _inputs(1, 1, 8, 16, 16, True)
    with pytest.raises(ValueError, match="torch.float64"):
        chunk_delta_rule(**{**x, "q": x["q"].double(), "k": x["k"].double(), "v": x["v"].double()})
    with pytest.raises(ValueError, match="log_alpha"):
        chunk_delta_rule(**{**x, "log_alpha": x["log_alpha"].double()})
    with pytest.raises(ValueError, match="k must be"):
        chunk_delta_rule(**{**x, "k": x["k"][..., :8]})
    with pytest.raises(ValueError, match="beta must be"):
        chunk_delta_rule(**{**x, "beta": x["beta"][..., :4]})
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_delta_rule(**{**x, "initial_state": x["initial_state"][..., :8]})
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule(**x, chunk_size=24)
    with pytest.raises(ValueError, match="at most 128"):
        wide = torch.randn(1, 1, 8, 136)
        chunk_delta_rule(**{**x, "q": wide, "k": wide, "initial_state": None})
    with pytest.raises(ValueError, match="share a dtype"):
        chunk_delta_rule(**{**x, "v": x["v"].bfloat16()})


# ----- decode steps -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("dk", "dv"), [(16, 32), (24, 20)])
@pytest.mark.parametrize("groups", [1, 3])
def test_fused_delta_step(groups: int, dk: int, dv: int) -> None:
    """Consecutive steps equal delta_step's (float64), the state updated in the same storage."""
    b, h = 2, 2
    state = torch.randn(b, h, dk, dv)
    ref_state = state.double()
    storage = state.data_ptr()
    for _ in range(4):
        q, k, v = torch.randn(b, h, groups, dk), F.normalize(torch.randn(b, h, dk), dim=-1), torch.randn(b, h, dv)
        log_alpha, beta, erase = -torch.rand(b, h), torch.rand(b, h), torch.rand(b, h)
        o = fused_delta_step(q, k, v, state, log_alpha, beta, erase)
        gates = (x[..., None].double() for x in (log_alpha, beta, erase))
        ref_o, ref_state = delta_step(
            q[..., None, :].double(), k[:, :, None].double(), v[:, :, None].double(), *gates, ref_state
        )
        assert o.shape == (b, h, groups, dv) and o.dtype == torch.float32
        _close("o", o, ref_o[:, :, :, 0])
        _close("state", state, ref_state)
    assert state.data_ptr() == storage


@pytest.mark.parametrize("gate", [None, "g", "gk", "both"])
@pytest.mark.parametrize("groups", [1, 3])
def test_fused_linear_step(groups: int, gate: str | None) -> None:
    """Consecutive steps equal linear_step's (scalar decay or none) or the per-key decayed update, in place."""
    b, h, dk, dv = 2, 2, 24, 20
    state = torch.randn(b, h, dk, dv)
    ref_state = state.double()
    z = torch.zeros(b, h, dk, dtype=torch.float64)
    storage = state.data_ptr()
    for _ in range(3):
        q, k, v = torch.randn(b, h, groups, dk), torch.randn(b, h, dk), torch.randn(b, h, dv)
        g = -torch.rand(b, h) if gate in ("g", "both") else None
        gk = -torch.rand(b, h, dk) if gate in ("gk", "both") else None
        o = fused_linear_step(q, k, v, state, g=g, gk=gk)
        if gk is not None:  # the per-key decay first, then linear_step (with the scalar one, if any)
            ref_state = ref_state * gk.double().exp()[..., None]
        log_g = None if g is None else g[..., None].double()
        ref_o, _, ref_state, z = linear_step(
            q[..., None, :].double(), k[:, :, None].double(), v[:, :, None].double(), ref_state, z, log_g
        )
        assert o.shape == (b, h, groups, dv)
        _close("o", o, ref_o[:, :, :, 0])
        _close("state", state, ref_state)
    assert state.data_ptr() == storage


def test_decode_half_precision_output() -> None:
    b, h, dk, dv = 1, 2, 16, 16
    state = torch.randn(b, h, dk, dv)
    ref = state.double().clone()
    q, k, v = torch.randn(b, h, 2, dk).bfloat16(), torch.randn(b, h, dk).bfloat16(), torch.randn(b, h, dv).bfloat16()
    o = fused_linear_step(q, k, v, state)
    ref = ref + k.double()[..., :, None] * v.double()[..., None, :]
    assert o.dtype == torch.bfloat16
    _close("state", state, ref)
    _close("o", o, q.double() @ ref, 1e-2)


def test_decode_bad_input() -> None:
    b, h, dk, dv = 1, 2, 16, 16
    q, k, v = torch.randn(b, h, 1, dk), torch.randn(b, h, dk), torch.randn(b, h, dv)
    gates = (torch.zeros(b, h), torch.ones(b, h), torch.ones(b, h))
    state = torch.zeros(b, h, dk, dv)
    with pytest.raises(ValueError, match="float32"):
        fused_delta_step(q, k, v, state.double(), *gates)
    with pytest.raises(ValueError, match="contiguous"):
        fused_linear_step(q, k, v, torch.zeros(b, h, dv, dk).transpose(-1, -2))
    with pytest.raises(ValueError, match="k must be"):
        fused_delta_step(q, k[..., :8], v, state, *gates)
    with pytest.raises(ValueError, match="state must be"):
        fused_linear_step(q, k, v, torch.zeros(b, 1, dk, dv))
    with pytest.raises(ValueError, match="gk must be"):
        fused_linear_step(q, k, v, state, gk=torch.zeros(b, h))
    with pytest.raises(ValueError, match="torch.float64"):
        fused_linear_step(q.double(), k, v, state)
    with pytest.raises(ValueError, match="beta must be"):
        fused_delta_step(q, k, v, state, gates[0], gates[1][:, :1], gates[2])


# ----- memory bounds (tests/bounds.py): the GPU faults on what the interpreter reads quietly --------------------
@triton.jit
def _copy_one_past(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Copies n + 1 elements: the last load reads past src (the kind of access a GPU reports as illegal)."""
    offsets = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets <= n), mask=offsets <= n)


@interpreted_only
def test_the_bounds_check_catches_an_access_past_a_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = torch.arange(8.0), torch.zeros(16)
    with pytest.raises(OutOfBounds, match="_copy_one_past: load .* nearest: src_ptr .* ends 4 bytes past its end"):
        with checked_memory(monkeypatch):
            _copy_one_past[(1,)](src, dst, 8, BLOCK=16)
    with pytest.raises(OutOfBounds, match="_copy_one_past: store .* nearest: dst_ptr .* ends 4 bytes past its end"):
        with checked_memory(monkeypatch):
            _copy_one_past[(1,)](dst, src, 8, BLOCK=16)
    with checked_memory(monkeypatch) as checker:
        _copy_one_past[(1,)](src, dst, 7, BLOCK=16)
    assert checker.accesses == 2 and torch.equal(dst[:8], src)


def _run_checked(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, int, int, int], chunk_size: int,
                 dtype: torch.dtype, initial: bool, final_grad: bool) -> int:
    """Forward and backward of every input under the bounds check (the final state's gradient only with
    ``final_grad``); shape is (B, H, T, K, V). Returns the number of accesses checked."""
    x = {name: None if a is None else a.to(dtype if name in "qkv" else torch.float32).requires_grad_()
         for name, a in _inputs(*shape, initial).items()}
    with checked_memory(monkeypatch) as checker:
        o, final = chunk_delta_rule(**x, output_final_state=True, chunk_size=chunk_size)
        (o.float().square().sum() + (final.sum() if final_grad else 0.0)).backward()
    assert all(a.grad is not None and torch.isfinite(a.grad).all() for a in x.values() if a is not None)
    return checker.accesses


@interpreted_only
@pytest.mark.parametrize(("shape", "chunk_size", "dtype", "initial", "final_grad"), [
    ((1, 2, 100, 16, 16), 16, torch.bfloat16, True, True),
    ((1, 2, 100, 16, 16), 32, torch.float32, True, True),
    ((2, 2, 100, 48, 48), 64, torch.float32, False, False),
    ((1, 1, 70, 24, 80), 32, torch.bfloat16, True, False),
    ((1, 1, 2048, 16, 16), 64, torch.float32, False, True),
])
def test_chunked_kernels_stay_inside_their_tensors(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, int, int, int], chunk_size: int, dtype: torch.dtype,
    initial: bool, final_grad: bool
) -> None:
    """Every load and store of the seven kernels lies inside one of its tensor arguments: at the length that faulted
    on a GPU (2,048 tokens), with a last partial chunk, padded key blocks (K = 24, 48), several value blocks per
    program (V = 48, 80), two batch rows, with and without an initial state and the final state's gradient."""
    assert _run_checked(monkeypatch, shape, chunk_size, dtype, initial, final_grad) > 0


@pytest.mark.slow
@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [16, 64, 128])
@pytest.mark.parametrize("heads", [1, 9])
def test_chunked_kernels_stay_inside_their_tensors_at_model_sizes(
    monkeypatch: pytest.MonkeyPatch, heads: int, chunk_size: int, dtype: torch.dtype
) -> None:
    """As above at the shapes of the GPU run that faulted: 2,048 tokens, heads of 64, several head counts."""
    assert _run_checked(monkeypatch, (1, heads, 2048, 64, 64), chunk_size, dtype, True, True) > 0


@interpreted_only
def test_decode_steps_stay_inside_their_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decode kernels (every gate, grouped queries, sizes that are not powers of two, value blocks) under the
    bounds check."""
    b, h, groups, dk, dv = 2, 2, 3, 24, 40
    state = torch.randn(b, h, dk, dv)
    q, k, v = torch.randn(b, h, groups, dk), F.normalize(torch.randn(b, h, dk), dim=-1), torch.randn(b, h, dv)
    with checked_memory(monkeypatch) as checker:
        fused_delta_step(q, k, v, state, -torch.rand(b, h), torch.rand(b, h), torch.rand(b, h))
        fused_linear_step(q, k, v, state, g=-torch.rand(b, h), gk=-torch.rand(b, h, dk))
        fused_linear_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), state)
    assert checker.accesses > 0 and torch.isfinite(state).all()
