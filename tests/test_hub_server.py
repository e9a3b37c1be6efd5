"""The local Hub test server (tests/hub_server.py) against the stock huggingface_hub client and transformers.

Client calls run in subprocesses (``HF_ENDPOINT`` is read when huggingface_hub is imported) with a fresh
``HF_HOME``, a dummy token and telemetry off; the server runs in this process on 127.0.0.1. Downloads must be
byte-identical (sha256 of every file). The last test pushes a tiny hf_recattn checkpoint to the server and
loads it with ``trust_remote_code=True`` in a child that cannot import hf_recattn: greedy generation must give
exactly the local model's tokens, at ``main`` and at a branch holding another model.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
from hub_server import LocalHub, git_blob_sha1
from isolated import HIDE_HF_RECATTN, save_tiny_recattn

PRELUDE = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    args = json.loads(sys.argv[1])
    api = HfApi()

    def digest(path):
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def status_of(call):
        try:
            call()
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as e:
            return type(e).__name__
        except HfHubHTTPError as e:
            return e.response.status_code
        return "ok"
    """
)


def run_client(hub: LocalHub, script: str, home: Path, hf_token: str = "dummy", **args: Any) -> dict[str, Any]:
    """Run PRELUDE + script in a fresh interpreter pointed at the hub; returns its last stdout line as JSON."""
    home.mkdir(parents=True, exist_ok=True)
    drop = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and "proxy" not in k.lower()}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(home / "hf_home"),
        HF_MODULES_CACHE=str(home / "modules"),
        HF_TOKEN=hf_token,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", PRELUDE + textwrap.dedent(script), json.dumps(args)],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def call(hub: LocalHub, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, dict, bytes]:
    """One raw HTTP request to the hub: (status, headers, body)."""
    host, port = hub.endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def commit_body(files: dict[str, bytes], summary: str = "test", parent: str | None = None) -> bytes:
    """An ndjson commit as the client sends it (regular files, base64)."""
    header: dict[str, Any] = {"summary": summary, "description": ""}
    if parent:
        header["parentCommit"] = parent
    lines = [{"key": "header", "value": header}]
    for path, data in files.items():
        lines.append({"key": "file", "value": {"path": path, "encoding": "base64",
                                               "content": base64.b64encode(data).decode()}})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def make_repo(hub: LocalHub, name: str, files: dict[str, bytes]) -> str:
    """Create ``user/name`` holding ``files`` on main through raw requests."""
    status, _, body = call(hub, "POST", "/api/repos/create", json.dumps({"name": name}).encode())
    assert status == 200, body
    repo_id = f"user/{name}"
    assert json.loads(body)["url"] == f"{hub.endpoint}/{repo_id}"
    status, _, body = call(hub, "POST", f"/api/models/{repo_id}/commit/main", commit_body(files))
    assert status == 200, body
    return repo_id


def unknown(hub: LocalHub) -> list:
    """Requests that matched no route: the client asked for something the server does not serve."""
    return [r for r in hub.requests if r.endpoint == "unknown"]


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write ``{relative path: bytes}`` under ``folder``."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


# ---------------------------------------------------------------- raw protocol


