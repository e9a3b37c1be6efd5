"""``extends:``: a recipe written as changes to another resolves to the same recipe written out in full."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from distill_fixtures import tiny_recipe_dict, write_recipe

from hf_recattn.conversion.recipe import budgets_of, load_recipe, read_recipe_yaml, recipe_from_dict
from hf_recattn.conversion.recipe_extends import merge_recipe


def _hybrid_base() -> dict:
    recipe = tiny_recipe_dict({"mixer": "hybrid", "window": 8, "sink_tokens": 2, "far": "none", "cache_slots": 16,
                               "cache_score": "keydiff", "cache_dtype": "int8"})
    recipe["budgets"] = {"quick": {"stage2": {"tokens": 64}}, "full": {"stage2": {"tokens": 128, "lr": 1.0e-4}}}
    return recipe


def test_changes_merge_into_the_base_and_fingerprint_as_written_out(tmp_path: Path) -> None:
    base = _hybrid_base()
    write_recipe(tmp_path / "base.yaml", base)
    child = {"extends": "base.yaml", "description": "int4 slots",
             "attention": {"cache_slots": 24, "cache_dtype": "int4"},
             "budgets": {"full": {"stage2": {"tokens": 256}}}}
    child_path = write_recipe(tmp_path / "child.yaml", child)
    written_out = merge_recipe(base, {"attention": child["attention"], "budgets": child["budgets"]})
    written_out["description"] = "int4 slots"
    full_path = write_recipe(tmp_path / "full.yaml", written_out)
    for budget in ("quick", "full"):
        extended, full = load_recipe(child_path, budget), load_recipe(full_path, budget)
        assert extended.name == "child" and extended.description == "int4 slots"
        assert extended.attention == {**base["attention"], "cache_slots": 24, "cache_dtype": "int4"}
        # the same settings: only the name (part of the fingerprint) tells them apart
        assert extended.as_dict() | {"name": "", "source": ""} == full.as_dict() | {"name": "", "source": ""}
    full_budget = load_recipe(child_path, "full").stage2
    assert (full_budget.tokens, full_budget.lr) == (256, 1.0e-4)  # one budget key changed, its sibling inherited
    assert budgets_of(child_path) == ["full", "quick"]


def test_name_and_description_are_not_inherited(tmp_path: Path) -> None:
    write_recipe(tmp_path / "base.yaml", _hybrid_base())
    child = write_recipe(tmp_path / "child.yaml", {"extends": "base.yaml"})
    data = read_recipe_yaml(child)
    assert data["name"] == "child" and "description" not in data and "extends" not in data


def test_another_mixer_replaces_the_spec_whole(tmp_path: Path) -> None:
    write_recipe(tmp_path / "base.yaml", _hybrid_base())
    child = write_recipe(tmp_path / "child.yaml",
                         {"extends": "base.yaml", "attention": {"mixer": "linear", "feature_map": "hedgehog"}})
    assert load_recipe(child).attention == {"mixer": "linear", "feature_map": "hedgehog"}  # no hybrid options left


def test_null_drops_a_key_of_the_base(tmp_path: Path) -> None:
    base = _hybrid_base()
    base["attention_overrides"] = {"0": {"mixer": "softmax"}, "1": {"mixer": "softmax"}}
    write_recipe(tmp_path / "base.yaml", base)
    child = write_recipe(tmp_path / "child.yaml", {"extends": "base.yaml", "attention_overrides": {"0": None},
                                                   "budgets": {"full": None}})
    assert load_recipe(child).attention_overrides == {"1": {"mixer": "softmax"}}
    assert budgets_of(child) == ["quick"]


def test_chains_resolve_in_order(tmp_path: Path) -> None:
    write_recipe(tmp_path / "a.yaml", _hybrid_base())
    write_recipe(tmp_path / "b.yaml", {"extends": "a.yaml", "attention": {"cache_slots": 20}, "seed": 3})
    (tmp_path / "sub").mkdir()
    c = write_recipe(tmp_path / "sub" / "c.yaml", {"extends": "../b.yaml", "attention": {"window": 4}})
    recipe = load_recipe(c)
    assert (recipe.attention["window"], recipe.attention["cache_slots"], recipe.seed) == (4, 20, 3)


def test_a_packaged_base_by_name(tmp_path: Path) -> None:
    child = write_recipe(tmp_path / "mine.yaml", {"extends": "retrieval9-int8keydiff", "attention": {"window": 32}})
    for budget in ("quick", "full"):
        mine, packaged = load_recipe(child, budget), load_recipe("retrieval9-int8keydiff", budget)
        assert mine.attention == {**packaged.attention, "window": 32}
        assert mine.retrieval_heads == packaged.retrieval_heads and mine.stage2 == packaged.stage2


def test_the_packaged_int4_recipe_keeps_the_fingerprint_of_its_written_out_form() -> None:
    """retrieval9-int8-int4keydiff extends retrieval9-int8keydiff; its output folders and the main job's results
    were made when it was written out in full, with these fingerprints."""
    assert load_recipe("retrieval9-int8-int4keydiff", "quick").fingerprint() == "8aff1df93230498f"
    assert load_recipe("retrieval9-int8-int4keydiff", "full").fingerprint() == "f9701674b807627c"


@pytest.mark.parametrize(("files", "message"), [
    ({"a.yaml": {"extends": "b.yaml"}, "b.yaml": {"extends": "a.yaml"}}, "extends loops: "),
    ({"a.yaml": {"extends": "a.yaml"}}, "extends loops: "),
    ({"a.yaml": {"extends": "missing.yaml"}}, "does not exist"),
    ({"a.yaml": {"extends": "no-such-packaged-recipe"}}, "unknown recipe"),
    ({"a.yaml": {"extends": 3}}, "extends must name"),
])
def test_bad_extends_name_the_file(tmp_path: Path, files: dict, message: str) -> None:
    for name, data in files.items():
        (tmp_path / name).write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as info:
        load_recipe(tmp_path / "a.yaml")
    assert message in str(info.value) and "a.yaml" in str(info.value), str(info.value)


def test_a_dict_may_extend_a_packaged_recipe() -> None:
    recipe = recipe_from_dict({"extends": "retrieval9-int8keydiff", "attention": {"cache_slots": 900}}, "quick")
    assert recipe.attention["cache_slots"] == 900 and recipe.retrieval_heads.max_heads == 9



def test_a_budget_merges_by_the_same_rules(tmp_path: Path) -> None:
    base = _hybrid_base()
    base["stage1"]["lr"] = 5.0e-2
    base["budgets"]["full"] = {"stage1": {"lr": None, "batch_size": 2}}
    path = write_recipe(tmp_path / "base.yaml", base)
    full, quick = load_recipe(path, "full").stage1, load_recipe(path, "quick").stage1
    assert full.lr == 1e-2 and quick.lr == 5.0e-2  # null: the setting's default, not the base's value
    assert (full.batch_size, full.block_size) == (2, quick.block_size)  # one key changed, its siblings inherited
