"""Stage 1 (attention transfer) on a tiny random Llama: what it trains and leaves alone, resume, NaN stop."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_teacher, tiny_texts, tiny_tokenizer
from safetensors.torch import load_file

from hf_recattn import from_teacher
from hf_recattn.conversion.attention_transfer import attention_transfer, softmax_twins
from hf_recattn.conversion.settings import Stage1Settings
from hf_recattn.data.corpus import token_blocks
from hf_recattn.modeling.mixer_base import MixerInputs, MixerShape
from hf_recattn.modeling.mixer_softmax import SoftmaxMixer
from hf_recattn.modeling.mixers import build_mixer, validate_spec
from hf_recattn.training import attention_objective as objective
from hf_recattn.training.attention_objective import (
    TransferObjective,
    attention_kl_divergence,
    mixer_parameters,
    mixer_state_dict,
)
from hf_recattn.training.attention_transfer import TransferSchedule, lr_at, transfer_optimizer
from hf_recattn.training.forms import fastest_forms
from hf_recattn.training.runner import NonFiniteLossError, latest_trainer_checkpoint

HEDGEHOG = {"mixer": "linear", "feature_map": "hedgehog"}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny ops: a second thread only adds synchronization on a shared machine


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, torch.Tensor]:
    tokenizer = tiny_tokenizer()
    teacher = tiny_teacher(len(tokenizer))
    blocks = token_blocks(tokenizer, tiny_texts(), 32)
    return teacher, blocks


def _settings(steps: int, **kw: object) -> Stage1Settings:
    return Stage1Settings(tokens=steps * 4 * 32, lr=2e-2, block_size=32, batch_size=4, save_every=2, **kw)


def _layer_inputs(teacher: torch.nn.Module, student: torch.nn.Module, ids: torch.Tensor) -> tuple[dict, object]:
    """Every teacher layer's attention input and output on ``ids``, and the rotary embedding stage 1 uses."""
    io = objective.teacher_attention_io(teacher, ids)
    return io, student.model.rotary_emb(io[0][0], position_ids=torch.arange(ids.shape[1])[None])


def _layer_mse(teacher: torch.nn.Module, student: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    io, pe = _layer_inputs(teacher, student, ids)
    with torch.no_grad():
        return [
            float(torch.nn.functional.mse_loss(student.model.layers[i].self_attn.attend(h, pe)[0], y))
            for i, (h, y) in sorted(io.items())
        ]


def test_hooks_capture_the_teacher_attention(setup) -> None:  # noqa: ANN001
    """A softmax student fed the captured inputs reproduces the captured outputs (the capture is faithful)."""
    teacher, blocks = setup
    student = from_teacher(teacher, "softmax")
    assert max(_layer_mse(teacher, student, blocks[:2])) < 1e-10


def test_stage1_reduces_mse_and_touches_only_mixer_parameters(setup) -> None:  # noqa: ANN001
    teacher, blocks = setup
    torch.manual_seed(0)
    student = from_teacher(teacher, HEDGEHOG)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in student.state_dict().items()}
    heldout = blocks[-4:]
    before = _layer_mse(teacher, student, heldout)
    rng = (random.getstate(), torch.get_rng_state())
    result = attention_transfer(teacher, student, blocks[:-4], _settings(30), progress=False)
    assert (random.getstate(), torch.get_rng_state().tolist()) == (rng[0], rng[1].tolist())  # Trainer's seed undone
    after = _layer_mse(teacher, student, heldout)
    assert result.steps == 30 and result.tokens == 30 * 4 * 32
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert a < 0.8 * b, f"layer {i}: held-out MSE {b:.4g} -> {a:.4g}"
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, teacher_before[key]), f"teacher weight {key} changed"
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, student_before[k])}
    assert changed and all(".mixer." in k for k in changed), sorted(changed)
    expected = {n for group in mixer_parameters(student).values() for n in group}
    assert changed <= expected
    assert not any(p.requires_grad for p in student.parameters())  # left frozen for stage 2


