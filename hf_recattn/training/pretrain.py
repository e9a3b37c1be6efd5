"""Pretraining from scratch: ``hf-recattn pretrain --config pretrain.yaml`` / ``pretrain(config_or_path)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import default_data_collator, set_seed

from .data import load_documents, load_tokenizer, packed_blocks
from .model_presets import model_values
from .run_config import (
    PRETRAIN_KEYS,
    block_size,
    loss_chunk_size,
    loss_kernel,
    read_training_yaml,
    run_arguments,
    tokenizer_max_length,
)
from .runner import CausalLMTrainer, RunResult, save_final, summarize, train_with_resume

DEFAULT_BLOCK_SIZE = 512


def pretrain(config_or_path: str | Path | dict[str, Any], output_dir: str | None = None,
             callbacks: list[Any] | None = None) -> RunResult:
    """Train a fresh RecAttnForCausalLM as the YAML (or dict) says; rerun to resume.

    Everything is checked before any data is tokenized; the model is written to ``OUTPUT_DIR/model``.
    ``output_dir`` overrides ``training.output_dir``; ``callbacks`` go to Trainer.
    """
    from ..modeling.configuration import RecAttnConfig
    from ..modeling.modeling import RecAttnForCausalLM

    run = read_training_yaml(config_or_path, PRETRAIN_KEYS)
    where, values = run.where, run.values
    chunk = loss_chunk_size(values.get("loss_chunk_size"), where)
    kernel = loss_kernel(values.get("loss_kernel"), where)
    model_kwargs = model_values(values.get("model"), where)
    streaming = run.data.streaming
    args = run_arguments(run, where, output_dir)
    tokenizer = load_tokenizer(values.get("tokenizer"), where)
    specials = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    try:
        config = RecAttnConfig(**{**specials, **model_kwargs})
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: model: {err}") from err
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"{where}: model.vocab_size {config.vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens")
    size = block_size(values.get("block_size"), where, config, DEFAULT_BLOCK_SIZE)
    tokenizer.model_max_length = tokenizer_max_length(config.length_limit())

    with args.main_process_first(desc="tokenize and pack"):
        train, held, column = load_documents(run.data, where, args.seed, [run.data.text_column])
        train = packed_blocks(train, tokenizer, column, size, run.data.num_proc)
        held = packed_blocks(held, tokenizer, column, size, run.data.num_proc) if held is not None else None
    if not streaming and len(train) == 0:
        raise ValueError(f"{where}: data: the training documents hold fewer tokens than one block of {size}")
    if held is not None and not streaming and len(held) == 0:
        raise ValueError(f"{where}: data: the held-out documents hold fewer tokens than one block of {size}; "
                         "raise data.eval_fraction or lower block_size")

    set_seed(args.seed)
    model = RecAttnForCausalLM(config)
    trainer = CausalLMTrainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                              data_collator=default_data_collator, processing_class=tokenizer,
                              callbacks=callbacks, loss_chunk_size=chunk, loss_kernel=kernel)
    resumed = train_with_resume(trainer)
    return summarize(trainer, save_final(trainer, tokenizer), resumed)
