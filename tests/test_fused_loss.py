"""The loss on Liger Kernel's fused linear + loss ops (``training/fused_loss.py``) and the ``loss_kernel`` choice.

Liger's Triton kernels run here on the CPU through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` without
a GPU; on a GPU these tests run them on CUDA). Tolerance: loss and gradients (w.r.t. the hidden states, the LM
head's weight and bias, and through a trainer every weight of a model) within ``rtol=1e-5`` plus 1e-5 of the
largest magnitude of the torch form's, in float32, where the two differ by summation order and the folded
``logits_scaling`` only (measured here: at most 8e-7 of the largest magnitude at the head, 1.1e-6 deep in a model).
The soft-capped cross-entropy is out of the interpreter's reach (the kernel calls ``.to`` on the ``softcap``
float, which the interpreter passes as a Python float): its mapping is checked with a stand-in for the op here and
its values by ``scripts/check_fused_loss.py`` on a GPU.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from distill_fixtures import loss_case, tiny_recipe_dict, tiny_teacher, tiny_texts, tiny_tokenizer
from script_modules import load_script
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    default_data_collator,
)

from hf_recattn import RecAttnConfig, RecAttnForCausalLM, from_teacher
from hf_recattn.conversion.recipe import check_against_teacher, recipe_from_dict
from hf_recattn.conversion.settings import Stage2Settings
from hf_recattn.data.corpus import token_blocks
from hf_recattn.training import fused_loss
from hf_recattn.training.distill import BlockDataset, DistillTrainer, finetune, training_arguments
from hf_recattn.training.distill_loss import distill_loss_sum
from hf_recattn.training.distill_settings import DistillSettings
from hf_recattn.training.fused_loss import fused_loss_sum, use_liger
from hf_recattn.training.lm_outputs import final_logits, linear_head
from hf_recattn.training.run_config import loss_kernel
from hf_recattn.training.runner import CausalLMTrainer
from hf_recattn.training.trainable import LoraSettings, set_trainable

VOCAB = 50
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL, SCALE = 1e-5, 1e-5
#: the interpreter's JSD kernel subtracts -inf from -inf in its masked lanes (values it never stores)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _recattn(seed: int, **config: object) -> RecAttnForCausalLM:
    torch.manual_seed(seed)
    return RecAttnForCausalLM(RecAttnConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
        attention={"mixer": "linear", "feature_map": "hedgehog"}, **config,
    ))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = SCALE * float(want.abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL, atol=atol, msg=what)


def _case(weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return tuple(None if t is None else t.to(DEVICE) for t in loss_case(weighted, VOCAB))


def _run(student: torch.nn.Module, teacher: torch.nn.Module, fused: bool, loss: str, temperature: float,
         weighted: bool) -> list[torch.Tensor]:
    """Loss, its count and the gradients of the hidden states and the student's LM head (weight, bias if any)."""
    hidden, teacher_hidden, labels, weights = _case(weighted)
    student.zero_grad()
    h = hidden.clone().requires_grad_()
    if fused:
        total, count = fused_loss_sum(student, h, labels, teacher, teacher_hidden, loss, temperature, 0.7, weights)
    else:
        with torch.no_grad():
            teacher_logits = None if teacher is None else final_logits(teacher, teacher_hidden)
        total, count = distill_loss_sum(final_logits(student, h), labels, teacher_logits, loss, temperature, 0.7,
                                        weights)
    total.backward()
    head = student.lm_head
    extra = [] if head.bias is None else [head.bias.grad.clone()]
    return [total.detach(), torch.tensor(count), h.grad, head.weight.grad.clone(), *extra]


