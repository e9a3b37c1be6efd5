"""Publishing through a Hub-compatible server on 127.0.0.1 (tests/hub_server.py), with the stock clients.

One conversion runs as a user would: ``hf-recattn convert --teacher org/tiny-llama ... --push-to-hub`` in a
subprocess whose ``HF_ENDPOINT`` is the local server (huggingface_hub reads it at import), so the teacher also
comes from the server by Hub id. Then ``hf-recattn push --revision`` publishes a branch, a Python that cannot
import hf_recattn loads model and tokenizer exactly as the card says and must generate the local model's
tokens, and refused pushes (401, 500, not a checkpoint, a bad repo id) must fail clearly and commit nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distill_fixtures import tiny_corpus_file, tiny_recipe_dict, tiny_teacher_folder, write_recipe
from hub_server import LocalHub
from huggingface_hub import ModelCard
from isolated import HIDE_HF_RECATTN
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

import hf_recattn  # noqa: F401  (registers the model type for the local loads)
from hf_recattn.cli import main
from hf_recattn.hub import PushError, push_checkpoint

TEACHER, STUDENT = "org/tiny-llama", "org/tiny-recattn"
PROMPT = "the cat sat"
ALLOWED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "report.json", "README.md", "modeling.py", "configuration.py"}

CLIENT_UPLOAD = """
import sys
from huggingface_hub import HfApi
api = HfApi()
api.create_repo(sys.argv[2], exist_ok=True)
api.upload_folder(repo_id=sys.argv[2], folder_path=sys.argv[1])
"""

LOAD_AS_THE_CARD_SAYS = HIDE_HF_RECATTN + textwrap.dedent(
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    repo, revision, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, revision=revision)
    tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True, revision=revision)
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print(json.dumps({"tokens": out[0].tolist(), "max_length": tokenizer.model_max_length,
                      "loaded": sorted(m for m in sys.modules if m.startswith("hf_recattn"))}))
    """
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHub]:
    """One server for the module's tests: the ``published`` conversion lives on it."""
    with LocalHub(tmp_path_factory.mktemp("hub")) as server:
        yield server


def client_env(hub: LocalHub, home: Path, token: str = "hf_test") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(home), HF_TOKEN=token, HF_HUB_DISABLE_TELEMETRY="1",
               OMP_NUM_THREADS="1", HF_RECATTN_CACHE=str(home / "recattn-cache"), TOKENIZERS_PARALLELISM="false")
    return env


def run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_recattn.cli", *args]


