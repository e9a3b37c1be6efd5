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
