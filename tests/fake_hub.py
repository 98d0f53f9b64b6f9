"""A stand-in for the Hugging Face Hub's file API on 127.0.0.1, for download tests (HF_ENDPOINT points at it).

It answers what huggingface_hub 2.4 asks (read from its source: hf_api.repo_info / list_repo_tree,
file_download.get_hf_file_metadata, utils/_http.hf_raise_for_status):
- GET /api/models/<id>[/revision/<rev>]: the repo's info (sha, siblings);
- GET /api/models/<id>/tree/<rev>[/<path>]: the files, recursively, with size and blob id;
- HEAD and GET /<id>/resolve/<rev>/<path>: the file, with X-Repo-Commit, ETag and Content-Length.
A gated repo's info is public (as on the hub), its files answer 401 without a token and 403 with one, both with
X-Error-Code: GatedRepo. Every request is logged as (method, path) for the tests to inspect.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""

    def add_folder(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None, gated=False) -> None:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_id] = Repo({**files, **(extra or {})}, gated)

    def requested(self, method: str = "GET") -> list[str]:
        return [p for m, p in self.log if m == method]


def serve(hub: FakeHub):
    """Start `hub` on a free loopback port; returns the server (call .shutdown() to stop it)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the log list is the record
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool):
            path = unquote(urlparse(self.path).path)
            hub.log.append((self.command, path))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._info(m.group(1))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(m.group(1), m.group(3) or "")
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._file(m.group(1), m.group(3), body)
            self._send(404, b"", {"X-Error-Code": "EntryNotFound"})

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._send(401, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return repo

        def _info(self, repo_id: str):
            repo = self._repo(repo_id)
            if repo:
                info = {
                    "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": COMMIT,
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [{"rfilename": f} for f in repo.files],
                }
                self._json(info)

        def _tree(self, repo_id: str, under: str):
            repo = self._repo(repo_id)
            if repo:
                entries = [
                    {"type": "file", "oid": _oid(data), "size": len(data), "path": f}
                    for f, data in repo.files.items()
                    if f.startswith(under)
                ]
                self._json(entries)

        def _file(self, repo_id: str, name: str, body: bool):
            repo = self._repo(repo_id)
            if repo is None:
                return
            if repo.gated:
                authed = bool(self.headers.get("Authorization"))
                msg = f"Access to model {repo_id} is restricted and you are not in the authorized list."
                if not authed:
                    msg = f"Access to model {repo_id} is restricted. You must be authenticated to access it."
                return self._send(403 if authed else 401, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": msg})
            data = repo.files.get(name)
            if data is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"', "Content-Type": "application/octet-stream"}
            self._send(200, data if body else b"", headers, length=len(data))

        def _json(self, obj):
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _send(self, code: int, data: bytes, headers: dict, length: int | None = None):
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if data:
                self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
