"""fla as a backend without a GPU: every computation ``fla_adapters`` hands to fla, run through the op, the adapter
and fla's own plain-torch reference (``fla.ops.*.naive``, injected where the kernel would run), against the torch
form of the same op (values and gradients).

fla's Triton kernels do not run on the CPU; its naive references do, and they are what fla's own tests hold the
kernels to. The shims below only translate a kernel's calling convention to its naive reference's (layout, a
reference's fixed scale); the mapping of our tensors to fla's (heads, groups, gates, states, the denominator column)
is the adapter's, under test. Inputs are float64 and so is the torch form, but fla's references compute in float32
whatever they are given, so values and gradients agree to float32 rounding: rtol = atol = 1e-4. A computation
fla does not cover runs the torch form exactly (tolerance 0) after one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from generation_cases import PAD, all_cases, left_padded_batch, one_thread, tiny_model

from hf_recattn.modeling import backends
from hf_recattn.modeling.ops_delta import delta_chunked, delta_step
from hf_recattn.modeling.ops_gated_linear import gla_chunked, gla_step
from hf_recattn.modeling.ops_kda import kda_chunked, kda_step
from hf_recattn.modeling.ops_linear import linear_chunked, linear_step

pytest.importorskip("fla")
from fla.ops.delta_rule.naive import delta_rule_recurrence  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gla.naive import naive_recurrent_gla  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from fla.ops.linear_attn.naive import naive_recurrent_linear_attn  # noqa: E402
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
B, HK, G, T, D, E, CHUNK = 2, 2, 2, 37, 8, 6, 16


# ----- fla's references in its kernels' calling convention ------------------------------------------------------
def _delta(q, k, v, beta, scale, initial_state, output_final_state):
    """fla's delta-rule recurrence takes [B, H, T, K] and scales q by K^-0.5 itself."""
    q = q * (scale * q.shape[-1] ** 0.5)
    o, s = delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state=initial_state,
                                 output_final_state=output_final_state)
    return o.transpose(1, 2), s


def _gla(q, k, v, scale, initial_state, output_final_state, g=None, gk=None):
    """fla's GLA recurrence scales q by K^-0.5 itself; the chunk kernel names the gate g, the recurrent one gk."""
    q = q * (scale * q.shape[-1] ** 0.5)
    return naive_recurrent_gla(q, k, v, g if gk is None else gk, initial_state=initial_state,
                               output_final_state=output_final_state)


def _linear_attn(q, k, v, scale, initial_state, output_final_state, normalize):
    """fla's linear-attention recurrence adds the start state to its float32 one without a cast."""
    return naive_recurrent_linear_attn(q, k, v, scale=scale, initial_state=initial_state.float(),
                                       output_final_state=output_final_state, normalize=normalize)


