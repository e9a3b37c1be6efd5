"""Typed, validated options for mixer specs (pure Python, no torch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One option of a mixer spec: accepted types, default, allowed values or range."""

    types: tuple[type, ...]
    default: Any
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    literals: tuple[Any, ...] = ()  # extra values accepted besides `types` (e.g. order="exp")
    nullable: bool = False

    def check(self, value: Any, where: str, name: str) -> Any:
        """Return the validated value or raise ValueError naming `where` and `name`."""
        if value is None and self.nullable:
            return None
        if value in self.literals and not isinstance(value, bool):
            return value
        types = self.types
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            accepted = [t.__name__ for t in types] + [repr(x) for x in self.literals]
            raise ValueError(
                f"{where}: option {name!r} must be {' or '.join(accepted)}, got {value!r} ({type(value).__name__})"
            )
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{where}: option {name!r} must be one of {list(self.choices)}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{where}: option {name!r} must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{where}: option {name!r} must be <= {self.maximum}, got {value!r}")
        return value


SpecCheck = Callable[[dict[str, Any], str], None]


def check_open_unit(spec: Mapping[str, Any], where: str, name: str, what: str = "") -> None:
    """Raise unless option ``name`` is None or strictly between 0 and 1 (``what``: what it is, for the message)."""
    value = spec[name]
    if value is not None and not 0.0 < value < 1.0:
        raise ValueError(f"{where}: option {name!r} must be in (0, 1){what}, got {value!r}")


def check_not_above(spec: Mapping[str, Any], where: str, low: str, high: str) -> None:
    """Raise if option ``low`` is above option ``high`` (nothing to compare where either is None)."""
    if spec[low] is not None and spec[high] is not None and spec[low] > spec[high]:
        raise ValueError(f"{where}: option {low!r} ({spec[low]}) is above {high!r} ({spec[high]})")


def check_kind(kind: str, known: tuple[str, ...], what: str, where: str) -> None:
    """Raise unless ``kind`` is one of ``known`` (``what``: the name the message gives it)."""
    if kind not in known:
        raise ValueError(f"{where}: unknown {what} {kind!r}; known: {list(known)}")


def check_gate_after_norm(spec: Mapping[str, Any], where: str) -> None:
    """An output gate multiplies the normalized output, so it needs ``output_norm``."""
    if spec["output_gate"] and not spec["output_norm"]:
        raise ValueError(f"{where}: option 'output_gate' needs output_norm=True (the gate follows the norm)")


def resolve_options(
    spec: Mapping[str, Any], options: Mapping[str, Option], where: str, extra_check: SpecCheck | None = None
) -> dict[str, Any]:
    """Fill defaults and validate every option of `spec` (which holds the key "mixer")."""
    unknown = sorted(set(spec) - set(options) - {"mixer"})
    if unknown:
        raise ValueError(
            f"{where}: unknown option(s) {unknown} for mixer {spec['mixer']!r}; known: {sorted(options)}"
        )
    resolved: dict[str, Any] = {"mixer": spec["mixer"]}
    for name, option in options.items():
        resolved[name] = option.check(spec.get(name, option.default), where, name)
    if extra_check is not None:
        extra_check(resolved, where)
    return resolved
