"""Checks of settings read from YAML, shared by every settings class: unknown keys (with close matches), types,
ranges. Each error names the file and the key (``pretrain.yaml: training.learnig_rate: not a TrainingArguments
field (did you mean learning_rate?)``)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any


def suggest(key: str, known: set[str] | list[str] | dict[str, Any]) -> str:
    """`` (did you mean A or B?)`` for the names of ``known`` close to ``key``, else an empty string."""
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def check_keys(values: dict[str, Any], known: set[str], where: str, what: str) -> None:
    """Raise ValueError naming the first key of ``values`` not in ``known``, with close matches."""
    for key in values:
        if key not in known:
            raise ValueError(f"{where}: {key}: not {what}{suggest(str(key), known)}")


def as_mapping(value: Any, where: str) -> dict[str, Any]:
    """A copy of the mapping ``value`` (None: empty), else ValueError naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def positive(value: float, where: str, allow_zero: bool = False) -> None:
    """Raise ValueError naming ``where`` unless ``value`` > 0 (or >= 0 with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def typed(value: Any, kind: type, where: str) -> Any:
    """``value`` as ``kind`` (ints and YAML strings such as ``1e-4`` taken as floats), else ValueError."""
    if kind is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def build_settings(cls: type, values: Any, where: str) -> Any:
    """A settings dataclass from a mapping: unknown keys and wrong types raise, naming ``where.key``."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {names}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        hint = hints[name]
        key = f"{where}.{name}"
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_settings(hint, value, key)
        elif typing.get_origin(hint) is tuple:
            kwargs[name] = _strings(value, key)
        elif isinstance(hint, types.UnionType):
            kinds = [k for k in typing.get_args(hint) if k is not type(None)]
            if value is None or len(kinds) != 1:
                kwargs[name] = value
            elif typing.get_origin(kinds[0]) is tuple:  # an optional list of strings
                kwargs[name] = _strings(value, key)
            else:  # an optional scalar: checked like the plain type
                kwargs[name] = typed(value, kinds[0], key)
        else:
            kwargs[name] = typed(value, hint, key)
    return cls(**kwargs)


def _strings(value: Any, key: str) -> tuple[str, ...]:
    """A list of strings (one string: a list of one) as a tuple, else ValueError naming ``key``."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings, got {value!r}")
    return tuple(value)


def check_schedule(settings: Any, at: str) -> None:
    """The values every training stage has: tokens, lr, block and batch size, clipping, warm-up."""
    positive(settings.tokens, f"{at}.tokens", allow_zero=True)
    for key in ("lr", "block_size", "batch_size", "max_grad_norm"):
        positive(getattr(settings, key), f"{at}.{key}")
    if not 0 <= settings.warmup_fraction < 1:
        raise ValueError(f"{at}.warmup_fraction must be in [0, 1)")
