"""The public functional API (hf_recattn.ops) against float64 per-token loops and transformers' Qwen3-Next code.

Tolerances:

* ours (float32) vs the float64 loop written here: ``max|ours - ref| <= 1e-5 * max|ref|`` for outputs, final
  states and the gradients of q, k, v, g, beta and initial_state (a random linear loss of o and the state);
* ours vs transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (both float32,
  unit-scale inputs): max abs difference <= 2e-5 for outputs and final states;
* packed (cu_seqlens) runs vs each sequence alone: <= 1e-5 abs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from hf_recattn import ops
from hf_recattn.modeling import ops_delta

REL_TOL = 1e-5
HF_ABS_TOL = 2e-5


# ----- the independent reference ---------------------------------------------------------------------------------
def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rule: str,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    l2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 token loop over [B, T, H, D] inputs: S_t = a S - e k (k^T S) + b k v^T, o_t = S_t^T q_t."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, length, heads, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if l2:
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q * (dk**-0.5 if scale is None else scale)
    head_of = torch.arange(hv) // (hv // heads)  # the q/k head each value head reads
    q, k = q[:, :, head_of], k[:, :, head_of]
    ones = torch.ones(bsz, length, hv, dtype=torch.float64)
    decay = ones if g is None else g.double().exp()
    if rule == "gated_delta":
        write, erase = beta.double(), beta.double() * decay
    elif rule == "delta":
        write, erase = beta.double(), beta.double()
    else:  # linear / simple_gla
        write, erase = ones, torch.zeros_like(ones)
    S = torch.zeros(bsz, hv, dk, dv, dtype=torch.float64) if state is None else state.double()
    outs = []
    for t in range(length):
        kt, vt = k[:, t], v[:, t]  # [B, HV, D]
        read = torch.einsum("bhd,bhde->bhe", kt, S)
        S = (
            decay[:, t, :, None, None] * S
            - erase[:, t, :, None, None] * kt[..., :, None] * read[..., None, :]
            + write[:, t, :, None, None] * kt[..., :, None] * vt[..., None, :]
        )
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], S))
    return torch.stack(outs, dim=1), S


# ----- helpers ----------------------------------------------------------------------------------------------------
def make_inputs(
    b: int = 2, t: int = 37, h: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, unit_keys: bool = True
) -> dict[str, torch.Tensor]:
    k = torch.randn(b, t, h, dk)
    if unit_keys:  # keeps the plain delta rule contractive without l2norm in the kernel
        k = F.normalize(k, dim=-1)
    return {
        "q": torch.randn(b, t, h, dk),
        "k": k,
        "v": torch.randn(b, t, hv, dv),
        "g": -0.3 * torch.rand(b, t, hv),
        "beta": torch.rand(b, t, hv),
        "initial_state": torch.randn(b, hv, dk, dv),
    }


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).abs().max() / ref.abs().max()).item()


# (public function, reference rule, its tensor arguments besides q, k, v, extra keywords)
CASES = {
    "chunk_gated_delta_rule": (ops.chunk_gated_delta_rule, "gated_delta", ("g", "beta"), {"chunk_size": 16}),
    "fused_recurrent_gated_delta_rule": (ops.fused_recurrent_gated_delta_rule, "gated_delta", ("g", "beta"), {}),
    "chunk_delta_rule": (ops.chunk_delta_rule, "delta", ("beta",), {"chunk_size": 16}),
    "fused_recurrent_delta_rule": (ops.fused_recurrent_delta_rule, "delta", ("beta",), {}),
    "chunk_linear_attn": (ops.chunk_linear_attn, "linear", (), {"chunk_size": 16}),
    "chunk_simple_gla": (ops.chunk_simple_gla, "simple_gla", ("g",), {"chunk_size": 16}),
}


# ----- values and gradients vs the float64 loop --------------------------------------------------------------------
L2_CASES = [(name, l2) for name in CASES for l2 in (False, True) if not l2 or "delta" in name]


@pytest.mark.parametrize(("name", "l2"), L2_CASES)
def test_matches_float64_loop_values_and_grads(name: str, l2: bool) -> None:
    fn, rule, extra, kwargs = CASES[name]
    if l2:
        kwargs = {**kwargs, "use_qk_l2norm_in_kernel": True}
    x = make_inputs(unit_keys=not l2)
    x["k"] = x["k"] * (3.0 if l2 else 1.0)  # the kernel's l2norm must undo this
    names = ["q", "k", "v", *extra, "initial_state"]
    ours_in = {n: x[n].clone().requires_grad_() for n in names}
    ref_in = {n: x[n].double().requires_grad_() for n in names}
    o, s = fn(**ours_in, scale=0.7, output_final_state=True, **kwargs)
    o_ref, s_ref = reference(ref_in["q"], ref_in["k"], ref_in["v"], rule, ref_in.get("g"), ref_in.get("beta"),
                             ref_in["initial_state"], scale=0.7, l2=l2)
    assert o.dtype == torch.float32 and o.shape == o_ref.shape
    assert rel_err(o, o_ref) < REL_TOL and rel_err(s, s_ref) < REL_TOL
    w_o, w_s = torch.randn(o.shape, dtype=torch.float64), torch.randn(s.shape, dtype=torch.float64)
    grads = torch.autograd.grad((o * w_o.float()).sum() + (s * w_s.float()).sum(), list(ours_in.values()))
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), list(ref_in.values()))
    for n, gr, gr_ref in zip(names, grads, grads_ref, strict=True):
        assert rel_err(gr, gr_ref) < REL_TOL, f"grad of {n}: {rel_err(gr, gr_ref):.2e}"


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "chunk_delta_rule", "chunk_simple_gla"])
def test_default_chunk_with_t_over_64_and_no_initial_state(name: str) -> None:
    fn, rule, extra, _ = CASES[name]
    x = make_inputs(b=1, t=70, h=1, hv=3, dk=16, dv=16)
    o, s = fn(x["q"], x["k"], x["v"], *(x[n] for n in extra))
    assert s is None
    gates = {n: x[n] for n in extra}
    o_ref, _ = reference(x["q"], x["k"], x["v"], rule, gates.get("g"), gates.get("beta"))
    assert rel_err(o, o_ref) < REL_TOL


@pytest.mark.parametrize("chunk_size", [5, 12])
def test_chunk_groups_and_odd_chunks_match_loop(monkeypatch: pytest.MonkeyPatch, chunk_size: int) -> None:
    """One chunk per group (the split / recompute path of long inputs) and chunk sizes that are not powers of 2."""
    monkeypatch.setattr(ops_delta, "GROUP_ELEMENTS", 1)
    x = make_inputs(t=37)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    ours_in = {n: x[n].clone().requires_grad_() for n in names}
    ref_in = {n: x[n].double().requires_grad_() for n in names}
    o, s = ops.chunk_gated_delta_rule(**ours_in, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = reference(ref_in["q"], ref_in["k"], ref_in["v"], "gated_delta", ref_in["g"], ref_in["beta"],
                             ref_in["initial_state"])
    assert rel_err(o, o_ref) < REL_TOL and rel_err(s, s_ref) < REL_TOL
    grads = torch.autograd.grad(o.sum() + s.sum(), list(ours_in.values()))
    grads_ref = torch.autograd.grad(o_ref.sum() + s_ref.sum(), list(ref_in.values()))
    for n, gr, gr_ref in zip(names, grads, grads_ref, strict=True):
        assert rel_err(gr, gr_ref) < REL_TOL, f"grad of {n}"


def test_linear_attn_normalize_divides_by_key_sum() -> None:
    x = make_inputs(hv=2)
    q, k = F.elu(x["q"]) + 1, F.elu(x["k"]) + 1
    o, _ = ops.chunk_linear_attn(q, k, x["v"], normalize=True, chunk_size=16)
    num, _ = reference(q, k, x["v"], "linear", scale=1.0)
    den, _ = reference(q, k, torch.ones_like(x["v"][..., :1]), "linear", scale=1.0)
    assert rel_err(o, num / den) < REL_TOL
    with pytest.raises(ValueError, match="initial_state"):
        ops.chunk_linear_attn(q, k, x["v"], normalize=True, initial_state=x["initial_state"])


def test_half_precision_in_float32_out_in_input_dtype() -> None:
    x = make_inputs()
    args = [x[n].bfloat16() for n in ("q", "k", "v", "g", "beta")]
    o, s = ops.chunk_gated_delta_rule(*args, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, _ = reference(*args[:3], "gated_delta", args[3], args[4])
    assert rel_err(o.float(), o_ref) < 1e-2  # bf16 output rounding only


# ----- packed sequences ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_cu_seqlens_equals_separate_runs(name: str) -> None:
    fn, _, extra, kwargs = CASES[name]
    lengths = [5, 23, 1, 17]
    x = make_inputs(b=1, t=sum(lengths))
    edges = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    states = torch.randn(len(lengths), *x["initial_state"].shape[1:])
    o, s = fn(x["q"], x["k"], x["v"], *(x[n] for n in extra), initial_state=states, output_final_state=True,
              cu_seqlens=edges, **kwargs)
    assert s.shape == states.shape
    for i, (a, b) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True)):
        o_i, s_i = fn(*(x[n][:, a:b] for n in ("q", "k", "v", *extra)), initial_state=states[i : i + 1],
                      output_final_state=True, **kwargs)
        assert (o[:, a:b] - o_i).abs().max() < 1e-5 and (s[i : i + 1] - s_i).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("edges", "match"),
    [
        ([1, 5, 10], "start at 0"),
        ([0, 5, 5, 10], "strictly increasing"),
        ([0, 7, 3, 10], "strictly increasing"),
        ([0, 5, 9], "end at T"),
        ([0.0, 10.0], "integer"),
        ([[0, 10]], "1-D"),
    ],
)
def test_bad_cu_seqlens_raise(edges: list, match: str) -> None:
    x = make_inputs(b=1, t=10)
    with pytest.raises(ValueError, match=f"cu_seqlens.*{match}|cu_seqlens must be a {match}"):
        ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=torch.tensor(edges))


def test_cu_seqlens_needs_batch_one() -> None:
    x = make_inputs(b=2, t=10)
    with pytest.raises(ValueError, match="cu_seqlens needs batch size 1"):
        ops.fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x: x.update(q=x["q"][0]), "q must be"),
        (lambda x: x.update(k=x["k"][:, :, :1]), "k must have the shape of q"),
        (lambda x: x.update(v=x["v"][:, :5]), "v must be"),
        (lambda x: x.update(v=x["v"][:, :, :3]), "v's heads"),
        (lambda x: x.update(g=x["g"][..., :2]), "g must be"),
        (lambda x: x.update(beta=x["beta"][..., None]), "beta must be"),
        (lambda x: x.update(initial_state=x["initial_state"][:1]), "initial_state must be"),
        (lambda x: x.update(initial_state=x["initial_state"].transpose(-1, -2)), "initial_state must be"),
        (lambda x: x.update(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_shapes_raise(change, match: str) -> None:
    x = make_inputs()
    change(x)
    with pytest.raises(ValueError, match=f"chunk_gated_delta_rule: {match}"):
        ops.chunk_gated_delta_rule(**x)


# ----- transformers' Qwen3-Next functions -------------------------------------------------------------------------
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_agrees_with_transformers_qwen3_next(l2: bool, form: str) -> None:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x = make_inputs(b=2, t=70, h=2, hv=4, dk=16, dv=16, unit_keys=not l2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    if form == "chunk":
        ours = ops.chunk_gated_delta_rule(*args, **kw)
        # unwrapped: transformers swaps in fla's kernel where fla imports (it does not run on the CPU)
        theirs = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)(*args, chunk_size=64, **kw)
    else:
        ours = ops.fused_recurrent_gated_delta_rule(*args, **kw)
        theirs = inspect.unwrap(qwen3_next.torch_recurrent_gated_delta_rule)(*args, **kw)
    assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape
    assert (ours[0] - theirs[0]).abs().max() < HF_ABS_TOL
    assert (ours[1] - theirs[1]).abs().max() < HF_ABS_TOL
