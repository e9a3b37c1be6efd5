"""``hf-recattn serve`` and ``transformers serve --trust-remote-code`` on a tiny RecAttn checkpoint, queried on
127.0.0.1 with the ``openai`` client: the greedy text equals ``model.generate()``'s; bad requests get an HTTP 400
naming the fault and the server keeps serving; continuous batching is refused.

``hf-recattn serve`` runs in a thread of this process; the remote-code server is a child process in a Python where
hf_recattn cannot be imported (tests/isolated.py). Each listens on a free port, is waited for (bounded) and is
always stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from isolated import HIDE_HF_RECATTN, save_tiny_chat_recattn

from hf_recattn import RecAttnForCausalLM
from hf_recattn.cli import main as cli_main
from hf_recattn.cli.serve import serve_in_background

openai = pytest.importorskip("openai", reason="the serve extra: pip install 'hf-recattn[serve]'")

START_TIMEOUT = 90  # seconds for a server to answer /health
LAYERS = [{"mixer": "softmax"}, {"mixer": "gdn", "chunk_size": 4}]
MESSAGES = [{"role": "user", "content": "the pass key is 12345. what is the pass key?"}]
NEW_TOKENS = 8

REMOTE_SERVER = HIDE_HF_RECATTN + textwrap.dedent(
    """
    from transformers.cli.transformers import app
    app(["serve", *sys.argv[1:]])
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RecAttnForCausalLM, object]:
    """A tiny random RecAttn checkpoint (softmax + Gated DeltaNet) with a tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("serve") / "ckpt"
    model, tokenizer = save_tiny_chat_recattn(folder, LAYERS)
    return folder, model, tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf_home"), HF_HUB_OFFLINE="1",
               HF_MODULES_CACHE=str(tmp / "modules"), TRANSFORMERS_OFFLINE="1")
    return env


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path, **popen: object) -> Iterator[str]:
    """Start a server, wait for its /health (at most START_TIMEOUT s), yield its /v1 URL; always kill it."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer within {START_TIMEOUT} s:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _greedy(model: RecAttnForCausalLM, tokenizer: object, ids: torch.Tensor) -> tuple[str, int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def _chat_reference(model: RecAttnForCausalLM, tokenizer: object) -> tuple[str, int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    return _greedy(model, tokenizer, ids)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def served(checkpoint: tuple) -> Iterator[str]:
    """``hf-recattn serve CHECKPOINT`` (the package installed), run in a thread of this process; its /v1 URL."""
    port = _free_port()
    server = serve_in_background(str(checkpoint[0]), ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"])
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not server.server.started:
            assert time.monotonic() < deadline, f"the server did not start within {START_TIMEOUT} s"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.kill_server()


def test_chat_and_completions_equal_generate(checkpoint: tuple, served: str) -> None:
    folder, model, tokenizer = checkpoint
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0)
    want, count = _chat_reference(model, tokenizer)
    assert want.strip(), "the reference generated nothing: the comparison would be empty"

    reply = client.chat.completions.create(model=str(folder), messages=MESSAGES, max_tokens=NEW_TOKENS,
                                           temperature=0)
    assert reply.choices[0].message.content == want
    assert reply.usage.completion_tokens == count

    stream = client.chat.completions.create(model=str(folder), messages=MESSAGES, max_tokens=NEW_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want

    prompt = "the river runs past the old mill"
    want_text, _ = _greedy(model, tokenizer, tokenizer(prompt, return_tensors="pt")["input_ids"])
    done = client.completions.create(model=str(folder), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert done.choices[0].text == want_text


def test_bad_requests_get_400_and_the_server_keeps_serving(checkpoint: tuple, served: str) -> None:
    folder, model, tokenizer = checkpoint
    chat = f"{served}/chat/completions"
    too_long = [{"role": "user", "content": "the quick brown fox " * 30}]  # > max_position_embeddings = 64
    status, body = _post(chat, {"model": str(folder), "messages": too_long, "max_tokens": 4})
    assert status == 400 and "max_position_embeddings=64" in body["error"]["message"], body
    status, body = _post(chat, {"model": str(folder), "messages": [{"content": "no role"}], "max_tokens": 4})
    assert status == 400 and body["error"]["message"] == "messages[0] needs a string 'role'", body
    status, body = _post(chat, {"model": str(folder), "messages": MESSAGES, "max_tokens": 4, "bogus": 1})
    assert status == 422 and "bogus" in body["detail"], body  # transformers' own check, kept

    status, body = _post(chat, {"model": str(folder), "messages": MESSAGES, "max_tokens": NEW_TOKENS,
                                "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == _chat_reference(model, tokenizer)[0]


def test_serve_passes_options_to_transformers_serve(checkpoint: tuple, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["serve", str(checkpoint[0]), "--port", "not-a-port"]) == 2  # transformers serve's own check
    assert "not-a-port" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--continuous-batching", "--cb-num-blocks=8", "--compile"])
def test_serve_refuses_options_recurrent_caches_cannot_take(checkpoint: tuple, option: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["serve", str(checkpoint[0]), "--port", "1", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-recattn serve: error: {option.split('=')[0]}: ")
    assert "RecAttnCache" in err


def test_serve_names_the_extra_without_the_server_dependencies(checkpoint: tuple, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the serve extra were not installed
    assert cli_main(["serve", str(checkpoint[0])]) == 2
    assert capsys.readouterr().err == 'hf-recattn serve needs the serve extra: pip install "hf-recattn[serve]"\n'


def test_model_refuses_continuous_batching(checkpoint: tuple) -> None:
    model = checkpoint[1]
    assert not hasattr(model, "init_continuous_batching")  # how transformers serve learns that it cannot
    with pytest.raises(NotImplementedError, match="continuous batching is not supported"):
        model.generate_batch([[1, 2, 3]])
    with pytest.raises(NotImplementedError, match="continuous batching is not supported"):
        model.generate(torch.tensor([[1, 2, 3]]), cache_implementation="paged", max_new_tokens=2)


def test_transformers_serve_trust_remote_code_without_the_package(checkpoint: tuple, tmp_path: Path) -> None:
    """Plain ``transformers serve --trust-remote-code`` (asked for continuous batching, which it then declines
    for this model) where hf_recattn cannot be imported: the checkpoint's own runtime files serve it."""
    folder, model, tokenizer = checkpoint
    port = _free_port()
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in _env(tmp_path).items() if not k.startswith("PYTHON")}
    command = [sys.executable, "-I", "-c", REMOTE_SERVER, str(folder), "--trust-remote-code", "--host",
               "127.0.0.1", "--port", str(port), "--device", "cpu", "--continuous-batching"]
    log = tmp_path / "server.log"
    with running(command, port, log, env=env, cwd=workdir) as url:
        status, body = _post(f"{url}/chat/completions", {"model": str(folder), "messages": MESSAGES,
                                                          "max_tokens": NEW_TOKENS, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == _chat_reference(model, tokenizer)[0]
    assert "does not support continuous batching" in log.read_text()
