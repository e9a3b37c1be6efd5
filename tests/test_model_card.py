"""Model cards, the zoo index and the files a push publishes, on a tiny saved checkpoint with a report.

The card is read back with huggingface_hub's own parser (``ModelCard.load``), so the front matter and the
``model-index`` must be what the Hub's conventions accept; sizes in the state table are checked against the
KV-cache formula written out here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import ModelCard
from tiny_lm import tiny_tokenizer

from hf_recattn import RecAttnConfig, RecAttnForCausalLM
from hf_recattn.hub import check_repo_id, checkpoint_files
from hf_recattn.model_card import build_model_card, state_table, write_model_card
from hf_recattn.zoo import _entry_name, build_zoo, entry_from_run, format_zoo, zoo_entries

LAYERS = [{"mixer": "hybrid", "window": 4}, {"mixer": "linear", "feature_map": "elu"}]
HKV, HEAD_DIM = 2, 8


def save_checkpoint(folder: Path, layers: list[dict[str, Any]] = LAYERS) -> Path:
    config = RecAttnConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers),
                           num_attention_heads=4, num_key_value_heads=HKV, max_position_embeddings=256,
                           attention=layers)
    torch.manual_seed(0)
    RecAttnForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


PROVENANCE = {"date": "2026-01-02", "commit": "0123456789abcdef", "command": "hf-recattn convert ...",
              "packages": {"torch": "2.13.0", "transformers": "5.24.0"}, "threads": 1,
              "machine": {"cpu": "Some CPU", "cores": 2, "gpu": None, "platform": "Linux"},
              "corpus": {"version": 3, "sha256": "ab" * 32}}


def fake_report(ppl: float = 11.5, teacher_ppl: float = 10.0, passkey: float = 0.5) -> dict[str, Any]:
    row = {"perplexity": ppl, "eval_tokens": 128, "block_size": 32,
           "passkey": {"accuracy": {"1024": passkey}, "mean_accuracy": passkey},
           "needles": {"accuracy": {"heldout": 0.75, "ood": 1.0}, "tasks": ["single_number"], "lengths": [1024],
                       "cells": {"single_number": {
                           "heldout": {"1024": {"accuracy": 0.75, "n": 4, "interval": [0.3, 0.95]}},
                           "ood": {"1024": {"accuracy": 1.0, "n": 4, "interval": [0.51, 1.0]}}}}}}
    return {
        "teacher": "org/teacher",
        "teacher_license": "mit",
        "data": "embedded",
        "recipe": {"name": "tiny", "budget": "quick", "seed": 0, "description": "a tiny recipe",
                   "stage1": {"tokens": 1000}, "stage2": {"tokens": 500}},
        "student": row,
        "comparison": {"teacher": {"perplexity": teacher_ppl, "passkey": {"mean_accuracy": 1.0}}, "tiny": row},
        "provenance": PROVENANCE,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_checkpoint(tmp_path_factory.mktemp("ckpt"))
    (folder / "report.json").write_text(json.dumps(fake_report()))
    return folder


def test_card_metadata_parses_with_huggingface_hub(checkpoint: Path, tmp_path: Path) -> None:
    path = write_model_card(checkpoint, "org/tiny-recattn")
    data = ModelCard.load(path).data
    assert data.license == "mit" and data.base_model == "org/teacher"
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"hf_recattn", "mixer-hybrid", "mixer-linear", "distillation"} <= set(data.tags)
    results = {r.metric_type: r.metric_value for r in data.eval_results}
    assert results == {"perplexity": 11.5, "perplexity_ratio": 1.15, "passkey_accuracy": 0.5,
                       "needle_accuracy_heldout": 0.75, "needle_accuracy_ood": 1.0}
    names = {r.metric_type: (r.metric_name, r.dataset_name) for r in data.eval_results}
    assert names["passkey_accuracy"][0].startswith("synthetic passkey")
    assert names["needle_accuracy_ood"] == ("needle recall (single_number; 1024 tokens)",
                                            "facts hidden in the embedded corpus's license texts")
    assert data.model_name == "org/tiny-recattn"


def test_card_body_tables_and_snippets(checkpoint: Path) -> None:
    text = str(build_model_card(checkpoint, "org/tiny-recattn"))
    assert "| 0 | `hybrid` | window=4 |" in text and "| 1 | `linear` | - |" in text
    # the teacher's KV cache: 2 (k and v) x KV heads x head dim x tokens x layers x 2 bytes
    for context, shown in ((1024, "128.0 KiB"), (8192, "1.00 MiB"), (32768, "4.00 MiB")):
        assert 2 * HKV * HEAD_DIM * context * len(LAYERS) * 2 == float(shown.split()[0]) * (2**10 if "KiB" in shown
                                                                                         else 2**20)
        assert f"| {context:,} |" in text and f"| {shown} |" in text
    assert "| tiny | 11.50 | 1.150 |" in text and "1024 tokens: 50%" in text
    assert 'AutoTokenizer.from_pretrained("org/tiny-recattn", trust_remote_code=True)' in text
    assert 'AutoModelForCausalLM.from_pretrained("org/tiny-recattn", trust_remote_code=True)' in text
    assert ("Facts hidden once in natural text are recalled 75% in held-out documents and 100% in the embedded "
            "corpus's license texts: do not rely") in text and "1,000 tokens" in text
    assert "Passkey retrieval succeeds" not in text  # the synthetic probe warns only where no needles ran
    assert ("single_number in held-out documents at 1024 tokens 75% [30%-95%] of 4; single_number in the embedded "
            "corpus's license texts at 1024 tokens 100% [51%-100%] of 4.") in text
    assert "Synthetic passkey accuracy of this model by context: 1024 tokens: 50%." in text
    assert "finetuning with transformers' Trainer (LoRA, loss" in text


def test_card_limitations_follow_the_needles_and_the_recipe_source(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "model")
    report = fake_report()
    report["recipe"].update(source="my/recipe.yaml", eval={"quick": True})  # a file: its budget is its own
    text = str(build_model_card(folder, "org/x", report=report))
    assert "quick-budget conversion" not in text and "ran the quick probes" in text
    report["recipe"]["source"] = "hf_recattn/recipes/tiny.yaml"  # a packaged quick budget
    assert "This is a quick-budget conversion" in str(build_model_card(folder, "org/x", report=report))
    del report["student"]["needles"]  # a report from before the needle probe: the passkey warns
    assert "Passkey retrieval succeeds in 50% of trials" in str(build_model_card(folder, "org/x", report=report))


def test_card_limitations_give_the_perplexity_ratio_on_both_kinds_of_text(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "model")
    report = fake_report(ppl=11.5, teacher_ppl=10.0)
    text = str(build_model_card(folder, "org/x", report=report))
    assert "Held-out perplexity is 1.15x the teacher's, measured on one corpus" in text  # no OOD figure yet
    report["comparison"]["teacher"]["perplexity_ood"] = {"perplexity": {"32": 20.0}}
    report["student"] = {**report["student"], "perplexity_ood": {"perplexity": {"32": 26.0}}}
    text = str(build_model_card(folder, "org/x", report=report))
    assert ("Held-out perplexity is 1.15x the teacher's (1.30x on the embedded corpus's license texts, which no "
            "training block uses), measured on one corpus") in text


def test_card_names_a_full_finetune(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "full")
    report = fake_report()
    report["recipe"]["stage2"]["method"] = "full"
    (folder / "report.json").write_text(json.dumps(report))
    text = str(build_model_card(folder, "org/tiny-recattn"))
    assert "finetuning with transformers' Trainer (every weight, loss" in text and "LoRA" not in text


def test_state_of_a_recurrent_model_stops_growing(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "m", [{"mixer": "linear"}] * 2)
    rows = [line for line in str(build_model_card(folder, "x/y")).splitlines() if line.startswith("| 8,192 |")
            or line.startswith("| 32,768 |")]
    assert len(rows) == 2 and rows[0].split("|")[2] == rows[1].split("|")[2]  # same state at 8k and 32k


def test_card_without_a_report_says_so(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "m")
    card = build_model_card(folder, "org/x")
    assert "No evaluation report ships" in str(card) and card.data.eval_results is None
    assert card.data.license is None and card.data.base_model is None


def test_a_gemma_derived_card_carries_the_gemma_terms(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "m")
    card = build_model_card(folder, "org/x", teacher="google/gemma-3-270m")
    assert card.data.license == "gemma" and card.data.base_model == "google/gemma-3-270m"
    assert "subject to the Gemma Terms of Use found at https://ai.google.dev/gemma/terms" in str(card)
    assert "Gemma Terms" not in str(build_model_card(folder, "org/x", teacher="HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_not_a_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        build_model_card(tmp_path, "org/x")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type is 'llama'"):
        checkpoint_files(tmp_path)


def test_push_publishes_only_the_allowed_files(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "m")
    for junk in ("optimizer.pt", "pytorch_model.bin", "trainer_state.json", "train.log"):
        (folder / junk).write_text("x")
    (folder / "stage1").mkdir()
    (folder / "stage1" / "mixer.safetensors").write_text("x")
    names = {p.name for p in checkpoint_files(folder)}
    assert {"config.json", "model.safetensors", "modeling.py", "configuration.py", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json"} <= names
    assert not names & {"optimizer.pt", "pytorch_model.bin", "trainer_state.json", "train.log", "stage1"}
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors weights"):
        checkpoint_files(folder)


def test_missing_runtime_files_are_refused(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path / "m")
    (folder / "modeling.py").unlink()
    with pytest.raises(ValueError, match="runtime files .* missing \\(modeling.py\\)"):
        checkpoint_files(folder)


@pytest.mark.parametrize("bad", ["org//name", "-org/name", "org/na me", "a/b/c", ""])
def test_invalid_repo_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="is not valid"):
        check_repo_id(bad)


def test_zoo_from_runs(tmp_path: Path) -> None:
    runs = []
    for name, layers, ppl in (("hyb", LAYERS, 11.0), ("lin", [{"mixer": "linear"}] * 2, 30.0)):
        run = tmp_path / name
        save_checkpoint(run / "model", layers)
        report = fake_report(ppl=ppl)
        report["recipe"]["name"] = name
        report["student"]["associative_recall"] = {"mean_accuracy": 0.25}
        report["recipe"]["source"] = f"hf_recattn/recipes/{name}.yaml" if name == "hyb" else f"my/{name}.yaml"
        (run / "report.json").write_text(json.dumps(report))
        runs.append(run)
    entries = build_zoo(runs, tmp_path / "cards", "python scripts/build_zoo.py ...")
    assert [e["recipe"] for e in entries] == ["lin", "hyb"]  # smallest state first
    hyb = entries[1]
    assert hyb["perplexity_ratio"] == 1.1 and hyb["training_tokens"] == 1500
    assert hyb["associative_recall"] == 0.25 and hyb["teacher_associative_recall"] is None
    assert "| 25% |" in format_zoo(entries)
    assert hyb["teacher_kv_mib_at_8k"] == round(2 * HKV * HEAD_DIM * 8192 * 2 * 2 / 2**20, 3)
    assert hyb["command"].endswith("--recipe hyb --budget quick --output runs/hyb")  # packaged: by its name
    assert entries[0]["command"].endswith("--recipe my/lin.yaml --budget quick --output runs/lin")  # a file: its path
    assert zoo_entries(tmp_path / "cards" / "zoo.json") == entries
    index = (tmp_path / "cards" / "README.md").read_text()
    assert format_zoo(entries) in index and "python scripts/build_zoo.py ..." in index
    assert "Measured on embedded corpus v3 (sha256 abababababab); Some CPU, 2 cores; 1 thread" in index
    assert json.loads((tmp_path / "cards" / "zoo.json").read_text())["provenance"] == PROVENANCE
    assert ModelCard.load(tmp_path / "cards" / "hyb.md").data.model_name == "smollm2-135m-hyb"
    gem = tmp_path / "gem"  # a run of another embedded teacher, added to the index built above
    save_checkpoint(gem / "model", LAYERS)
    report = fake_report(ppl=12.0)
    report["recipe"]["name"] = "gem"
    (gem / "report.json").write_text(json.dumps(report))
    (gem / "run.json").write_text(json.dumps({"teacher": "gemma3-270m"}))
    added = build_zoo([gem, runs[0]], tmp_path / "cards", "python scripts/build_zoo.py --add ...", add=True)
    assert sorted(e["name"] for e in added) == ["gemma3-270m-gem", "smollm2-135m-hyb", "smollm2-135m-lin"]
    assert _entry_name("gemma3-270m", "gemma3-270m-full-delta") == "gemma3-270m-full-delta"  # no doubled prefix
    gem_entry = next(e for e in added if e["recipe"] == "gem")
    assert gem_entry["command"].startswith("hf-recattn convert --teacher gemma3-270m ")
    assert "| `gem` (quick) |" in format_zoo(added)
    one = tmp_path / "one"  # a recipe file without budgets: its run records the budget "default"
    save_checkpoint(one / "model", LAYERS)
    report = fake_report()
    report["recipe"].update(name="one", budget="default", source="my/one.yaml")
    (one / "report.json").write_text(json.dumps(report))
    one_entry = entry_from_run(one)
    assert one_entry["command"].endswith("--recipe my/one.yaml --output runs/one")  # no --budget it cannot take
    assert "| `one` |" in format_zoo([one_entry])
    assert zoo_entries(tmp_path / "cards" / "zoo.json") == added
    assert json.loads((tmp_path / "cards" / "zoo.json").read_text())["command"] == (
        "python scripts/build_zoo.py ...\npython scripts/build_zoo.py --add ...")
    build_zoo([gem], tmp_path / "cards", "python scripts/build_zoo.py --add ...", add=True)  # the same, rerun
    assert json.loads((tmp_path / "cards" / "zoo.json").read_text())["command"] == (
        "python scripts/build_zoo.py ...\npython scripts/build_zoo.py --add ...")
    other = json.loads((runs[1] / "report.json").read_text())
    other["provenance"] = {**PROVENANCE, "corpus": {"version": 2, "sha256": "cd" * 32}}
    (runs[1] / "report.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="zoo entries .* differ in corpus"):
        build_zoo(runs, tmp_path / "cards2", "python scripts/build_zoo.py ...")
    del other["provenance"]
    (runs[1] / "report.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="no provenance record"):
        entry_from_run(runs[1])
    (runs[0] / "report.json").unlink()
    with pytest.raises(ValueError, match="report.json: no conversion report"):
        entry_from_run(runs[0])


def test_shipped_zoo_lists_the_main_job_and_two_more() -> None:
    entries = zoo_entries()
    recipes = {e["recipe"] for e in entries}
    assert "retrieval9-int8-int4keydiff" in recipes and len(recipes) >= 3  # the README main job and more
    for e in entries:
        # a student finetuned on the corpus it is scored on may beat the teacher there (the retrieval recipe: 0.97x)
        assert 0.5 < e["perplexity_ratio"] < 100 and 0 < e["state_fraction_at_8k"] < 1
        assert (Path(__file__).parents[1] / "model_cards" / e["card"]).is_file()


def test_cached_hybrid_entry_and_card_show_the_cache_and_recall(tmp_path: Path) -> None:
    """A hybrid with the exact cache: the zoo entry and the card give the cache's slots and bytes, passkey at every
    length and recall by distance; an entry from another machine is named under the table."""
    layers = [{"mixer": "hybrid", "window": 4, "cache_slots": 8}, {"mixer": "linear", "feature_map": "elu"}]
    run = tmp_path / "cached"
    save_checkpoint(run / "model", layers)
    report = fake_report()
    report["recipe"]["name"] = "cached"
    report["student"]["passkey"] = {"accuracy": {"4096": 0.5, "1024": 1.0}, "mean_accuracy": 0.75}
    report["student"]["recall_by_distance"] = {"accuracy": {"100": 1.0, "1000": 0.5}}
    report["comparison"]["teacher"]["recall_by_distance"] = {"accuracy": {"100": 1.0, "1000": 1.0}}
    report["student"]["needles"] = {"accuracy": {"heldout": 0.85, "ood": 0.95}}
    report["comparison"]["teacher"]["needles"] = {"accuracy": {"heldout": 0.9, "ood": 1.0}}
    report["provenance"] = {**PROVENANCE, "machine": {"cpu": "Other CPU", "cores": 2, "gpu": None,
                                                       "platform": "Linux"}}
    for folder in (run, run / "model"):  # a conversion writes it into both
        (folder / "report.json").write_text(json.dumps(report))
    plain = tmp_path / "plain"
    save_checkpoint(plain / "model")
    plain_report = fake_report()
    del plain_report["student"]["needles"]  # a report from before the needle probe
    (plain / "report.json").write_text(json.dumps(plain_report))
    entries = build_zoo([plain, run], tmp_path / "cards", "python scripts/build_zoo.py ...")
    entry = next(e for e in entries if e["recipe"] == "cached")
    # the cache and its pending buffer: (cache_slots + window) x (k and v of each KV head + a mask) x 2 bytes
    assert entry["cache_slots"] == 8
    assert entry["exact_cache_mib_at_8k"] == round((8 + 4) * (2 * HKV * HEAD_DIM + 1) * 2 / 2**20, 3)
    assert entry["recall_by_distance"] == {"100": 1.0, "1000": 0.5}
    assert entry["teacher_recall_by_distance"] == {"100": 1.0, "1000": 1.0}
    assert entry["needles"] == {"heldout": 0.85, "ood": 0.95} and entry["teacher_needles"]["ood"] == 1.0
    assert next(e for e in entries if e["recipe"] == "tiny")["cache_slots"] == 0
    table = format_zoo(entries)
    assert "| 8 slots, 0.00 MiB |" in table
    assert "| 85 / 95% (90 / 100%) | 1024: 100%, 4096: 50% | 100: 100%, 1000: 50% |" in table  # needles, passkey
    assert "| - | 1024: 50% |" in table  # a report without the needle probe
    assert "| needles held-out / OOD (teacher) | passkey (synthetic) |" in table
    assert ("Measured on another machine than the line below says: smollm2-135m-cached: embedded corpus v3 (sha256 "
            "abababababab); Other CPU, 2 cores") in table
    assert json.loads((tmp_path / "cards" / "zoo.json").read_text())["provenance"] == PROVENANCE
    card = (tmp_path / "cards" / "cached.md").read_text()
    assert "the exact cache of its hybrid layers (`cache_slots` 8" in card
    assert "1024 tokens: 100%, 4096 tokens: 50%" in card
    assert "Recall of one fact by how far before the question it was planted: 100 tokens back: 100%, 1000 tokens " \
           "back: 50%." in card


@pytest.mark.parametrize(("scores", "says", "never"), [
    (["far"], ["its far state recalls worst"], "least like"),
    (["novelty"], ["least like any value in the window"], "recalls worst"),
    (["far", "novelty"], ["its far state recalls worst; the key / value pairs whose values are least like"], None),
    (["keydiff+3"], ["from the mean direction of the candidates' keys, the 3 newest kept first"], "recalls worst"),
    (["keydiff", "keydiff+3"], ["candidates' keys; the key / value pairs whose keys", "the 3 newest kept first"],
     None),
])
def test_card_says_what_each_cache_score_keeps(scores: list[str], says: list[str], never: str | None) -> None:
    """The card's sentence on the exact cache names what the layers' ``cache_score`` keeps (and the newest pairs
    reserved by ``cache_recent``, written ``score+N`` here), each once."""
    def cache(score: str) -> dict[str, Any]:
        name, _, reserve = score.partition("+")
        return {"cache_score": name, "cache_recent": int(reserve or 0)}

    layers = [{"mixer": "hybrid", "window": 4, "cache_slots": 8, **cache(s)} for s in scores for _ in range(2)]
    layers.append({"mixer": "hybrid", "window": 4})  # no cache: says nothing
    config = RecAttnConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers),
                           num_attention_heads=4, num_key_value_heads=HKV, max_position_embeddings=256,
                           attention=layers)
    text = state_table(config)
    for phrase in says:
        assert phrase in text
    assert text.count("recalls worst") <= 1 and text.count("least like") <= 1
    if never:
        assert never not in text
