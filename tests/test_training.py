"""hf_recattn.training: pretrain / finetune with Trainer on tiny models and tiny local data.

Tolerances: a resumed run against an uninterrupted one and a merged LoRA checkpoint loaded without the package
against the same checkpoint loaded here: 1e-6 / 1e-5 (same arithmetic, maybe other threads); one SGD step on 2
processes x 2 examples against 1 process x 4 examples: 1e-5 (gradients summed in another order).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from distill_fixtures import tiny_texts, tiny_tokenizer
from isolated import HIDE_HF_RECATTN
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from hf_recattn.cli import main
from hf_recattn.training import finetune, pretrain
from hf_recattn.training.data import assistant_spans, chat_example, pack_documents, packed_blocks

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: the same rendering with the assistant turns marked for transformers' return_assistant_tokens_mask
CHATML_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128,
    "attention": {"mixer": "linear", "feature_map": "hedgehog"},
    "attention_overrides": {"0": {"mixer": "sliding_window", "window": 8}},
}
QUIET = {"disable_tqdm": True, "logging_steps": 1, "report_to": "none"}


_NOUNS = "cat mat river mill birds hills gold light summer water".split()


def _conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"where does the river run {_NOUNS[i]}?"},
        {"role": "assistant", "content": "the river runs past the old mill."},
        {"role": "user", "content": "and the birds?"},
        {"role": "assistant", "content": f"birds sing in green hedges {_NOUNS[i]}."},
    ]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("training")
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tokenizer")
    texts = tiny_texts(12)
    return {
        "root": root,
        "tokenizer": root / "tokenizer",
        "docs": _jsonl(root / "docs.jsonl", [{"text": t} for t in texts * 3]),  # repeated: loss must fall
        "chat": _jsonl(root / "chat.jsonl", [{"messages": _conversation(i)} for i in range(10)]),
    }


def _pretrain_config(files: dict[str, Path], out: Path, **training: Any) -> dict[str, Any]:
    return {
        "model": dict(MODEL),
        "tokenizer": str(files["tokenizer"]),
        "data": {"source": str(files["docs"]), "eval_fraction": 0.1, "cache_dir": str(files["root"] / "hf")},
        "block_size": 32,
        "training": {"output_dir": str(out), "max_steps": 8, "per_device_train_batch_size": 4,
                     "learning_rate": 1e-2, "warmup_steps": 0, "save_steps": 4, "eval_steps": 4, **QUIET,
                     **training},
    }


def _write_yaml(path: Path, value: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(value, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def pretrained(files: dict[str, Path]) -> Any:
    """One pretraining run from a YAML file (its result also serves as the checkpoint to finetune)."""
    config = _write_yaml(files["root"] / "pretrain.yaml", _pretrain_config(files, files["root"] / "pre"))
    return pretrain(config)


# ----- pretraining ------------------------------------------------------------------------------------------
def test_pretrain_from_yaml_learns_logs_perplexity_and_saves(pretrained: Any) -> None:
    losses = [row["loss"] for row in pretrained.log_history if "loss" in row]
    assert len(losses) == 8 and pretrained.global_step == 8
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # repeated data: a few steps visibly learn
    evals = [row for row in pretrained.log_history if "eval_loss" in row]
    assert [row["step"] for row in evals] == [4, 8]
    for row in evals:
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]), rel=1e-9)
    model = AutoModelForCausalLM.from_pretrained(pretrained.model_dir)
    mixers = [type(layer.self_attn.mixer).__name__ for layer in model.model.layers]
    assert mixers == ["SlidingWindowMixer", "LinearMixer"]
    tokenizer = AutoTokenizer.from_pretrained(pretrained.model_dir)
    # window + linear layers need no positions (tests/test_length_limit.py): the tokenizer says "unbounded"
    assert tokenizer.model_max_length == VERY_LARGE_INTEGER and model.config.vocab_size == len(tokenizer)
    assert not any(p.name.startswith(".tmp-") for p in pretrained.model_dir.parent.iterdir())


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def test_rerun_resumes_at_the_last_checkpoint(files: dict[str, Path], tmp_path: Path) -> None:
    whole = pretrain(_pretrain_config(files, tmp_path / "whole", max_steps=4, save_steps=2, eval_strategy="no"))
    config = _pretrain_config(files, tmp_path / "split", max_steps=4, save_steps=2, eval_strategy="no")
    first = pretrain(config, callbacks=[_StopAt(3)])  # "interrupted" after step 3: checkpoint-2 is the last
    assert first.global_step == 3 and (tmp_path / "split" / "checkpoint-2").is_dir()
    second = pretrain(config)
    assert second.resumed_from == 2 and second.global_step == 4
    assert [row["step"] for row in second.log_history if "loss" in row][-2:] == [3, 4]
    a = load_file(str(whole.model_dir / "model.safetensors"))
    b = load_file(str(second.model_dir / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


# ----- the data pipeline ------------------------------------------------------------------------------------
def test_pack_documents_restarts_positions_and_masks_first_tokens() -> None:
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    blocks = pack_documents(docs, 4)
    assert blocks["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # [9, 10] does not fill a block: dropped
    assert blocks["position_ids"] == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert blocks["labels"] == [[-100, 2, 3, -100], [-100, 6, 7, 8]]


def test_packed_blocks_through_datasets_map(files: dict[str, Path]) -> None:
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(files["tokenizer"])
    texts = tiny_texts(5)
    packed = packed_blocks(datasets.Dataset.from_dict({"text": texts}), tokenizer, "text", 16, None)
    stream = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]
              + [tokenizer.eos_token_id]]
    starts, position = set(), 0
    for text in texts:
        starts.add(position)
        position += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
    assert len(packed) == len(stream) // 16
    for b, row in enumerate(packed):
        assert row["input_ids"] == stream[16 * b : 16 * (b + 1)]
        for t in range(16):
            first = t == 0 or (16 * b + t) in starts
            assert row["labels"][t] == (-100 if first else row["input_ids"][t])
            expect = 0 if first else row["position_ids"][t - 1] + 1
            assert row["position_ids"][t] == expect


def test_chat_labels_are_the_assistant_tokens(files: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(files["tokenizer"])
    messages = _conversation(7)
    example = chat_example(tokenizer, messages, 1000)
    ids, labels = example["input_ids"], example["labels"]
    assert ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False),
                            add_special_tokens=False)["input_ids"]
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        assert label in (-100, token)
        if label == token:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    assert runs == ["the river runs past the old mill.<|im_end|>", "birds sing in green hedges light.<|im_end|>"]
    # transformers' own {% generation %} masks, with a template that renders the same text: token by token
    tagged = AutoTokenizer.from_pretrained(files["tokenizer"])
    tagged.chat_template = CHATML_GENERATION
    assert tagged.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False)
    assert chat_example(tagged, messages, 1000) == example
    assert chat_example(tokenizer, messages, 20)["labels"] == labels[:20]


def test_the_embedded_template_has_no_generation_tags_and_prefixes_render_as_prefixes(
        files: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(files["tokenizer"])
    text, spans = assistant_spans(tokenizer, _conversation(1))
    assert [text[a:b] for a, b in spans] == ["the river runs past the old mill.<|im_end|>",
                                             "birds sing in green hedges mat.<|im_end|>"]


# ----- finetuning -------------------------------------------------------------------------------------------
def _finetune_yaml(path: Path, **values: Any) -> Path:
    base = {"block_size": 128, "data": {"eval_fraction": 0.2, "cache_dir": str(path.parent / "hf")},
            "training": {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 2e-2,
                         "save_steps": 100, **QUIET}}
    for key, value in values.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return _write_yaml(path, base)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_finetune_plain_text_full(pretrained: Any, files: dict[str, Path], tmp_path: Path) -> None:
    config = _finetune_yaml(tmp_path / "ft.yaml", method="full", block_size=32)
    result = finetune(str(pretrained.model_dir), str(files["docs"]), config, output_dir=str(tmp_path / "out"))
    assert result.global_step == 3 and "eval_perplexity" in result.eval_metrics
    before, after = _weights(pretrained.model_dir), _weights(result.model_dir)
    assert all(not torch.equal(before[k], after[k]) for k in before if "embed" in k or "mlp" in k)


def test_finetune_mixers_only(pretrained: Any, files: dict[str, Path], tmp_path: Path) -> None:
    config = _finetune_yaml(tmp_path / "ft.yaml", method="mixers", block_size=32)
    result = finetune(str(pretrained.model_dir), str(files["docs"]), config, output_dir=str(tmp_path / "out"))
    before, after = _weights(pretrained.model_dir), _weights(result.model_dir)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".mixer." in k for k in changed), sorted(changed)
    assert any(".mixer." in k for k in changed)


CHILD = HIDE_HF_RECATTN + textwrap.dedent(
    r"""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ckpt, io = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(load_file(f"{io}/ids.safetensors")["ids"]).logits
    save_file({"logits": logits.contiguous()}, f"{io}/logits.safetensors")
    print(json.dumps({"loaded": sorted(m for m in sys.modules if m.split(".")[0] == "hf_recattn")}))
    """
)


def test_lora_chat_merged_loads_with_and_without_the_package(
        pretrained: Any, files: dict[str, Path], tmp_path: Path) -> None:
    config = _finetune_yaml(tmp_path / "ft.yaml", method="lora", lora={"r": 4, "alpha": 8,
                            "target_modules": ["q_proj", "v_proj", "down_proj"]})
    result = finetune(str(pretrained.model_dir), str(files["chat"]), config, output_dir=str(tmp_path / "out"))
    assert result.global_step == 3
    before, after = _weights(pretrained.model_dir), _weights(result.model_dir)
    assert not any("lora" in k for k in after) and before.keys() == after.keys()
    changed = {k.split(".")[-2] for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"q_proj", "v_proj", "down_proj"}
    model = AutoModelForCausalLM.from_pretrained(result.model_dir).eval()  # with the package
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-I", "-c", CHILD, str(result.model_dir), str(tmp_path)],
                          cwd=tmp_path / "empty", env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["loaded"] == []
    got = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    assert (got - want).abs().max() <= 1e-5


def test_lora_chunked_loss_and_gradient_checkpointing_make_the_same_steps(
        pretrained: Any, files: dict[str, Path], tmp_path: Path) -> None:
    """``loss_chunk_size`` and ``training.activation_checkpointing`` change the memory a LoRA finetune needs, not
    its steps (up to floating-point rounding)."""
    sgd = {"optim": "sgd", "lr_scheduler_type": "constant", "warmup_steps": 0}
    runs = {}
    lean = {"loss_chunk_size": 7, "training": {"activation_checkpointing": True}}
    for name, values in {"plain": {}, "lean": lean}.items():
        values = {**values, "training": {**sgd, **values.get("training", {})}}
        config = _finetune_yaml(tmp_path / f"{name}.yaml", method="lora", lora={"r": 4, "alpha": 8}, **values)
        runs[name] = finetune(str(pretrained.model_dir), str(files["chat"]), config, output_dir=str(tmp_path / name))
    losses = {name: [row["loss"] for row in run.log_history if "loss" in row] for name, run in runs.items()}
    assert losses["lean"] == pytest.approx(losses["plain"], rel=1e-5) and len(losses["plain"]) == 3
    assert runs["lean"].eval_metrics["eval_loss"] == pytest.approx(runs["plain"].eval_metrics["eval_loss"], rel=1e-5)
    plain, lean = _weights(runs["plain"].model_dir), _weights(runs["lean"].model_dir)
    for key, value in plain.items():
        torch.testing.assert_close(lean[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(value, _weights(pretrained.model_dir)[key]) for key, value in plain.items())


# ----- bad input, refused before training ------------------------------------------------------------------
def _bad_pretrain(files: dict[str, Path], out: Path, case: str) -> dict[str, Any]:
    config = _pretrain_config(files, out)
    if case == "training key":
        config["training"]["learnig_rate"] = 1e-3
    elif case == "model key":
        config["model"]["hiden_size"] = 64
    elif case == "section":
        config["trainig"] = {}
    elif case == "missing file":
        config["data"]["source"] = str(files["root"] / "nope.jsonl")
    elif case == "no text column":
        config["data"]["source"] = str(files["chat"])
    elif case == "block size":  # a softmax layer needs positions: the blocks must fit max_position_embeddings
        config["block_size"] = 512
        config["model"]["attention_overrides"] = {"0": {"mixer": "softmax"}}
    elif case == "data key":
        config["data"]["text_colum"] = "body"
    elif case == "chunk size":
        config["loss_chunk_size"] = 0
    return config


BAD_PRETRAIN = {
    "training key": "training: learnig_rate: not a TrainingArguments field (did you mean learning_rate",
    "model key": "model: hiden_size: not a RecAttnConfig field (did you mean hidden_size",
    "section": "trainig: not a known section (did you mean training",
    "missing file": "data.source: {root}/nope.jsonl: no such file",
    "no text column": "data.text_column: {root}/chat.jsonl has no column 'text' (columns: ['messages'])",
    "block size": "block_size 512 is above the model's max_position_embeddings 128 (layer 0 (softmax): its exact",
    "data key": "data: text_colum: not a data option (did you mean text_column",
    "chunk size": "loss_chunk_size must be a positive integer (tokens per chunk), got 0",
}


@pytest.mark.parametrize("case", sorted(BAD_PRETRAIN))
def test_bad_pretrain_config_is_refused_naming_file_and_key(
        files: dict[str, Path], tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_yaml(tmp_path / "bad.yaml", _bad_pretrain(files, tmp_path / "out", case))
    assert main(["pretrain", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and BAD_PRETRAIN[case].format(root=files["root"]) in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))


BAD_CHAT = {
    "no assistant": ([{"role": "user", "content": "hello"}], "row 0: messages: no 'assistant' turn"),
    "unknown role": ([{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}],
                     "row 0: messages[0]: role 'bot' is not one of"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_chat_data_without_the_roles_is_refused(
        pretrained: Any, files: dict[str, Path], tmp_path: Path, case: str) -> None:
    messages, expected = BAD_CHAT[case]
    data = _jsonl(tmp_path / "bad_chat.jsonl", [{"messages": messages}, {"messages": _conversation(0)},
                                                 {"messages": _conversation(1)}])
    config = _finetune_yaml(tmp_path / "ft.yaml", data={"eval_fraction": 0})
    with pytest.raises(ValueError, match="bad_chat.jsonl") as info:
        finetune(str(pretrained.model_dir), str(data), config, output_dir=str(tmp_path / "out"))
    assert expected in str(info.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))


def _softmax_checkpoint(pretrained: Any, folder: Path) -> str:
    """The pretrained checkpoint's shape and tokenizer with softmax layers: a model that needs positions."""
    config = AutoConfig.from_pretrained(pretrained.model_dir)
    config.attention, config.attention_overrides = {"mixer": "softmax"}, None
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(pretrained.model_dir).save_pretrained(folder)
    return str(folder)