REFERENCES: dict[str, Callable] = {
    "chunk_delta_rule": _delta,
    "fused_recurrent_delta_rule": _delta,
    "chunk_gated_delta_rule": naive_recurrent_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": naive_recurrent_gated_delta_rule,
    "chunk_gla": _gla,
    "fused_recurrent_gla": _gla,
    "chunk_simple_gla": naive_recurrent_simple_gla,
    "fused_recurrent_simple_gla": naive_recurrent_simple_gla,
    "chunk_linear_attn": _linear_attn,
    "fused_recurrent_linear_attn": _linear_attn,
    "chunk_kda": naive_recurrent_kda,
    "fused_recurrent_kda": naive_recurrent_kda,
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


@pytest.fixture
def references(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """fla's references registered as the kernels, the CPU and float64 taken as a kernel's; returns the ops that
    ran (name -> calls)."""
    ran: dict[str, list[str]] = {}

    def recording(name: str, fn: Callable) -> Callable:
        def run(**kwargs: object) -> object:
            ran.setdefault(name, []).append(name)
            return fn(**kwargs)
        return run

    monkeypatch.setattr(backends, "_kernels", {name: recording(name, fn) for name, fn in REFERENCES.items()})
    monkeypatch.setattr(backends, "_loaded", True)
    monkeypatch.setattr(backends, "_unverified_backward", set())
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(backends, "KERNEL_DTYPES", (*backends.KERNEL_DTYPES, torch.float64))
    return ran


def _inputs(seed: int, t: int = T, gate_width: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    gate_shape = (B, HK, t) if gate_width is None else (B, HK, t, gate_width)
    return {
        "q": rand(B, HK, G, t, D) * D**-0.5,
        "k": F.normalize(rand(B, HK, t, D), dim=-1),
        "v": rand(B, HK, t, E),
        "log_a": F.logsigmoid(rand(*gate_shape) + 2.0),
        "beta": torch.rand(B, HK, t, generator=gen, dtype=torch.float64),
        "S": rand(B, HK, D, E) * 0.5,
        "z": torch.rand(B, HK, D, generator=gen, dtype=torch.float64),
    }


def _values_and_grads(run: Callable, inputs: dict[str, torch.Tensor], choice: str) -> list[torch.Tensor]:
    """run(**leaves) -> tensors; returns them and the gradients of a random projection of them."""
    leaves = {name: x.clone().requires_grad_(True) for name, x in inputs.items()}
    with backends.use_kernels("torch") if choice == "torch" else _fla_mode():
        outs = run(**leaves)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    used = [x for x in leaves.values() if x.requires_grad]
    grads = torch.autograd.grad(loss, used, allow_unused=True)
    return [*outs, *(torch.zeros_like(x) if g is None else g for x, g in zip(used, grads, strict=True))]


class _fla_mode:
    """HF_RECATTN_KERNELS=fla for the block (use_kernels refuses it on a machine without CUDA)."""

    def __enter__(self) -> None:
        self.previous = getattr(backends._override, "mode", None)
        backends._override.mode = "fla"

    def __exit__(self, *exc: object) -> None:
        backends._override.mode = self.previous


def _check(run: Callable, inputs: dict[str, torch.Tensor], ran: dict[str, list[str]], op: str) -> None:
    expected = _values_and_grads(run, inputs, "torch")
    assert not ran, "the torch form ran a kernel"
    got = _values_and_grads(run, inputs, "fla")
    assert op in ran, f"fla's {op} did not run (ran: {sorted(ran)})"
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL)


# ----- the delta rules ---------------------------------------------------------------------------------------------
def _coefficients(rule: str, log_a: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if rule == "delta":
        return torch.zeros_like(beta), beta, beta
    return log_a, beta, beta * log_a.exp()


@pytest.mark.parametrize("rule,op", [("delta", "chunk_delta_rule"), ("gated", "chunk_gated_delta_rule")])
def test_chunked_delta_rules_match_fla(references: dict, rule: str, op: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        return delta_chunked(q, k, v, *_coefficients(rule, log_a, beta), S, CHUNK, rule=rule)

    _check(run, _inputs(0), references, op)


@pytest.mark.parametrize("rule,op", [("delta", "fused_recurrent_delta_rule"),
                                     ("gated", "fused_recurrent_gated_delta_rule")])
@pytest.mark.parametrize("in_place", [False, True])
def test_delta_decode_steps_match_fla(references: dict, rule: str, op: str, in_place: bool) -> None:
    def run(q, k, v, log_a, beta, S, z):
        state = S.detach().clone() if in_place else S
        outs = []
        for t in range(3):
            coefficients = _coefficients(rule, log_a[:, :, t : t + 1], beta[:, :, t : t + 1])
            o, state = delta_step(q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], *coefficients,
                                  state, in_place=in_place, rule=rule)
            outs.append(o)
        return torch.cat(outs, dim=3), state

    if in_place:  # a cache's buffer: no gradients, the state written where it lies
        with torch.no_grad():
            inputs = _inputs(1, t=3)
            with backends.use_kernels("torch"):
                expected = run(**inputs)
            with _fla_mode():
                got = run(**inputs)
        assert op in references
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        return
    _check(run, _inputs(1, t=3), references, op)


# ----- GLA and linear attention -------------------------------------------------------------------------------------
def test_chunked_gla_matches_fla(references: dict) -> None:
    def run(q, k, v, log_a, beta, S, z):
        return gla_chunked(q, k, v, log_a, S, CHUNK)

    _check(run, _inputs(2, gate_width=D), references, "chunk_gla")


def test_gla_decode_steps_match_fla(references: dict) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs, state = [], S
        for t in range(3):
            o, state = gla_step(q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                log_a[:, :, t : t + 1], state)
            outs.append(o)
        return torch.cat(outs, dim=3), state

    _check(run, _inputs(3, t=3, gate_width=D), references, "fused_recurrent_gla")


@pytest.mark.parametrize("decayed,op", [(False, "chunk_linear_attn"), (True, "chunk_simple_gla")])
def test_chunked_linear_attention_matches_fla(references: dict, decayed: bool, op: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        return linear_chunked(q.abs(), k.abs(), v, S, z, CHUNK, log_g=log_a if decayed else None)

    _check(run, _inputs(4), references, op)


@pytest.mark.parametrize("decayed,op", [(False, "fused_recurrent_linear_attn"), (True, "fused_recurrent_simple_gla")])
def test_linear_decode_steps_match_fla(references: dict, decayed: bool, op: str) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs = []
        for t in range(3):
            log_g = log_a[:, :, t : t + 1] if decayed else None
            num, den, S, z = linear_step(q[:, :, :, t : t + 1].abs(), k[:, :, t : t + 1].abs(), v[:, :, t : t + 1],
                                         S, z, log_g)
            outs += [num, den]
        return (*outs, S, z)

    _check(run, _inputs(5, t=3), references, op)


def test_chunked_kda_matches_fla(references: dict) -> None:
    def run(q, k, v, log_a, beta, S, z):
        return kda_chunked(q, k, v, log_a, beta, S, CHUNK)

    _check(run, _inputs(8, gate_width=D), references, "chunk_kda")


def test_kda_decode_steps_match_fla(references: dict) -> None:
    def run(q, k, v, log_a, beta, S, z):
        outs, state = [], S
        for t in range(3):
            sl = slice(t, t + 1)
            o, state = kda_step(q[:, :, :, sl], k[:, :, sl], v[:, :, sl], log_a[:, :, sl], beta[:, :, sl], state)
            outs.append(o)
        return torch.cat(outs, dim=3), state

    _check(run, _inputs(9, t=3, gate_width=D), references, "fused_recurrent_kda")


# ----- what fla does not compute -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,steps,message", [("comba", 1, "Comba"), ("gated", 2, "DeltaProduct")])
def test_what_fla_does_not_cover_warns_once_and_runs_the_torch_form(
    references: dict, rule: str, steps: int, message: str
) -> None:
    x = _inputs(6, t=steps * T)
    q, k, v = x["q"][..., :T, :], x["k"], x["v"]
    log_a, beta = x["log_a"], x["beta"]
    args = (q, k, v, log_a, beta, beta if rule == "comba" else beta * log_a.exp(), x["S"], CHUNK, steps)
    with backends.use_kernels("torch"):
        expected = delta_chunked(*args, rule=rule)
    with _fla_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = delta_chunked(*args, rule=rule)
        delta_chunked(*args, rule=rule)
    assert not references, "a kernel ran"
    messages = [str(w.message) for w in caught if "running the torch form" in str(w.message)]
    assert len(messages) == 1 and message in messages[0], messages
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----- whole models through the adapters -----------------------------------------------------------------------------
MODEL_CASES = ["linear(feature_map=elu)", "linear(decay=learned)", "gated_linear", "delta", "kda", "hybrid(window=3)"]


@pytest.mark.parametrize("case_id", MODEL_CASES)
def test_models_give_the_same_logits_and_tokens_through_fla(references: dict, case_id: str) -> None:
    model = tiny_model(next(c for c in all_cases() if c.id == case_id)).double()
    ids, mask = left_padded_batch(lengths=(20, 24))
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        with backends.use_kernels("torch"):
            logits, tokens = model(ids, attention_mask=mask).logits, model.generate(ids, **kwargs)
        assert not references
        with _fla_mode():
            fla_logits, fla_tokens = model(ids, attention_mask=mask).logits, model.generate(ids, **kwargs)
    assert references, "no fla op ran"
    torch.testing.assert_close(fla_logits, logits, **TOL)
    assert torch.equal(fla_tokens, tokens)