def test_summed_loss_gives_each_layer_its_own_gradient(setup) -> None:  # noqa: ANN001
    """One backward of the objective's sum gives every layer exactly the gradient of its own loss alone."""
    teacher, blocks = setup
    torch.manual_seed(0)
    student = from_teacher(teacher, HEDGEHOG)
    groups = mixer_parameters(student)
    student.requires_grad_(False)
    for params in groups.values():
        for p in params.values():
            p.requires_grad_(True)
    loss_of = TransferObjective(teacher, student, list(groups))
    loss_of(blocks[:4]).backward()
    together = {n: p.grad.clone() for params in groups.values() for n, p in params.items()}
    for i, params in groups.items():
        student.zero_grad(set_to_none=True)
        TransferObjective(teacher, student, [i])(blocks[:4]).backward()
        for name, p in params.items():
            assert torch.equal(p.grad, together[name]), name


def test_frozen_projections_build_no_graph(setup) -> None:  # noqa: ANN001
    """q/k/v of a layer whose projections stay frozen carry no autograd graph; trained projections do."""
    teacher, blocks = setup
    student = from_teacher(teacher, HEDGEHOG)
    seen: list[bool] = []
    handle = student.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.requires_grad))
    try:
        for projections in ((), ("q_proj",)):
            groups = mixer_parameters(student, projections)
            student.requires_grad_(False)
            for p in groups[0].values():
                p.requires_grad_(True)
            TransferObjective(teacher, student, [0])(blocks[:1])
    finally:
        handle.remove()
    assert seen == [False, True]


def _layer_kl(teacher: torch.nn.Module, student: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    io, pe = _layer_inputs(teacher, student, ids)
    twins = softmax_twins(teacher, student.config, sorted(io))
    with torch.no_grad():
        return [float(attention_kl_divergence(twins[i].log_attention_weights(h, pe),
                                              student.model.layers[i].self_attn.attend(h, pe, mixer_weights=True)[1]))
                for i, (h, _) in sorted(io.items())]


def _llama_log_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The log weights stage 1 computed for Llama teachers before they came from the softmax mixer."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    logits = q.float().view(b, k.shape[1], groups, t, d) @ k.float()[:, :, None].transpose(-1, -2) * d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return logits.masked_fill(~causal, float("-inf")).log_softmax(-1).view(b, h, t, t)


def test_attention_kl_measures_the_distance_to_softmax_weights() -> None:
    """The KL term is 0 for the softmax weights themselves, positive for others, and equals the closed form for
    uniform causal weights (log t - H(softmax row t), averaged); the softmax mixer's log weights are the Llama
    formula bit for bit."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen)
    mixer = SoftmaxMixer({"mixer": "softmax", "forget": "none"}, MixerShape(32, 4, 2, 8, 0))
    log_p = mixer.log_attention_weights(q, k, MixerInputs(hidden_states=torch.zeros(1, 6, 32)))
    assert torch.equal(log_p, _llama_log_weights(q, k))
    assert float(attention_kl_divergence(log_p, log_p.exp())) < 1e-6
    uniform = torch.ones(6, 6).tril() / torch.arange(1, 7)[:, None]
    p = log_p.exp()
    entropy = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
    expected = (torch.arange(1, 7).log() - entropy).mean()
    assert abs(float(attention_kl_divergence(log_p, uniform.expand(1, 4, 6, 6))) - float(expected)) < 1e-5
    assert float(expected) > 0.1


def test_softmax_log_weights_are_what_the_mixer_attends_with() -> None:
    """With a window and ALiBi forgetting, the log weights are those of the mixer's own eager attention."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, 8, generator=gen), torch.randn(2, 2, 7, 8, generator=gen)
    shape = MixerShape(32, 4, 2, 8, 0)
    for spec in ({"mixer": "sliding_window", "window": 3, "forget": "alibi"}, {"mixer": "softmax", "forget": "alibi"}):
        mixer = build_mixer(validate_spec(spec, "test"), shape, None)
        inputs = MixerInputs(hidden_states=torch.zeros(2, 7, 32), output_attentions=True)
        mixer.parallel(q, k, k, inputs)
        got = mixer.log_attention_weights(q, k, inputs).exp()
        torch.testing.assert_close(got, inputs.attention_probs, rtol=0, atol=1e-6)


def test_teacher_log_weights_are_the_teachers_attention_weights(setup) -> None:  # noqa: ANN001
    """The softmax twins' weights on the captured layer inputs equal what the teacher's eager attention returns,
    and share the teacher's q/k weights rather than copying them."""
    teacher, blocks = setup
    ids = blocks[:2]
    student = from_teacher(teacher, HEDGEHOG)
    io, pe = _layer_inputs(teacher, student, ids)
    implementation, teacher.config._attn_implementation = teacher.config._attn_implementation, "eager"
    try:
        with torch.no_grad():
            expected = teacher(input_ids=ids, output_attentions=True).attentions
    finally:
        teacher.config._attn_implementation = implementation
    twins = softmax_twins(teacher, student.config, sorted(io))
    for i, (hidden, _) in sorted(io.items()):
        assert twins[i].q_proj.weight.data_ptr() == teacher.model.layers[i].self_attn.q_proj.weight.data_ptr()
        with torch.no_grad():
            got = twins[i].log_attention_weights(hidden, pe).exp()
        assert torch.allclose(got, expected[i], atol=1e-6), i


def test_attention_kl_option_trains_the_weights_towards_softmax(setup) -> None:  # noqa: ANN001
    """stage1.attention_kl adds the weights' KL to the loss: after the same steps from the same start, the student
    trained with it is closer to the teacher's attention weights than the one trained on outputs alone (the tiny
    teacher's weights are nearly uniform, so both start close: KL 0.12-0.14 nats); the result reports the term."""
    teacher, blocks = setup
    kls = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        student = from_teacher(teacher, HEDGEHOG)
        result = attention_transfer(teacher, student, blocks[:-4], _settings(20, attention_kl=weight), progress=False)
        kls[weight] = _layer_kl(teacher, student, blocks[-4:])
        assert bool(result.attention_kl_last) == (weight > 0)
    assert all(b < 0.95 * a for a, b in zip(kls[0.0], kls[1.0], strict=True)), kls  # measured 0.087 -> 0.077


def test_attention_kl_refuses_mixers_without_weights(setup) -> None:  # noqa: ANN001
    teacher, blocks = setup
    student = from_teacher(teacher, {**HEDGEHOG, "normalize": "rms"})
    with pytest.raises(ValueError, match=r"stage 1: layer 0: mixer 'linear' .* no attention weights.*attention_kl"):
        attention_transfer(teacher, student, blocks, _settings(1, attention_kl=1.0), progress=False)


def test_projections_option_trains_only_those_copies(setup) -> None:  # noqa: ANN001
    teacher, blocks = setup
    student = from_teacher(teacher, {"mixer": "heinsen", "scale": 0.5})  # a mixer without parameters
    assert mixer_parameters(student) == {}
    before = {k: v.clone() for k, v in student.state_dict().items()}
    settings = _settings(3, projections=("q_proj", "k_proj"), projection_lr=1e-3)
    attention_transfer(teacher, student, blocks, settings, progress=False)
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in changed), sorted(changed)
    assert torch.equal(
        teacher.model.layers[0].self_attn.q_proj.weight,
        tiny_teacher(teacher.config.vocab_size).model.layers[0].self_attn.q_proj.weight,
    )


