"""``AutoTokenizer.from_pretrained(CHECKPOINT)`` where hf_recattn cannot be imported.

The tokenizer files name no custom code (no ``auto_map``, a built-in tokenizer class). What asks "run the custom
code? [y/N]" is the config: transformers 5.24's AutoTokenizer always reads config.json through AutoConfig, and a
``recattn`` config is defined by the checkpoint's code (``auto_map["AutoConfig"]``), which it may not run unasked;
nothing in the saved files can change that without breaking ``trust_remote_code`` loading. So a child Python checks
that ``trust_remote_code=False`` loads the same tokenizer without a question and without running any of the
checkpoint's code, and that the default call, left unanswered, still returns it instead of stopping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from isolated import HIDE_HF_RECATTN, save_tiny_chat_recattn

TEXT = "the pass key is 12345. what is the pass key?"
PROMPT = "Do you wish to run the custom code?"

CHILD = HIDE_HF_RECATTN + textwrap.dedent(
    """
    from transformers import AutoTokenizer

    folder, text = sys.argv[1], sys.argv[2]
    for trust in (False, None):  # None: the default call, which asks (nobody answers: stdin is closed)
        tokenizer = AutoTokenizer.from_pretrained(folder, **({} if trust is None else {"trust_remote_code": trust}))
        print(f"\\nEND OF LOAD trust_remote_code={trust}", flush=True)
        print("RESULT", json.dumps({
            "ids": tokenizer(text)["input_ids"],
            "chat": tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False),
            "class": type(tokenizer).__module__,
            "remote_modules": sorted(m for m in sys.modules if m.startswith("transformers_modules")),
        }), flush=True)
    """
)


def _load_in_child(folder: Path, tmp_path: Path) -> tuple[list[dict], list[str]]:
    """The child's two loads (trust_remote_code=False, then the default), and what each printed."""
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-I", "-c", CHILD, str(folder), TEXT], cwd=workdir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return results, proc.stdout.split("END OF LOAD")[:2]


def test_tokenizer_loads_without_the_package_and_without_remote_code(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _, tokenizer = save_tiny_chat_recattn(folder, [{"mixer": "softmax"}])
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved and saved["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert "AutoConfig" in json.loads((folder / "config.json").read_text())["auto_map"]  # what AutoTokenizer meets
    want = {"ids": tokenizer(TEXT)["input_ids"],
            "chat": tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False)}

    (plain, default), (plain_output, default_output) = _load_in_child(folder, tmp_path)
    assert {k: plain[k] for k in want} == want
    assert plain["class"].startswith("transformers.") and plain["remote_modules"] == []
    assert PROMPT not in plain_output

    assert {k: default[k] for k in want} == want
    assert default["remote_modules"] == []
    assert PROMPT in default_output  # transformers' question, which trust_remote_code=False or True avoids