@pytest.mark.parametrize("loss", ["ce", "kl", "ce+kl"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_liger_loss_equals_the_whole_logits_loss(loss: str, temperature: float) -> None:
    """Value and gradients equal ``distill_loss_sum`` over the full logits, masked positions left out, with the
    student's ``logits_scaling`` folded into its hidden states."""
    pytest.importorskip("liger_kernel")
    student, teacher = _recattn(0, logits_scaling=1.5).to(DEVICE), _recattn(1, logits_scaling=0.8).to(DEVICE)
    assert use_liger("liger", "loss_kernel", student, teacher, loss)
    want = _run(student, teacher, False, loss, temperature, False)
    got = _run(student, teacher, True, loss, temperature, False)
    assert int(got[1]) == int(want[1]) == 13
    for name, a, b in zip(("loss", "count", "hidden", "weight"), got, want, strict=True):
        _close(a, b, f"{loss} T={temperature}: {name}")
    assert all(p.grad is None for p in teacher.parameters())


def test_liger_cross_entropy_takes_weights_and_a_bias() -> None:
    """Per-position weights (Liger's per-position losses) and an LM-head bias, scaled with the hidden states."""
    pytest.importorskip("liger_kernel")
    student = _recattn(0, logits_scaling=1.5)
    student.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.1)
    student.to(DEVICE)
    want = _run(student, None, False, "ce", 1.0, True)
    got = _run(student, None, True, "ce", 1.0, True)
    for name, a, b in zip(("loss", "count", "hidden", "weight", "bias"), got, want, strict=True):
        _close(a, b, name)


def test_the_linear_head_is_each_models_final_logits() -> None:
    """``softcap(inputs(h) @ W^T + scaled_bias())`` is ``final_logits(h)``: the scaling folded into the hidden states
    and the bias; no ``LinearHead`` for a LoRA-wrapped or sharded head."""
    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    biased = _recattn(0, logits_scaling=3.0, final_logit_softcapping=2.0)
    biased.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB))
    models = [biased, GraniteForCausalLM(GraniteConfig(**small, logits_scaling=4.0)),
              Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=1.5)), tiny_teacher(VOCAB)]
    for model in models:
        head = linear_head(model)
        hidden = torch.randn(5, model.config.hidden_size)
        logits = torch.nn.functional.linear(head.inputs(hidden), head.weight, head.scaled_bias())
        if head.softcap is not None:
            logits = head.softcap * torch.tanh(logits / head.softcap)
        torch.testing.assert_close(logits, final_logits(model, hidden), rtol=1e-6, atol=1e-6)
    sharded = _recattn(0)
    sharded.lm_head.weight = torch.nn.Parameter(sharded.lm_head.weight[:10].clone())
    assert linear_head(sharded) is None


def test_nothing_predicted_is_a_zero_in_the_graph() -> None:
    student = _recattn(0)
    hidden = torch.randn(1, 4, 32, requires_grad=True)
    total, count = fused_loss_sum(student, hidden, torch.full((1, 4), -100))
    total.backward()
    assert (float(total.detach()), count) == (0.0, 0) and torch.equal(hidden.grad, torch.zeros_like(hidden))


# ----- the ops' arguments, with a stand-in for liger_kernel -------------------------------------------------
class _Recorded:
    """A stand-in for a Liger loss module: records its settings and inputs, returns a fixed value."""

    calls: list[tuple[str, dict, tuple]] = []

    def __init__(self, **settings: object) -> None:
        self.settings = settings

    def __call__(self, *args: object) -> torch.Tensor:
        type(self).calls.append((type(self).__name__, self.settings, args))
        rows = args[1] if "CrossEntropy" in type(self).__name__ else args[0]  # (weight, input, ...) / (input, ...)
        return torch.full((rows.shape[0],), 2.0) if self.settings.get("reduction") == "none" else torch.tensor(3.0)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict, tuple]]:
    module = types.ModuleType("liger_kernel.transformers")
    module.LigerFusedLinearCrossEntropyLoss = type("LigerFusedLinearCrossEntropyLoss", (_Recorded,), {})
    module.LigerFusedLinearJSD = type("LigerFusedLinearJSD", (_Recorded,), {})
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    monkeypatch.setattr(_Recorded, "calls", [])
    return _Recorded.calls


