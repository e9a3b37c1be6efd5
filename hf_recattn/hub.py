"""Publishing checkpoints to the Hugging Face Hub (or any server speaking its API, see ``HF_ENDPOINT``).

What lands in the repository is an allow-list of top-level files (``HUB_FILES``): the safetensors weights, the
config with ``auto_map``, the flat runtime (``*.py``), tokenizer files, the generation config, ``report.json``
and the model card, rendered anew for the target repo id. Anything else in the folder (optimizer states,
stage folders, pickled weights, logs) is never uploaded. All files travel in one commit, which the Hub applies
whole or not at all: a refused push leaves the repository as it was (a repository created by the push stays,
empty, so that a retry can reuse it).
"""

from __future__ import annotations

import fnmatch
import json
import tempfile
from pathlib import Path
from typing import Any

from .model_card import build_model_card
from .modeling.configuration import read_checkpoint_config

#: top-level files that are published; everything else stays local
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "*.py",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "report.json",
)


class PushError(RuntimeError):
    """A push that the server refused; the message names the repo, the step and the server's answer."""


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if the Hub accepts it as a model repo id (``name`` or ``namespace/name``), else ValueError."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"repo id {repo_id!r} is not valid: {err}") from None
    return repo_id


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The files of an hf_recattn checkpoint folder that a push publishes; ValueError when it is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such checkpoint folder")
    read_checkpoint_config(folder)  # refuses folders that are not hf_recattn checkpoints, naming the file
    config = json.loads((folder / "config.json").read_text())
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in HUB_FILES)
    )
    names = {p.name for p in files}
    if not names & {"model.safetensors", "model.safetensors.index.json"}:
        raise ValueError(f"{folder}: no safetensors weights (model.safetensors); save with save_pretrained")
    auto_map = config.get("auto_map") or {}
    needed = sorted({ref.split(".", 1)[0] + ".py" for ref in auto_map.values() if isinstance(ref, str)})
    missing = [name for name in needed if name not in names]
    if not auto_map or missing:
        raise ValueError(
            f"{folder / 'config.json'}: the runtime files for trust_remote_code are missing "
            f"({', '.join(missing) or 'no auto_map'}); save with hf_recattn's save_pretrained"
        )
    return files


def _fail(step: str, repo_id: str, err: Exception) -> PushError:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    answer = f"the server answered {status}" if status is not None else "the request failed"
    hint = {401: " (check the token: HF_TOKEN or `hf auth login`)", 403: " (no write access to this repo)",
            404: " (no such repo or revision)"}.get(status or 0, "")
    detail = " ".join(str(err).split())  # one line: the client's message spans several
    return PushError(f"push to {repo_id!r} failed at {step}: {answer}{hint}: {detail}. Nothing was committed.")


def push_checkpoint(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Publish the checkpoint in ``folder`` to ``repo_id`` in one commit; returns the commit URL.

    The model card is rendered for ``repo_id`` from the folder's config and ``report.json``; ``revision``
    names a branch (created from main when missing)."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    files = checkpoint_files(folder)
    api = HfApi(token=token, endpoint=endpoint)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    except (HfHubHTTPError, OSError) as err:
        raise _fail("creating the repo", repo_id, err) from err
    card = str(build_model_card(folder, repo_id)).encode()
    operations = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in files]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card))
    if revision not in (None, "main"):
        try:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        except (HfHubHTTPError, OSError) as err:
            raise _fail(f"creating branch {revision!r}", repo_id, err) from err
    try:
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload hf_recattn checkpoint ({len(operations)} files)",
            revision=revision,
        )
    except (HfHubHTTPError, OSError) as err:
        raise _fail("the commit", repo_id, err) from err
    return str(info.commit_url)


def push_model(model: Any, repo_id: str, tokenizer: Any = None, **kwargs: Any) -> str:
    """Save ``model`` (and ``tokenizer``) to a temporary folder and publish it with :func:`push_checkpoint`."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return push_checkpoint(tmp, repo_id, **kwargs)


def write_card_for_push(folder: str | Path, repo_id: str, tags: list[str] | None = None) -> None:
    """``model.push_to_hub``'s card hook: the project's card, with any extra ``tags``."""
    card = build_model_card(folder, repo_id)
    for tag in tags or []:
        if tag not in card.data.tags:
            card.data.tags.append(tag)
    card.save(str(Path(folder) / "README.md"))
