"""The loss over chunks of positions from the final hidden states (stage 2's distillation loss, and the causal-LM
loss of pretraining and finetuning): the same value and gradients as the loss over the whole logits."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from distill_fixtures import loss_case, tiny_teacher
from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, default_data_collator

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, from_teacher
from hf_recattn.conversion.settings import Stage2Settings
from hf_recattn.training.distill import BlockDataset, DistillTrainer, training_arguments
from hf_recattn.training.distill_loss import chunked_loss_sum, distill_loss_sum
from hf_recattn.training.distill_settings import DistillSettings
from hf_recattn.training.lm_outputs import final_logits
from hf_recattn.training.runner import CausalLMTrainer
from hf_recattn.training.trainable import LoraSettings, set_trainable

VOCAB = 50
CHUNKS = (1, 4, 7, 100)  # none divides the 13 predicted positions below
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _recattn(seed: int, **config: object) -> RecAttnForCausalLM:
    torch.manual_seed(seed)
    return RecAttnForCausalLM(RecAttnConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
        attention={"mixer": "linear", "feature_map": "hedgehog"}, **config,
    ))


def test_final_logits_are_each_models_own() -> None:
    """The LM head with the config's scaling and soft-cap, as each family's forward applies them."""
    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    models = [
        _recattn(0, logits_scaling=3.0, final_logit_softcapping=2.0),
        tiny_teacher(VOCAB),
        GraniteForCausalLM(GraniteConfig(**small, logits_scaling=4.0)),
        Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=1.5)),
    ]
    ids = torch.randint(1, VOCAB, (2, 6))
    for model in models:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            hidden = model.get_decoder()(ids).last_hidden_state
            assert torch.equal(final_logits(model, hidden), out.logits), type(model).__name__


def _case(weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return loss_case(weighted, VOCAB)


@pytest.mark.parametrize("loss", ["ce", "kl", "ce+kl"])
@pytest.mark.parametrize(("temperature", "weighted"), [(1.0, False), (2.5, True)])
def test_chunked_loss_equals_the_whole_logits_loss(loss: str, temperature: float, weighted: bool) -> None:
    """Value and gradients (w.r.t. the hidden states and the LM head's weight) match the loss over the full logits
    for chunk sizes that do not divide the positions, with the scaling and soft-cap in the heads."""
    student = _recattn(0, logits_scaling=1.5, final_logit_softcapping=4.0)
    teacher = _recattn(1, final_logit_softcapping=3.0)
    hidden, teacher_hidden, labels, weights = _case(weighted)

    def run(chunk: int | None) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        student.zero_grad()
        h = hidden.clone().requires_grad_()
        if chunk is None:
            with torch.no_grad():
                teacher_logits = final_logits(teacher, teacher_hidden)
            total, count = distill_loss_sum(final_logits(student, h), labels, teacher_logits, loss, temperature, 0.7,
                                            weights)
        else:
            total, count = chunked_loss_sum(partial(final_logits, student), h, labels, chunk,
                                            partial(final_logits, teacher), teacher_hidden, loss, temperature, 0.7,
                                            weights)
        total.backward()
        return total.detach(), count, h.grad, student.lm_head.weight.grad.clone()

    want = run(None)
    assert want[1] == 13
    for chunk in CHUNKS:
        got = run(chunk)
        assert got[1] == want[1]
        for a, b in zip((got[0], *got[2:]), (want[0], *want[2:]), strict=True):
            torch.testing.assert_close(a, b, **TOLERANCE, msg=f"chunk {chunk}")
    assert all(p.grad is None for p in teacher.parameters())


def test_nothing_predicted_is_a_zero_in_the_graph() -> None:
    student = _recattn(0)
    hidden = torch.randn(1, 4, 32, requires_grad=True)
    total, count = chunked_loss_sum(partial(final_logits, student), hidden, torch.full((1, 4), -100), 3)
    total.backward()
    assert (float(total.detach()), count) == (0.0, 0) and torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_a_negative_chunk_size_is_refused_before_any_work(tmp_path: Path) -> None:
    """A recipe's 0 is an explicit off (the whole block's logits); a trainer takes positive sizes or None."""
    Stage2Settings(loss_chunk_size=0).check("recipe.yaml")
    with pytest.raises(ValueError, match=r"recipe.yaml: stage2.loss_chunk_size must be >= 0, got -1"):
        Stage2Settings(loss_chunk_size=-1).check("recipe.yaml")
    with pytest.raises(ValueError, match=r"s: stage2.loss_chunk_size must be >= 0, got -4"):
        DistillSettings(loss_chunk_size=-4).check("s", "stage2")
    args = training_arguments(DistillSettings(tokens=64, block_size=8, batch_size=1), tmp_path, 0, 1, False)
    for trainer in (CausalLMTrainer, DistillTrainer):
        with pytest.raises(ValueError, match="loss_chunk_size must be a positive number of tokens, got 0"):
            trainer(model=_recattn(0), args=args, loss_chunk_size=0)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        chunked_loss_sum(partial(final_logits, _recattn(0)), torch.zeros(1, 2, 32), torch.zeros(1, 2).long(), 0)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(got[0], want[0], **TOLERANCE)
    assert got[1].keys() == want[1].keys() and got[1]
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **TOLERANCE, msg=name)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("loss", ["ce", "ce+kl"])
def test_stage2_trainer_chunked_equals_whole(tmp_path: Path, loss: str) -> None:
    """DistillTrainer's loss and the LoRA gradients, through peft, with padding and per-token weights."""
    teacher = tiny_teacher(VOCAB)
    torch.manual_seed(0)
    student = set_trainable(from_teacher(teacher, {"mixer": "linear", "feature_map": "hedgehog"}), "lora",
                            LoraSettings(r=4, alpha=8, targets=("q_proj", "v_proj", "lm_head")), False, "stage2")
    with torch.no_grad():  # non-zero B so that both LoRA factors get gradients
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    blocks = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(blocks)
    mask[1, 6:] = 0
    data = BlockDataset(blocks, mask, weights=torch.rand(2, 11, generator=torch.Generator().manual_seed(2)) * 3)
    inputs = default_data_collator([data[0], data[1]])
    args = training_arguments(DistillSettings(tokens=64, block_size=11, batch_size=2), tmp_path, 0, 1, False)

    def run(chunk: int | None) -> tuple[torch.Tensor, dict]:
        trainer = DistillTrainer(model=student, args=args, teacher=teacher, loss=loss, temperature=2.0,
                                 kl_weight=0.5, loss_chunk_size=chunk)
        student.zero_grad()
        value = trainer.compute_loss(student, inputs, num_items_in_batch=torch.tensor(15))
        value.backward()
        return value.detach(), _gradients(student)

    want = run(None)
    assert any("lm_head" in n for n in want[1])
    for chunk in (1, 6, 64):
        _assert_same(run(chunk), want)


def test_causal_lm_trainer_chunked_equals_the_models_own_loss(tmp_path: Path) -> None:
    """Pretraining / finetuning: the chunked cross-entropy equals the model's loss (divided by Trainer's count of
    tokens, or their mean without one), with its gradients, for a plain and a LoRA model."""
    model = _recattn(0, logits_scaling=2.0, final_logit_softcapping=5.0)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :4] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    args = training_arguments(DistillSettings(tokens=64, block_size=10, batch_size=2), tmp_path, 0, 1, False)
    lora = set_trainable(_recattn(0), "lora", LoraSettings(r=4, alpha=8), False, "finetune")
    for net in (model, lora):
        for items in (None, torch.tensor(13)):
            def run(chunk: int | None, net: torch.nn.Module = net, items: torch.Tensor | None = items) -> tuple:
                trainer = CausalLMTrainer(model=net, args=args, loss_chunk_size=chunk)
                net.zero_grad()
                value = trainer.compute_loss(net, dict(inputs), num_items_in_batch=items)
                value.backward()
                return value.detach(), _gradients(net)

            want = run(None)
            for chunk in (3, 7, 40):
                _assert_same(run(chunk), want)
