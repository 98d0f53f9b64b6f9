"""A stand-in for the Hugging Face Hub on 127.0.0.1, for download and upload tests (HF_ENDPOINT points at it).

It answers what huggingface_hub 2.4 asks (read from its source: hf_api.repo_info / list_repo_tree / whoami /
preupload_lfs_files / create_commit, _commit_api._fetch_upload_modes / _send_commit, lfs.post_lfs_batch_info /
lfs_upload, file_download.get_hf_file_metadata, utils/_http.hf_raise_for_status), for models and datasets:
- GET /api/{models,datasets}/<id>[/revision/<rev>]: the repo's info (sha, siblings) at that revision;
- GET /api/{models,datasets}/<id>/tree/<rev>[/<path>][?recursive=true]: files (size, blob id, and `lfs` with the
  sha256 for LFS files) and folders;
- POST /api/{models,datasets}/<id>/paths-info/<rev> (form: paths=...): the same entries for the paths that exist;
- HEAD and GET /[datasets/]<id>/resolve/<rev>/<path>: the file, with X-Repo-Commit, ETag and Content-Length; a
  `Range: bytes=A-B` request gets those bytes (206), as HfFileSystem reads a file block by block;
- GET /api/whoami-v2: the token's user and role (tokens in `FakeHub.tokens`); POST /api/validate-yaml: the card;
- POST /api/<type>s/<id>/preupload/<rev>: each file's upload mode (LFS for data and images, as the Hub's default
  .gitattributes says, and for anything from 10 MiB), and the blob id of the file already at that path;
- POST /[datasets/]<id>.git/info/lfs/objects/batch: an upload action (a PUT to /lfs-upload/<sha256>) for each
  object the hub lacks, none for one it has;
- POST /api/<type>s/<id>/commit/<rev>: the ndjson commit; every file appears in one step, or none (a missing LFS
  object or a write without a write token changes nothing).
Writes need a token whose role is "write". A gated repo's info is public (as on the hub), its files answer 401
without a token and 403 with one, both with X-Error-Code: GatedRepo. Every request is logged as (method, path).
A dataset repo is `repos["datasets/ORG/NAME"]`; a model repo `repos["ORG/NAME"]`. A revision is "main", the repo's
sha, or a name in `Repo.revisions` (a tag or branch: its own files); any other answers 404 RevisionNotFound.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".parquet", ".png", ".jpg", ".jpeg", ".webp", ".tar", ".safetensors", ".bin")
LFS_FROM = 10 * 2**20


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    sha: str = COMMIT
    commits: list[dict] = field(default_factory=list)  # each commit's header and operations, as sent
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)  # tag or branch -> its files (read only)

    def at(self, rev: str) -> dict[str, bytes] | None:
        """The files at revision `rev`; None for a revision the repo does not have."""
        return self.files if rev in ("main", self.sha) else self.revisions.get(rev)


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""
    tokens: dict[str, str] = field(default_factory=dict)  # token -> role ("read", "write" or "fineGrained")
    lfs: dict[str, bytes] = field(default_factory=dict)  # uploaded LFS objects by sha256
    fail_commits: int = 0  # answer this many commits 429 (rate limited) before accepting one
    fail_status: int = 429  # or this status: 503, say, an overloaded Hub (no rate-limit headers then)
    refuse_commits: bool = False  # answer every commit 403, as for a token that lost its write access
    lock: threading.Lock = field(default_factory=threading.Lock)

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
            self._route()

        do_GET = do_POST = do_PUT = do_HEAD

        def _route(self):
            url = urlparse(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            hub.log.append((self.command, path))
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            kind = r"/api/(models|datasets)/([^/]+/[^/]+)"
            if self.command == "GET" and path == "/api/whoami-v2":
                return self._whoami()
            if self.command == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(data)["content"])
            if self.command == "PUT" and (m := re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)):
                return self._lfs_put(m.group(1), data)
            if self.command == "POST" and (
                m := re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
            ):
                return self._lfs_batch(_key(m.group(1), m.group(2)), json.loads(data))
            if m := re.fullmatch(kind + r"/preupload/([^/]+)", path):
                return self._preupload(_key(m.group(1), m.group(2)), json.loads(data))
            if m := re.fullmatch(kind + r"/commit/([^/]+)", path):
                return self._commit(_key(m.group(1), m.group(2)), data)
            if m := re.fullmatch(kind + r"(?:/revision/([^/]+))?", path):
                return self._info(_key(m.group(1), m.group(2)), m.group(3) or "main")
            if m := re.fullmatch(kind + r"/tree/([^/]+)(?:/(.*))?", path):
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                return self._tree(_key(m.group(1), m.group(2)), m.group(3), (m.group(4) or "").strip("/"), recursive)
            if self.command == "POST" and (m := re.fullmatch(kind + r"/paths-info/([^/]+)", path)):
                return self._paths_info(_key(m.group(1), m.group(2)), m.group(3), parse_qs(data.decode())["paths"])
            if m := re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._file(_key(m.group(1), m.group(2)), m.group(3), m.group(4), self.command == "GET")
            self._send(404, b"", {"X-Error-Code": "EntryNotFound"})

        def _repo(self, key: str) -> Repo | None:
            repo = hub.repos.get(key)
            if repo is None:
                self._send(401, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return repo

        def _files(self, key: str, rev: str) -> dict[str, bytes] | None:
            """The repo's files at `rev`, or None once the error is sent (no repo, no such revision)."""
            repo = self._repo(key)
            files = repo and repo.at(rev)
            if repo and files is None:
                msg = f"Invalid rev id: {rev}"
                self._send(404, b"", {"X-Error-Code": "RevisionNotFound", "X-Error-Message": msg})
            return files

        def _role(self) -> str | None:
            auth = self.headers.get("Authorization") or ""
            return hub.tokens.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None

        def _may_write(self) -> bool:
            role = self._role()  # a fine-grained token here is one given write access to the repo
            if role not in ("write", "fineGrained"):
                code, msg = (403, "You don't have the rights to write here") if role else (401, "Invalid token")
                self._send(code, b"", {"X-Error-Message": msg})
            return role in ("write", "fineGrained")

        def _whoami(self):
            role = self._role()
            if role is None:
                return self._send(401, b"", {"X-Error-Message": "Invalid user token."})
            self._json({"type": "user", "name": "tester", "auth": {"accessToken": {"displayName": "t", "role": role}}})

        def _validate_yaml(self, card: str):
            """The card's front matter must be YAML whose `configs` name data files (as the Hub checks)."""
            import yaml

            try:
                front = yaml.safe_load(card.split("---\n")[1]) if card.startswith("---\n") else {}
                assert all(c["config_name"] and c["data_files"] for c in front.get("configs", []))
            except (yaml.YAMLError, AssertionError, KeyError, TypeError, IndexError) as e:
                return self._send(400, json.dumps({"errors": [{"message": str(e)}]}).encode(), {})
            self._json({"warnings": []})

        def _info(self, key: str, rev: str):
            files = self._files(key, rev)
            if files is not None:
                repo = hub.repos[key]
                repo_id = key.removeprefix("datasets/")
                info = {
                    "_id": hashlib.sha1(key.encode()).hexdigest()[:24],
                    "id": repo_id,
                    **({"modelId": repo_id} if key == repo_id else {}),
                    "sha": repo.sha if files is repo.files else hashlib.sha1(rev.encode()).hexdigest(),
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [{"rfilename": f} for f in files],
                }
                self._json(info)

        def _tree(self, key: str, rev: str, under: str, recursive: bool):
            files = self._files(key, rev)
            if files is None:
                return
            prefix = f"{under}/" if under else ""
            entries, folders = [], set()
            for f, data in sorted(files.items()):
                if not f.startswith(prefix):
                    continue
                parts = f[len(prefix) :].split("/")
                for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                    folders.add(prefix + "/".join(parts[:depth]))
                if recursive or len(parts) == 1:
                    entries.append(_entry(key, f, data))
            entries += [_folder(d) for d in folders]
            if prefix and not entries:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            self._json(sorted(entries, key=lambda e: e["path"]))

        def _paths_info(self, key: str, rev: str, paths: list[str]):
            files = self._files(key, rev)
            if files is None:
                return
            out = []
            for p in (p.strip("/") for p in paths):
                if p in files:
                    out.append(_entry(key, p, files[p]))
                elif any(f.startswith(p + "/") for f in files):
                    out.append(_folder(p))
            self._json(out)

        def _file(self, key: str, rev: str, name: str, body: bool):
            files = self._files(key, rev)
            if files is None:
                return
            repo = hub.repos[key]
            if repo.gated:
                authed = bool(self.headers.get("Authorization"))
                msg = f"Access to model {key} is restricted and you are not in the authorized list."
                if not authed:
                    msg = f"Access to model {key} is restricted. You must be authenticated to access it."
                return self._send(403 if authed else 401, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": msg})
            data = files.get(name)
            if data is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
            headers = {
                "X-Repo-Commit": repo.sha,
                "ETag": f'"{_git_oid(data)}"',
                "Content-Type": "application/octet-stream",
            }
            if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):
                first, last = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1)
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                part = data[first : last + 1]
                return self._send(206, part if body else b"", headers, len(part))
            self._send(200, data if body else b"", headers, len(data))

        def _preupload(self, key: str, payload: dict):
            repo = self._repo(key)
            if repo is None or not self._may_write():
                return
            files = []
            for f in payload["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_FROM
                have = repo.files.get(f["path"])
                oid = None if have is None else (_sha256(have) if _lfs(key, f["path"], have) else _git_oid(have))
                files.append(
                    {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
                )
            self._json({"files": files})

        def _lfs_batch(self, key: str, payload: dict):
            if self._repo(key) is None or not self._may_write():
                return
            objects = []
            for o in payload["objects"]:
                entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                if o["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}", "header": {}}}
                objects.append(entry)
            self._json({"transfer": "basic", "objects": objects})

        def _lfs_put(self, sha256: str, data: bytes):
            if _sha256(data) != sha256:
                return self._send(400, b"", {"X-Error-Message": "sha256 mismatch"})
            hub.lfs[sha256] = data
            self._send(200, b"", {})

        def _commit(self, key: str, data: bytes):
            repo = self._repo(key)
            if repo is None or not self._may_write():
                return
            if hub.refuse_commits:
                return self._send(403, b"", {"X-Error-Message": "You don't have the rights to write here"})
            with hub.lock:
                if hub.fail_commits > 0:
                    hub.fail_commits -= 1
                    if hub.fail_status != 429:
                        return self._send(hub.fail_status, b"", {"X-Error-Message": "try again later"})
                    headers = {"RateLimit": '"api";r=0;t=1', "RateLimit-Policy": '"fixed window";"api";q=1;w=1'}
                    return self._send(429, b"", {"X-Error-Message": "rate limited", **headers})
                lines = [json.loads(x) for x in data.splitlines() if x.strip()]
                files = dict(repo.files)
                for op in lines[1:]:
                    v = op["value"]
                    if op["key"] == "file":
                        files[v["path"]] = base64.b64decode(v["content"])
                    elif op["key"] == "lfsFile":
                        if v["oid"] not in hub.lfs:
                            return self._send(422, b"", {"X-Error-Message": f"LFS object {v['oid']} not uploaded"})
                        files[v["path"]] = hub.lfs[v["oid"]]
                    elif op["key"] == "deletedFile":
                        files.pop(v["path"], None)
                    else:
                        return self._send(400, b"", {"X-Error-Message": f"unknown operation {op['key']}"})
                repo.files = files  # all at once: a reader sees the commit's files together or not at all
                repo.sha = hashlib.sha1(repo.sha.encode() + data).hexdigest()
                repo.commits.append({"header": lines[0]["value"], "ops": lines[1:]})
                self._json({"commitUrl": f"{hub.url}/{key}/commit/{repo.sha}", "commitOid": repo.sha})

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
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    # polled every 20 ms for shutdown (0.5 s by default: half a second of every test's teardown)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


def _key(kind: str | None, repo_id: str) -> str:
    return f"datasets/{repo_id}" if kind and kind.startswith("dataset") else repo_id


def _lfs(key: str, path: str, data: bytes) -> bool:
    """Whether the repo keeps `path` in LFS; model repos are listed as they always were here (git blob ids)."""
    return key.startswith("datasets/") and (path.endswith(LFS_SUFFIXES) or len(data) >= LFS_FROM)


def _entry(key: str, path: str, data: bytes) -> dict:
    if not _lfs(key, path, data):
        return {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{_sha256(data)}\nsize {len(data)}\n".encode()
    lfs = {"oid": _sha256(data), "size": len(data), "pointerSize": len(pointer)}
    return {"type": "file", "oid": _git_oid(pointer), "size": len(data), "path": path, "lfs": lfs}


def _folder(path: str) -> dict:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
