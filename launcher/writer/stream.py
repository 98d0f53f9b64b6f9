"""One shard's files written as its batches arrive, so that a shard's size never bounds the writer's memory.

Each batch's encoded images go at once to the shard's image folder, into the Parquet file's current row group
(written out every `output.row_group_size` rows) and into the WebDataset tar; the writer holds at most one row
group of encoded images. Every file is written under a temporary name (a hidden file or folder beside it on
disk, a local spool file for an object store: launcher/ledger/store.py `open_output`) and appears at `commit`,
whole, or never (`abort`): a shard's data files appear complete or not at all, and its state file, which the
caller writes after `commit`, comes last. Rows keep the shard's order (each sample's `_pos`): batches come shape
bucket by shape bucket, so a sample that arrives before its turn waits in a local spool file, and only its row
fields stay in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from launcher.ledger.states import DATA_DIR, IMAGES_DIR, WDS_DIR
from launcher.ledger.store import Store, _commit, tmp_name
from launcher.plan.shards import file_stem
from launcher.writer.encode import EXTENSIONS
from launcher.writer.writer import image_path, schema_of


class _Hashed:
    """A write-only stream that hashes and counts what passes through to `f` (pyarrow and tarfile write to it)."""

    def __init__(self, f):
        self.f, self.size, self.sha, self.closed = f, 0, hashlib.sha256(), False

    def write(self, data) -> int:
        if self.f is None:  # discarded: the shard was aborted
            return len(data)
        data = bytes(data)
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the underlying file is open_output's: it commits it
        self.closed = True

    def entry(self) -> list:
        return [self.size, self.sha.hexdigest()]


class _Folder:
    """The shard's image folder: on disk a hidden temporary folder renamed into place at commit; on an object store
    each file written in place (as Store.put_folder does) and, at commit, the names not written removed."""

    def __init__(self, store: Store, rel: str):
        self.store, self.rel, self.names = store, rel, set()
        if store.is_local:
            self.final: Path = store.local(rel)
            self.tmp: Path = self.final.with_name(tmp_name(self.final.name))
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)

    def put(self, name: str, data: bytes) -> None:
        self.names.add(name)
        if not self.store.is_local:
            return self.store.write_bytes(f"{self.rel}/{name}", data)
        with open(self.tmp / name, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # a power loss must not leave a "done" shard with empty images

    def commit(self) -> None:
        if not self.store.is_local:
            for info in self.store.files(self.rel):
                if info.base_name not in self.names:
                    self.store.delete(f"{self.rel}/{info.base_name}")
            return
        shutil.rmtree(self.final, ignore_errors=True)  # an earlier attempt that was never marked done
        _commit(self.tmp, self.final)

    def abort(self) -> None:
        if self.store.is_local:
            shutil.rmtree(self.tmp, ignore_errors=True)


class ShardStream:
    """The files of one shard being written. `add` each batch's samples (row fields and `encoded`, the image's
    bytes), then `commit` (what the state keeps of the files) or `abort` (nothing of them stays)."""

    def __init__(self, store: Store, shard_name: str, output_cfg):
        self.store, self.name, self.cfg = store, shard_name, output_cfg
        self.ext = EXTENSIONS[output_cfg.format]
        # a mapping's view of the settings: the writer process gets them as a SimpleNamespace (bgwriter.py)
        self._settings = output_cfg if hasattr(output_cfg, "get") else vars(output_cfg)
        self.files: dict[str, list] = {}
        self._stack = contextlib.ExitStack()
        self._folder = _Folder(store, f"{IMAGES_DIR}/{shard_name}") if output_cfg.image_files else None
        self._parquet: Any = None
        self._wds: Any = None
        self._tar: tarfile.TarFile | None = None
        self._writer: Any = None
        self._schema: pa.Schema | None = None
        self._rows: list[dict] = []  # the row group being filled
        self._metadata: list = []
        self.images = 0
        self._next = 0  # the position whose turn it is
        self._waiting: dict[int, tuple[dict, int, int]] = {}  # position -> (row fields, offset, size in the spool)
        self._spool = None

    def _open(self, rel: str) -> _Hashed:
        return _Hashed(self._stack.enter_context(self.store.open_output(rel)))

    def _start(self, samples: list[dict]) -> None:

        self._schema = schema_of(samples)
        if self.cfg.parquet:
            self._parquet = self._open(f"{DATA_DIR}/{self.name}.parquet")
            self._writer = pq.ParquetWriter(
                self._parquet, self._schema, compression="zstd", metadata_collector=self._metadata
            )
        if self.cfg.webdataset:
            self._wds = self._open(f"{WDS_DIR}/{self.name}.tar")
            # PAX: a key is an id's file stem, up to 200 bytes; USTAR's headers refuse names over 100
            self._tar = tarfile.open(fileobj=self._wds, mode="w", format=tarfile.PAX_FORMAT)

    def add(self, samples: list[dict]) -> None:
        """Write the samples whose turn it is (and those that waited for them); spool the others."""
        if not samples:
            return
        if self._schema is None:
            self._start(samples)
        for s in samples:
            pos = s.pop("_pos", None)
            if pos is None:  # no order given (a whole shard handed over at once, already in order)
                self._emit(s)
            elif pos == self._next:
                self._emit(s)
                self._next += 1
                while self._next in self._waiting:  # those that waited for it
                    self._emit(self._unspool(self._next))
                    self._next += 1
            else:
                self._wait(pos, s)

    def _wait(self, pos: int, s: dict) -> None:
        if self._spool is None:
            self._spool = tempfile.TemporaryFile(prefix="meshgen-order-")
        data = s.pop("encoded")
        offset = self._spool.seek(0, os.SEEK_END)
        self._spool.write(data)
        self._waiting[pos] = (s, offset, len(data))

    def _unspool(self, pos: int) -> dict:
        s, offset, size = self._waiting.pop(pos)
        self._spool.seek(offset)
        s["encoded"] = self._spool.read(size)
        return s

    def _emit(self, s: dict) -> None:
        names, name = self._schema.names, f"{file_stem(s['id'])}.{self.ext}"
        if self._folder is not None:
            self._folder.put(name, s["encoded"])
            self.files[f"{IMAGES_DIR}/{self.name}/{name}"] = [len(s["encoded"]), _sha(s["encoded"])]
        if self._writer is not None:
            data = s["encoded"] if self._settings.get("embed_images", True) else None
            image = {"bytes": data, "path": image_path(self.name, name, self._settings)}
            self._rows.append({**{k: s.get(k) for k in names}, "image": image})
            if len(self._rows) >= self.cfg.row_group_size:
                self._flush()
        if self._tar is not None:
            meta = {k: s.get(k) for k in names if k not in ("image", "reference_image")}
            _tar_add(self._tar, name, s["encoded"])
            # default=str: a kept timestamp, date or decimal column has no JSON type of its own
            _tar_add(self._tar, f"{file_stem(s['id'])}.json", json.dumps(meta, sort_keys=True, default=str).encode())
        self.images += 1

    def _flush(self) -> None:
        # Row groups of a fixed row count: `datasets` streaming and pyarrow read one group at a time.
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []

    def commit(self) -> dict:
        """Close and commit every file; what the state keeps: `files` (size and sha256 each) and `data_bytes`."""
        if self._schema is None and (self.cfg.parquet or self.cfg.webdataset):
            self._start([])  # a shard of no images still has its (empty) files
        for pos in sorted(self._waiting):  # after a position that never came (none should): the rest in order
            self._emit(self._unspool(pos))
        if self._spool is not None:
            self._spool.close()
        data_bytes = None
        if self._writer is not None:
            self._flush()
            self._writer.close()
            self.files[f"{DATA_DIR}/{self.name}.parquet"] = self._parquet.entry()
            meta = self._metadata[0]
            data_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        if self._tar is not None:
            self._tar.close()
            self.files[f"{WDS_DIR}/{self.name}.tar"] = self._wds.entry()
        if self._folder is not None:
            self._folder.commit()
        self._stack.close()  # each open_output commits its file here, whole
        return {"files": self.files, **({"data_bytes": data_bytes} if data_bytes is not None else {})}

    def abort(self) -> None:
        """Leave nothing of the shard's new files (its temporary names removed, nothing committed)."""
        if self._folder is not None:
            self._folder.abort()
        if self._spool is not None:
            self._spool.close()
        for stream in (self._parquet, self._wds):
            if stream is not None:
                stream.f = None
        for closing in (self._writer, self._tar):  # closed now, into nothing: not later by the collector
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.close()
        with contextlib.suppress(Exception):
            self._stack.__exit__(RuntimeError, RuntimeError("shard aborted"), None)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: the same samples, the same bytes
    tar.addfile(info, io.BytesIO(data))
