"""The Hugging Face Hub's URL layout, served from local folders over real HTTP on 127.0.0.1, for tests.

    with HubServer({"test/tiny-flux": tiny.resolve("tiny:flux")}, gated={"test/gated"}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path)}  # for a subprocess

The real ``huggingface_hub``, and diffusers through it, then work as against the hub: model info
(``/api/models/{repo}[/revision/{rev}]``), listings (``/api/models/{repo}/tree/{rev}[/{folder}]``) and files
(``HEAD``/``GET /{repo}/resolve/{rev}/{path}``) of ``owner/name`` repos at ``main`` or the repo's commit sha, errors
with the hub's ``X-Error-Code``. Files come from here (no CDN redirect, no ``X-Xet-*`` headers): plain HTTP.
Weights get the sha256 ETag and ``lfs`` entries the hub gives LFS files, other files their git blob sha1.
``huggingface_hub`` reads ``HF_ENDPOINT`` when imported: set it before (in a subprocess), or pass ``endpoint=``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".msgpack", ".h5", ".gguf"}
# A repository is served as a model and as a dataset (``/api/datasets/...``, ``/datasets/{repo}/resolve/...``).
_ROUTES = {"tree": re.compile(r"/api/(?:models|datasets)/([^/]+/[^/]+)/tree/([^/]+)(?:/(.+))?"),
           "info": re.compile(r"/api/(?:models|datasets)/([^/]+/[^/]+)(?:/revision/([^/]+))?()"),
           "resolve": re.compile(r"/(?:datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")}


class _File(NamedTuple):
    local: Path
    size: int
    sha1: str  # git blob sha1; of the LFS pointer for an LFS file
    sha256: str | None  # LFS files only


def _pointer(sha256: str, size: int) -> bytes:  # the text git keeps for an LFS file
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class _Repo:
    def __init__(self, repo_id: str, folder, sha: str | None, gated: bool):
        self.id, self.gated, self.files = repo_id, gated, {}
        for local in sorted(p for p in Path(folder).rglob("*") if p.is_file() and ".git" not in p.parts):
            data = local.read_bytes()
            sha256 = hashlib.sha256(data).hexdigest() if local.suffix in LFS_SUFFIXES else None
            blob = _pointer(sha256, len(data)) if sha256 else data
            sha1 = hashlib.sha1(b"blob %d\0" % len(blob) + blob).hexdigest()
            self.files[local.relative_to(folder).as_posix()] = _File(local, len(data), sha1, sha256)
        listing = "".join(f"{path} {f.sha1}\n" for path, f in self.files.items())
        self.sha = sha or hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()

    @staticmethod
    def _lfs(f: _File, sha256_key: str) -> dict:
        pointer = _pointer(f.sha256, f.size) if f.sha256 else b""
        return {"lfs": {sha256_key: f.sha256, "size": f.size, "pointerSize": len(pointer)}} if pointer else {}

    def info(self, blobs: bool) -> dict:
        siblings = [{"rfilename": path} for path in self.files]
        if blobs:  # ?blobs=True: model_info(files_metadata=True)
            for sibling, f in zip(siblings, self.files.values()):
                sibling.update(size=f.size, blobId=f.sha1, **self._lfs(f, "sha256"))
        return {"id": self.id, "sha": self.sha, "private": False, "gated": "manual" if self.gated else False,
                "disabled": False, "tags": [], "siblings": siblings}

    def tree(self, folder: str, recursive: bool) -> list[dict] | None:
        prefix = f"{folder}/" if folder else ""
        below = {path[len(prefix):]: f for path, f in self.files.items() if path.startswith(prefix)}
        if folder and not below:
            return None
        files, folders = [], set()
        for rest, f in below.items():
            parts = rest.split("/")
            folders.update("/".join(parts[:n]) for n in range(1, len(parts) if recursive else min(len(parts), 2)))
            if recursive or len(parts) == 1:
                files.append({"type": "file", "oid": f.sha1, "size": f.size, "path": prefix + rest,
                              **self._lfs(f, "oid")})
        dirs = []
        for sub in sorted(folders):  # the oid stands in for git's tree sha1: a hash of the blobs below
            oid = hashlib.sha1("".join(f.sha1 for rest, f in below.items() if rest.startswith(sub + "/")).encode())
            dirs.append({"type": "directory", "oid": oid.hexdigest(), "size": 0, "path": prefix + sub})
        return dirs + files


class HubServer:
    """Serves ``{repo_id: folder}`` at ``self.endpoint`` inside a ``with`` block (or from ``start()`` to ``stop()``).

    ``gated``: repo ids whose files are refused as the hub refuses a gated repo's (their info and tree stay public).
    ``commits``: a fixed commit sha per repo id; by default a sha1 of the repo's files.
    ``requests``: the (method, path) of every request, the path unquoted and without its query.
    """

    def __init__(self, repos: dict, *, gated=(), commits: dict | None = None):
        self.repos = {rid: _Repo(rid, folder, (commits or {}).get(rid), rid in gated) for rid, folder in repos.items()}
        self.requests: list[tuple[str, str]] = []
        self._server = self._thread = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubServer:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads, self._server.hub = True, self
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and frees the port: requests after this are refused ("connection refused")."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # a connection per request: a stopped server leaves none open behind it

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _reply(self, status: int, body: bytes, headers: dict, head: bool) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, value, head: bool, status: int = 200, **headers) -> None:
        self._reply(status, json.dumps(value).encode(), {"Content-Type": "application/json", **headers}, head)

    def _error(self, status: int, code: str | None, message: str, head: bool, **headers) -> None:
        headers = {**({"X-Error-Code": code} if code else {}), "X-Error-Message": message, **headers}
        self._json({"error": message}, head, status, **headers)

    def _serve(self, head: bool) -> None:
        url, hub = urlsplit(self.path), self.server.hub
        hub.requests.append((self.command, unquote(url.path)))
        if url.path == "/api/agent-harnesses":  # asked once a day per HF_HOME, to name an AI agent in the user agent
            return self._json({"standardEnvVars": [], "harnesses": {}}, head)
        kind, match = next(((k, m) for k, rx in _ROUTES.items() if (m := rx.fullmatch(url.path))), (None, None))
        if match is None:
            return self._error(404, None, "Sorry, we can't find the page you are looking for.", head)
        repo_id, rev, path = (unquote(g) if g else None for g in match.groups())
        repo = hub.repos.get(repo_id)
        if repo is None:  # the hub answers 401 for a missing repo, as for a private one
            return self._error(401, "RepoNotFound", "Repository not found", head)
        if rev not in (None, "main", repo.sha):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        flag = {k: v[-1].lower() == "true" for k, v in parse_qs(url.query).items()}.get
        if kind == "info":
            return self._json(repo.info(blobs=flag("blobs", False)), head)
        if kind == "tree":
            entries = repo.tree(path or "", recursive=flag("recursive", False))
            if entries is None:
                return self._error(404, "EntryNotFound", f'{path} does not exist on "{rev}"', head)
            return self._json(entries, head)
        commit = {"X-Repo-Commit": repo.sha}
        if repo.gated:
            status, why = ((403, " and you are not in the authorized list.") if self.headers.get("Authorization") else
                           (401, ". You must have access to it and be authenticated to access it. Please log in."))
            return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted{why}", head, **commit)
        if path not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found", head, **commit)
        f = repo.files[path]
        data, status, headers = f.local.read_bytes(), 200, {"Accept-Ranges": "bytes"}
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted and int(wanted[1]) < f.size:  # the client resumes a broken download with a byte range
            first, last = int(wanted[1]), min(int(wanted[2] or f.size - 1), f.size - 1)
            data, status, headers["Content-Range"] = data[first:last + 1], 206, f"bytes {first}-{last}/{f.size}"
        headers.update({"Content-Type": "application/octet-stream", "ETag": f'"{f.sha256 or f.sha1}"', **commit})
        self._reply(status, data, headers, head)
