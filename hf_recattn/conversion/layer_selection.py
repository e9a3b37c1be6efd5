"""Which teacher layers a conversion replaces (a recipe's ``layers``); the others keep the teacher's attention.

Exactly one of:

* ``{"convert": "full_attention"}`` (or ``"sliding_attention"``): the layers of that type in the teacher;
* ``{"convert": [0, 5, -1]}``: these layer indices (negative counts from the end);
* ``{"keep_every": 4}``: every layer but one in four (layers 3, 7, 11, ... keep the teacher's attention).

None (no ``layers``) converts every layer.
"""

from __future__ import annotations

from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
KEYS = ("convert", "keep_every")


def check_layers(layers: Any, where: str) -> dict[str, Any] | None:
    """The selection as given, once its form is valid (ValueError naming ``where`` otherwise)."""
    if layers is None:
        return None
    if not isinstance(layers, dict) or len(layers) != 1 or next(iter(layers)) not in KEYS:
        raise ValueError(
            f"{where}: expected exactly one of {{convert: full_attention | sliding_attention | [layer indices]}} "
            f"or {{keep_every: N}}, got {layers!r}"
        )
    key, value = next(iter(layers.items()))
    if key == "keep_every":
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{where}.keep_every: an integer >= 2 (one layer in N keeps its attention), got {value!r}")
    elif isinstance(value, str):
        if value not in LAYER_TYPES:
            raise ValueError(f"{where}.convert: a layer type is one of {list(LAYER_TYPES)}, got {value!r}")
    elif isinstance(value, list) and value:
        bad = [i for i in value if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise ValueError(f"{where}.convert: layer indices are integers, got {bad}")
    else:
        raise ValueError(f"{where}.convert: a layer type or a non-empty list of layer indices, got {value!r}")
    return dict(layers)


def selected_layers(layers: dict[str, Any] | None, teacher_types: list[str], where: str = "layers") -> list[int]:
    """The indices of the teacher layers to convert, sorted; ValueError when the selection names layers (or a
    layer type) the teacher does not have."""
    check_layers(layers, where)
    n = len(teacher_types)
    if layers is None:
        return list(range(n))
    if "keep_every" in layers:
        period = layers["keep_every"]
        return [i for i in range(n) if i % period != period - 1]
    value = layers["convert"]
    if isinstance(value, str):
        chosen = [i for i, kind in enumerate(teacher_types) if kind == value]
        if not chosen:
            raise ValueError(f"{where}.convert: the teacher has no {value} layers (its layers: "
                             f"{_summary(teacher_types)})")
        return chosen
    outside = [i for i in value if not -n <= i < n]
    if outside:
        raise ValueError(f"{where}.convert: the teacher has {n} layers (0..{n - 1}); no layer {outside}")
    indices = sorted({i % n for i in value})
    if len(indices) != len(value):
        raise ValueError(f"{where}.convert: layer indices {value} name a layer twice")
    return indices


def _summary(types: list[str]) -> str:
    counts = {kind: types.count(kind) for kind in dict.fromkeys(types)}
    return ", ".join(f"{count} {kind}" for kind, count in counts.items())
