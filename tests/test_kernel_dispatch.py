"""Which implementation runs: the Triton kernels through the models and the functional API, and the rules of
``hf_recattn.modeling.backends``.

Kernels run on the CPU through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``). Tolerances: model
logits within 1e-5 of the torch forms (float32; the kernels sum in another order), greedy tokens equal; the
functional API's outputs and gradients within 1e-4 relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from generation_cases import PAD, all_cases, left_padded_batch, one_thread, tiny_model

from hf_recattn import cli, ops
from hf_recattn.modeling import backends
from hf_recattn.modeling.backends import use_kernels

pytest.importorskip("triton")

#: one case per kernel path: linear (plain and decayed), GLA, the gated delta rule, a hybrid's linear far part
MODEL_CASES = ["linear(feature_map=elu)", "linear(decay=learned)", "gated_linear", "delta", "hybrid(window=3)"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


@pytest.mark.parametrize("case_id", MODEL_CASES)
def test_models_give_the_same_logits_and_tokens_on_the_kernels(case_id: str) -> None:
    model = tiny_model(next(c for c in all_cases() if c.id == case_id))
    ids, mask = left_padded_batch(lengths=(20, 24))
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        logits, tokens = model(ids, attention_mask=mask).logits, model.generate(ids, **kwargs)
        with use_kernels("triton"):
            kernel_logits, kernel_tokens = model(ids, attention_mask=mask).logits, model.generate(ids, **kwargs)
    torch.testing.assert_close(kernel_logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel_tokens, tokens)


def _delta_inputs(requires_grad: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 40, 2, 16
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, h, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, d, d, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta, state)]


def _run_delta(choice: str) -> tuple[torch.Tensor, ...]:
    q, k, v, g, beta, state = inputs = _delta_inputs(True)
    with use_kernels(choice):
        o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (final * torch.randn(final.shape, generator=gen)).sum()
    return (o, final, *torch.autograd.grad(loss, inputs))


def test_functional_api_dispatches_values_and_gradients() -> None:
    for kernel, torch_form in zip(_run_delta("triton"), _run_delta("torch"), strict=True):
        torch.testing.assert_close(kernel, torch_form, rtol=1e-4, atol=1e-4)


def test_auto_never_runs_a_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel ran on the CPU in auto mode")

    backends.registered()  # load the real kernels first, then shadow them
    for name in ("chunk_linear", "chunk_delta", "linear_step", "delta_step"):
        monkeypatch.setitem(backends._kernels, name, refuse)
    model = tiny_model(next(c for c in all_cases() if c.id == "delta"))
    ids, mask = left_padded_batch(lengths=(20, 24))
    with torch.no_grad(), use_kernels("auto"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)


def test_auto_falls_back_with_one_warning_on_what_a_kernel_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))  # pretend the CPU is a kernel device
    monkeypatch.setattr(backends, "_warned", set())
    q, k, v, g, beta, _ = (x.double() for x in _delta_inputs(False))
    with use_kernels("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
        ops.chunk_gated_delta_rule(q, k, v, g, beta)
    assert o.dtype == torch.float64
    messages = [str(w.message) for w in caught if "Triton kernel" in str(w.message)]
    assert len(messages) == 1 and "torch.float64" in messages[0], messages
    with use_kernels("torch"):
        expected, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def test_forced_kernels_refuse_what_they_cannot_take() -> None:
    q, k, v, g, beta, _ = _delta_inputs(False)
    with use_kernels("triton"):
        with pytest.raises(ValueError, match="float64"):
            ops.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double())
        model = tiny_model(next(c for c in all_cases() if c.id.startswith("delta(init=convert,householder")))
        ids, mask = left_padded_batch(lengths=(20, 24))
        with pytest.raises(ValueError, match="DeltaProduct"), torch.no_grad():
            model(ids, attention_mask=mask)


def test_bad_choices_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="use_kernels"):
        with use_kernels("fast"):
            pass
    monkeypatch.setenv(backends.ENV, "gpu")
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS='gpu'"):
        backends.mode()


def test_forced_kernels_on_the_cpu_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, CPU tensors
    x = torch.zeros(1, 2, 3, 16)
    with use_kernels("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backends.pick("chunk_delta", x)


def test_a_forced_mode_the_machine_cannot_run_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"use_kernels\('triton'\) needs a CUDA device, or TRITON_INTERPRET=1"):
        with use_kernels("triton"):
            raise AssertionError("the block ran")
    monkeypatch.setenv(backends.ENV, "triton")
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS=triton needs a CUDA device"):
        backends.check_mode()
    assert cli.main(["mixers"]) == 2  # the command line stops before any work, with one line
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.registered()
    monkeypatch.setattr(backends, "_kernels", {})  # triton not installed: nothing registered
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS=triton but no Triton kernel is registered"):
        backends.check_mode()
    monkeypatch.setenv(backends.ENV, "auto")
    assert backends.check_mode() == "auto"


def test_auto_does_not_train_with_an_unverified_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))  # pretend the CPU is CUDA
    kernels = {"chunk_delta": object(), "chunk_linear": object()}
    backends.registered()
    for name, fn in kernels.items():
        monkeypatch.setitem(backends._kernels, name, fn)
    assert "chunk_delta" in backends._unverified_backward and "chunk_linear" not in backends._unverified_backward
    x, leaf = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16, requires_grad=True)
    with use_kernels("auto"):
        assert backends.pick("chunk_delta", x, leaf) is None  # gradients recorded: the torch form
        assert backends.pick("chunk_linear", x, leaf) is kernels["chunk_linear"]  # verified backward
        assert backends.pick("chunk_delta", x) is kernels["chunk_delta"]  # the forward alone
        with torch.no_grad():
            assert backends.pick("chunk_delta", x, leaf) is kernels["chunk_delta"]
    with use_kernels("triton"):
        assert backends.pick("chunk_delta", x, leaf) is kernels["chunk_delta"]  # an explicit opt-in runs it


def test_auto_trains_a_delta_rule_on_the_torch_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))
    ran = []
    backends.registered()
    kernel = backends._kernels["chunk_delta"]
    monkeypatch.setitem(backends._kernels, "chunk_delta", lambda *a, **kw: ran.append(1) or kernel(*a, **kw))
    for kernel_form, torch_form in zip(_run_delta("auto"), _run_delta("torch"), strict=True):
        torch.testing.assert_close(kernel_form, torch_form, rtol=0, atol=0)
    assert not ran


def test_heads_wider_than_a_kernel_takes_are_refused_by_name() -> None:
    q = torch.randn(1, 20, 1, 200)
    with use_kernels("triton"), pytest.raises(ValueError, match="at most 128"):
        ops.chunk_delta_rule(q, q, q[..., :16], torch.rand(1, 20, 1))
