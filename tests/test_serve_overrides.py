"""A recipe's ``serve_overrides``: the student trains with the recipe's attention and is saved to serve with other
hybrid options that carry no weights (conversion/recipe.py, conversion/pipeline.py). The saved weights are those of
the same conversion without them; the saved config holds the served options, and they are in effect; options that
do not fit, or that would add or drop parameters, are refused before any work, naming the recipe and the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_teacher_folder, write_recipe
from transformers import AutoModelForCausalLM

from hf_recattn.cli import main
from hf_recattn.conversion.recipe import load_recipe

#: trained with 4 int4 slots beside a window of 4 (the cache fills within the tiny blocks)
TRAINED = {"mixer": "hybrid", "window": 4, "sink_tokens": 1, "cache_slots": 4, "cache_dtype": "int4",
           "far": {"mixer": "linear", "feature_map": "hedgehog"}}
#: served: every layer's pairs as int8, then layer 1's slots fewer (entries in order, indices last)
SERVED = {"1": {"cache_slots": 3}, "every:1": {"cache_dtype": "int8"}}


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test's own data cache (one thread: conftest.py)."""
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    return {"teacher": tiny_teacher_folder(root / "teacher"), "corpus": tiny_corpus_file(root / "corpus.jsonl"),
            "root": root}


def _recipe(assets: dict[str, Path], stem: str, **extra: object) -> Path:
    return write_recipe(assets["root"] / f"{stem}.yaml", {**tiny_recipe_dict(TRAINED), **extra})


def _convert(assets: dict[str, Path], recipe: Path, out: Path) -> int:
    return main(["convert", "--teacher", str(assets["teacher"]), "--recipe", str(recipe), "--output", str(out),
                 "--corpus", str(assets["corpus"]), "--no-progress", "--no-eval", "--threads", "1"])


def test_the_served_model_is_the_trained_one_with_the_options(assets: dict[str, Path], tmp_path: Path) -> None:
    """Same seed with and without ``serve_overrides``: the same weights byte for byte; the served config differs
    only by the options; loaded back, the model computes what the trained one computes with those options set (and
    not what it computes without them, the cache being full); a rerun finds the served model done."""
    plain, served = tmp_path / "plain", tmp_path / "served"
    assert _convert(assets, _recipe(assets, "plain"), plain) == 0
    recipe = _recipe(assets, "served", serve_overrides=SERVED)
    assert _convert(assets, recipe, served) == 0
    weights = "model/model.safetensors"
    assert (plain / weights).read_bytes() == (served / weights).read_bytes()
    loaded = [AutoModelForCausalLM.from_pretrained(folder / "model").eval() for folder in (plain, served)]
    trained, specs = (m.config.layer_specs() for m in loaded)
    assert all(s["cache_dtype"] == "int4" and s["cache_slots"] == 4 for s in trained)
    assert specs == [{**trained[0], "cache_dtype": "int8"}, {**trained[1], "cache_dtype": "int8", "cache_slots": 3}]
    report = json.loads((served / "report.json").read_text())
    assert report["recipe"]["serve_overrides"] == SERVED
    card = (served / "model" / "README.md").read_text()
    assert "(`serve_overrides`): layers `1`: `cache_slots: 3`; layers `every:1`: `cache_dtype: int8`." in card
    assert "then saved to serve" not in (plain / "model" / "README.md").read_text()

    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    rebuilt = type(loaded[0])(loaded[1].config).eval()
    rebuilt.load_state_dict(loaded[0].state_dict())
    with torch.no_grad():
        got, want, unserved = (m(input_ids=ids).logits for m in (loaded[1], rebuilt, loaded[0]))
    assert torch.equal(got, want)
    assert (got - unserved).abs().max() > 1e-4

    before = (served / weights).stat().st_mtime_ns
    assert _convert(assets, recipe, served) == 0
    assert (served / weights).stat().st_mtime_ns == before


def test_a_converted_checkpoint_reoptioned_without_training(assets: dict[str, Path], tmp_path: Path) -> None:
    """``init`` (a converted checkpoint), no tokens in either stage and ``serve_overrides``: the checkpoint saved
    again with the options, its weights byte for byte."""
    first = tmp_path / "first"
    assert _convert(assets, _recipe(assets, "first"), first) == 0
    recipe = _recipe(assets, "reoption", init=str(first / "model"), stage1={"tokens": 0},
                     stage2={**tiny_recipe_dict()["stage2"], "tokens": 0}, serve_overrides=SERVED)
    assert _convert(assets, recipe, tmp_path / "again") == 0
    weights = "model/model.safetensors"
    assert (first / weights).read_bytes() == (tmp_path / "again" / weights).read_bytes()
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "again" / "model").config
    assert [(s["cache_dtype"], s["cache_slots"]) for s in config.layer_specs()] == [("int8", 4), ("int8", 3)]


def test_the_fingerprint_names_the_served_options(assets: dict[str, Path]) -> None:
    """Without ``serve_overrides`` (or with an empty one) a recipe keeps the fingerprint it had before the key
    existed (test_recipe.py pins the packaged ones'); with them, the run is another one."""
    plain = load_recipe(_recipe(assets, "fp-plain", name="fp"))
    empty = load_recipe(_recipe(assets, "fp-empty", name="fp", serve_overrides={}))
    served = load_recipe(_recipe(assets, "fp-served", name="fp", serve_overrides=SERVED))
    assert plain.fingerprint() == empty.fingerprint() != served.fingerprint()


@pytest.mark.parametrize(("overrides", "says"), [
    ({"every:1": {"cache_colour": "red"}}, r"serve_overrides\['every:1'\]: \['cache_colour'\] unknown"),
    ([{"cache_dtype": "int8"}], r"serve_overrides must map a layer key"),
    ({"0": {}}, r"serve_overrides must map a layer key"),
])
def test_a_malformed_entry_is_refused_when_the_recipe_loads(overrides: object, says: str,
                                                            assets: dict[str, Path]) -> None:
    path = _recipe(assets, "malformed", serve_overrides=overrides)
    with pytest.raises(ValueError, match=r"malformed\.yaml: " + says):
        load_recipe(path)


@pytest.mark.parametrize(("overrides", "says"), [
    ({"every:1": {"cache_slots": 4096}}, "exceeds max_position_embeddings=2048"),
    ({"every:1": {"cache_score": "learned"}}, "change the parameters"),  # a retention head the training never made
    ({"5": {"cache_slots": 2}}, r"serve_overrides\['5'\]: layer index out of range"),
    ({"every:x": {"cache_slots": 2}}, r"serve_overrides\['every:x'\]: expected 'every:N"),
])
def test_options_that_do_not_fit_are_refused_before_any_work(overrides: object, says: str, assets: dict[str, Path],
                                                             tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = _recipe(assets, "misfit", serve_overrides=overrides)
    assert _convert(assets, recipe, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "misfit.yaml" in err and "serve_overrides" in err, err
    assert re.search(says, err), err
    assert not (tmp_path / "out").exists()
