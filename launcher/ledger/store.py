"""The output folder, on local disk or an object store (`gs://`, `s3://`), through pyarrow.fs.

Every read and write of a run folder goes through a Store, so the same guarantees hold everywhere:
- a file appears whole or not at all: on disk through a temporary name and a rename; on an object store by
  one PUT (pyarrow completes a multipart upload atomically), so no temporary objects exist there;
- `create_exclusive` creates a file only if it does not exist yet, atomically: a hard link on disk, a
  conditional PUT on S3 (`If-None-Match: *`) and on GCS (`ifGenerationMatch=0`). Claims and object-store locks
  are built on it.
Object stores fail transiently now and then (a 500, a dropped response stream): every object-store call is
tried again, 0.5, 1 and 2 s later, before its error is raised. A missing file is never retried.
Credentials come from the standard places: the `AWS_*` variables (`AWS_ENDPOINT_URL` included) for S3, and
Google's application default credentials for GCS (or a local GCS server: launcher/ledger/gcs.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

TMP_MARK = ".tmp-"
RETRIES = 4  # attempts of one object-store call
RETRY_DELAY_S = 0.5  # before the second attempt; doubled before each next one
FOLDER_RACE_TRIES = 5  # to make a local folder that another process removes the moment it is empty


HOST = socket.gethostname().replace("/", "_")
_OPENED = {"remote": False}  # whether this process has opened an object store's client: see open_uri


def open_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for a gs:// or s3:// address, and the path in it; this process remembers it opened one
    (`opened_remote`), because a fork of it would copy the client's threads and connections half-alive."""
    _OPENED["remote"] = True
    if uri.startswith("gs://") and "?" not in uri:  # an address with options: pyarrow's own parser reads them
        from launcher.ledger.gcs import open_gcs

        return open_gcs(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return (_bounded_s3(fs) if isinstance(fs, pafs.S3FileSystem) else fs), path


S3_TIMEOUT_S = 5  # connect, and the longest silence within a request (curl's low-speed limit on Linux)
RETRY_BUDGET_S = 15  # no object-store call is tried again after this long: an unreachable store is exit 2 in <30 s


def _bounded_s3(fs: pafs.S3FileSystem) -> pafs.S3FileSystem:
    """The same S3 client with its waits bounded: by default an endpoint that accepts connections and never
    answers holds each request for minutes (200 s measured to the launcher's exit). Its own retries are left to
    Store._call, which bounds them in time."""
    rebuild, (options,) = fs.__reduce__()
    options = {**options, "connect_timeout": S3_TIMEOUT_S, "request_timeout": S3_TIMEOUT_S}
    options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
    return rebuild(options)


def opened_remote() -> bool:
    """Whether this process has opened an object store's client (open_uri)."""
    return _OPENED["remote"]


def tmp_name(name: str) -> str:
    """The hidden temporary name of `name` while this process writes it: its host and pid, so that on a folder
    that several nodes share (NFS under SLURM) a starting worker can tell another node's live write from a dead
    process's leftover of its own (launcher/ledger/states.py's clean_tmp)."""
    return f".{name}{TMP_MARK}{HOST}-{os.getpid()}"


logger = logging.getLogger(__name__)


class Store:
    def __init__(self, uri: str | os.PathLike):
        from launcher.ledger.addresses import check_address

        uri = str(uri)
        check_address(uri)  # never s3://KEY:SECRET@...: the address is printed and recorded everywhere
        self.is_local = "://" not in uri
        if self.is_local:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(uri).resolve())
        else:
            self.fs, self.root = open_uri(uri.rstrip("/"))
        self.uri = self.root if self.is_local else uri.rstrip("/")
        self.scheme = "file" if self.is_local else uri.split("://", 1)[0]

    def __str__(self) -> str:
        return self.uri

    def url(self, rel: str = "") -> str:
        """What to print for `rel`: the address with its scheme (`path` drops it on an object store)."""
        return f"{self.uri}/{rel}" if rel else self.uri

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def local(self, rel: str = "") -> Path:
        """The local path of `rel` (local stores only: locks and temporary files exist only there)."""
        assert self.is_local, "only a local store has local paths"
        return Path(self.path(rel))

    def _call(self, fn: Callable, *args):
        """fn(*args); on an object store, tried again after a transient error."""
        attempts, start = 1 if self.is_local else RETRIES, time.monotonic()
        for n in range(attempts):
            try:
                return fn(*args)
            except OSError as e:
                if _missing(e) or n == attempts - 1 or time.monotonic() - start > RETRY_BUDGET_S:
                    raise
                delay = RETRY_DELAY_S * 2**n
                logger.warning("%s: %s; trying again in %.1f s", self.uri, str(e).splitlines()[0][:200], delay)
                time.sleep(delay)

    # -- reading
    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self._call(self._read, self.path(rel))
        except OSError as e:
            if _missing(e):
                return None
            raise

    def _read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path, compression=None) as f:  # the bytes as stored: no .gz magic
            return f.read()

    def read_json(self, rel: str) -> dict | None:
        data = self.read_bytes(rel)
        return None if data is None else json.loads(data)

    def mtime(self, rel: str) -> float | None:
        """When `rel` was last written, by the store's own clock (its mtime; LastModified on an object store)."""
        info = self._call(self.fs.get_file_info, self.path(rel))
        return None if info.type == pafs.FileType.NotFound else info.mtime.timestamp()

    def now(self) -> float:
        """The store's clock now, as `mtime` reads it: the time of a probe file written and read back at each call.
        Never this host's clock plus an offset measured once: that clock may step (NTP, a resumed VM) mid-run and
        would age every file at once. Hosts whose own clocks disagree still agree on what is old."""
        rel = f"locks/.clock-{HOST}-{os.getpid()}-{threading.get_ident()}"
        self.write_bytes(rel, b"")
        written = self.mtime(rel)
        self.delete(rel)
        if written is None:  # removed under us (a run.overwrite of the folder): nothing better to go by
            return time.time()
        return written

    def exists(self, rel: str) -> bool:
        return self._call(self.fs.get_file_info, self.path(rel)).type != pafs.FileType.NotFound

    def files(self, rel_dir: str, suffix: str = "", recursive: bool = False) -> list[pafs.FileInfo]:
        """Files directly under `rel_dir` (or anywhere below it), by name; temporary files of a live run (hidden
        names) left out. On an object store a recursive listing is one request per 1,000 files, whatever the depth."""
        selector = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=recursive)
        infos, skip = self._call(self.fs.get_file_info, selector), len(selector.base_dir) + 1
        # A hidden folder's files are a live run's temporary ones too (put_folder's folder before its rename).
        hidden = (lambda i: "/." in "/" + i.path[skip:]) if recursive else (lambda i: i.base_name.startswith("."))
        keep = [i for i in infos if i.type == pafs.FileType.File and not hidden(i)]
        return sorted((i for i in keep if i.base_name.endswith(suffix)), key=lambda i: i.base_name)

    def parquet(self, rel: str) -> pq.ParquetFile:
        return pq.ParquetFile(self.fs.open_input_file(self.path(rel)))

    # -- writing
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write `rel` whole or not at all."""
        if not self.is_local:
            self._call(self._put, self.path(rel), data)
            return
        path, tmp = self._synced_temp(rel, data)
        _commit(tmp, path)

    def _put(self, path: str, data: bytes) -> None:
        with self.fs.open_output_stream(path, compression=None) as f:  # one object, visible once complete
            f.write(data)

    def _synced_temp(self, rel: str, data: bytes) -> tuple[Path, Path]:
        """`data` in a hidden temporary file beside `rel`, on disk for good; (final path, temporary path)."""
        path = self.local(rel)
        tmp, f = _open_temp_beside(path)
        try:
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError:  # a full disk: leave no partial temporary file behind
            tmp.unlink(missing_ok=True)
            raise
        return path, tmp

    @contextlib.contextmanager
    def open_output(self, rel: str):
        """A stream whose bytes become `rel` whole when the block ends, or not at all when it raises.

        On disk a synced temporary file renamed into place; on an object store a local temporary file uploaded
        as one object (pyarrow's own upload stream would complete a half-written object on an error).
        """
        import shutil
        import tempfile

        if self.is_local:
            path = self.local(rel)
            tmp, f = _open_temp_beside(path)
        else:
            tmp = Path(tempfile.mkdtemp(prefix="meshgen-")) / "upload"
            f = None  # opened inside the try: its temporary folder goes whatever happens
        try:
            with f or open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            if self.is_local:
                _commit(tmp, path)
            else:
                self._call(pafs.copy_files, str(tmp), self.path(rel), pafs.LocalFileSystem(), self.fs)
        finally:
            if self.is_local:
                tmp.unlink(missing_ok=True)
            else:
                shutil.rmtree(tmp.parent, ignore_errors=True)

    def write_json(self, rel: str, obj: dict) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())

    def put_folder(self, rel: str, files: dict[str, bytes]) -> None:
        """Replace the folder `rel` with `files`: on disk all at once (a renamed temporary folder). On an object
        store each file is overwritten in place and only then are the files not in `files` removed, so no moment
        leaves a name missing that a done state (another writer's, however it came to be) describes."""
        if not self.is_local:
            for name, data in files.items():
                self.write_bytes(f"{rel}/{name}", data)
            for info in self.files(rel):
                if info.base_name not in files:
                    self.delete(f"{rel}/{info.base_name}")
            return
        import shutil

        final = self.local(rel)
        tmp = final.with_name(tmp_name(final.name))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for name, data in files.items():
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())  # a power loss must not leave a "done" shard with empty images
        except OSError:  # a full disk: leave no partial temporary folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)  # an earlier attempt that was never marked done
        _commit(tmp, final)

    def delete(self, rel: str) -> None:
        """Remove `rel` if it exists. Any other error is raised: a state file that could not be removed must not
        be taken for removed."""
        try:
            self._call(self.fs.delete_file, self.path(rel))
        except OSError as e:
            if not _missing(e):
                raise

    def delete_dir(self, rel: str) -> None:
        try:
            self._call(self.fs.delete_dir, self.path(rel))
        except OSError as e:
            if not _missing(e):
                raise

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` if it does not exist; False if it does. Atomic on every backend."""
        if self.is_local:
            # A complete, synced temporary file linked to the final name: link fails if the name exists, and
            # a reader never sees the file half-written (O_EXCL then write would show it empty for a moment).
            path, tmp = self._synced_temp(rel, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
            return True
        bucket, _, key = self.path(rel).partition("/")
        if self.scheme == "s3":
            return _s3_create_exclusive(bucket, key, data)
        if self.scheme == "gs":
            from launcher.ledger.gcs import create_exclusive

            return create_exclusive(bucket, key, data)
        raise NotImplementedError(f"no atomic create for {self.scheme}://")


def _open_temp_beside(path: Path):
    """(temporary path, its file open for writing): a new hidden file beside `path`, its folder made as needed.

    Another process may remove that folder the moment it is empty (a shard's claims folder goes once the shard is
    done, and claims/ and plans/ once a run is finished) while a peer is writing there: between our mkdir and our
    open, or inside mkdir (it found the folder, then no folder). Make it again; the remover is done by then."""
    tmp = path.with_name(tmp_name(path.name))
    for _ in range(FOLDER_RACE_TRIES - 1):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return tmp, open(tmp, "wb")
        except (FileExistsError, FileNotFoundError):
            continue
    path.parent.mkdir(parents=True, exist_ok=True)  # the last try raises what it meets (a file in the way, say)
    return tmp, open(tmp, "wb")


def boto_bounds():
    """What a boto3 client of ours waits at most, as _bounded_s3 for pyarrow's (boto3's defaults: 60 s to connect,
    60 s of silence, 5 tries, minutes for an endpoint that never answers)."""
    from botocore.config import Config

    return Config(connect_timeout=S3_TIMEOUT_S, read_timeout=2 * S3_TIMEOUT_S, retries={"total_max_attempts": 2})


def _s3_create_exclusive(bucket: str, key: str, data: bytes) -> bool:
    import boto3
    from botocore.exceptions import ClientError

    try:
        with boto_errors():
            boto3.client("s3", config=boto_bounds()).put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise
    return True


@contextlib.contextmanager
def boto_errors():
    """botocore's transport errors as OSError, as pyarrow's are: a refused connection (EndpointConnectionError) is
    none, and the callers' one-line handling of a store that cannot be reached would miss it."""
    from botocore.exceptions import BotoCoreError

    try:
        yield
    except BotoCoreError as e:
        if isinstance(e, OSError):  # botocore's timeouts are OSErrors already
            raise
        raise OSError(f"{type(e).__name__}: {e}") from e


def _missing(e: OSError) -> bool:
    return isinstance(e, FileNotFoundError) or "NoSuchKey" in str(e) or "not found" in str(e).lower()


def _commit(tmp: Path, final: Path) -> None:
    """Rename a finished temporary file or folder into place; when that fails, leave nothing half-written."""
    try:
        os.replace(tmp, final)
    except OSError:
        if tmp.is_dir():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
