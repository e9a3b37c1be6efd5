"""Gradient checkpointing of the decoder layers (transformers' ``activation_checkpointing_enable``, what Trainer
calls for ``activation_checkpointing`` / ``gradient_checkpointing``; stage 2's and
the training YAML's setting): the same gradients as keeping the activations, for every mixer family, with LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from generation_cases import VOCAB, Case, case_params, one_thread, tiny_model

from hf_recattn.training.distill import training_arguments
from hf_recattn.training.distill_settings import DistillSettings
from hf_recattn.training.runner import quiet_gradient_checkpointing_notice
from hf_recattn.training.trainable import LoraSettings, set_trainable


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    one_thread()


def _gradients(model: torch.nn.Module, ids: torch.Tensor, checkpointed: bool) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    with quiet_gradient_checkpointing_notice():
        if checkpointed:
            model.activation_checkpointing_enable()
        else:
            model.activation_checkpointing_disable()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", case_params())
def test_checkpointed_gradients_equal_the_kept_ones(case: Case) -> None:
    model = tiny_model(case)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _gradients(model, ids, checkpointed=False)
    _assert_same(_gradients(model, ids, checkpointed=True), want)
    assert model.model.layers[0].gradient_checkpointing


@pytest.mark.parametrize("case", case_params())
def test_checkpointed_lora_gradients_equal_the_kept_ones(case: Case) -> None:
    """peft's frozen embeddings give the checkpointed layers inputs without a gradient: the non-reentrant
    checkpoint still gives the adapters theirs."""
    with quiet_gradient_checkpointing_notice():
        model = set_trainable(tiny_model(case), "lora", LoraSettings(r=4, alpha=8), True, "stage2")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _gradients(model, ids, checkpointed=False)
    assert any("lora_A" in n for n in want)
    _assert_same(_gradients(model, ids, checkpointed=True), want)


def test_stage2_setting_turns_it_on(tmp_path: Path) -> None:
    settings = DistillSettings(tokens=64, block_size=8, batch_size=1)
    assert not training_arguments(settings, tmp_path, 0, 1, False).activation_checkpointing
    on = DistillSettings(tokens=64, block_size=8, batch_size=1, gradient_checkpointing=True)
    assert training_arguments(on, tmp_path, 0, 1, False).activation_checkpointing