def test_bad_finetune_inputs(pretrained: Any, files: dict[str, Path], tmp_path: Path) -> None:
    ckpt, out = str(pretrained.model_dir), str(tmp_path / "out")
    config = _finetune_yaml(tmp_path / "ft.yaml", block_size=512)
    with pytest.raises(ValueError, match=r"ft.yaml: block_size 512 is above the model's max_position_embeddings 128 "
                                         r"\(layer 0 \(softmax\)"):
        finetune(_softmax_checkpoint(pretrained, tmp_path / "softmax"), str(files["docs"]), config, output_dir=out)
    cases = [
        (dict(method="adapter"), "method: 'adapter' is not one of"),
        (dict(lora={"rank": 4}), "lora: rank: not a LoRA option"),
        (dict(lora={"r": 0}), "lora.r must be > 0"),  # the same LoRA checks as a recipe's stage2.lora
        (dict(lora={"dropout": "high"}), "lora.dropout must be float"),
        (dict(training={"num_train_epoch": 1}), "did you mean num_train_epochs"),
        (dict(loss_chunk_size=-2), "loss_chunk_size must be a positive integer (tokens per chunk), got -2"),
    ]
    for values, expected in cases:
        config = _finetune_yaml(tmp_path / "ft.yaml", **values)
        with pytest.raises(ValueError, match="ft.yaml") as info:
            finetune(ckpt, str(files["docs"]), config, output_dir=out)
        assert expected in str(info.value)
    with pytest.raises(ValueError, match=r"model: .*no such checkpoint folder"):
        finetune(str(tmp_path / "missing"), str(files["docs"]), _finetune_yaml(tmp_path / "ok.yaml"), output_dir=out)
    assert not (tmp_path / "out").exists()


# ----- several processes ------------------------------------------------------------------------------------
def test_two_processes_make_the_same_step_as_one(files: dict[str, Path], tmp_path: Path) -> None:
    """DDP (torchrun, gloo) with 2 x 2 examples against 1 process with 4: one SGD step, same weights."""
    step = {"max_steps": 1, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0,
            "train_sampling_strategy": "sequential", "save_strategy": "no", "eval_strategy": "no"}
    one = pretrain(_pretrain_config(files, tmp_path / "one", per_device_train_batch_size=4, **step))
    config = _write_yaml(tmp_path / "two.yaml",
                         _pretrain_config(files, tmp_path / "two", per_device_train_batch_size=2, **step))
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "hf_recattn.cli",
                           "pretrain", "--config", str(config)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("1 steps; model saved") == 1
    state = json.loads((tmp_path / "two" / "model" / "config.json").read_text())
    assert state["model_type"] == "recattn"
    a, b = _weights(one.model_dir), _weights(tmp_path / "two" / "model")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    half = pretrain(_pretrain_config(files, tmp_path / "half", per_device_train_batch_size=2, **step))
    c = _weights(half.model_dir)  # the first 2 examples only: a step that the comparison above must tell apart
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-3
