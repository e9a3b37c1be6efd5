"""The catalog behind ``hf-recattn mixers``: every registered mixer family with its options, and every preset."""

from __future__ import annotations

import json
from typing import Any

from .modeling.mixer_base import Mixer
from .modeling.mixers import MIXERS, validate_spec
from .modeling.options import Option
from .modeling.presets import PRESET_DOCS, PRESETS


def allowed_values(option: Option) -> str:
    """The values an option accepts beyond its type, in words ("" when any value of the type goes)."""
    parts = []
    if option.choices is not None:
        parts.append(" | ".join(str(c) for c in option.choices))
    if option.minimum is not None and option.maximum is not None:
        parts.append(f"[{option.minimum}, {option.maximum}]")
    elif option.minimum is not None:
        parts.append(f">= {option.minimum}")
    elif option.maximum is not None:
        parts.append(f"<= {option.maximum}")
    if option.literals:
        parts.append("or " + ", ".join(repr(x) for x in option.literals))
    if option.nullable:
        parts.append("or None")
    return ", ".join(parts)


def option_entry(name: str, option: Option) -> dict[str, Any]:
    return {
        "name": name,
        "types": [t.__name__ for t in option.types],
        "default": option.default,
        "choices": None if option.choices is None else list(option.choices),
        "minimum": option.minimum,
        "maximum": option.maximum,
        "literals": list(option.literals),
        "nullable": option.nullable,
        "allowed": allowed_values(option),
        "doc": option.doc,
    }


def _summary(cls: type[Mixer]) -> str:
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def family_entry(cls: type[Mixer]) -> dict[str, Any]:
    forms = ["parallel", *(["chunked"] if cls.has_chunked else []), "step"]
    return {
        "name": cls.name,
        "class": cls.__name__,
        "summary": _summary(cls),
        "state_kind": cls.state_kind,
        "forms": forms,
        "options": [option_entry(name, option) for name, option in cls.all_options().items()],
    }


def catalog() -> dict[str, Any]:
    """``{"families": [...], "presets": [...]}``, each preset with the full spec it resolves to."""
    return {
        "families": [family_entry(MIXERS[name]) for name in sorted(MIXERS)],
        "presets": [
            {"name": name, "doc": PRESET_DOCS.get(name, ""), "spec": validate_spec(name, f"preset {name!r}")}
            for name in sorted(PRESETS)
        ],
    }


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else repr(value)


def format_catalog(data: dict[str, Any]) -> str:
    """Plain text: one block per family (an option per line), then the presets and their specs."""
    lines = ['Mixer families: a spec is {"mixer": FAMILY, **options}; every option has a default.', ""]
    header = ("option", "type", "default", "allowed", "doc")
    for family in data["families"]:
        lines.append(
            f"{family['name']} ({family['class']}, {family['state_kind']} state; forms: "
            f"{', '.join(family['forms'])}): {family['summary']}"
        )
        rows = [
            (o["name"], " | ".join(o["types"]), _show(o["default"]), o["allowed"], o["doc"])
            for o in family["options"]
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        for row in [header, *rows]:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append(("  " + "  ".join([*cells, row[4]])).rstrip())
        lines.append("")
    lines.append('Presets: a string spec "NAME", or {"mixer": NAME, **options} to override some of its options.')
    lines.append("")
    for preset in data["presets"]:
        lines.append(f"{preset['name']}: {preset['doc']}")
        lines.append(f"  resolves to {json.dumps(preset['spec'])}")
    return "\n".join(lines)