@pytest.fixture(scope="module")
def published(hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny teacher on the server (with a card saying MIT), converted from its Hub id and pushed."""
    root = tmp_path_factory.mktemp("published")
    env = client_env(hub, root / "home")
    teacher = tiny_teacher_folder(root / "teacher")
    (teacher / "README.md").write_text("---\nlicense: mit\n---\n# tiny teacher\n")
    done = run([sys.executable, "-c", CLIENT_UPLOAD, str(teacher), TEACHER], env)
    assert done.returncode == 0, done.stderr
    recipe = write_recipe(root / "tiny-hybrid.yaml", tiny_recipe_dict({"mixer": "hybrid", "window": 8}))
    corpus = tiny_corpus_file(root / "corpus.jsonl")
    out = root / "run"
    done = run(cli("convert", "--teacher", TEACHER, "--recipe", str(recipe), "--output", str(out), "--corpus",
                   str(corpus), "--no-progress", "--threads", "1", "--push-to-hub", STUDENT), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"pushed {out}/model to {STUDENT}" in done.stdout
    return {"root": root, "run": out, "model": out / "model"}


def test_convert_pushes_exactly_the_checkpoint(hub: LocalHub, published: dict[str, Path]) -> None:
    files = hub.files(STUDENT)
    assert ALLOWED <= set(files)
    assert all("/" not in name for name in files) and not any(n.endswith((".pt", ".bin", ".log")) for n in files)
    local = published["model"]
    for name in set(files) - {"README.md"}:  # byte-identical to the saved checkpoint
        assert files[name] == (local / name).read_bytes(), name
    # a window + far hybrid needs no positions: its tokenizer says "unbounded" (tests/test_length_limit.py)
    assert json.loads(files["tokenizer_config.json"])["model_max_length"] == VERY_LARGE_INTEGER


def test_pushed_card_metadata(hub: LocalHub, published: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "README.md").write_bytes(hub.files(STUDENT)["README.md"])
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.license == "mit" and card.data.base_model == TEACHER  # inherited from the teacher's card
    assert card.data.model_name == STUDENT and "mixer-hybrid" in card.data.tags
    report = json.loads((published["run"] / "report.json").read_text())
    values = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert values["perplexity"] == round(report["student"]["perplexity"], 4)
    assert f'from_pretrained("{STUDENT}", trust_remote_code=True)' in card.text


def test_loads_without_the_package_as_the_card_says(hub: LocalHub, published: dict[str, Path]) -> None:
    env = client_env(hub, published["root"] / "home")
    done = run(cli("push", str(published["model"]), STUDENT, "--revision", "v1", "--commit-message", "v1"), env)
    assert done.returncode == 0, done.stderr
    assert set(hub.branches(STUDENT)) == {"main", "v1"}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(published["model"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(published["model"])
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    child_home = published["root"] / "child-home"  # an empty cache: everything comes from the server
    empty = published["root"] / "empty"
    empty.mkdir(exist_ok=True)
    for revision in ("main", "v1"):
        done = run([sys.executable, "-I", "-c", LOAD_AS_THE_CARD_SAYS, STUDENT, revision, PROMPT],
                   client_env(hub, child_home), cwd=empty)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "[y/N]" not in done.stdout + done.stderr  # no interactive prompt anywhere
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["loaded"] == [] and result["max_length"] == VERY_LARGE_INTEGER
        assert result["tokens"] == expected[0].tolist()


def test_refused_pushes_commit_nothing(hub: LocalHub, published: dict[str, Path], tmp_path: Path) -> None:
    before = hub.sha(STUDENT)
    changed = tmp_path / "model"  # a changed checkpoint, so that the client has something to commit
    shutil.copytree(published["model"], changed)
    report = json.loads((changed / "report.json").read_text())
    (changed / "report.json").write_text(json.dumps({**report, "note": "changed"}))
    hub.fail["commit"] = 500
    try:
        with pytest.raises(PushError, match="failed at the commit: the server answered 500.*Nothing was committed"):
            push_checkpoint(changed, STUDENT, endpoint=hub.endpoint, token="hf_test")
    finally:
        hub.fail.clear()
    assert hub.sha(STUDENT) == before
    hub.token = "the-right-token"
    try:
        with pytest.raises(PushError, match="the server answered 401 \\(check the token"):
            push_checkpoint(changed, STUDENT, endpoint=hub.endpoint, token="wrong")
    finally:
        hub.token = None
    assert hub.sha(STUDENT) == before
    assert push_checkpoint(changed, STUDENT, endpoint=hub.endpoint, token="hf_test").startswith(hub.endpoint)
    assert json.loads(hub.files(STUDENT)["report.json"])["note"] == "changed"


def test_bad_input_is_refused_before_any_request(
    hub: LocalHub, published: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    count = len(hub.requests)
    assert main(["push", str(published["model"]), "org//bad"]) == 2
    assert "repo id 'org//bad' is not valid" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["push", str(tmp_path), "org/other"]) == 2
    assert "not an hf_recattn checkpoint" in capsys.readouterr().err
    assert main(["convert", "--recipe", "gdn", "--output", str(tmp_path / "x"), "--push-to-hub", "a/b/c"]) == 2
    assert not (tmp_path / "x").exists()  # refused before the conversion took the folder
    assert len(hub.requests) == count and "org/other" not in hub.repos()


PUSH_FROM_PYTHON = """
import sys, torch
from hf_recattn import RecAttnConfig, RecAttnForCausalLM
config = RecAttnConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, attention={"mixer": "linear"})
RecAttnForCausalLM(config).push_to_hub(sys.argv[1], tags=["my-tag"])
"""


def test_model_push_to_hub_uses_the_project_card(hub: LocalHub, tmp_path: Path) -> None:
    done = run([sys.executable, "-c", PUSH_FROM_PYTHON, "org/from-python"], client_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    files = hub.files("org/from-python")
    assert {"config.json", "model.safetensors", "modeling.py", "README.md"} <= set(files)
    (tmp_path / "README.md").write_bytes(files["README.md"])
    card = ModelCard.load(tmp_path / "README.md")
    assert "## Attention per layer" in card.text and {"my-tag", "mixer-linear"} <= set(card.data.tags)