def test_the_ops_get_the_soft_cap_bias_scaling_beta_and_temperature(recorded: list) -> None:
    """``ce``: the soft-cap, the bias and hidden states divided by ``logits_scaling``, a sum; weighted: per position.
    ``kl``: forward KL (``jsd_beta=0``) at the temperature, the teacher's rows detached, the mean times count * T^2."""
    student = _recattn(0, logits_scaling=2.0, final_logit_softcapping=30.0)
    student.lm_head.bias = torch.nn.Parameter(torch.ones(VOCAB))
    teacher = _recattn(1, logits_scaling=4.0)
    hidden, teacher_hidden, labels, weights = (t.cpu() for t in _case(True))
    total, count = fused_loss_sum(student, hidden, labels, shift_weights=weights)
    (name, settings, (weight, rows, targets, bias)), = recorded
    mask = labels != -100
    assert (name, settings) == ("LigerFusedLinearCrossEntropyLoss", {"reduction": "none", "softcap": 30.0})
    assert weight is student.lm_head.weight and torch.equal(bias, torch.full((VOCAB,), 0.5))
    assert torch.equal(rows, hidden[mask] / 2.0) and torch.equal(targets, labels[mask])
    assert count == 13 and torch.allclose(total, 2.0 * weights[mask].sum())
    recorded.clear()
    plain = _recattn(0)
    total, count = fused_loss_sum(plain, hidden, labels, teacher, teacher_hidden, "ce+kl", 2.0, 0.7)
    (ce_name, ce_settings, _), (kl_name, kl_settings, kl_args) = recorded
    assert (ce_name, ce_settings) == ("LigerFusedLinearCrossEntropyLoss", {"reduction": "sum", "softcap": None})
    assert (kl_name, kl_settings) == ("LigerFusedLinearJSD", {"jsd_beta": 0.0, "temperature": 2.0})
    rows, weight, teacher_rows, teacher_weight, no_labels = kl_args
    assert weight is plain.lm_head.weight and teacher_weight is teacher.lm_head.weight and no_labels is None
    assert torch.equal(rows, hidden[mask]) and torch.equal(teacher_rows, teacher_hidden[mask] / 4.0)
    assert not teacher_rows.requires_grad
    assert torch.allclose(total, torch.tensor(3.0 + 0.7 * 3.0 * 13 * 2.0 * 2.0))


