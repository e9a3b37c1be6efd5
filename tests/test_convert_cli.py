"""``hf-recattn convert`` end to end on a tiny teacher folder and a tiny corpus file: outputs, resume after an
interrupt, refusing a folder that holds another run, determinism, and the NaN stop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_teacher_folder, write_recipe
from safetensors.torch import load_file
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from hf_recattn import evaluation
from hf_recattn.cli import main
from hf_recattn.conversion import stage2 as stage2_module
from hf_recattn.conversion.baselines import WINDOW_LABEL
from hf_recattn.data.corpus import load_texts, split_heldout, token_blocks
from hf_recattn.evaluation import suite
from hf_recattn.training import attention_objective as objective
from hf_recattn.training.distill import finetune as distill_finetune
from hf_recattn.training.parallel import local_share

HYBRID = {"mixer": "hybrid", "window": 8, "far": {"mixer": "linear", "feature_map": "hedgehog"}}
#: window + sinks + a gated delta far part (the hybrid-w64-sink4-gdn recipe in miniature)
HYBRID_DELTA = {"mixer": "hybrid", "window": 8, "sink_tokens": 2, "combine": "sum", "mix_init": 0.9,
                "far": {"mixer": "delta", "init": "convert", "conv_size": 2, "output_norm": False,
                        "output_gate": False}}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {
        "teacher": tiny_teacher_folder(root / "teacher"),
        "corpus": tiny_corpus_file(root / "corpus.jsonl"),
        "hybrid": write_recipe(root / "tiny-hybrid.yaml", tiny_recipe_dict(HYBRID, eval={"baselines": None})),
        "hybrid_delta": write_recipe(root / "tiny-hybrid-delta.yaml", tiny_recipe_dict(HYBRID_DELTA)),
        "linear": write_recipe(root / "tiny-linear.yaml", tiny_recipe_dict()),
        "retrieval": write_recipe(root / "tiny-retrieval.yaml", tiny_recipe_dict(
            HYBRID, retrieval_heads={"max_heads": 1, "context_length": 256, "prompts": 1, "per_round": 1},
            stage2={"block_size": 512, "batch_size": 1, "tokens": 2048, "retrieval_share": 0.5,
                    "answer_weight": 20})),
        "retrieval_teacher": write_recipe(root / "tiny-retrieval-teacher.yaml", tiny_recipe_dict(
            {"mixer": "hybrid", "window": 8, "sink_tokens": 2, "far": "none"}, stage1={"tokens": 0},
            stage2={"tokens": 0},
            retrieval_heads={"max_heads": 2, "context_length": 512, "prompts": 1, "method": "teacher",
                             "kinds": ["words", "passkey"],
                             "retrieval": {"mixer": "hybrid", "window": 64, "sink_tokens": 2, "far": "none"}})),
        "fox": write_recipe(  # the fox recipe in miniature: lossless start, no stage 1, gates train in stage 2
            root / "tiny-fox.yaml",
            tiny_recipe_dict({"mixer": "softmax", "forget": "fox"}, stage1={"tokens": 0},
                             stage2={"train_mixer": True, "mixer_lr": 0.1, "mixer_eps": 1.0e-16}),
        ),
    }


def _args(assets: dict[str, Path], out: Path, recipe: str = "linear", *extra: str) -> list[str]:
    return [
        "convert",
        "--teacher",
        str(assets["teacher"]),
        "--recipe",
        str(assets[recipe]),
        "--output",
        str(out),
        "--corpus",
        str(assets["corpus"]),
        "--no-progress",
        *extra,
    ]


@pytest.mark.parametrize("recipe", ["hybrid", "hybrid_delta"])
def test_convert_end_to_end_hybrid(
    recipe: str, assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "run"
    recipe_name = assets[recipe].stem
    recall_sources: list[object] = []
    real_evaluate = evaluation.evaluate

    def spy(*args: object, **kwargs: object) -> dict:
        recall_sources.append(kwargs.get("recall_texts"))
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    assert main(_args(assets, out, recipe)) == 0
    # every model's associative recall plants its facts in the whole held-out documents, not in the blocks
    heldout = split_heldout(load_texts(str(assets["corpus"])), 0.2, seed=0)[1]  # the tiny recipe's fraction
    baselines = [WINDOW_LABEL] if recipe == "hybrid" else []  # the recipe's default, or none (eval.baselines [])
    assert len(recall_sources) == 4 + len(baselines) and all(source == heldout for source in recall_sources)
    printed = capsys.readouterr().out
    assert "| teacher |" in printed and "| window-only |" in printed and "| far-only |" in printed
    assert (f"| {WINDOW_LABEL} |" in printed) == bool(baselines)
    assert "through the window cache" in printed  # the sample went through the recurrent cache
    model_dir = out / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "report.json"):
        assert (model_dir / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    rows = report["comparison"]
    assert set(rows) == {"teacher", "window-only", "far-only", recipe_name, *baselines}
    for row in rows.values():
        assert row["perplexity"] > 1 and row["eval_tokens"] == rows["teacher"]["eval_tokens"]
    if baselines:  # the teacher's weights with its window: 512 tokens + 4 sinks cover the 32-token blocks exactly
        window = rows[WINDOW_LABEL]
        assert {(s["mixer"], s["window"], s["sink_tokens"], s["far"]) for s in window["model"]["attention"]} == {
            ("hybrid", 512, 4, "none")}
        assert window["perplexity"] == pytest.approx(rows["teacher"]["perplexity"], rel=1e-4)
        assert window["perplexity"] != pytest.approx(rows[recipe_name]["perplexity"], rel=1e-4)
    assert report["stage1"]["steps"] == 6 and report["stage2"]["steps"] == 4
    provenance = report["provenance"]  # a local corpus file: no corpus pin, but the rest of the record
    assert "corpus" not in provenance and provenance["packages"]["transformers"] and provenance["machine"]["cpu"]
    card = (model_dir / "README.md").read_text()
    assert card.startswith("---") and "| window-only |" in card and recipe_name in card
    assert (f"| {WINDOW_LABEL} |" in card) == bool(baselines) == ("untrained, with softmax over only" in card)
    # the tokenizer knows the model's positions: the teacher's 2048 where the sinks need them, else transformers'
    # "unbounded" (a window and a far part need none: tests/test_length_limit.py)
    limit = 2048 if recipe == "hybrid_delta" else VERY_LARGE_INTEGER
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["model_max_length"] == limit
    # the folder is a plain checkpoint: it loads with the Auto classes and generates through its cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("the cat sat", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == ids.shape[1] + 4
    # stage checkpoints are cleaned up once the model exists
    assert not (out / "stage1" / "progress").exists() and not (out / "stage2" / "trainer").exists()


def test_convert_keeps_retrieval_heads_and_resumes_with_them(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """After stage 1 the run chooses one KV head, records it, finetunes (half of the blocks retrieval prompts) and
    saves the model that keeps it; a rerun without the model reads the choice instead of searching again."""
    out = tmp_path / "run"
    assert main(_args(assets, out, "retrieval")) == 0
    chosen = json.loads((out / "retrieval_heads.json").read_text())
    assert chosen["count"] == 1 and chosen["prompts"] == 2  # a secret number and a recall fact
    (layer, heads), = chosen["heads"].items()
    report = json.loads((out / "report.json").read_text())
    assert report["retrieval_heads"]["heads"] == chosen["heads"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    spec = model.config.layer_spec(int(layer))
    assert spec["mixer"] == "retrieval_heads" and spec["heads"] == heads and spec["others"]["mixer"] == "hybrid"
    printed = capsys.readouterr().out
    assert "retrieval heads: choosing at most 1" in printed
    assert "2 of 4 blocks hide facts in training text" in printed and report["stage2"]["steps"] == 4
    shutil.rmtree(out / "model")
    assert main(_args(assets, out, "retrieval", "--no-eval")) == 0
    assert "retrieval heads: chosen earlier, 1 KV heads" in capsys.readouterr().out


def test_convert_keeps_the_teachers_retrieval_heads_bounded(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without training: the two KV heads the teacher copies answers with run the recipe's bounded spec, the rest
    the window; the choice and the teacher's scores are recorded, and the state no longer grows."""
    from hf_recattn.state_size import state_size_report

    out = tmp_path / "run"
    assert main(_args(assets, out, "retrieval_teacher", "--no-eval")) == 0
    chosen = json.loads((out / "retrieval_heads.json").read_text())
    assert chosen["method"] == "teacher" and chosen["count"] == 2
    assert sum(map(len, chosen["heads"].values())) == 2
    scores = torch.tensor(chosen["scores"])
    kept = sorted(float(scores[int(layer), h]) for layer, kv in chosen["heads"].items() for h in kv)
    assert kept[0] >= scores.flatten().sort(descending=True).values[1].item() - 1e-5  # the two highest
    printed = capsys.readouterr().out
    assert "the 2 KV heads the teacher copies with on 2 recall prompts of 512 tokens (words, passkey)" in printed
    assert "scored 2 of 2 prompts (512 tokens)" in printed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    for layer, heads in chosen["heads"].items():
        spec = model.config.layer_spec(int(layer))
        if len(heads) == model.config.num_key_value_heads:  # every KV head of the layer: the retrieval spec whole
            assert spec["mixer"] == "hybrid" and spec["window"] == 64
        else:
            assert spec["mixer"] == "retrieval_heads" and spec["heads"] == heads
            assert spec["retrieval"]["window"] == 64
    sizes = [sum(r.state_elements for r in state_size_report(model.config, n)) for n in (100, 10_000)]
    assert sizes[0] == sizes[1]


