"""benchmarks/loss_by_position.py: its arguments, its summaries of position losses, its table, and a whole run on
a tiny random teacher and a made-up corpus (the teacher's row against ``perplexity``, a saved student against the
same untrained window built in the run). Tolerance rel 1e-6 between float32 measures of the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_modules import load_script
from tiny_lm import save_tiny_teacher

from hf_recattn import from_teacher
from hf_recattn.conversion.teacher import load_teacher
from hf_recattn.evaluation import perplexity
from hf_recattn.evaluation.heldout import long_blocks
from hf_recattn.modeling.registry import validate_spec


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks", "loss_by_position")


def test_defaults_measure_8192_tokens_in_log_buckets(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert (args.length, args.blocks, args.kinds, args.windows, args.sinks) == (8192, 2, ["heldout", "ood"],
                                                                               [512, 64], 4)
    assert args.buckets == [1, 64, 256, 1024, 4096, 8192] and args.prefix_lengths == [4096, 8192]
    assert args.students == [] and args.out.name == "loss_by_position_cpu.json"
    plan = bench.models_to_measure(args)
    assert [name for name, _ in plan] == ["teacher", "window 512 + 4 sinks", "window 64 + 4 sinks"]
    assert plan[1][1]["attention"] == {"mixer": "hybrid", "window": 512, "far": "none", "sink_tokens": 4}
    validate_spec(plan[2][1]["attention"], "window 64")
    short = bench.parse_args(["--length", "100", "--prefix-lengths", "10", "50", "--buckets", "1", "10", "100"])
    assert short.prefix_lengths == [10, 50, 100] and short.buckets == [1, 10, 100]


def test_students_are_checkpoint_folders(bench: ModuleType, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    args = bench.parse_args(["--student", f"a={run}", "--student", f"b b={tmp_path / 'plain'}"])
    assert args.students == [("a", run / "model"), ("b b", tmp_path / "plain")]
    assert [name for name, _ in bench.models_to_measure(args)][-2:] == ["a", "b b"]
    for bad, why in (("no-path", "NAME=PATH"), ("=x", "NAME=PATH"), (f"c={tmp_path}", "config.json")):
        with pytest.raises(SystemExit, match=why):
            bench.parse_args(["--student", bad])


def test_bad_lengths_and_buckets_are_refused(bench: ModuleType) -> None:
    for argv in (["--prefix-lengths", "9000"], ["--prefix-lengths", "1"], ["--buckets", "0", "64"],
                 ["--buckets", "1", "9000"], ["--buckets", "64", "1"], ["--blocks", "0"], ["--windows", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_summarize_reads_prefix_perplexity_and_buckets_from_the_losses(bench: ModuleType) -> None:
    args = bench.parse_args(["--length", "16", "--prefix-lengths", "8", "--buckets", "1", "4", "16"])
    losses = torch.arange(2 * 15, dtype=torch.float32).view(2, 15) / 10
    got = bench.summarize(losses, args)
    assert got["perplexity"]["8"] == pytest.approx(math.exp(float(losses[:, :7].double().mean())))
    assert got["perplexity"]["16"] == pytest.approx(math.exp(float(losses.double().mean())))
    assert [(b["start"], b["end"]) for b in got["buckets"]] == [(1, 4), (4, 16)]
    assert [(b["start"], b["end"]) for b in got["curve"]] == [(1, 2), (2, 4), (4, 8), (8, 16)]
    assert sum(b["tokens"] for b in got["curve"]) == losses.numel()


def _row(loss: float, ppl: float) -> dict:
    kind = {"buckets": [{"start": 1, "end": 64, "loss": loss, "tokens": 10}], "perplexity": {"64": ppl}}
    return {"heldout": kind, "ood": kind}


def test_table_has_a_row_per_model_and_kind_and_the_notes(bench: ModuleType) -> None:
    results = {"settings": {"kinds": ["heldout", "ood"], "buckets": [1, 64], "prefix_lengths": [64]},
               "models": {"w": _row(3.0, 20.0), "teacher": _row(2.5, 12.25)}, "order": ["teacher", "w"],
               "notes": ["Blocks of 64 tokens."]}
    table = bench.render_markdown(results).splitlines()
    assert table[0] == "| model | text | loss 1-64 | ppl @ 64 |"
    assert table[2] == "| teacher | held-out | 2.500 | 12.25 |"
    assert table[5] == "| w | license texts (ood) | 3.000 | 20.00 |"
    assert table[-1] == "Blocks of 64 tokens."


HELDOUT = ["birds sing in the morning. " * 10, "the river runs past the old mill. " * 8]
OOD = ["a hash table maps keys to values. ", "the quick brown fox. " * 2, "write a short poem. ", "birds. " * 9]


class FakeCorpus:
    def files(self, split: str) -> list[str]:
        return {"heldout": HELDOUT, "ood": OOD}[split]


def test_a_run_on_a_tiny_teacher(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_teacher(tmp_path / "teacher")
    teacher, tok = load_teacher(str(tmp_path / "teacher"))
    window = bench.window_spec(8, 1)
    from_teacher(teacher, window).save_pretrained(tmp_path / "student")
    monkeypatch.setattr(bench, "embedded_corpus", FakeCorpus)
    out = tmp_path / "r.json"
    argv = ["--teacher", str(tmp_path / "teacher"), "--windows", "8", "--sinks", "1", "--length", "40",
            "--blocks", "2", "--prefix-lengths", "20", "--student", f"saved={tmp_path / 'student'}",
            "--out", str(out), "--plot", str(tmp_path / "p.png")]
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    assert results["benchmark"] == "loss_by_position" and results["provenance"]["command"]
    assert results["order"] == ["teacher", "window 8 + 1 sinks", "saved"] and len(results["models"]) == 3
    assert results["texts"]["heldout"]["joined"] == 0 and results["texts"]["ood"]["joined"] == 1
    blocks = long_blocks(tok, HELDOUT, 40, 2)
    assert results["models"]["teacher"]["heldout"]["perplexity"]["40"] == pytest.approx(perplexity(teacher, blocks),
                                                                                       rel=1e-6)
    for kind in ("heldout", "ood"):
        built, saved = results["models"]["window 8 + 1 sinks"][kind], results["models"]["saved"][kind]
        assert saved["perplexity"] == pytest.approx(built["perplexity"], rel=1e-6)
    try:  # the plot needs matplotlib (the "bench" extra); without it the run says so and goes on
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "p.png").exists()
    else:
        assert (tmp_path / "p.png").stat().st_size > 0
    assert "held-out (2 files): 2 of one file each; license texts (ood) (4 files): 1 of one file each and 1 cut " \
           "from the files too short" in results["notes"][0]
    first = len(tok(OOD[0], add_special_tokens=False)["input_ids"])
    assert first + 1 < 40 < first + len(tok(OOD[1], add_special_tokens=False)["input_ids"]) + 2
    assert results["texts"]["ood"]["starts"] == [[first + 1]] and results["texts"]["heldout"]["starts"] == []
    assert f"joined block 1: a text starts at position {first + 1}." in results["notes"][0]
    results["models"]["saved"]["heldout"]["perplexity"]["40"] = -1.0  # a rerun skips the models measured
    out.write_text(json.dumps(results))
    assert bench.main(argv) == 0
    assert json.loads(out.read_text())["models"]["saved"]["heldout"]["perplexity"]["40"] == -1.0
