"""Where a dataset is published (launcher/publish/push.py): a Hub dataset repo, or a folder on an object store.

Each target is probed when opened (one line, exit 2, before anything is sent: no token, a read-only token, a
missing repo or bucket, no answer), lists what it holds with each file's size and sha256, and takes batches:
- the Hub: every batch is one commit (its LFS files pre-uploaded first with `preupload_lfs_files`, then
  `create_commit`), so a file appears there only within a commit and a killed push leaves whole shards; a commit
  the Hub rate-limits is sent again when its RateLimit headers say (huggingface_hub retries the uploads itself);
- an object store or folder (any `Store`): each file is one object, a shard's images before its data files, and then
  `.meshgen-published/shard-NNNNN.json` with the files' sizes and sha256 (what the next push compares with, since a
  listing gives only sizes). A loader never reads that hidden folder.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

from launcher.errors import ConfigError
from launcher.ledger.states import DATA_DIR, IMAGES_DIR, READERS, WDS_DIR
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)

COMMIT_TRIES = 6
MANIFESTS = ".meshgen-published"
HUB_ADDRESS = re.compile(r"hf://datasets/([\w.-]+/[\w.-]+)(?:@([\w./-]+))?/?")


def open_target(uri: str, run: Store | None = None):
    if uri.startswith("hf://"):
        return HubTarget(uri)
    if "://" in uri and not uri.startswith(("s3://", "gs://")):
        raise ConfigError(f"cannot publish to {uri}: give hf://datasets/ORG/NAME, s3://BUCKET/PATH or gs://BUCKET/PATH")
    return StoreTarget(uri, run)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubTarget:
    def __init__(self, uri: str):
        from huggingface_hub import HfApi, constants

        m = HUB_ADDRESS.fullmatch(uri)
        if not m:
            raise ConfigError(f"cannot publish to {uri}: a Hub target is hf://datasets/ORG/NAME (or ...@REVISION)")
        self.uri, self.repo_id, self.revision = uri, m.group(1), m.group(2) or "main"
        self.api = HfApi(endpoint=constants.ENDPOINT)
        self._probe()

    def _probe(self) -> None:
        """One bounded request for the repo (a hub that does not answer is one line within HF_HUB_ETAG_TIMEOUT, as in
        launcher/checks/download.py), then the token's role: a read-only token would fail only at the first commit."""
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalTokenNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where, wait = f"{self.repo_id} on {constants.ENDPOINT}", constants.HF_HUB_ETAG_TIMEOUT
        try:
            self.api.repo_info(self.repo_id, repo_type="dataset", revision=self.revision, timeout=wait)
            role = self.api.whoami()["auth"]["accessToken"].get("role")
        except LocalTokenNotFoundError:
            raise ConfigError(f"publishing to {where} needs a token: log in (hf auth login) or set HF_TOKEN") from None
        except RevisionNotFoundError:
            no_rev = f"{where} has no revision {self.revision}: create the branch or drop @{self.revision}"
            raise ConfigError(no_rev) from None
        except RepositoryNotFoundError:
            raise ConfigError(
                f"{where} is not a dataset repo (or a private one this token cannot see): create it "
                f"(hf repo create {self.repo_id} --repo-type dataset) or log in with hf auth login"
            ) from None
        except HfHubHTTPError as e:
            status = e.response.status_code  # huggingface_hub's HTTP errors always carry their response
            why = str(e).splitlines()[0][:120]
            raise ConfigError(f"{where} refused the token ({status}: {why}); log in again (hf auth login)") from None
        except (httpx2.TransportError, OSError) as e:
            raise ConfigError(
                f"publishing to {where}: the hub did not answer within {wait} s ({type(e).__name__}); check the "
                "network and HF_ENDPOINT (HF_HUB_ETAG_TIMEOUT sets the wait)"
            ) from None
        if role not in (None, "write", "fineGrained"):
            raise ConfigError(f"publishing to {where}: the token is {role}-only; use a token that may write to it")

    def listing(self) -> dict:
        from huggingface_hub.hf_api import RepoFile

        tree = self.api.list_repo_tree(self.repo_id, repo_type="dataset", revision=self.revision, recursive=True)
        return {f.path: f for f in tree if isinstance(f, RepoFile)}

    @staticmethod
    def same(name: str, entry: tuple[int, str], remote, data: bytes | None = None) -> bool:
        """Whether the Hub's file is this one: an LFS file by its sha256, a git file by its blob id."""
        if remote is None or remote.size != entry[0]:
            return False
        if remote.lfs is not None:
            return remote.lfs.sha256 == entry[1]
        return data is not None and remote.blob_id == git_blob_id(data)

    def push(self, run: Store, batch, message: str) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        adds = [
            CommitOperationAdd(n, str(run.local(n)) if run.is_local else run.read_bytes(n))  # ty: ignore[invalid-argument-type]
            for n in sorted(batch.send)
        ]
        self.api.preupload_lfs_files(self.repo_id, adds, repo_type="dataset", revision=self.revision)
        self._commit([*adds, *(CommitOperationDelete(n) for n in batch.remove)], message)

    def put_card(self, run: Store, shards: list[int]) -> bool:
        from huggingface_hub import CommitOperationAdd

        text = _card(run, self.repo_id)
        if self.same("README.md", (len(text), ""), self.listing().get("README.md"), text):
            return False
        self._commit([CommitOperationAdd("README.md", text)], "meshgen: dataset card")
        return True

    def _commit(self, ops: list, message: str) -> None:
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import parse_ratelimit_headers

        for attempt in range(COMMIT_TRIES):
            try:
                self.api.create_commit(
                    self.repo_id, ops, commit_message=message, repo_type="dataset", revision=self.revision
                )
                return
            except HfHubHTTPError as e:
                status = e.response.status_code
                if (status != 429 and status < 500) or attempt == COMMIT_TRIES - 1:
                    raise
                limit = parse_ratelimit_headers(e.response.headers)
                wait = limit.reset_in_seconds if limit is not None else min(2**attempt, 60)
                logger.warning("%s: commit answered %d; sending it again in %d s", self.uri, status, wait)
                time.sleep(wait)