def test_convert_end_to_end_fox(assets: dict[str, Path], tmp_path: Path) -> None:
    """Stage 1 is skipped, stage 2 trains the FoX gates, the checkpoint keeps them and generates."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main(_args(assets, out, "fox")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["stage2"]["steps"] == 4
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    biases = torch.stack([layer.self_attn.mixer.fox_bias for layer in model.model.layers])
    moved = (biases - 18.0).abs()
    # trained (not re-initialized on load) at the gates' own rate: the first Adam step alone moves every bias by
    # mixer_lr = 0.1, while in the LoRA group (lr 1e-3, eps 1e-8) 4 steps could move it by at most 4e-3
    assert moved.max() > 0.09 and moved.max() <= 4 * 0.1 + 1e-4
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).shape[1] == 7


def test_throughput_counts_only_the_steps_of_this_sitting() -> None:
    from types import SimpleNamespace

    from hf_recattn.conversion.stage1 import tokens_per_second

    fresh = SimpleNamespace(tokens=1000, steps=10, resumed_from=0, seconds=5.0)
    resumed = SimpleNamespace(tokens=1000, steps=10, resumed_from=4, seconds=3.0)  # 6 steps of 100 tokens
    assert tokens_per_second(fresh) == 200.0 and tokens_per_second(resumed) == 200.0


def test_resume_after_interrupt_skips_finished_stage(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("hf_recattn.conversion.stage2.finetune", interrupted)
    assert main(_args(assets, out, "linear", "--no-eval")) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert (out / "stage1" / "result" / "summary.json").is_file() and not (out / "model").exists()
    saved = (out / "stage1" / "result" / "mixer.safetensors").read_bytes()

    monkeypatch.undo()
    monkeypatch.setenv("HF_RECATTN_CACHE", str(tmp_path / "cache"))

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("stage 1 ran again")

    monkeypatch.setattr("hf_recattn.conversion.stage1.attention_transfer", must_not_run)
    assert main(_args(assets, out, "linear", "--no-eval")) == 0
    printed = capsys.readouterr().out
    assert "resuming" in printed and "stage 1: done earlier" in printed
    assert (out / "model" / "model.safetensors").is_file()
    assert (out / "stage1" / "result" / "mixer.safetensors").read_bytes() == saved


def test_an_interrupted_evaluation_resumes_from_its_finished_probes(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    recall = suite.associative_recall_probe
    models: list[int] = []

    def stopped_at_the_student(*args: object, **kwargs: object) -> object:
        models.append(1)
        if len(models) == 2:  # the teacher's, then the student's: interrupted there
            raise KeyboardInterrupt
        return recall(*args, **kwargs)

    monkeypatch.setattr(suite, "associative_recall_probe", stopped_at_the_student)
    assert main(_args(assets, out, "linear")) == 130
    assert not (out / "report.json").exists()
    assert sorted(p.name for p in (out / "evaluation").iterdir()) == ["teacher", "tiny-linear"]
    assert (out / "evaluation" / "teacher" / "associative_recall.json").is_file()
    assert not (out / "evaluation" / "tiny-linear" / "associative_recall.json").exists()
    monkeypatch.undo()
    perplexities: list[int] = []
    monkeypatch.setattr(suite, "perplexity", lambda *a, **k: perplexities.append(1))
    assert main(_args(assets, out, "linear")) == 0
    report = json.loads((out / "report.json").read_text())
    assert not perplexities  # every model's perplexity had finished: read back, not measured again
    teacher, student = report["comparison"]["teacher"], report["student"]
    assert "associative_recall" in teacher["resumed_probes"] and "perplexity" in student["resumed_probes"]
    assert "associative_recall" not in student["resumed_probes"] and student["associative_recall"]["accuracy"]
    first, second = report["sittings"]["sittings"]  # the interrupted sitting ends at the last probe it stored
    assert first["ended_by"] == "last_file" and second["ended_by"] == "report"
    assert report["sittings"]["total_s"] == round(first["seconds"] + second["seconds"], 1)


def test_the_report_names_the_code_the_run_began_with(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provenance is taken before the training: a commit made while a conversion runs is not what it ran."""
    events: list[str] = []
    monkeypatch.setattr("hf_recattn.conversion.pipeline.provenance",
                        lambda **kwargs: events.append("provenance") or {"commit": f"at event {len(events)}"})
    finetune = stage2_module.finetune
    monkeypatch.setattr(stage2_module, "finetune", lambda *a, **k: events.append("stage 2") or finetune(*a, **k))
    assert main(_args(assets, tmp_path / "run", "linear", "--no-eval")) == 0
    assert events == ["provenance", "stage 2"]
    assert json.loads((tmp_path / "run" / "report.json").read_text())["provenance"] == {"commit": "at event 1"}


