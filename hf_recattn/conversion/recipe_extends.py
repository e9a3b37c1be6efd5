"""``extends:``: a recipe file written as the changes to another.

``extends: NAME`` (a packaged recipe) or ``extends: path.yaml`` (relative to the extending file) reads the base
recipe, itself resolved, and merges the file's keys over it:

- mappings merge key by key, at every depth (``budgets.full.stage2``, ``attention``'s options);
- any other value (a list, a number, a string) replaces the base's;
- ``null`` drops the base's key, so its default applies (an override of ``attention_overrides``, a budget);
- an attention spec that names another ``mixer`` than the base's replaces the base's spec whole, since a spec of
  another mixer shares none of its options;
- ``name`` and ``description`` are never inherited: they describe the file that has them.

The result is the recipe written out in full, so a recipe that extends another has the fingerprint of the same
settings written out, and trains the same model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: keys a file keeps for itself
OWN_KEYS = ("name", "description")


def resolve_extends(
    data: dict[str, Any],
    path: Path | None,
    source: str,
    read: Callable[[str, Path | None], tuple[dict[str, Any], Path, str]],
    chain: tuple[tuple[Path, str], ...] = (),
) -> dict[str, Any]:
    """``data`` (read from ``path``, None for a dict) with its ``extends`` chain merged in, ``extends`` removed.

    ``read(reference, folder)`` finds and parses a base recipe, returning its data, its file and how messages name
    it. Errors name the file at fault and, for a loop, the chain of files.
    """
    if "extends" not in data:
        return data
    reference = data["extends"]
    if not isinstance(reference, str) or not reference:
        raise ValueError(f"{source}: extends must name a packaged recipe or a .yaml file, got {reference!r}")
    if path is not None:
        chain = (*chain, (path.resolve(), source))
    try:
        base_data, base_path, base_source = read(reference, None if path is None else path.parent)
    except ValueError as err:
        raise ValueError(f"{source}: extends: {err}") from None
    if any(base_path.resolve() == seen for seen, _ in chain):
        names = [name for _, name in chain]
        raise ValueError(f"{source}: extends loops: {' -> '.join((*names, base_source))}")
    base = resolve_extends(base_data, base_path, base_source, read, chain)
    own = {key: value for key, value in data.items() if key != "extends"}
    inherited = {key: value for key, value in base.items() if key not in OWN_KEYS}
    return merge_recipe(inherited, own)


def merge_recipe(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: mappings merge key by key, ``None`` drops the key, other values replace (see the
    module docstring)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        old = out.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(old, dict) and not _other_mixer(old, value):
            out[key] = merge_recipe(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _other_mixer(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` is a mixer spec naming another mixer than the spec ``old`` (``attention``, an override,
    a hybrid's ``far``, ``retrieval_heads.retrieval``)."""
    return "mixer" in old and "mixer" in new and new["mixer"] != old["mixer"]
