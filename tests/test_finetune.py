"""Stage 2 (Trainer; LoRA or every weight): the loss, gradient-accumulation scaling, merging, resume, NaN stop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_teacher, tiny_texts, tiny_tokenizer
from transformers import default_data_collator

from hf_recattn import RecAttnForCausalLM, from_teacher
from hf_recattn.data.corpus import token_blocks
from hf_recattn.training.distill import (
    BlockDataset,
    DistillTrainer,
    finetune,
    trainable_student,
    training_arguments,
)
from hf_recattn.training.distill_loss import distill_loss_sum
from hf_recattn.training.distill_settings import DistillSettings
from hf_recattn.training.runner import NonFiniteLossError
from hf_recattn.training.trainable import LoraSettings, merge_lora

HEDGEHOG = {"mixer": "linear", "feature_map": "hedgehog"}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, torch.Tensor]:
    tokenizer = tiny_tokenizer()
    return tiny_teacher(len(tokenizer)), token_blocks(tokenizer, tiny_texts(), 32)


def _settings(**kw: object) -> DistillSettings:
    base = dict(
        tokens=4 * 2 * 32,
        lr=1e-2,
        block_size=32,
        batch_size=2,
        grad_accum=1,
        loss="ce+kl",
        temperature=2.0,
        save_steps=2,
        warmup_fraction=0.0,
        lora=LoraSettings(r=4, alpha=8),
    )
    base.update(kw)
    return DistillSettings(**base)


# ----- the loss ---------------------------------------------------------------------------------------------
def _reference_loss(
    student: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor, mode: str, t: float, w: float,
    weights: torch.Tensor | None = None,
) -> tuple[float, int]:
    """Per-position float64 loop, written independently of distill_loss_sum."""
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for i in range(labels.shape[1]):
            if labels[b, i] == -100:
                continue
            s = student[b, i].double()
            count += 1
            ce = float(torch.logsumexp(s, 0) - s[labels[b, i]])
            p = torch.softmax(teacher[b, i].double() / t, 0)
            kl = float((p * (p.log() - torch.log_softmax(s / t, 0))).sum()) * t * t
            scale = 1.0 if weights is None else float(weights[b, i])
            total += scale * {"ce": ce, "kl": kl, "ce+kl": ce + w * kl}[mode]
    return total, count


@pytest.mark.parametrize("mode", ["ce", "kl", "ce+kl"])
def test_distill_loss_sum_matches_a_float64_loop(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=gen) * 3, torch.randn(2, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 3:] = -100
    total, count = distill_loss_sum(student, labels, teacher, mode, temperature=2.0, kl_weight=0.5)
    ref_total, ref_count = _reference_loss(student, labels, teacher, mode, 2.0, 0.5)
    assert count == ref_count == 8
    assert float(total) == pytest.approx(ref_total, rel=1e-5)  # fp32 against fp64


@pytest.mark.parametrize("mode", ["ce", "kl", "ce+kl"])
def test_weighted_loss_scales_each_position(mode: str) -> None:
    """Per-position weights (the answer tokens of retrieval blocks) scale that position's loss; the count of
    predicted positions does not change."""
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 5, 11, generator=gen) * 3, torch.randn(2, 5, 11, generator=gen) * 3
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[1, :2] = -100
    weights = torch.rand(2, 5, generator=gen) * 10
    total, count = distill_loss_sum(student, labels, teacher, mode, 2.0, 0.5, shift_weights=weights)
    ref_total, ref_count = _reference_loss(student, labels, teacher, mode, 2.0, 0.5, weights)
    assert count == ref_count == 8
    assert float(total) == pytest.approx(ref_total, rel=1e-5)
    unweighted, _ = distill_loss_sum(student, labels, teacher, mode, 2.0, 0.5)
    assert float(total) != pytest.approx(float(unweighted), rel=1e-3)  # the weights did something


def test_block_dataset_shifts_the_weights_with_the_labels() -> None:
    blocks = torch.arange(12).view(2, 6)
    weights = torch.ones(2, 6)
    weights[1, 4] = 50.0  # the weight of predicting token 4 of block 1
    item = BlockDataset(blocks, weights=weights)[1]
    assert item["shift_labels"][3] == blocks[1, 4] and item["shift_weights"][3] == 50.0
    assert float(item["shift_weights"].sum()) == 5 + 50.0
    assert "shift_weights" not in BlockDataset(blocks)[0]
    with pytest.raises(ValueError, match="weights"):
        BlockDataset(blocks, weights=torch.ones(2, 5))


def test_kl_of_identical_distributions_is_zero() -> None:
    logits = torch.randn(1, 4, 9)
    total, _ = distill_loss_sum(logits, torch.zeros(1, 4, dtype=torch.long), logits.clone(), "kl", 3.0)
    assert abs(float(total)) < 1e-5


# ----- gradient accumulation --------------------------------------------------------------------------------
class _UnscaledTrainer(DistillTrainer):
    """The bug the test must catch: a per-token-normalized loss that Trainer then divides again."""

    loss_is_scaled_for_ga = False


def _one_sgd_step(
    teacher: torch.nn.Module,
    blocks: torch.Tensor,
    mask: torch.Tensor,
    batch: int,
    accum: int,
    tmp: Path,
    trainer_class: type = DistillTrainer,
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    student = from_teacher(teacher, HEDGEHOG)
    settings = _settings(batch_size=batch, grad_accum=accum, tokens=4 * 32)
    peft_model = trainable_student(student, settings)
    with torch.no_grad():  # non-zero B so that both LoRA factors get gradients
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    args = training_arguments(
        settings,
        tmp,
        seed=0,
        steps=1,
        progress=False,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        logging_strategy="no",
    )
    trainer = trainer_class(
        model=peft_model,
        args=args,
        train_dataset=BlockDataset(blocks, mask),
        data_collator=default_data_collator,
        teacher=teacher,
        loss="ce+kl",
        temperature=2.0,
    )
    trainer.train()
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def test_accumulation_1x4_equals_4x1(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """One optimizer step over 4 sequences gives the same update as a batch of 4 or 4 micro-batches of 1, even
    with different numbers of real tokens per sequence (the loss is normalized over the accumulated batch)."""
    teacher, blocks = setup
    blocks = blocks[:4]
    mask = torch.ones_like(blocks)
    for row, real in enumerate((32, 9, 20, 4)):  # right padding of different lengths
        mask[row, real:] = 0
    start = _one_sgd_step(teacher, blocks, mask, 4, 1, tmp_path / "init")  # reference update
    torch.manual_seed(0)
    initial = {
        n: p.detach().clone()
        for n, p in trainable_student(from_teacher(teacher, HEDGEHOG), _settings()).named_parameters()
        if p.requires_grad
    }
    big = _one_sgd_step(teacher, blocks, mask, 4, 1, tmp_path / "a")
    small = _one_sgd_step(teacher, blocks, mask, 1, 4, tmp_path / "b")
    wrong = _one_sgd_step(teacher, blocks, mask, 1, 4, tmp_path / "c", _UnscaledTrainer)
    for name in big:
        torch.testing.assert_close(big[name], start[name], rtol=0, atol=0)  # deterministic
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-6, msg=name)
    name = next(n for n in big if "lora_A" in n)
    step_big = big[name] - _lora_init(initial, name, big)
    step_wrong = wrong[name] - _lora_init(initial, name, big)
    ratio = float(step_wrong.norm() / step_big.norm())
    assert 0.1 < ratio < 0.9, ratio  # the double-scaled update is visibly smaller: the test can fail


def test_loss_over_processes_is_scaled_as_trainer_scales_its_own(setup, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """With Trainer's token count taken over P processes, stage 2's loss is multiplied by P, as Trainer multiplies
    the model's own loss (CausalLMTrainer): DDP / FSDP average the gradients over the processes, so without it each
    step would be 1/P of the one-process step."""
    teacher, blocks = setup
    student = from_teacher(teacher, HEDGEHOG)
    args = training_arguments(_settings(), tmp_path, 0, 1, False)
    trainer = DistillTrainer(model=student, args=args, train_dataset=BlockDataset(blocks[:2]),
                             data_collator=default_data_collator, teacher=teacher, loss="ce+kl")
    batch = default_data_collator([BlockDataset(blocks[:2])[i] for i in range(2)])
    count = int((batch["shift_labels"] != -100).sum())
    one = trainer.compute_loss(student, batch, num_items_in_batch=count)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    assert trainer.args.average_tokens_across_devices and trainer.process_scale() == 2
    two = trainer.compute_loss(student, batch, num_items_in_batch=count)
    torch.testing.assert_close(two, 2 * one, rtol=1e-6, atol=0)


def _lora_init(initial: dict[str, torch.Tensor], name: str, like: dict[str, torch.Tensor]) -> torch.Tensor:
    """LoRA A starts from the seeded init (the B values we overwrite do not touch A)."""
    return initial[name] if name in initial else torch.zeros_like(like[name])


# ----- merging, the whole stage, resume, NaN ----------------------------------------------------------------
def test_merged_model_equals_the_peft_model(setup) -> None:  # noqa: ANN001
    teacher, blocks = setup
    peft_model = trainable_student(from_teacher(teacher, HEDGEHOG), _settings())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(input_ids=blocks[:2]).logits
        merged = merge_lora(peft_model)
        got = merged(input_ids=blocks[:2]).logits
    assert type(merged) is RecAttnForCausalLM
    assert not any("lora" in n for n, _ in merged.named_parameters())
    plain = from_teacher(teacher, HEDGEHOG)
    assert (got - plain(input_ids=blocks[:2]).logits).abs().max() > 1e-3  # the adapters did change something
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_finetune_trains_lora_merges_and_saves(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    torch.manual_seed(0)
    student = from_teacher(teacher, HEDGEHOG)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    merged, result = finetune(
        teacher, student, blocks, _settings(tokens=6 * 2 * 32), tmp_path / "t", progress=False
    )
    assert result.steps == 6 and result.trainable_parameters > 0 and result.final_loss is not None
    state = merged.state_dict()
    changed = {k for k, v in state.items() if not torch.equal(v, before[k])}
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed
    ), sorted(changed)
    merged.save_pretrained(tmp_path / "m")
    loaded = RecAttnForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=blocks[:1]).logits, merged(input_ids=blocks[:1]).logits)


@pytest.mark.parametrize("method", [None, "full"])
def test_finetune_resumes_from_trainer_checkpoint(setup, tmp_path: Path, method: str | None) -> None:  # noqa: ANN001
    teacher, blocks = setup
    settings = _settings(tokens=4 * 2 * 32, method=method, lr=1e-3 if method else 1e-2)
    torch.manual_seed(0)
    reference, _ = finetune(
        teacher, from_teacher(teacher, HEDGEHOG), blocks, settings, tmp_path / "a", progress=False
    )
    torch.manual_seed(0)
    finetune(
        teacher,
        from_teacher(teacher, HEDGEHOG),
        blocks,
        settings,
        tmp_path / "b",
        progress=False,
        stop_after_step=2,
    )
    torch.manual_seed(0)
    resumed, result = finetune(
        teacher, from_teacher(teacher, HEDGEHOG), blocks, settings, tmp_path / "b", progress=False
    )
    assert result.resumed_from == 2 and result.steps == 4
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_loss_and_gradient_checkpointing_train_the_same(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """Stage 2 with ``loss_chunk_size`` (not dividing the block) and ``gradient_checkpointing``: the same run up to
    floating-point rounding, with the KL to the teacher and per-token weights."""
    teacher, blocks = setup
    weights = torch.ones(blocks.shape, dtype=torch.float32)
    weights[:, 10:14] = 5.0
    trained = {}
    for name, extra in {"plain": {}, "lean": {"loss_chunk_size": 9, "gradient_checkpointing": True}}.items():
        torch.manual_seed(0)
        trained[name] = finetune(teacher, from_teacher(teacher, HEDGEHOG), blocks, _settings(**extra),
                                 tmp_path / name, progress=False, weights=weights)
    (plain, plain_result), (lean, lean_result) = trained["plain"], trained["lean"]
    assert lean_result.final_loss == pytest.approx(plain_result.final_loss, rel=1e-5)
    for (name, a), b in zip(plain.state_dict().items(), lean.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_full_method_trains_every_weight(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """``method: full``: no adapters, every tensor of the student moves, the mixers' own parameters in their own
    optimizer group when ``mixer_lr`` is set (no ``train_mixer`` needed)."""
    teacher, blocks = setup
    student = from_teacher(teacher, HEDGEHOG)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    total = sum(p.numel() for p in student.parameters())
    settings = _settings(method="full", lr=1e-3, mixer_lr=0.125)
    trained, result = finetune(teacher, student, blocks, settings, tmp_path / "t", progress=False)
    assert type(trained) is RecAttnForCausalLM and not trained.training
    assert result.trainable_parameters == total and not any(p.requires_grad for p in trained.parameters())
    unchanged = sorted(k for k, v in trained.state_dict().items() if torch.equal(v, before[k]))
    assert not unchanged, unchanged
    trainer = DistillTrainer(
        model=student.requires_grad_(True), args=training_arguments(settings, tmp_path / "o", 0, 1, False),
        train_dataset=BlockDataset(blocks), data_collator=default_data_collator, teacher=teacher, loss="ce+kl",
        mixer_lr=0.125,
    )
    groups = trainer.create_optimizer().param_groups
    names = {id(p): n for n, p in student.named_parameters()}
    assert groups[-1]["lr"] == 0.125 and all(".mixer.feature_map." in names[id(p)] for p in groups[-1]["params"])
    assert sum(p.numel() for g in groups for p in g["params"]) == total  # every weight exactly once


def test_nan_loss_stops_stage2(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    bad_teacher = tiny_teacher(teacher.config.vocab_size)
    with torch.no_grad():
        bad_teacher.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"stage 2: loss is nan at step 0"):
        finetune(
            bad_teacher, from_teacher(teacher, HEDGEHOG), blocks, _settings(loss="kl"), tmp_path, progress=False
        )


def test_kl_needs_a_teacher(setup, tmp_path: Path) -> None:  # noqa: ANN001
    _, blocks = setup
    with pytest.raises(ValueError, match="teacher"):
        DistillTrainer(
            model=torch.nn.Linear(2, 2),
            args=training_arguments(dataclasses.replace(_settings()), tmp_path, 0, 1, False),
            loss="kl",
        )


def test_train_mixer_also_trains_the_mixer_parameters(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    student = from_teacher(teacher, HEDGEHOG)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    merged, _ = finetune(teacher, student, blocks, _settings(train_mixer=True), tmp_path, progress=False)
    state = merged.state_dict()
    assert set(state) == set(before)  # merged back into the plain layout
    changed = {k for k, v in state.items() if not torch.equal(v, before[k])}
    assert any(".mixer.feature_map." in k for k in changed) and any("q_proj" in k for k in changed)


# ----- the mixer's own optimizer group (mixer_lr, mixer_eps) ------------------------------------------------
FOX = {"mixer": "softmax", "forget": "fox"}


def _fox_settings(**kw: object) -> DistillSettings:
    return _settings(**{"train_mixer": True, "lr": 1e-4, "tokens": 2 * 32, **kw})


def test_mixer_group_has_its_own_lr_and_eps(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    settings = _fox_settings(mixer_lr=0.25, mixer_eps=1e-20)
    peft_model = trainable_student(from_teacher(teacher, FOX), settings)
    trainer = DistillTrainer(
        model=peft_model,
        args=training_arguments(settings, tmp_path, 0, 1, False),
        train_dataset=BlockDataset(blocks),
        data_collator=default_data_collator,
        teacher=teacher,
        loss="ce+kl",
        mixer_lr=0.25,
        mixer_eps=1e-20,
    )
    groups = trainer.create_optimizer().param_groups
    names = {id(p): n for n, p in peft_model.named_parameters()}
    mixer, others = groups[-1], groups[:-1]
    got = sorted(names[id(p)].rsplit(".", 1)[-1] for p in mixer["params"])
    assert got == ["fox_bias"] * 2 + ["fox_weight"] * 2  # both layers' gates, nothing else
    assert (mixer["lr"], mixer["eps"], mixer["weight_decay"]) == (0.25, 1e-20, 0.0)
    rest = [names[id(p)] for g in others for p in g["params"]]
    assert rest and all("lora_" in n for n in rest)
    assert all(g["lr"] == 1e-4 and g["eps"] == 1e-8 for g in others)  # LoRA keeps lr and Trainer's eps
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in groups for p in g["params"]) == trainable  # every parameter exactly once


def _gate_biases(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([layer.self_attn.mixer.fox_bias.detach() for layer in model.model.layers])


def test_mixer_lr_sets_the_gate_step(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """One Adam step moves each FoX gate bias by mixer_lr (eps << |g| ~ 1e-9), LoRA B by at most lr; with the
    defaults the same gates barely move (their gradients are below Adam's eps)."""
    teacher, blocks = setup
    merged, result = finetune(
        teacher, from_teacher(teacher, FOX), blocks, _fox_settings(mixer_lr=0.25, mixer_eps=1e-20), tmp_path / "a",
        progress=False,
    )
    assert result.steps == 1
    step = _gate_biases(merged) - 18.0
    torch.testing.assert_close(step.abs(), torch.full_like(step, 0.25), rtol=1e-3, atol=0)
    default, _ = finetune(teacher, from_teacher(teacher, FOX), blocks, _fox_settings(), tmp_path / "b",
                          progress=False)
    assert (_gate_biases(default) - 18.0).abs().max() <= 1e-4 * 1.001  # at most lr: the stuck gates


def test_lora_follows_lr_beside_the_mixer_group(setup, tmp_path: Path) -> None:  # noqa: ANN001
    teacher, blocks = setup
    settings = _fox_settings(mixer_lr=0.25, mixer_eps=1e-20)
    peft_model = trainable_student(from_teacher(teacher, FOX), settings)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    trainer = DistillTrainer(
        model=peft_model,
        args=training_arguments(settings, tmp_path, 0, 1, False, save_strategy="no"),
        train_dataset=BlockDataset(blocks),
        data_collator=default_data_collator,
        teacher=teacher,
        loss="ce+kl",
        mixer_lr=0.25,
        mixer_eps=1e-20,
    )
    trainer.train()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in peft_model.named_parameters()
             if p.requires_grad}
    lora_b = [v for n, v in moved.items() if "lora_B" in n]
    assert lora_b and max(lora_b) == pytest.approx(1e-4, rel=1e-2)  # Adam's first step: lr per element
    gates = [v for n, v in moved.items() if n.endswith("fox_bias")]
    assert len(gates) == 2 and all(v == pytest.approx(0.25, rel=1e-3) for v in gates)


def test_resume_with_a_mixer_group(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """The checkpointed optimizer holds the third group (lr, eps) and a resumed run ends where one piece does."""
    teacher, blocks = setup
    settings = _fox_settings(mixer_lr=0.25, mixer_eps=1e-20, tokens=4 * 2 * 32)
    torch.manual_seed(0)
    reference, _ = finetune(teacher, from_teacher(teacher, FOX), blocks, settings, tmp_path / "a", progress=False)
    torch.manual_seed(0)
    finetune(teacher, from_teacher(teacher, FOX), blocks, settings, tmp_path / "b", progress=False,
             stop_after_step=2)
    saved = torch.load(next((tmp_path / "b").glob("checkpoint-2")) / "optimizer.pt", weights_only=False)
    assert saved["param_groups"][-1]["eps"] == 1e-20 and len(saved["param_groups"]) == 3
    torch.manual_seed(0)
    resumed, result = finetune(teacher, from_teacher(teacher, FOX), blocks, settings, tmp_path / "b",
                               progress=False)
    assert result.resumed_from == 2 and result.steps == 4
    assert (_gate_biases(reference) - 18.0).abs().max() > 0.5  # four steps of up to 0.25 (cosine-decayed)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
