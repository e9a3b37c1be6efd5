"""A small Hugging Face Hub-compatible HTTP server for tests (stdlib only, serves 127.0.0.1).

`LocalHub` keeps model repos in a folder: content-addressed blobs (``blobs/<git sha1>``) and one JSON file per
repo (``repos/<ns>/<name>.json``: privacy, branches -> commit, commits -> {path: blob}). It answers what the
stock ``huggingface_hub`` client and ``transformers`` ask for: repo creation and deletion, YAML validation,
pre-upload (every file "regular", so file bytes travel base64 inside the commit and hf_xet is never used),
ndjson commits (applied atomically once every line is decoded), branches, refs, model info, tree and
paths-info listings and ``resolve`` downloads (HEAD and GET with Range). Errors carry the ``X-Error-Code``
headers the client maps to its exceptions (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).

Options for tests: ``token`` makes every request without ``Authorization: Bearer <token>`` answer 401;
``fail`` maps an endpoint name (see `ENDPOINTS`) to a status it answers instead of doing anything; every
request is logged in ``requests`` as ``(method, path, status, endpoint)``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

#: endpoint names used in the request log and in `LocalHub.fail` (requests matching no route log "unknown")
ENDPOINTS = (
    "create",
    "delete",
    "validate-yaml",
    "whoami",
    "info",
    "tree",
    "paths-info",
    "refs",
    "preupload",
    "commit",
    "branch",
    "resolve",
)


#: (endpoint name, repo id or "", unquoted path segments after the endpoint's own)
Route = tuple[str, str, list[str]]


class Request(NamedTuple):
    """One logged request."""

    method: str
    path: str
    status: int
    endpoint: str


class HubError(Exception):
    """An error answer: status, message, optional ``X-Error-Code``, JSON body ``extra`` and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.extra, self.headers = extra or {}, headers or {}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub sends as the ETag of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class LocalHub:
    """A Hub for tests: ``LocalHub(root).start()`` returns the endpoint to put in ``HF_ENDPOINT``."""

    def __init__(self, root: Path, token: str | None = None, namespace: str = "user") -> None:
        self.root = Path(root)
        self.token = token
        self.namespace = namespace
        self.fail: dict[str, int] = {}
        self.requests: list[Request] = []
        self.endpoint = ""
        self._lock = threading.Lock()
        self._repos: dict[str, dict[str, Any]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._counter = 0
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        for meta in sorted((self.root / "repos").glob("*/*.json")):
            self._repos[f"{meta.parent.name}/{meta.stem}"] = json.loads(meta.read_text())

    # ---------------------------------------------------------------- lifecycle

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; returns the endpoint URL."""
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer((host, port), handler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        server = self._server
        self._thread = threading.Thread(target=lambda: server.serve_forever(0.05), name="local-hub", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LocalHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- inspection for tests

    def repos(self) -> list[str]:
        """Ids of the repos that exist."""
        with self._lock:
            return sorted(self._repos)

    def sha(self, repo_id: str, revision: str = "main") -> str:
        """The commit a branch (or commit id) resolves to."""
        with self._lock:
            return self._resolve(self._repo(repo_id), revision)

    def branches(self, repo_id: str) -> dict[str, str]:
        """Branch name -> commit id."""
        with self._lock:
            return dict(self._repo(repo_id)["branches"])

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Every file of a revision: path -> bytes."""
        with self._lock:
            repo = self._repo(repo_id)
            tree = dict(repo["commits"][self._resolve(repo, revision)]["files"])
        return {path: self._blob(oid).read_bytes() for path, oid in sorted(tree.items())}

    # ---------------------------------------------------------------- storage (call with the lock held)

    def _blob(self, oid: str) -> Path:
        return self.root / "blobs" / oid

    def _store_blob(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        path = self._blob(oid)
        if not path.exists():
            tmp = path.with_name(f"{oid}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return oid

    def _save(self, repo_id: str) -> None:
        path = self.root / "repos" / f"{repo_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._repos[repo_id]))
        os.replace(tmp, path)

    def _repo(self, repo_id: str) -> dict[str, Any]:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        return repo

    def _resolve(self, repo: dict[str, Any], revision: str) -> str:
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if revision in repo["commits"]:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _new_commit(self, repo: dict[str, Any], parent: str | None, files: dict[str, str], summary: str) -> str:
        self._counter += 1
        record = {"parent": parent, "files": files, "summary": summary, "date": _now()}
        sha = hashlib.sha1(json.dumps([record, self._counter, time.time_ns()]).encode()).hexdigest()
        repo["commits"][sha] = record
        return sha

    # ---------------------------------------------------------------- endpoints

    def create_repo(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST /api/repos/create."""
        name = payload.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise HubError(400, "name must be a repo name without '/'")
        repo_type = payload.get("type") or "model"
        if repo_type != "model":
            raise HubError(400, f"this test server only hosts models, not {repo_type}s")
        repo_id = f"{payload.get('organization') or self.namespace}/{name}"
        url = f"{self.endpoint}/{repo_id}"
        private = payload.get("visibility") == "private" or payload.get("private") is True
        with self._lock:
            if repo_id in self._repos:
                raise HubError(409, "You already created this model repo", extra={"url": url})
            repo: dict[str, Any] = {"private": private, "created": _now(), "branches": {}, "commits": {}}
            repo["branches"]["main"] = self._new_commit(repo, None, {}, "initial commit")
            self._repos[repo_id] = repo
            self._save(repo_id)
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def delete_repo(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """DELETE /api/repos/delete."""
        repo_id = f"{payload.get('organization') or self.namespace}/{payload.get('name')}"
        with self._lock:
            self._repo(repo_id)
            del self._repos[repo_id]
            (self.root / "repos" / f"{repo_id}.json").unlink(missing_ok=True)
        return 200, {}

    def info(self, repo_id: str, revision: str, blobs: bool) -> dict[str, Any]:
        """GET /api/models/{repo}[/revision/{rev}]: id, sha, siblings."""
        with self._lock:
            repo = self._repo(repo_id)
            sha = self._resolve(repo, revision)
            commit = repo["commits"][sha]
            siblings: list[dict[str, Any]] = []
            for path, oid in sorted(commit["files"].items()):
                sibling: dict[str, Any] = {"rfilename": path}
                if blobs:
                    sibling.update(size=self._blob(oid).stat().st_size, blobId=oid)
                siblings.append(sibling)
            return {
                "_id": repo_id,
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": sha,
                "private": repo["private"],
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "createdAt": repo["created"],
                "lastModified": commit["date"],
                "siblings": siblings,
            }

    def _entries(self, files: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Every file and folder of a tree as a listing entry, by path."""
        entries: dict[str, dict[str, Any]] = {}
        for path, oid in files.items():
            entries[path] = {"type": "file", "oid": oid, "size": self._blob(oid).stat().st_size, "path": path}
            parts = path.split("/")
            for i in range(1, len(parts)):
                folder = "/".join(parts[:i])
                folder_oid = hashlib.sha1(f"tree {folder}".encode()).hexdigest()
                entries.setdefault(folder, {"type": "directory", "oid": folder_oid, "size": 0, "path": folder})
        return entries

    def tree(self, repo_id: str, revision: str, folder: str, recursive: bool) -> list[dict[str, Any]]:
        """GET /api/models/{repo}/tree/{rev}[/{path}]; a missing folder is EntryNotFound."""
        with self._lock:
            repo = self._repo(repo_id)
            entries = self._entries(repo["commits"][self._resolve(repo, revision)]["files"])
        folder = folder.strip("/")
        if folder and entries.get(folder, {}).get("type") != "directory":
            raise HubError(404, f"{folder} does not exist on {revision}", "EntryNotFound")
        prefix = f"{folder}/" if folder else ""
        found = [e for p, e in entries.items() if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])]
        return sorted(found, key=lambda e: (e["type"] != "directory", e["path"]))

    def paths_info(self, repo_id: str, revision: str, paths: list[str]) -> list[dict[str, Any]]:
        """POST /api/models/{repo}/paths-info/{rev}: the entries among ``paths`` that exist."""
        with self._lock:
            repo = self._repo(repo_id)
            entries = self._entries(repo["commits"][self._resolve(repo, revision)]["files"])
        return [entries[p.strip("/")] for p in paths if p.strip("/") in entries]

    def refs(self, repo_id: str) -> dict[str, Any]:
        """GET /api/models/{repo}/refs."""
        with self._lock:
            branches = dict(self._repo(repo_id)["branches"])
        listed = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha} for b, sha in sorted(branches.items())]
        return {"branches": listed, "tags": [], "converts": [], "pullRequests": []}

    def preupload(self, repo_id: str, revision: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /api/models/{repo}/preupload/{rev}: every file "regular", with the oid it has now (if any)."""
        with self._lock:
            repo = self._repo(repo_id)
            if revision not in repo["branches"]:
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            current = repo["commits"][repo["branches"][revision]]["files"]
        answers = []
        for item in payload.get("files", []):
            path = item["path"]
            answers.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": current.get(path)})
        return {"files": answers}

    def commit(self, repo_id: str, branch: str, body: bytes) -> dict[str, Any]:
        """POST /api/models/{repo}/commit/{rev}: decode every ndjson line first, then apply under the lock."""
        header: dict[str, Any] = {}
        ops: list[tuple[str, str, bytes | str | None]] = []  # (kind, path, bytes | lfs sha256 | None)
        for number, line in enumerate(body.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    content = value["content"]
                    if value.get("encoding", "base64") == "base64":
                        data = base64.b64decode(content, validate=True)
                    else:
                        data = content.encode()
                    ops.append(("add", value["path"], data))
                elif key == "lfsFile":
                    ops.append(("lfs", value["path"], value["oid"]))
                elif key in ("deletedFile", "deletedFolder"):
                    ops.append((key, value["path"].strip("/"), None))
                else:
                    raise ValueError(f"unknown key {key!r}")
            except (ValueError, KeyError, TypeError, binascii.Error) as e:
                raise HubError(400, f"commit line {number}: {e}") from e
        blobs = {path: self._store_blob(data) for kind, path, data in ops if kind == "add" and isinstance(data, bytes)}
        with self._lock:
            repo = self._repo(repo_id)
            if branch not in repo["branches"]:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = repo["branches"][branch]
            parent = header.get("parentCommit")
            if parent and parent != head:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo["commits"][head]["files"])
            for kind, path, data in ops:
                if kind == "add":
                    files[path] = blobs[path]
                elif kind == "lfs":
                    files[path] = self._blob_by_sha256(repo, str(data))
                elif kind == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                else:
                    doomed = [p for p in files if p.startswith(f"{path}/")]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in doomed:
                        del files[p]
            sha = self._new_commit(repo, head, files, str(header.get("summary", "")))
            repo["branches"][branch] = sha
            self._save(repo_id)
        return {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}

    def _blob_by_sha256(self, repo: dict[str, Any], sha256: str) -> str:
        """An ``lfsFile`` line may only name content this repo already holds (copies)."""
        for commit in repo["commits"].values():
            for oid in commit["files"].values():
                if hashlib.sha256(self._blob(oid).read_bytes()).hexdigest() == sha256:
                    return oid
        raise HubError(400, f"LFS object {sha256} is unknown: this server asks for regular uploads only")

    def branch(self, repo_id: str, name: str, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST (create, from ``startingPoint`` or main) or DELETE /api/models/{repo}/branch/{name}."""
        with self._lock:
            repo = self._repo(repo_id)
            if method == "DELETE":
                if name not in repo["branches"] or name == "main":
                    raise HubError(404 if name != "main" else 403, f"cannot delete branch {name}")
                del repo["branches"][name]
            else:
                if name in repo["branches"]:
                    raise HubError(409, f"Reference already exists: refs/heads/{name}")
                if name.startswith("refs/") or not name:
                    raise HubError(400, f"Invalid reference for a branch: {name}")
                repo["branches"][name] = self._resolve(repo, payload.get("startingPoint") or "main")
            self._save(repo_id)
        return {}

    def locate(self, repo_id: str, revision: str, path: str) -> tuple[Path, str, str]:
        """(blob file, commit id, git oid) of a file at a revision."""
        with self._lock:
            repo = self._repo(repo_id)
            sha = self._resolve(repo, revision)
            oid = repo["commits"][sha]["files"].get(path)
        if oid is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        return self._blob(oid), sha, oid

    def is_private(self, repo_id: str) -> bool:
        """Whether a repo exists and is private."""
        with self._lock:
            return bool(self._repos.get(repo_id, {}).get("private"))


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to the `LocalHub` set as the class attribute ``hub``."""

    hub: LocalHub
    protocol_version = "HTTP/1.1"
    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr log (requests are logged in ``hub.requests``)."""

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    # ---------------------------------------------------------------- plumbing

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, ctype: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self._log(status)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode())

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message, **err.headers}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, json.dumps({"error": err.message, **err.extra}).encode(), headers)

    def _log(self, status: int) -> None:
        """Log before the answer leaves, so a client that has its answer finds the request logged."""
        self.hub.requests.append(Request(self.command, urlsplit(self.path).path, status, self._endpoint))
        self._logged = True

    def _handle(self, method: str) -> None:
        self._logged, self._endpoint = False, "unknown"
        split = urlsplit(self.path)
        try:
            body = self._read_body()
            route = _route(method, split.path)
            if route is not None:
                self._endpoint = route[0]
            self._check_auth(route)
            if route is None:
                raise HubError(404, f"no route for {method} {split.path}")
            if self._endpoint in self.hub.fail:
                raise HubError(self.hub.fail[self._endpoint], f"injected failure of {self._endpoint}")
            self._dispatch(method, route, parse_qs(split.query), body)
        except HubError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:  # a server bug: answer 500 and keep serving
            self._error(HubError(500, f"{type(err).__name__}: {err}"))
        finally:
            if not self._logged:  # the connection broke before an answer
                self._log(0)

    def _check_auth(self, route: Route | None) -> None:
        given = self.headers.get("Authorization", "")
        if self.hub.token is not None and given != f"Bearer {self.hub.token}":
            if given:
                raise HubError(401, "Invalid credentials in Authorization header")
            raise HubError(401, "Authentication required")
        if route is not None and route[1] and not given and self.hub.is_private(route[1]):
            raise HubError(401, "Repository not found", "RepoNotFound")

    def _dispatch(self, method: str, route: Route, query: dict[str, list[str]], body: bytes) -> None:
        hub = self.hub
        endpoint, repo_id, rest = route
        try:
            payload = json.loads(body) if body and endpoint not in ("commit", "paths-info") else {}
        except ValueError as e:
            raise HubError(400, f"the body is not JSON: {e}") from e
        if endpoint == "create":
            self._json(*hub.create_repo(payload))
        elif endpoint == "delete":
            self._json(*hub.delete_repo(payload))
        elif endpoint == "validate-yaml":
            self._json(200, {"errors": [], "warnings": []})
        elif endpoint == "whoami":
            name = hub.namespace
            auth = {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}}
            self._json(200, {"type": "user", "name": name, "fullname": name, "orgs": [], "auth": auth})
        elif endpoint == "info":
            revision = rest[0] if rest else "main"
            blobs = query.get("blobs", [""])[0].lower() in ("1", "true")
            self._json(200, hub.info(repo_id, revision, blobs))
        elif endpoint == "tree":
            recursive = query.get("recursive", [""])[0].lower() in ("1", "true")
            self._json(200, hub.tree(repo_id, rest[0], "/".join(rest[1:]), recursive))
        elif endpoint == "paths-info":
            form = parse_qs(body.decode()) if body else {}
            self._json(200, hub.paths_info(repo_id, rest[0], form.get("paths", [])))
        elif endpoint == "refs":
            self._json(200, hub.refs(repo_id))
        elif endpoint == "preupload":
            if query.get("create_pr"):
                raise HubError(400, "pull requests are not supported by this test server")
            self._json(200, hub.preupload(repo_id, rest[0], payload))
        elif endpoint == "commit":
            if query.get("create_pr"):
                raise HubError(400, "pull requests are not supported by this test server")
            self._json(200, hub.commit(repo_id, rest[0], body))
        elif endpoint == "branch":
            self._json(200, hub.branch(repo_id, rest[0], method, payload))
        elif endpoint == "resolve":
            self._resolve_file(repo_id, rest[0], "/".join(rest[1:]))

    def _resolve_file(self, repo_id: str, revision: str, path: str) -> None:
        blob, sha, oid = self.hub.locate(repo_id, revision, path)
        size = blob.stat().st_size
        headers = {"X-Repo-Commit": sha, "ETag": f'"{oid}"', "Accept-Ranges": "bytes"}
        start, end, status = 0, size - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            span = _parse_range(wanted, size)
            if span is None:
                raise HubError(416, f"range not satisfiable: {wanted}", headers={"Content-Range": f"bytes */{size}"})
            start, end, status = span[0], span[1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        with blob.open("rb") as f:
            f.seek(start)
            data = f.read(end - start + 1) if self.command == "GET" else b""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self._log(status)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> inclusive (start, end), or None if unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first:
            start, end = int(first), (int(last) if last else size - 1)
        else:
            start, end = max(size - int(last), 0), size - 1
    except ValueError:
        return None
    end = min(end, size - 1)
    return (start, end) if 0 <= start <= end else None


#: /api/models/{ns}/{name}/<segment>/... -> endpoint
_REPO_API = {
    "revision": "info",
    "tree": "tree",
    "paths-info": "paths-info",
    "refs": "refs",
    "preupload": "preupload",
    "commit": "commit",
    "branch": "branch",
}


def _route(method: str, path: str) -> Route | None:
    """(endpoint, repo id or "", unquoted remaining segments) for a URL path, or None."""
    raw = path.split("/")[1:]
    parts = [unquote(p) for p in raw]
    if parts[:2] == ["api", "repos"] and len(parts) == 3:
        wanted = {"create": "POST", "delete": "DELETE"}.get(parts[2])
        return (parts[2], "", []) if wanted == method else None
    if parts == ["api", "validate-yaml"] and method == "POST":
        return ("validate-yaml", "", [])
    if parts == ["api", "whoami-v2"] and method == "GET":
        return ("whoami", "", [])
    if parts[:2] == ["api", "models"] and len(parts) >= 4:
        repo_id = f"{parts[2]}/{parts[3]}"
        if len(parts) == 4:
            return ("info", repo_id, []) if method == "GET" else None
        endpoint = _REPO_API.get(parts[4])
        if endpoint is None or (endpoint != "refs" and len(parts) < 6):
            return None
        methods = {"info": "GET", "tree": "GET", "refs": "GET", "branch": "POST DELETE"}.get(endpoint, "POST")
        return (endpoint, repo_id, parts[5:]) if method in methods.split() else None
    if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
        return ("resolve", f"{parts[0]}/{parts[1]}", parts[3:])
    return None