def test_resolve_headers_ranges_and_error_codes(local_hub: LocalHub) -> None:
    data = bytes(range(256)) * 4
    repo_id = make_repo(local_hub, "raw", {"a.bin": data, "sub/b.txt": b"hello"})
    sha = local_hub.sha(repo_id)
    status, headers, body = call(local_hub, "HEAD", f"/{repo_id}/resolve/main/a.bin")
    assert (status, body) == (200, b"")
    assert headers["X-Repo-Commit"] == sha and len(sha) == 40
    assert headers["ETag"] == f'"{hashlib.sha1(b"blob 1024" + bytes(1) + data).hexdigest()}"'
    assert headers["Content-Length"] == "1024"
    status, headers, body = call(local_hub, "GET", f"/{repo_id}/resolve/{sha}/a.bin", Range="bytes=10-19")
    assert (status, body, headers["Content-Range"]) == (206, data[10:20], "bytes 10-19/1024")
    assert call(local_hub, "GET", f"/{repo_id}/resolve/main/a.bin", Range="bytes=1000-")[2] == data[1000:]
    assert call(local_hub, "GET", f"/{repo_id}/resolve/main/a.bin", Range="bytes=-4")[2] == data[-4:]
    assert call(local_hub, "GET", f"/{repo_id}/resolve/main/a.bin", Range="bytes=2000-")[0] == 416
    assert call(local_hub, "GET", f"/{repo_id}/resolve/main/sub/b.txt")[2] == b"hello"
    for path, code in [
        (f"/{repo_id}/resolve/main/missing.txt", "EntryNotFound"),
        (f"/{repo_id}/resolve/main/sub", "EntryNotFound"),  # a folder is not a file
        (f"/{repo_id}/resolve/nobranch/a.bin", "RevisionNotFound"),
        ("/user/none/resolve/main/a.bin", "RepoNotFound"),
        (f"/api/models/{repo_id}/tree/main/nofolder", "EntryNotFound"),
        (f"/api/models/{repo_id}/revision/nobranch", "RevisionNotFound"),
        ("/api/models/user/none", "RepoNotFound"),
    ]:
        status, headers, _ = call(local_hub, "GET", path)
        assert (status, headers.get("X-Error-Code")) == (404, code), path
    status, _, body = call(local_hub, "GET", f"/api/models/{repo_id}/tree/main?recursive=1")
    assert [(e["type"], e["path"]) for e in json.loads(body)] == [
        ("directory", "sub"), ("file", "a.bin"), ("file", "sub/b.txt")
    ]
    assert [e["path"] for e in json.loads(call(local_hub, "GET", f"/api/models/{repo_id}/tree/main")[2])] == [
        "sub", "a.bin"
    ]
    assert json.loads(call(local_hub, "GET", f"/api/models/{repo_id}/tree/main/sub")[2])[0]["oid"] == git_blob_sha1(
        b"hello"
    )
    assert not unknown(local_hub)


def test_commit_is_atomic_and_checks_parent(local_hub: LocalHub) -> None:
    repo_id = make_repo(local_hub, "atomic", {"keep.txt": b"v1"})
    before = local_hub.sha(repo_id)
    good = commit_body({"keep.txt": b"v2", "new.txt": b"new"})
    broken = good + b'{"key": "file", "value": {"path": "bad.bin", "encoding": "base64", "content": "@@@"}}\n'
    status, headers, body = call(local_hub, "POST", f"/api/models/{repo_id}/commit/main", broken)
    assert status == 400, body
    assert local_hub.sha(repo_id) == before and local_hub.files(repo_id) == {"keep.txt": b"v1"}
    stale = commit_body({"keep.txt": b"v3"}, parent="0" * 40)
    assert call(local_hub, "POST", f"/api/models/{repo_id}/commit/main", stale)[0] == 412
    local_hub.fail["commit"] = 503
    assert call(local_hub, "POST", f"/api/models/{repo_id}/commit/main", good)[0] == 503
    assert local_hub.files(repo_id) == {"keep.txt": b"v1"}
    del local_hub.fail["commit"]
    status, _, body = call(local_hub, "POST", f"/api/models/{repo_id}/commit/main", commit_body({}, parent=before))
    assert status == 200 and json.loads(body)["commitOid"] == local_hub.sha(repo_id) != before
    status, _, body = call(local_hub, "POST", f"/api/models/{repo_id}/commit/nobranch", good)
    assert status == 404
    assert [r.status for r in local_hub.requests if r.endpoint == "commit"] == [200, 400, 412, 503, 200, 404]


# ---------------------------------------------------------------- the stock client

UPLOAD = """
repo = api.create_repo("tiny").repo_id
again = api.create_repo("tiny", exist_ok=True).repo_id
conflict = status_of(lambda: api.create_repo("tiny"))
commit = api.upload_folder(folder_path=args["folder"], repo_id=repo, commit_message="first")
files = {name: digest(hf_hub_download(repo, name)) for name in args["names"]}
snap = Path(snapshot_download(repo, cache_dir=args["other_cache"]))
snapshot = {str(p.relative_to(snap)): digest(p) for p in snap.rglob("*") if p.is_file()}
info = api.model_info(repo, files_metadata=True)
secret = api.create_repo("secret", private=True).repo_id
api.delete_repo(api.create_repo("doomed").repo_id)
print(json.dumps({
    "repo": repo, "again": again, "conflict": conflict, "commit": commit.oid, "files": files,
    "snapshot": snapshot, "sha": info.sha, "siblings": {s.rfilename: s.size for s in info.siblings},
    "tree": sorted(e.path for e in api.list_repo_tree(repo, recursive=True)),
    "missing_file": status_of(lambda: hf_hub_download(repo, "nope.txt")),
    "missing_repo": status_of(lambda: api.model_info("user/nope")),
    "deleted_again": status_of(lambda: api.delete_repo("user/doomed")),
    "private": api.model_info(secret).private,
    "private_anonymous": status_of(lambda: api.model_info(secret, token=False)),
}))
"""