# ----- which form runs --------------------------------------------------------------------------------------
def test_auto_runs_torch_on_the_cpu_and_torch_never_liger() -> None:
    student, teacher = _recattn(0), _recattn(1)
    for loss in ("ce", "kl", "ce+kl"):
        assert not use_liger("auto", "loss_kernel", student, teacher, loss)  # CPU, even under the interpreter
        assert not use_liger("torch", "loss_kernel", student, teacher, loss)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_auto_runs_liger_where_it_runs_and_takes_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CUDA device with liger-kernel: every loss of plain heads; the torch form for a soft-capped or
    biased KL, per-position weights in the KL, an LM head wrapped by LoRA."""
    monkeypatch.setattr(fused_loss, "_unavailable", lambda choice, device: None)
    student, teacher = _recattn(0), _recattn(1)
    for loss in ("ce", "kl", "ce+kl"):
        assert use_liger("auto", "loss_kernel", student, teacher, loss)
    assert use_liger("auto", "loss_kernel", student, teacher, "ce", weighted=True)
    assert not use_liger("auto", "loss_kernel", student, teacher, "kl", weighted=True)
    capped = _recattn(1, final_logit_softcapping=30.0)
    assert use_liger("auto", "loss_kernel", capped, None, "ce")
    assert not use_liger("auto", "loss_kernel", student, capped, "ce+kl")
    biased = _recattn(0)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    assert use_liger("auto", "loss_kernel", biased, None, "ce")
    assert not use_liger("auto", "loss_kernel", biased, teacher, "kl")
    lora = set_trainable(_recattn(0), "lora", LoraSettings(r=2, alpha=4, targets=("q_proj", "lm_head")), False, "x")
    assert not use_liger("auto", "loss_kernel", lora.get_base_model(), None, "ce")
    assert not use_liger("auto", "loss_kernel", _recattn(0).double(), None, "ce")


def test_liger_where_it_cannot_run_is_one_error_naming_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_loss, "liger_installed", lambda: True)
    student, capped = _recattn(0), _recattn(1, final_logit_softcapping=30.0)
    for case, says in (((student, capped, "kl"), "no final_logit_softcapping (the teacher's is 30)"),
                       ((student, student, "ce+kl", True), "takes no per-position weights"),
                       ((_recattn(0).double(), None, "ce"), "LM head is torch.float64")):
        with pytest.raises(ValueError, match=r"stage2\.loss_kernel: liger cannot compute this loss: .*") as info:
            use_liger("liger", "stage2.loss_kernel", *case)
        assert says in str(info.value) and str(info.value).endswith("; use auto or torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="loss_kernel: liger cannot compute this loss: the model is on cpu"):
        use_liger("liger", "loss_kernel", _recattn(0).float())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"x.yaml: loss_kernel: liger needs a CUDA device \(or TRITON_INTERPRET"):
            loss_kernel("liger", "x.yaml")
    monkeypatch.setattr(fused_loss, "liger_installed", lambda: False)
    monkeypatch.setattr(fused_loss, "_interpreted", lambda: True)
    with pytest.raises(ValueError, match=r'^x.yaml: loss_kernel: liger needs the fused extra: pip install '
                                         r'"hf-recattn\[fused\]"$'):
        loss_kernel("liger", "x.yaml")
    with pytest.raises(ValueError, match="liger-kernel is not installed"):
        use_liger("liger", "loss_kernel", _recattn(0))


def test_the_option_in_recipes_and_training_yamls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or ``auto``: the fingerprint of old; a value out of the three refused by name; ``liger`` refused at
    load where its KL would need per-position weights, and against a teacher that soft-caps or a LoRA LM head."""
    monkeypatch.setattr(fused_loss, "liger_installed", lambda: True)
    monkeypatch.setattr(fused_loss, "_interpreted", lambda: True)
    base = recipe_from_dict(tiny_recipe_dict())
    assert base.stage2.loss_kernel is None
    assert recipe_from_dict(tiny_recipe_dict(stage2={"loss_kernel": "auto"})).fingerprint() == base.fingerprint()
    for choice in ("torch", "liger"):
        assert recipe_from_dict(tiny_recipe_dict(stage2={"loss_kernel": choice})).fingerprint() != base.fingerprint()
    assert (loss_kernel(None, "p.yaml"), loss_kernel("torch", "p.yaml")) == ("auto", "torch")
    for check in (lambda: loss_kernel("fast", "p.yaml"),
                  lambda: Stage2Settings(loss_kernel="fast").check("r.yaml")):
        with pytest.raises(ValueError, match=r"loss_kernel must be one of \['auto', 'torch', 'liger'\], got 'fast'"):
            check()
    weighted = dict(loss_kernel="liger", loss="ce+kl", retrieval_share=0.5)
    with pytest.raises(ValueError, match=r"r.yaml: stage2.loss_kernel: liger cannot compute this loss: .* no "
                                         r"per-position weights \(stage2.retrieval_share sets them\)"):
        Stage2Settings(**weighted).check("r.yaml")
    Stage2Settings(**{**weighted, "loss": "ce"}).check("r.yaml")
    gemma = Gemma2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0,
                         attn_logit_softcapping=None)
    capped_kl = recipe_from_dict(tiny_recipe_dict(stage2={"loss_kernel": "liger", "loss": "kl"}))
    with pytest.raises(ValueError, match=r"stage2.loss_kernel: liger .* no final_logit_softcapping"):
        check_against_teacher(capped_kl, gemma)
    check_against_teacher(recipe_from_dict(tiny_recipe_dict(stage2={"loss_kernel": "liger", "loss": "ce"})), gemma)
    head = tiny_recipe_dict(stage2={"loss_kernel": "liger", "loss": "ce"})
    head["stage2"]["lora"] = {"r": 4, "alpha": 8, "targets": ["q_proj", "lm_head"]}
    with pytest.raises(ValueError, match=r"stage2.loss_kernel: liger .* LM head is not a plain nn.Linear"):
        check_against_teacher(recipe_from_dict(head), gemma)


