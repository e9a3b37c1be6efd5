"""A recipe's ``init``: the converted checkpoint a run starts from to train it further. It is checked against the
recipe and the teacher before the run takes its folder, loaded as the student, and the training tokens behind it
count in the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..modeling.configuration import RecAttnConfig, read_checkpoint_config
from ..modeling.modeling import RecAttnForCausalLM
from .job import read_json
from .recipe import EXPECTABLE, Recipe, report_training_tokens


def check_init(recipe: Recipe, config: RecAttnConfig) -> None:
    """``recipe.init`` must be a converted checkpoint with the recipe's attention (layer by layer) and the
    teacher's shape (``config``: the student's config that the recipe check built), read from its config."""
    where = f"{recipe.source}: init {recipe.init!r}"
    folder = Path(str(recipe.init)).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{where} is not a converted checkpoint folder (no config.json)")
    init = read_checkpoint_config(folder)
    for key in EXPECTABLE:  # the teacher's shape, as a recipe's ``expects`` may pin it
        have, want = getattr(init, key), getattr(config, key)
        if have != want:
            raise ValueError(f"{where} has {key} {have}, the teacher {want}")
    for layer, (have, want) in enumerate(zip(init.layer_specs(), config.layer_specs(), strict=True)):
        if have != want:
            raise ValueError(f"{where} layer {layer} has attention {have}, the recipe {want}")


def init_facts(init: str) -> dict[str, Any]:
    """The checkpoint a continuing run starts from and the training tokens behind it (its saved report)."""
    earlier = read_json(Path(init).expanduser() / "report.json")
    return {"checkpoint": init, "recipe": (earlier.get("recipe") or {}).get("name"),
            "training_tokens": report_training_tokens(earlier)}


def load_converted(folder: Path) -> RecAttnForCausalLM:
    """A converted checkpoint (``init``, or this run's model on a rerun), in eval mode."""
    return RecAttnForCausalLM.from_pretrained(folder).eval()