class StoreTarget:
    def __init__(self, uri: str, run: Store | None):
        self.store = Store(uri)
        self.uri = self.store.url()
        if run is not None and (self.store.uri + "/").startswith(run.uri.rstrip("/") + "/"):
            raise ConfigError(f"cannot publish {run} into itself ({self.uri}): give another folder or bucket")
        self._probe()

    def _probe(self) -> None:
        import pyarrow.fs as pafs

        try:
            if not self.store.is_local:
                bucket = self.store.root.split("/", 1)[0]
                if self.store.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise ConfigError(f"cannot publish to {self.uri}: bucket {bucket} does not exist; create it first")
            self.store.files(DATA_DIR)  # credentials and network: one listing
        except OSError as e:
            raise ConfigError(f"cannot publish to {self.uri}: {str(e).splitlines()[0][:200]}") from None

    def listing(self) -> dict:
        skip = len(self.store.path("")) + 1
        sizes = {
            i.path[skip:]: i.size for d in (DATA_DIR, WDS_DIR, IMAGES_DIR) for i in self.store.files(d, recursive=True)
        }
        manifests = [i.base_name for i in self.store.files(MANIFESTS, ".json")]
        with ThreadPoolExecutor(max(1, min(READERS, len(manifests)))) as pool:
            recorded = list(pool.map(lambda n: self.store.read_json(f"{MANIFESTS}/{n}") or {}, manifests))
        hashes = {name: e[1] for m in recorded for name, e in m.items()}
        return {name: (size, hashes.get(name)) for name, size in sizes.items()}

    @staticmethod
    def same(name: str, entry: tuple[int, str], remote, data: bytes | None = None) -> bool:
        return remote is not None and tuple(remote) == tuple(entry)

    def push(self, run: Store, batch, message: str) -> None:
        import shutil

        import pyarrow.fs as pafs

        for index in batch.shards:
            files = batch.files[index]
            for name in sorted(n for n in batch.remove if n not in files):
                self.store.delete(name)
            # Images first: a Parquet file whose rows point at image files arrives after them.
            for name in sorted((n for n in batch.send if n in files), key=lambda n: not n.startswith(IMAGES_DIR)):
                if self.store.is_local:  # through a temporary file and a rename, streamed
                    with self.store.open_output(name) as f, run.fs.open_input_stream(run.path(name)) as src:
                        shutil.copyfileobj(src, f, 2**20)
                else:  # one object, streamed
                    self.store._call(pafs.copy_files, run.path(name), self.store.path(name), run.fs, self.store.fs)
            self.store.write_json(f"{MANIFESTS}/shard-{index:05d}.json", {n: list(e) for n, e in files.items()})

    def put_card(self, run: Store, shards: list[int]) -> bool:
        text = _card(run, None)
        if self.store.read_bytes("README.md") == text:
            return False
        self.store.write_bytes("README.md", text)
        return True


def _card(run: Store, repo_id: str | None) -> bytes:
    from launcher.publish.card import card_text

    return card_text(run, repo_id=repo_id).encode()
