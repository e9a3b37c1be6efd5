"""Finetuning an hf_recattn checkpoint: ``hf-recattn finetune --model CKPT --data FILE [--config YAML]``.

``method``: ``lora`` (peft adapters on ``lora.target_modules``, merged into the weights at the end),
``full`` (every parameter) or ``mixers`` (only the mixers' own parameters: feature maps, gates, ...). Plain
text is packed as in pretraining; chat data (a ``messages`` column) is one padded example per conversation
with labels on the assistant tokens only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DataCollatorForSeq2Seq, default_data_collator, set_seed

from .data import chat_examples, load_documents, packed_blocks
from .run_config import (
    FINETUNE_KEYS,
    block_size,
    length_limit,
    lora_section,
    loss_chunk_size,
    loss_kernel,
    read_training_yaml,
    run_arguments,
    tokenizer_max_length,
)
from .runner import (
    CausalLMTrainer,
    RunResult,
    quiet_gradient_checkpointing_notice,
    save_final,
    summarize,
    train_with_resume,
)
from .trainable import METHODS, merge_lora, set_trainable

DEFAULT_BLOCK_SIZE = 1024


def load_checkpoint(spec: str, where: str) -> tuple[Any, Any]:
    """An hf_recattn checkpoint (a folder or a Hub id) and its tokenizer, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    if not path.is_dir() and (path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise ValueError(f"{where}: model: {spec}: no such checkpoint folder")
    try:
        config = AutoConfig.from_pretrained(str(path) if path.is_dir() else spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: model: {spec}: cannot read its config ({err})") from err
    if config.model_type != "recattn":
        raise ValueError(f"{where}: model: {spec} is a {config.model_type!r} model, not an hf_recattn checkpoint "
                         "(convert it first: hf-recattn convert)")
    model = AutoModelForCausalLM.from_pretrained(str(path) if path.is_dir() else spec, dtype=torch.float32)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: model: {spec} has no usable tokenizer ({err})") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def finetune(model: str | None = None, data: str | None = None, config_or_path: str | Path | dict | None = None,
             output_dir: str | None = None, callbacks: list[Any] | None = None) -> RunResult:
    """Finetune the checkpoint ``model`` on ``data`` (both override the YAML's ``model`` / ``data.source``);
    the merged model is written to ``OUTPUT_DIR/model``. Rerun to resume."""
    run = read_training_yaml(config_or_path, FINETUNE_KEYS)
    where, values = run.where, run.values
    chunk = loss_chunk_size(values.get("loss_chunk_size"), where)
    kernel = loss_kernel(values.get("loss_kernel"), where)
    if data is not None:
        run.data.source = data
    spec = model or values.get("model")
    if not spec:
        raise ValueError(f"{where}: model: missing (pass --model CHECKPOINT)")
    method = values.get("method", "lora")
    if method not in METHODS:
        raise ValueError(f"{where}: method: {method!r} is not one of {list(METHODS)}")
    lora, train_mixers = lora_section(values.get("lora"), where)
    if values.get("lora") and method != "lora":
        raise ValueError(f"{where}: lora: only used with method: lora (method is {method!r})")
    streaming = run.data.streaming
    args = run_arguments(run, where, output_dir, label_names=["labels"])
    net, tokenizer = load_checkpoint(str(spec), where)
    size = block_size(values.get("block_size"), where, net.config, DEFAULT_BLOCK_SIZE)
    tokenizer.model_max_length = tokenizer_max_length(length_limit(net.config)[0])

    columns = [run.data.messages_column, run.data.text_column]
    with args.main_process_first(desc="tokenize"):
        train, held, column = load_documents(run.data, where, args.seed, columns)
        chat = column == run.data.messages_column
        name = f"{where}: data {run.data.source}"
        if chat:
            train = chat_examples(train, tokenizer, column, size, run.data.num_proc, name)
            held = chat_examples(held, tokenizer, column, size, run.data.num_proc, name) if held is not None else None
        else:
            train = packed_blocks(train, tokenizer, column, size, run.data.num_proc)
            held = packed_blocks(held, tokenizer, column, size, run.data.num_proc) if held is not None else None
    why = (f"no conversation has assistant tokens within block_size {size}" if chat
           else f"fewer tokens than one block of {size}")
    if not streaming and len(train) == 0:
        raise ValueError(f"{name}: no training examples ({why})")
    if held is not None and not streaming and len(held) == 0:
        raise ValueError(f"{name}: no held-out examples ({why}); raise data.eval_fraction or lower block_size")

    set_seed(args.seed)
    with quiet_gradient_checkpointing_notice():
        trained = set_trainable(net, method, lora, train_mixers, where)
    collator = (DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True) if chat
                else default_data_collator)
    trainer = CausalLMTrainer(model=trained, args=args, train_dataset=train, eval_dataset=held,
                              data_collator=collator, processing_class=tokenizer, callbacks=callbacks,
                              loss_chunk_size=chunk, loss_kernel=kernel)
    with quiet_gradient_checkpointing_notice():
        resumed = train_with_resume(trainer)
        model_dir = save_final(trainer, tokenizer, merge_lora if method == "lora" else None)
    return summarize(trainer, model_dir, resumed)
