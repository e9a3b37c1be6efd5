"""Data for training: documents through ``datasets``, tokenized and packed with ``Dataset.map``.

Packing (pretraining and plain-text finetuning): each document's tokens get the EOS token appended and are
laid end to end into blocks of ``block_size``; a document that does not fit is continued in the next block.
Every piece of a document in a block is a segment; as transformers' ``DataCollatorWithFlattening`` does,
``position_ids`` restart at 0 at each segment and ``labels`` are -100 at each segment's first token, so no
token is predicted across a document boundary. The tail of each map batch that does not fill a block is
dropped (as in transformers' ``run_clm`` example).

Chat data (a column of ``{"role", "content"}`` lists): the tokenizer's chat template renders each
conversation and only assistant tokens carry labels. With ``{% generation %}`` in the template this is
transformers' ``return_assistant_tokens_mask``; otherwise the assistant spans are found by rendering
prefixes of the conversation (the embedded SmolLM2 template has no generation tags).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..embedded_teachers import embedded_gguf_path, gguf_tokenizer
from .run_config import DataSettings

_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_HUB_ID = re.compile(r"^(hub:)?[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
CHAT_ROLES = ("system", "user", "assistant", "tool")


# ----- tokenizer ----------------------------------------------------------------------------------------
def load_tokenizer(spec: str | None, where: str) -> Any:
    """``embedded`` (default; the SmolLM2 tokenizer of the embedded teacher), a folder or a Hub id."""
    from transformers import AutoTokenizer

    if spec is None or str(spec).strip().lower() == "embedded":
        tokenizer = gguf_tokenizer(embedded_gguf_path())  # the plain copy a conversion leaves, when there is one
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(spec))
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: tokenizer: cannot load {spec!r} ({err})") from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{where}: tokenizer: {spec or 'embedded'} has no eos_token to end documents with")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----- loading documents --------------------------------------------------------------------------------
def _local_files(source: Any, where: str, key: str) -> list[Path] | None:
    """The local data files ``source`` names (a file, a list, a folder of files); None for other sources."""
    items = source if isinstance(source, list) else [source]
    files: list[Path] = []
    for item in items:
        path = Path(str(item)).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _BUILDERS
                           and not p.name.startswith("."))
            if not found:
                raise ValueError(f"{where}: {key}: folder {path} holds no {sorted(_BUILDERS)} files")
            files += found
        elif path.is_file():
            files.append(path)
        elif isinstance(source, list) or path.suffix.lower() in _BUILDERS or not _HUB_ID.match(str(item)):
            raise ValueError(f"{where}: {key}: {item}: no such file or folder")
        else:
            return None
    kinds = {_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in kinds:
        bad = next(p for p in files if p.suffix.lower() not in _BUILDERS)
        raise ValueError(f"{where}: {key}: {bad}: unsupported file type; use {sorted(_BUILDERS)}")
    if len(kinds) > 1:
        raise ValueError(f"{where}: {key}: mixes file types {sorted(str(k) for k in kinds)}; use one")
    return files


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _embedded_file() -> str | None:
    from ..data.corpus import embedded_corpus_file

    path = embedded_corpus_file()
    return None if path is None else str(path)


def load_source(source: Any, settings: DataSettings, where: str, key: str) -> tuple[Any, Any, str]:
    """(dataset, the saved eval split or None, a name for messages) for one ``source``."""
    import datasets

    stream = settings.streaming
    if source is None or str(source).strip().lower() == "embedded":
        file = _embedded_file()
        if file is None:  # the corpus could not be cached on disk: keep it in memory
            from ..data.corpus import embedded_texts

            data = datasets.Dataset.from_dict({"text": embedded_texts()})
            return (data.to_iterable_dataset() if stream else data), None, "the embedded corpus"
        source = file
    if not isinstance(source, list) and _is_saved_dataset(Path(str(source)).expanduser()):
        data = datasets.load_from_disk(str(Path(str(source)).expanduser()))
        held = None
        if isinstance(data, datasets.DatasetDict):
            held = next((data[s] for s in ("validation", "test") if s in data), None)
            if settings.split not in data:
                raise ValueError(f"{where}: data.split: {source} has no split {settings.split!r} "
                                 f"(has {sorted(data)})")
            data = data[settings.split]
        if stream:
            data = data.to_iterable_dataset()
            held = held.to_iterable_dataset() if held is not None else None
        return data, held, str(source)
    files = _local_files(source, where, key)
    try:
        if files is not None:
            builder = _BUILDERS[files[0].suffix.lower()]
            options = {"sample_by": "document"} if builder == "text" else {}
            data = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         streaming=stream, cache_dir=settings.cache_dir, **options)
            name = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
            return data, None, name
        name = str(source).removeprefix("hub:")
        data = datasets.load_dataset(name, settings.config_name, split=settings.split, streaming=stream,
                                     cache_dir=settings.cache_dir)
        return data, None, name
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{where}: {key}: cannot load {source} ({err})") from err
    except Exception as err:  # noqa: BLE001 - arrow / json readers raise many kinds for bad files
        raise ValueError(f"{where}: {key}: cannot read {source} ({type(err).__name__}: {err})") from err


def column_names(data: Any) -> list[str]:
    """Columns of a Dataset or IterableDataset (an IterableDataset without features: its first row's keys)."""
    names = data.column_names
    if names is None:
        first = next(iter(data), None)
        names = list(first) if first is not None else []
    return list(names)


def load_documents(settings: DataSettings, where: str, seed: int, columns: Sequence[str]) -> tuple[Any, Any, str]:
    """(train, eval or None, the column found) for ``settings``; ``columns`` are the accepted columns in order
    of preference (``text`` or, for finetuning, the messages column first)."""
    train, held, name = load_source(settings.source, settings, where, "data.source")
    present = column_names(train)
    column = next((c for c in columns if c in present), None)
    if column is None:
        wanted = " or ".join(repr(c) for c in columns)
        raise ValueError(f"{where}: data.text_column: {name} has no column {wanted} (columns: {present})")
    if settings.max_documents is not None:
        train = train.take(settings.max_documents) if settings.streaming else train.select(
            range(min(settings.max_documents, len(train))))
    if settings.eval_source is not None:
        held, _, eval_name = load_source(settings.eval_source, settings, where, "data.eval_source")
        if column not in column_names(held):
            raise ValueError(f"{where}: data.eval_source: {eval_name} has no column {column!r} "
                             f"(columns: {column_names(held)})")
    elif held is None and settings.eval_documents is not None:
        if not settings.streaming and settings.eval_documents >= len(train):
            raise ValueError(f"{where}: data.eval_documents: {settings.eval_documents} of {len(train)} "
                             "documents leaves none to train on")
        held, train = train.take(settings.eval_documents), train.skip(settings.eval_documents)
    elif held is None and settings.eval_fraction > 0 and not settings.streaming:
        if len(train) < 2:
            raise ValueError(f"{where}: data.eval_fraction: {name} has {len(train)} document(s); need 2 to "
                             "hold one out (or set eval_fraction: 0)")
        count = min(len(train) - 1, max(1, round(settings.eval_fraction * len(train))))
        split = train.train_test_split(test_size=count, seed=seed, shuffle=True)
        train, held = split["train"], split["test"]
    return train, held, column


def _map_options(data: Any, num_proc: int | None, desc: str) -> dict[str, Any]:
    import datasets

    if isinstance(data, datasets.IterableDataset):
        return {}
    return {"num_proc": num_proc, "desc": desc}


# ----- packing -----------------------------------------------------------------------------------------
def pack_documents(documents: Sequence[Sequence[int]], block_size: int) -> dict[str, list[list[int]]]:
    """Blocks of ``block_size`` tokens from documents laid end to end (the unfilled tail is dropped), with
    ``position_ids`` restarting at each document piece and ``labels`` -100 at each piece's first token."""
    blocks: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for document in documents:
        start = 0
        while start < len(document):
            piece = document[start : start + block_size - len(ids)]
            ids += piece
            labels += [-100, *piece[1:]]
            positions += range(len(piece))
            start += len(piece)
            if len(ids) == block_size:
                blocks["input_ids"].append(ids)
                blocks["labels"].append(labels)
                blocks["position_ids"].append(positions)
                ids, labels, positions = [], [], []
    return blocks


def packed_blocks(data: Any, tokenizer: Any, column: str, block_size: int, num_proc: int | None) -> Any:
    """Tokenize the ``column`` documents (EOS appended) and pack them into blocks, both with ``map``."""
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = [t if isinstance(t, str) else "" for t in batch[column]]
        rows = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [row + [eos] for row, text in zip(rows, texts, strict=True) if text]}

    def pack(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return pack_documents(batch["input_ids"], block_size)

    names = column_names(data)
    tokens = data.map(tokenize, batched=True, remove_columns=names, **_map_options(data, num_proc, "tokenize"))
    return tokens.map(pack, batched=True, remove_columns=["input_ids"],
                      **_map_options(data, num_proc, f"pack into blocks of {block_size}"))


# ----- chat ---------------------------------------------------------------------------------------------
def has_generation_tags(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def check_conversation(messages: Any, where: str) -> None:
    """A list of role/content dicts with known roles and at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str):
            raise ValueError(f"{where}[{i}]: each message needs string 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"{where}[{i}]: role {message['role']!r} is not one of {list(CHAT_ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no 'assistant' turn, so nothing to learn (roles: "
                         f"{[m['role'] for m in messages]})")


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant turns (their content and the
    template's end-of-turn text, trailing whitespace excluded), found by rendering prefixes."""
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError("the chat template does not render a conversation's prefixes as prefixes, so "
                             "the assistant tokens cannot be found; use a template with {% generation %}")
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return text, spans


def chat_example(tokenizer: Any, messages: list[dict[str, str]], max_length: int) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` (-100 outside assistant turns) for one conversation, cut at ``max_length``."""
    if has_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text, spans = assistant_spans(tokenizer, messages)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [int(any(a <= s < b for a, b in spans)) for s, _e in encoded["offset_mapping"]]
    ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]}


def chat_examples(data: Any, tokenizer: Any, column: str, max_length: int, num_proc: int | None,
                  name: str) -> Any:
    """Tokenized conversations (``input_ids``, ``attention_mask``, ``labels``), one example each."""
    if not tokenizer.chat_template:
        raise ValueError(f"{name}: chat data needs a tokenizer with a chat template")

    def tokenize(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for index, messages in zip(indices, batch[column], strict=True):
            check_conversation(messages, f"{name}: row {index}: {column}")
            example = chat_example(tokenizer, messages, max_length)
            if all(label == -100 for label in example["labels"]):
                continue  # the assistant turns lie beyond max_length
            out["input_ids"].append(example["input_ids"])
            out["attention_mask"].append([1] * len(example["input_ids"]))
            out["labels"].append(example["labels"])
        return out

    return data.map(tokenize, batched=True, with_indices=True, remove_columns=column_names(data),
                    **_map_options(data, num_proc, "apply the chat template"))
