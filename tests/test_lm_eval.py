"""lm-evaluation-harness (``--model hf``) on a tiny RecAttn checkpoint, with tasks defined from local files (a
task YAML per request type and a jsonl dataset; no hub access): loglikelihood, multiple choice, rolling
loglikelihood and generate_until. Every score lm_eval reports equals the one computed here with the model itself.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from isolated import save_tiny_chat_recattn

from hf_recattn.cli import main as cli_main

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra: pip install 'hf-recattn[eval]'")

LAYERS = [{"mixer": "softmax"}, {"mixer": "gdn", "chunk_size": 4}]
DOCS = [
    {"context": "the pass key is", "continuation": " 12345", "question": "the river runs past the",
     "choices": ["old mill", "sea", "hills"], "answer": 0, "text": "birds sing in the hedges in the morning."},
    {"context": "the quick brown fox", "continuation": " jumps over", "question": "a hash table maps keys to",
     "choices": ["values", "birds"], "answer": 0, "text": "a hash table maps keys to values."},
    {"context": "write a short poem about", "continuation": " the sea", "question": "the road climbs through the",
     "choices": ["hills", "mill", "town"], "answer": 1, "text": "the river runs past the old mill."},
]
TASKS = {
    "tiny_ll": "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
               "metric_list:\n  - metric: perplexity\n  - metric: acc\n",
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    "tiny_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
                "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
}
MAX_GEN = 6
ATOL = 1e-4  # the same float32 model run by lm_eval (batches) and here (one sequence)


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object, object]:
    """(checkpoint, task folder, model, tokenizer): a tiny checkpoint and one YAML per task over DOCS."""
    root = tmp_path_factory.mktemp("lm_eval")
    model, tokenizer = save_tiny_chat_recattn(root / "ckpt", LAYERS)
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, body in TASKS.items():
        source = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        (tasks / f"{name}.yaml").write_text(source + "test_split: test\n" + body)
    return root / "ckpt", tasks, model, tokenizer


@pytest.fixture(scope="module")
def evaluated(setup: tuple) -> dict:
    """``lm_eval.simple_evaluate(model="hf", model_args="pretrained=...,trust_remote_code=True")`` on every task."""
    from lm_eval.tasks import TaskManager

    folder, tasks, _, _ = setup
    return lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32", tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), device="cpu", batch_size=2,
        log_samples=True, bootstrap_iters=0,
    )


def _continuation_logprob(model: object, tokenizer: object, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenized as lm_eval does for causal models (the pair encoded whole)."""
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    return _token_logprob(model, whole, start)


def _token_logprob(model: object, ids: list[int], start: int) -> float:
    """Sum of log p(ids[i] | ids[:i]) for i >= start."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(sum(logprobs[i - 1, ids[i]] for i in range(start, len(ids))))


def _args(sample: dict) -> list[tuple]:
    """The (context, continuation) pairs of one logged sample, one per request (a list in memory, a dict of
    dicts in lm_eval's samples files)."""
    requests = sample["arguments"]
    requests = requests.values() if isinstance(requests, dict) else requests
    return [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in requests]


def test_loglikelihood_and_multiple_choice_equal_our_logprobs(setup: tuple, evaluated: dict) -> None:
    _, _, model, tokenizer = setup
    for task in ("tiny_ll", "tiny_mc"):
        samples = evaluated["samples"][task]
        assert len(samples) == len(DOCS)
        for sample in samples:
            pairs = _args(sample)
            assert len(pairs) == (1 if task == "tiny_ll" else len(sample["doc"]["choices"]))
            for (context, continuation), response in zip(pairs, sample["resps"], strict=True):
                want = _continuation_logprob(model, tokenizer, context, continuation)
                assert abs(float(response[0][0]) - want) <= ATOL, (task, context, continuation)
        acc = evaluated["results"][task]["acc,none"]
        assert acc == sum(s["acc"] for s in samples) / len(samples)
    nll = [-_continuation_logprob(model, tokenizer, d["context"], d["continuation"]) for d in DOCS]
    perplexity = evaluated["results"]["tiny_ll"]["perplexity,none"]
    assert math.isclose(perplexity, math.exp(sum(nll) / len(nll)), rel_tol=1e-4)


def test_rolling_loglikelihood_equals_our_logprobs(setup: tuple, evaluated: dict) -> None:
    _, _, model, tokenizer = setup
    prefix = tokenizer.bos_token_id  # lm_eval's prefix token for the first window
    total, words = 0.0, 0
    for sample in evaluated["samples"]["tiny_rolling"]:
        text = sample["doc"]["text"]
        ids = [prefix, *tokenizer.encode(text)]
        assert len(ids) <= model.config.max_position_embeddings  # one window
        want = _token_logprob(model, ids, 1)
        assert abs(float(sample["filtered_resps"][0]) - want) <= ATOL
        total += want
        words += len(text.split())
    assert math.isclose(evaluated["results"]["tiny_rolling"]["word_perplexity,none"], math.exp(-total / words),
                        rel_tol=1e-4)


def test_generate_until_equals_greedy_generate(setup: tuple, evaluated: dict) -> None:
    _, _, model, tokenizer = setup
    outputs = []
    for sample in evaluated["samples"]["tiny_gen"]:
        ids = torch.tensor([tokenizer.encode(sample["doc"]["question"])])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_GEN, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:]).split("\n")[0].split(tokenizer.eos_token)[0]
        assert sample["resps"][0][0] == text
        outputs.append(text)
    assert any(o.strip() for o in outputs), "nothing was generated: the comparison would be empty"
    assert "exact_match,none" in evaluated["results"]["tiny_gen"]


def test_hf_recattn_eval_lm_eval_passes_through(setup: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    # lm_eval's command line indexes its thousands of built-in task files (~15 s); these local tasks need none
    monkeypatch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__, include_defaults=False))
    folder, tasks, model, tokenizer = setup
    out = tmp_path / "results"
    code = cli_main(["eval", str(folder), "--lm-eval", "tiny_ll", "--lm-eval-args",
                     f"--include_path {tasks} --device cpu --limit 1 --output_path {out} "
                     "--model_args dtype=float32"])
    assert code == 0
    [written] = list(out.rglob("results_*.json"))
    report = json.loads(written.read_text())
    assert report["config"]["model_args"] == {"pretrained": str(folder), "dtype": "float32"}
    doc = DOCS[0]
    want = math.exp(-_continuation_logprob(model, tokenizer, doc["context"], doc["continuation"]))
    assert math.isclose(report["results"]["tiny_ll"]["perplexity,none"], want, rel_tol=1e-4)


def test_hf_recattn_eval_lm_eval_names_the_extra(setup: tuple, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if lm_eval were not installed
    assert cli_main(["eval", str(setup[0]), "--lm-eval", "piqa"]) == 2
    assert capsys.readouterr().err == 'hf-recattn eval needs the eval extra: pip install "hf-recattn[eval]"\n'
    assert cli_main(["eval", str(setup[0]), "--lm-eval", "piqa", "--lm-eval-args", "--tasks x"]) == 2
    assert "--tasks is set by hf-recattn eval" in capsys.readouterr().err