# ----- the trainers -----------------------------------------------------------------------------------------
def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_trainers_on_liger_equal_torch(tmp_path: Path) -> None:
    """DistillTrainer (every weight trains, ce+kl at T=2, padding) and CausalLMTrainer (the model's own loss):
    the loss and every gradient as on the torch forms."""
    pytest.importorskip("liger_kernel")
    teacher = tiny_teacher(VOCAB).to(DEVICE)
    torch.manual_seed(0)
    student = from_teacher(teacher, {"mixer": "linear", "feature_map": "hedgehog"}).to(DEVICE)
    blocks = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(blocks)
    mask[1, 6:] = 0
    inputs = {k: v.to(DEVICE) for k, v in default_data_collator([*BlockDataset(blocks, mask)]).items()}
    args = training_arguments(DistillSettings(tokens=64, block_size=11, batch_size=2), tmp_path, 0, 1, False)

    def run(kernel: str, distill: bool) -> tuple[torch.Tensor, dict]:
        if distill:
            trainer = DistillTrainer(model=student, args=args, teacher=teacher, loss="ce+kl", temperature=2.0,
                                     kl_weight=0.5, loss_kernel=kernel)
        else:
            trainer = CausalLMTrainer(model=student, args=args, loss_kernel=kernel)
        assert trainer.uses_liger(student) == (kernel == "liger")
        student.zero_grad()
        value = trainer.compute_loss(student, dict(inputs), num_items_in_batch=torch.tensor(15))
        value.backward()
        return value.detach(), _gradients(student)

    for distill in (True, False):
        (got, got_grads), (want, want_grads) = run("liger", distill), run("torch", distill)
        _close(got, want, "loss")
        assert got_grads.keys() == want_grads.keys() and any("embed" in n for n in want_grads)
        for name, grad in want_grads.items():
            _close(got_grads[name], grad, name)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_stage2_on_liger_trains_as_on_torch(tmp_path: Path) -> None:
    """A whole stage-2 finetune (every weight, ce+kl) with ``loss_kernel: liger`` makes the torch run's steps."""
    pytest.importorskip("liger_kernel")
    tokenizer = tiny_tokenizer()
    teacher, blocks = tiny_teacher(len(tokenizer)), token_blocks(tokenizer, tiny_texts(), 16)
    trained = {}
    for kernel in ("torch", "liger"):
        torch.manual_seed(0)
        settings = DistillSettings(tokens=3 * 2 * 16, lr=1e-3, block_size=16, batch_size=2, loss="ce+kl",
                                   temperature=2.0, warmup_fraction=0.0, method="full", loss_kernel=kernel)
        trained[kernel] = finetune(teacher, from_teacher(teacher, {"mixer": "linear", "feature_map": "hedgehog"}),
                                   blocks, settings, tmp_path / kernel, progress=False)
    (plain, plain_result), (fused, fused_result) = trained["torch"], trained["liger"]
    assert fused_result.steps == plain_result.steps == 3
    assert fused_result.final_loss == pytest.approx(plain_result.final_loss, rel=1e-5)
    for (name, a), b in zip(plain.state_dict().items(), fused.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_a_lora_head_under_liger_is_refused_by_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("liger_kernel")
    student = set_trainable(_recattn(0), "lora", LoraSettings(r=2, alpha=4, targets=("lm_head",)), False, "x")
    args = training_arguments(DistillSettings(tokens=64, block_size=8, batch_size=1), tmp_path, 0, 1, False)
    trainer = DistillTrainer(model=student, args=args, loss_kernel="liger")
    inputs = default_data_collator([BlockDataset(torch.randint(1, VOCAB, (1, 8)))[0]])
    with pytest.raises(ValueError, match=r"^stage2.loss_kernel: liger cannot compute this loss: the student's LM "
                                         r"head is not a plain nn.Linear"):
        trainer.compute_loss(student, inputs)


def test_the_gpu_check_script_runs_in_the_interpreter(capsys: pytest.CaptureFixture) -> None:
    """``scripts/check_fused_loss.py`` (the hardware check) at a tiny shape on the CPU: every case passes."""
    pytest.importorskip("liger_kernel")
    script = load_script("scripts", "check_fused_loss")
    assert script.main(["--device", DEVICE, "--shapes", "16,8,20", "--dtypes", "float32"]) == 0
    assert "all cases pass" in capsys.readouterr().out