def test_upload_folder_and_downloads(local_hub: LocalHub, tmp_path: Path) -> None:
    big = random.Random(0).randbytes(11 * 2**20)  # > 10 MB: the client's LFS threshold
    files = {
        "README.md": b"---\nlicense: mit\n---\n# tiny\n",
        "config.json": b'{"a": 1}',
        "weights.bin": big,
        "nested/dir/notes.txt": "h\u00e9llo\n".encode(),
    }
    write_files(tmp_path / "folder", files)
    want = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    out = run_client(local_hub, UPLOAD, tmp_path / "client", folder=str(tmp_path / "folder"), names=sorted(files),
                     other_cache=str(tmp_path / "other_cache"))
    assert out["repo"] == out["again"] == "user/tiny"
    assert out["conflict"] == 409
    assert out["files"] == want
    assert out["snapshot"] == want
    assert out["commit"] == out["sha"] == local_hub.sha("user/tiny")
    assert out["siblings"] == {name: len(data) for name, data in files.items()}
    assert out["tree"] == sorted([*files, "nested", "nested/dir"])
    assert (out["missing_file"], out["missing_repo"]) == ("RemoteEntryNotFoundError", "RepositoryNotFoundError")
    assert out["private"] is True and out["private_anonymous"] == "RepositoryNotFoundError"
    assert out["deleted_again"] == "RepositoryNotFoundError" and local_hub.repos() == ["user/secret", "user/tiny"]
    assert local_hub.files("user/tiny") == files
    called = {r.endpoint for r in local_hub.requests}
    assert {"create", "validate-yaml", "preupload", "commit", "resolve", "info", "tree"} <= called
    assert [r.status for r in local_hub.requests if r.endpoint == "commit"] == [200]  # one atomic commit
    assert not unknown(local_hub)


BRANCH = """
repo = api.create_repo("branched").repo_id
api.upload_folder(folder_path=args["main"], repo_id=repo)
no_branch = status_of(lambda: api.upload_folder(folder_path=args["dev"], repo_id=repo, revision="dev/v2"))
api.create_branch(repo, branch="dev/v2")
twice = status_of(lambda: api.create_branch(repo, branch="dev/v2"))
api.create_branch(repo, branch="dev/v2", exist_ok=True)
api.upload_folder(folder_path=args["dev"], repo_id=repo, revision="dev/v2")
snap = Path(snapshot_download(repo, revision="dev/v2"))
print(json.dumps({
    "no_branch": no_branch, "twice": twice,
    "main": Path(hf_hub_download(repo, "weights.txt")).read_text(),
    "dev": Path(hf_hub_download(repo, "weights.txt", revision="dev/v2")).read_text(),
    "dev_sha": api.model_info(repo, revision="dev/v2").sha,
    "snapshot": sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()),
    "refs": sorted((b.name, b.target_commit) for b in api.list_repo_refs(repo).branches),
}))
"""


def test_branch_upload_and_revision_download(local_hub: LocalHub, tmp_path: Path) -> None:
    write_files(tmp_path / "main", {"weights.txt": b"main weights"})
    write_files(tmp_path / "dev", {"weights.txt": b"dev weights", "extra.txt": b"only on dev"})
    out = run_client(local_hub, BRANCH, tmp_path / "client", main=str(tmp_path / "main"), dev=str(tmp_path / "dev"))
    assert out["no_branch"] == "RevisionNotFoundError"  # like the Hub: create_branch first
    assert out["twice"] == 409
    assert (out["main"], out["dev"]) == ("main weights", "dev weights")
    assert out["snapshot"] == ["extra.txt", "weights.txt"]
    branches = local_hub.branches("user/branched")
    assert out["dev_sha"] == branches["dev/v2"] != branches["main"]
    assert out["refs"] == [[name, sha] for name, sha in sorted(branches.items())]
    assert local_hub.files("user/branched") == {"weights.txt": b"main weights"}
    assert not unknown(local_hub)