def test_refuses_a_folder_holding_something_else(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(_args(assets, out, "linear", "--no-eval")) == 2
    assert "already holds files that are not a conversion run" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")
    assert main(_args(assets, dangling, "linear", "--no-eval")) == 2
    assert "which does not exist; create that folder or remove the link" in capsys.readouterr().err

    other = tmp_path / "other"
    assert main(_args(assets, other, "linear", "--no-eval")) == 0
    assert main(_args(assets, other, "linear", "--no-eval", "--seed", "3")) == 2
    assert "differs in: recipe_fingerprint, seed" in capsys.readouterr().err
    assert main(_args(assets, other, "linear", "--no-eval", "--seed", "3", "--overwrite")) == 0
    assert json.loads((other / "run.json").read_text())["seed"] == 3


def test_continues_from_an_earlier_conversion(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``init`` starts the student from a converted checkpoint, not from the teacher's copy, and
    ``stage2.skip_tokens`` trains stage 2 on the corpus text after the first run's."""
    from transformers import AutoTokenizer

    first = tmp_path / "first"
    assert main(_args(assets, first, "linear", "--no-eval")) == 0
    more = write_recipe(tmp_path / "more.yaml", tiny_recipe_dict(
        init=str(first / "model"), stage1={"tokens": 0}, stage2={"skip_tokens": 256}))
    seen: dict[str, object] = {}
    real_finetune = distill_finetune

    def spy(teacher: object, student: torch.nn.Module, blocks: torch.Tensor, *args: object, **kwargs: object):
        seen["weights"] = {k: v.clone() for k, v in student.state_dict().items()}
        seen["blocks"] = blocks.clone()
        return real_finetune(teacher, student, blocks, *args, **kwargs)

    monkeypatch.setattr("hf_recattn.conversion.stage2.finetune", spy)
    assets = {**assets, "more": more}
    assert main(_args(assets, tmp_path / "more", "more", "--no-eval")) == 0
    assert "starting from the converted checkpoint" in capsys.readouterr().out
    saved = load_file(first / "model" / "model.safetensors")
    assert saved.keys() <= seen["weights"].keys()
    assert all(torch.equal(seen["weights"][key], value) for key, value in saved.items())
    tokenizer = AutoTokenizer.from_pretrained(assets["teacher"])
    train, _ = split_heldout(load_texts(str(assets["corpus"])), 0.2, seed=0)
    order = token_blocks(tokenizer, train, 32, max_tokens=512, seed=1)  # stage 2's blocks: recipe seed + 1
    assert torch.equal(seen["blocks"], order[8:])  # 256 skipped tokens = the first run's 8 blocks of 32
    first_tokens = json.loads((first / "report.json").read_text())["training_tokens"]
    assert first_tokens == 6 * 4 * 32 + 4 * 2 * 32  # stage 1 + stage 2 of the tiny recipe
    report = json.loads((tmp_path / "more" / "report.json").read_text())
    assert report["init"]["training_tokens"] == first_tokens
    assert report["training_tokens"] == first_tokens + 4 * 2 * 32  # all the tokens behind the checkpoint
    card = (tmp_path / "more" / "model" / "README.md").read_text()
    assert f"continued from the converted checkpoint `{first / 'model'}`" in card


@pytest.mark.parametrize(("init", "says"), [("model", "layer 0 has attention"),
                                            ("nowhere", "is not a converted checkpoint folder")])
def test_init_that_does_not_fit_is_refused_before_taking_the_folder(
    init: str, says: str, assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    first = tmp_path / "first"
    assert main(_args(assets, first, "linear", "--no-eval")) == 0
    bad = write_recipe(tmp_path / "bad.yaml", tiny_recipe_dict(HYBRID, init=str(first / init)))
    assert main(_args({**assets, "bad": bad}, tmp_path / "out", "bad", "--no-eval")) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and says in err, err
    assert not (tmp_path / "out").exists()


def test_same_seed_same_model(assets: dict[str, Path], tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert main(_args(assets, tmp_path / name, "linear", "--no-eval")) == 0
    a = (tmp_path / "a" / "model" / "model.safetensors").read_bytes()
    b = (tmp_path / "b" / "model" / "model.safetensors").read_bytes()
    assert a == b


def test_nan_during_stage1_stops_with_a_clear_message(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real = objective.teacher_attention_io
    calls = {"n": 0}

    def poisoned(teacher: torch.nn.Module, ids: torch.Tensor, last_layer: int | None = None) -> dict:
        io = real(teacher, ids, last_layer)
        calls["n"] += 1
        if calls["n"] == 2:
            hidden, out = io[0]
            io[0] = (hidden, out * float("inf"))
        return io

    monkeypatch.setattr(objective, "teacher_attention_io", poisoned)
    out = tmp_path / "run"
    assert main(_args(assets, out, "linear", "--no-eval")) == 3
    err = capsys.readouterr().err
    assert "layer 0" in err and "at step 1" in err and "last good checkpoint" in err
    assert (out / "stage1" / "progress" / "checkpoint-1" / "mixer.safetensors").is_file()
    assert not (out / "model").exists()


def test_bad_recipe_is_one_clear_line(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad = write_recipe(tmp_path / "bad.yaml", tiny_recipe_dict({"mixer": "linear", "feature_map": "nope"}))
    args = [
        "convert",
        "--teacher",
        str(assets["teacher"]),
        "--recipe",
        str(bad),
        "--output",
        str(tmp_path / "o"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-recattn convert: error:") and "bad.yaml" in err and "feature_map" in err


def test_missing_teacher_fails_before_taking_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "o"
    args = ["convert", "--teacher", str(tmp_path / "nope"), "--recipe", "linear-hedgehog", "--output", str(out)]
    assert main(args) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not out.exists()  # a corrected rerun is not refused as "another conversion"


# ----- several processes, bfloat16 teachers -------------------------------------------------------------------
QUIET = ("--no-eval", "--threads", "1")


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_processes_convert_like_one(assets: dict[str, Path], tmp_path: Path) -> None:
    """Stages 1 and 2 (both Trainer, DDP) on 2 x 2 blocks per step against 1 process on 4: the same stage-1
    parameters and the same converted model; only rank 0 writes."""
    assert main(_args(assets, tmp_path / "one", "linear", *QUIET)) == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_RECATTN_CACHE": str(tmp_path / "cache")}
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "hf_recattn.cli",
               *_args(assets, tmp_path / "two", "linear", *QUIET)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("saved the converted model") == 1  # rank 0 logs and writes
    one, two = tmp_path / "one", tmp_path / "two"
    stage1 = "stage1/result/mixer.safetensors"
    assert _largest_difference(load_file(one / stage1), load_file(two / stage1)) <= 1e-5
    model = "model/model.safetensors"
    assert _largest_difference(load_file(one / model), load_file(two / model)) <= 1e-5
    summary = json.loads((two / "stage1/result/summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 4 * 32  # the recipe's batches, shared out
    # the comparison can tell runs apart: another seed gives another model
    assert main(_args(assets, tmp_path / "seed1", "linear", *QUIET, "--seed", "1")) == 0
    assert _largest_difference(load_file(one / model), load_file(tmp_path / "seed1" / model)) > 1e-3


def test_a_batch_that_does_not_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"stage1.batch_size 4 does not split over 3 processes"):
        local_share(4, "stage1.batch_size")


def test_bfloat16_teacher_float32_student(assets: dict[str, Path], tmp_path: Path) -> None:
    """``--teacher-dtype bfloat16``: the teacher runs in bfloat16, the student (a copy of its bfloat16 weights)
    trains and is saved in float32, and the run says which dtype its teacher had."""
    out = tmp_path / "bf16"
    assert main(_args(assets, out, "linear", "--threads", "1", "--teacher-dtype", "bfloat16")) == 0
    saved = load_file(out / "model" / "model.safetensors")
    assert {value.dtype for value in saved.values()} == {torch.float32}
    teacher_weights = load_file(assets["teacher"] / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj.weight"  # not trained by either stage: the teacher's, rounded
    assert torch.equal(saved[key], teacher_weights[key].to(torch.bfloat16).float())
    assert not torch.equal(saved[key], teacher_weights[key])
    stage1 = json.loads((out / "stage1/result/summary.json").read_text())
    assert all(0 < value < 1 for value in stage1["relative_last"].values())
    assert json.loads((out / "run.json").read_text())["teacher_dtype"] == "bfloat16"
    report = json.loads((out / "report.json").read_text())
    assert report["teacher_dtype"] == "bfloat16"
    assert all(0 < row["perplexity"] < 200 for row in report["comparison"].values())  # teacher and student
