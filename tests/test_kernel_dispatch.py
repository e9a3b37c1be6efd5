"""Which implementation runs: the rules of ``hf_recattn.modeling.backends`` (``auto``, ``fla``, ``torch``).

fla's kernels need a CUDA device, so here stand-ins are registered as the kernels and the CPU is taken for a
kernel device where a rule needs one; that fla's kernels compute the torch forms' function is
tests/test_fla_equality.py's (on fla's references) and scripts/gpu_checks.sh's (on a GPU). Where the torch form runs,
results are compared exactly (tolerance 0).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from generation_cases import PAD, all_cases, left_padded_batch, one_thread, tiny_model

from hf_recattn import cli, ops
from hf_recattn.modeling import backends
from hf_recattn.modeling.backends import use_kernels
from hf_recattn.modeling.fla_adapters import FLA_FUNCTIONS


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a kernel ran")


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Callable], None]:
    """Every fla op registered as a stand-in that refuses to run (unverified backward, as fla's are); returns a
    function registering another stand-in."""
    monkeypatch.setattr(backends, "_kernels", {})
    monkeypatch.setattr(backends, "_unverified_backward", set())
    monkeypatch.setattr(backends, "_loaded", True)
    monkeypatch.setattr(backends, "_warned", set())
    for name in FLA_FUNCTIONS:
        backends.register(name, _refuse, backward_verified=False)
    return lambda name, fn: backends.register(name, fn, backward_verified=False)


class _forced:
    """HF_RECATTN_KERNELS=fla for the block, past use_kernels' refusal on a machine without CUDA."""

    def __enter__(self) -> None:
        self.previous = getattr(backends._override, "mode", None)
        backends._override.mode = "fla"

    def __exit__(self, *exc: object) -> None:
        backends._override.mode = self.previous


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


def test_auto_never_runs_a_kernel_on_the_cpu(stand_ins: Callable) -> None:
    model = tiny_model(next(c for c in all_cases() if c.id == "delta"))
    ids, mask = left_padded_batch(lengths=(20, 24))
    with torch.no_grad(), use_kernels("auto"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)


def test_auto_falls_back_with_one_warning_on_what_fla_cannot_take(
    stand_ins: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))  # pretend the CPU is a kernel device
    q, k, v, g, beta, _ = (x.double() for x in _delta_inputs(False))
    with use_kernels("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
        ops.chunk_gated_delta_rule(q, k, v, g, beta)
    assert o.dtype == torch.float64
    messages = [str(w.message) for w in caught if "running the torch form" in str(w.message)]
    assert len(messages) == 1 and "torch.float64" in messages[0] and "chunk_gated_delta_rule" in messages[0]
    with use_kernels("torch"):
        expected, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def test_heads_wider_than_fla_takes_run_the_torch_form(stand_ins: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))
    q, beta = torch.randn(1, 20, 1, 300), torch.rand(1, 20, 1)
    with _forced(), pytest.warns(UserWarning, match="key heads of 300 \\(at most 256\\)"):
        o, _ = ops.chunk_delta_rule(q, q, q[..., :16], beta)
    with use_kernels("torch"):
        expected, _ = ops.chunk_delta_rule(q, q, q[..., :16], beta)
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def test_bad_choices_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="use_kernels"):
        with use_kernels("triton"):
            pass
    monkeypatch.setenv(backends.ENV, "gpu")
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS='gpu'"):
        backends.mode()


def test_forced_fla_on_cpu_tensors_is_an_error(stand_ins: Callable) -> None:
    x = torch.zeros(1, 2, 3, 16)
    with _forced(), pytest.raises(ValueError, match="HF_RECATTN_KERNELS=fla: fla's 'chunk_gla' runs on CUDA"):
        backends.pick("chunk_gla", x)


def test_a_forced_mode_the_machine_cannot_run_is_refused_up_front(
    stand_ins: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"use_kernels\('fla'\) needs a CUDA device"):
        with use_kernels("fla"):
            raise AssertionError("the block ran")
    monkeypatch.setenv(backends.ENV, "fla")
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS=fla needs a CUDA device"):
        backends.check_mode()
    assert cli.main(["mixers"]) == 2  # the command line stops before any work, with one line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_kernels", {})  # fla not installed: nothing registered
    with pytest.raises(ValueError, match="HF_RECATTN_KERNELS=fla but fla does not import"):
        backends.check_mode()
    monkeypatch.setenv(backends.ENV, "auto")
    assert backends.check_mode() == "auto"


def test_auto_does_not_train_with_an_unverified_backward(stand_ins: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))  # pretend the CPU is CUDA
    kernels = {"chunk_gated_delta_rule": object(), "chunk_gla": object()}
    stand_ins("chunk_gated_delta_rule", kernels["chunk_gated_delta_rule"])
    backends.register("chunk_gla", kernels["chunk_gla"])  # as if its backward had passed the GPU check
    x, leaf = torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16, requires_grad=True)
    with use_kernels("auto"):
        assert backends.pick("chunk_gated_delta_rule", x, leaf) is None  # gradients recorded: the torch form
        assert backends.pick("chunk_gla", x, leaf) is kernels["chunk_gla"]  # verified backward
        assert backends.pick("chunk_gated_delta_rule", x) is kernels["chunk_gated_delta_rule"]  # the forward alone
        with torch.no_grad():
            assert backends.pick("chunk_gated_delta_rule", x, leaf) is kernels["chunk_gated_delta_rule"]
    with _forced():
        assert backends.pick("chunk_gated_delta_rule", x, leaf) is kernels["chunk_gated_delta_rule"]  # opted in


def test_auto_trains_a_delta_rule_on_the_torch_backward(stand_ins: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "KERNEL_DEVICES", ("cpu",))
    for auto_form, torch_form in zip(_run_delta("auto"), _run_delta("torch"), strict=True):  # _refuse never runs
        torch.testing.assert_close(auto_form, torch_form, rtol=0, atol=0)


def test_fla_registers_every_op_with_an_unverified_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fla")
    monkeypatch.setattr(backends, "_kernels", {})
    monkeypatch.setattr(backends, "_unverified_backward", set())
    monkeypatch.setattr(backends, "_loaded", False)
    assert backends.registered() == sorted(FLA_FUNCTIONS)
    assert backends._unverified_backward == set(FLA_FUNCTIONS)