TOKEN = """
refused = status_of(lambda: api.create_repo("guarded"))
repo = api.create_repo("guarded", token=args["token"]).repo_id
api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo, token=args["token"])
read = Path(hf_hub_download(repo, "x.txt", token=args["token"])).read_bytes().decode()
print(json.dumps({"refused": refused, "read": read, "info": status_of(lambda: api.model_info(repo))}))
"""


def test_wrong_token_is_refused(tmp_path: Path) -> None:
    with LocalHub(tmp_path / "hub", token="secret") as hub:
        out = run_client(hub, TOKEN, tmp_path / "client", hf_token="wrong", token="secret")
        assert out == {"refused": 401, "read": "x", "info": 401}
        assert hub.files("user/guarded") == {"x.txt": b"x"}
        assert [r.status for r in hub.requests if r.endpoint == "create"] == [401, 200]


FAIL = """
refused = status_of(lambda: api.upload_file(path_or_fileobj=b"v2", path_in_repo="w.txt", repo_id=args["repo"]))
print(json.dumps({"refused": refused, "sha": api.model_info(args["repo"]).sha}))
"""


def test_refused_commit_leaves_main_unchanged(local_hub: LocalHub, tmp_path: Path) -> None:
    repo_id = make_repo(local_hub, "failing", {"w.txt": b"v1"})
    before = local_hub.sha(repo_id)
    local_hub.fail["commit"] = 500
    out = run_client(local_hub, FAIL, tmp_path / "client", repo=repo_id)
    assert out == {"refused": 500, "sha": before}
    assert local_hub.sha(repo_id) == before and local_hub.files(repo_id) == {"w.txt": b"v1"}
    assert [r.status for r in local_hub.requests if r.endpoint == "commit"] == [200, 500]  # no retry, no partial


# ---------------------------------------------------------------- a checkpoint round trip

#: hf_recattn hidden first (tests/isolated.py), then the round trip
ROUND_TRIP = HIDE_HF_RECATTN + """
import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
repo = api.create_repo("recattn-tiny").repo_id
api.upload_folder(folder_path=args["main"], repo_id=repo)
api.create_branch(repo, branch="v2")
api.upload_folder(folder_path=args["v2"], repo_id=repo, revision="v2")
out = {"loaded": [], "missing": ""}
for name, revision in [("main", None), ("v2", "v2")]:
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, revision=revision).eval()
    out[name + "_class"] = f"{type(model).__module__}.{type(model).__name__}"
    out[name] = model.generate(torch.tensor(args["prompt"]), **args["generate"]).tolist()
try:
    AutoModelForCausalLM.from_pretrained("user/nope", trust_remote_code=True)
except OSError as e:
    out["missing"] = str(e)
out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "hf_recattn")
print(json.dumps(out))
"""

LAYERS = [
    {"mixer": "linear", "feature_map": "hedgehog", "normalize": "rms", "chunk_size": 4},
    {"mixer": "delta", "chunk_size": 4},
]
GENERATE = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


def test_checkpoint_round_trip_with_remote_code(local_hub: LocalHub, tmp_path: Path) -> None:
    models = {name: save_tiny_recattn(tmp_path / name, LAYERS, seed) for name, seed in [("main", 1), ("v2", 2)]}
    prompt = [[5, 17, 42, 8, 99, 3]]
    with torch.no_grad():
        want = {name: m.generate(torch.tensor(prompt), **GENERATE).tolist() for name, m in models.items()}
    assert want["main"] != want["v2"], "the two checkpoints must generate differently to tell revisions apart"
    out = run_client(local_hub, ROUND_TRIP, tmp_path / "client", main=str(tmp_path / "main"),
                     v2=str(tmp_path / "v2"), prompt=prompt, generate=GENERATE)
    assert out["loaded"] == []
    for name in ("main", "v2"):
        assert out[f"{name}_class"].startswith("transformers_modules."), out[f"{name}_class"]
        assert out[f"{name}_class"].endswith(".modeling.RecAttnForCausalLM")
        assert out[name] == want[name], name
        saved = {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()}
        assert local_hub.files("user/recattn-tiny", revision=name) == saved
    assert "is not a local folder and is not a valid model identifier" in out["missing"]
    fetched = {r.path.rsplit("/", 1)[-1] for r in local_hub.requests if r.endpoint == "resolve" and r.status == 200}
    assert {"config.json", "model.safetensors", "modeling.py", "configuration.py"} <= fetched
    assert not unknown(local_hub)