def test_resume_after_interrupt_continues_identically(setup, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    teacher, blocks = setup
    settings = _settings(6)
    torch.manual_seed(0)
    reference = from_teacher(teacher, HEDGEHOG)
    done = attention_transfer(teacher, reference, blocks, settings, checkpoint_dir=tmp_path / "a", progress=False)

    torch.manual_seed(0)
    student = from_teacher(teacher, HEDGEHOG)
    real = objective.teacher_attention_io
    calls = {"n": 0}

    def interrupt_at_step_5(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "teacher_attention_io", interrupt_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        attention_transfer(teacher, student, blocks, settings, checkpoint_dir=tmp_path / "b", progress=False)
    monkeypatch.setattr(objective, "teacher_attention_io", real)
    kept = latest_trainer_checkpoint(tmp_path / "b")
    assert kept is not None and kept.name == "checkpoint-4"
    # a checkpoint holds the trained parameters, not the whole student
    assert set(load_file(kept / "mixer.safetensors")) == set(mixer_state_dict(student))
    assert not list(kept.glob("model*.safetensors"))

    torch.manual_seed(0)
    fresh = from_teacher(teacher, HEDGEHOG)
    result = attention_transfer(teacher, fresh, blocks, settings, checkpoint_dir=tmp_path / "b", progress=False)
    assert result.resumed_from == 4 and result.steps == 6
    assert (result.first_loss, result.last_loss) == (done.first_loss, done.last_loss)
    for (name, a), b in zip(
        mixer_state_dict(reference).items(), mixer_state_dict(fresh).values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_nan_loss_stops_naming_layer_and_step_and_keeps_last_good(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    student = from_teacher(teacher, HEDGEHOG)
    calls = {"n": 0}

    def poison(module, args, output):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 4:  # the fourth step
            return (torch.full_like(output[0], float("nan")), *output[1:])
        return output

    handle = teacher.model.layers[1].self_attn.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteLossError, match=r"layer 1: .* at step 3") as info:
            attention_transfer(teacher, student, blocks, _settings(10), checkpoint_dir=tmp_path, progress=False)
    finally:
        handle.remove()
    assert "last good checkpoint" in str(info.value)
    kept = latest_trainer_checkpoint(tmp_path)
    assert kept is not None and kept.name == "checkpoint-3"
    saved = load_file(kept / "mixer.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())
    for name, param in mixer_state_dict(student).items():  # the saved state is the one before the NaN step
        assert torch.equal(saved[name], param)


def test_fastest_forms_switch_back(setup) -> None:  # noqa: ANN001
    teacher, _ = setup
    student = from_teacher(teacher, {"mixer": "taylor", "order": 2, "denominator": "rms", "chunk_size": 8})
    mixer = student.model.layers[0].self_attn.mixer
    with fastest_forms(student, seq_len=32) as chosen:
        assert list(chosen.values())[0] in ("parallel", "chunked")
        assert mixer.has_chunked == (list(chosen.values())[0] == "chunked")
    assert "has_chunked" not in vars(mixer) and mixer.has_chunked is type(mixer).has_chunked


def test_lr_schedule_and_empty_input(setup) -> None:  # noqa: ANN001
    settings = dataclasses.replace(_settings(100), warmup_fraction=0.1, min_lr_fraction=0.1, projection_lr=1e-3)
    lrs = [lr_at(s, 100, settings) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(settings.lr) and lrs[-1] == pytest.approx(
        0.1 * settings.lr, rel=0.01
    )
    # the scheduler sets each group's rate to exactly lr_at(step) * its scale (projections: projection_lr / lr)
    student = from_teacher(setup[0], HEDGEHOG)
    optimizer = transfer_optimizer(mixer_parameters(student, ("q_proj",)), settings)
    schedule = TransferSchedule(optimizer, lambda step: lr_at(step, 100, settings))
    for step in range(100):
        assert [g["lr"] for g in optimizer.param_groups] == [lrs[step] * g["lr_scale"] for g in optimizer.param_groups]
        optimizer.step()
        schedule.step()
    assert {g["lr_scale"] for g in optimizer.param_groups} == {1.0, 1e-3 / settings.lr}
    with pytest.raises(ValueError, match="stage 1"):
        attention_transfer(
            torch.nn.Linear(1, 1),
            torch.nn.Linear(1, 1),
            torch.zeros(0, 4, dtype=torch.long),
            _settings(1),
            progress=False,
        )


def test_teacher_stops_after_the_last_trained_layer(setup, monkeypatch) -> None:  # noqa: ANN001
    """Training layer 0 of 3 runs the teacher up to layer 0's attention only, with the same losses and parameters,
    bit for bit, as running its whole stack."""
    _, blocks = setup
    teacher = tiny_teacher(setup[0].config.vocab_size, layers=3)
    ids = blocks[:2]
    full = objective.teacher_attention_io(teacher, ids)
    assert sorted(full) == [0, 1, 2]
    seen: list[int] = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.append(i))
             for i, layer in enumerate(teacher.model.layers)]
    part = objective.teacher_attention_io(teacher, ids, last_layer=1)
    for hook in hooks:
        hook.remove()
    assert seen == [0] and sorted(part) == [0, 1]  # layer 1's MLP and layer 2 never ran
    for i in part:
        assert all(torch.equal(a, b) for a, b in zip(part[i], full[i], strict=True))

    def run(whole_stack: bool) -> tuple[object, dict[str, torch.Tensor]]:
        if whole_stack:
            real = objective.teacher_attention_io
            monkeypatch.setattr(objective, "teacher_attention_io", lambda t, x, last=None: real(t, x))
        torch.manual_seed(0)
        student = from_teacher(teacher, HEDGEHOG)
        result = attention_transfer(teacher, student, blocks, _settings(3), progress=False, layers=[0])
        monkeypatch.undo()
        return result, mixer_state_dict(student)

    (stopped, params), (whole, whole_params) = run(False), run(True)
    assert (stopped.first_loss, stopped.last_loss) == (whole.first_loss, whole.last_loss)
    assert stopped.first_loss != stopped.last_loss
    for name, value in params.items():
        assert torch.equal(value, whole_params[name]), name
