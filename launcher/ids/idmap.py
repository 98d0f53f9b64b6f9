"""The id map: which shard each id of the prompt source belongs to, and what the ledger needs to skip a file.

With `dataset.id_column`, shards hold ids, not row positions. The output folder keeps, under `sources/`:
- `index.json`: per source file, what it was when last read (size, mtime) and its map; the shard table; the runs
  of id hashes; the ids that left the source; how rows were read (`reads`: the id, prompt, reference and kept
  columns; read otherwise now, every file is read again). Written last: the other files of a generation are in
  place first.
- `map-*.parquet`, one per source file: each mapped row's row number in the file, id, id hash, row hash, shard
  and place in the shard, in file order. A file whose size and mtime are unchanged is not read again; a text
  file that only grew at its end (`grown`) is read from its old end, its old map copied and extended;
- `shards-*.parquet`: per shard, its row count and the sum of its rows' hashes (its fingerprint,
  launcher/ids/rowhash.py), and the fingerprint that its done state had before the map existed (`legacy`);
- `hashes-*.u64`: sorted runs of every mapped id's hash (launcher/ids/idruns.py);
- `left-*.parquet`: ids that left the source: their samples stay, and they keep their shard if they come back.
The planner (launcher/ids/idplan.py) builds the next generation in a local folder; the run commits it under
its lock (`commit`), so a dry run or a refused run leaves the output folder as it was.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from launcher.ledger.store import Store

DIR = "sources"
INDEX = f"{DIR}/index.json"
VERSION = 1
MAP_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("id", pa.string()),
        ("h", pa.uint64()),
        ("fp", pa.uint64()),
        ("shard", pa.int32()),
        ("pos", pa.int32()),
    ]
)
# Ids are unique and hashes random: a dictionary never pays, and statistics go unread (a map is read whole).
MAP_WRITE = {"use_dictionary": False, "write_statistics": False, "compression": "lz4"}
SHARDS_SCHEMA = pa.schema([("rows", pa.int32()), ("total", pa.uint64()), ("legacy", pa.string())])


@dataclass
class Index:
    """A committed generation of the id map (or an empty one), as the planner reads it."""

    store: Store | None
    data: dict = field(default_factory=dict)
    # Where object-store files were fetched to, for memory-mapping: removed with the Index (or at exit), since its
    # hash runs take 8 bytes per id (800 MB a night at 100M prompts).
    local: tempfile.TemporaryDirectory | None = None

    @property
    def files(self) -> dict[str, dict]:
        return self.data.get("files", {})

    @property
    def gen(self) -> int:
        return self.data.get("gen", 0)

    def read_map(self, f: str, columns: list[str] | None = None) -> pa.Table:
        with reading(self.files[f]["map"]):
            return pq.read_table(self._open(self.files[f]["map"]), columns=columns)

    def map_batches(self, f: str) -> Iterator[pa.RecordBatch]:
        with reading(self.files[f]["map"]):
            yield from pq.ParquetFile(self._open(self.files[f]["map"])).iter_batches()

    def map_file(self, f: str) -> pq.ParquetFile:
        """`f`'s map, its footer read: open it, and read it, inside `reading(index.files[f]["map"])`."""
        return pq.ParquetFile(self._open(self.files[f]["map"]))

    def read_shards(self) -> tuple[np.ndarray, np.ndarray, list]:
        if not self.data.get("shards"):
            return np.zeros(0, np.int32), np.zeros(0, np.uint64), []
        with reading(self.data["shards"]):
            t = pq.read_table(self._open(self.data["shards"]))
        rows = t["rows"].to_numpy().astype(np.int32)
        total = t["total"].to_numpy(zero_copy_only=False).astype(np.uint64)
        return rows, total, t["legacy"].to_pylist()

    def read_left(self) -> pa.Table | None:
        if not self.data.get("left"):
            return None
        with reading(self.data["left"]):
            return pq.read_table(self._open(self.data["left"]))

    def run_paths(self) -> list[Path]:
        return [self._fetched(rel) for rel in self.data.get("runs", [])]

    def _open(self, rel: str):
        return self.store.fs.open_input_file(self.store.path(rel))

    def _fetched(self, rel: str) -> Path:
        if self.store.is_local:
            return self.store.local(rel)
        if self.local is None:
            self.local = tempfile.TemporaryDirectory(prefix="meshgen-idmap-")
        out = Path(self.local.name) / rel.rsplit("/", 1)[-1]
        if not out.exists():
            with self._open(rel) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        return out


class Damaged(Exception):
    """A file of the committed id map that cannot be read as what it should be (`reading`)."""


@contextmanager
def reading(rel: str) -> Iterator[None]:
    """Raise Damaged, naming `rel`, where reading it fails: a file the listing shows can still be cut short or
    overwritten inside (pyarrow's ArrowInvalid, or OSError: "Corrupt Lz4 compressed data"). On an object store a
    read that fails after the client's own retries is taken as damage too: the map is then built afresh."""
    try:
        yield
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise Damaged(f"{rel}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from e


def warn_damaged(store: Store, problem: str) -> None:
    logging.getLogger(__name__).warning(
        "the id map %s is damaged (%s): the source is planned afresh; a done shard whose ids it placed "
        "otherwise is found stale and named", store.path(INDEX), problem,
    )  # fmt: skip


def load(store: Store | None, shard_size: int) -> Index:
    """The committed id map, or an empty one (none yet, none readable, or made with another shard size)."""
    if store is None:
        return Index(None)
    data = store.read_json(INDEX)
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("shard_size") != shard_size:
        return Index(store)
    problem = _problem(store, data)
    if problem:  # the output folder is outside the process: a damaged map must not stop the run with a traceback
        warn_damaged(store, problem)
        return Index(store)
    return Index(store, data)


def _problem(store: Store, data: dict) -> str | None:
    """Why a committed index cannot be used (every name it holds a file under sources/, every place a number), or
    None."""
    files, runs = data.get("files"), data.get("runs")
    if not isinstance(data.get("gen"), int) or not isinstance(files, dict) or not isinstance(runs, list):
        return "its fields have the wrong types"
    ints = ("start", "rows_all", "lo", "hi")
    if not all(isinstance(e, dict) and all(isinstance(e.get(k), int) for k in ints) for e in files.values()):
        return "a source file's entry is not what it should be"
    names = [data.get("shards"), data.get("left"), *runs, *(e.get("map") for e in files.values())]
    listed = {f"{DIR}/{i.base_name}" for i in store.files(DIR)}
    missing = [n for n in names if n is not None and (not isinstance(n, str) or n not in listed)]
    return f"{missing[0]} is missing" if missing else None


@dataclass
class Staged:
    """The next generation, built in a local folder: the names it will have under `sources/`, and its index."""

    folder: Path
    data: dict
    names: dict[str, Path] = field(default_factory=dict)  # rel under the store -> local file

    def add(self, kind: str, suffix: str) -> tuple[str, Path]:
        rel = f"{DIR}/{kind}-g{self.data['gen']}-{len(self.names)}{suffix}"
        path = self.folder / rel.rsplit("/", 1)[-1]
        self.names[rel] = path
        return rel, path


def stage(previous: Index) -> Staged:
    import weakref

    data = {k: v for k, v in previous.data.items()} or {"version": VERSION}
    data["gen"] = previous.gen + 1
    staged = Staged(Path(tempfile.mkdtemp(prefix="meshgen-ids-")), data)
    # A dry run, a refused run: nothing of it stays, once the plan is dropped or at exit.
    weakref.finalize(staged, shutil.rmtree, staged.folder, True)
    return staged


def write_shards(staged: Staged, rows: np.ndarray, total: np.ndarray, legacy: list) -> None:
    rel, path = staged.add("shards", ".parquet")
    table = pa.table(
        [pa.array(rows, pa.int32()), pa.array(total, pa.uint64()), pa.array(legacy, pa.string())],
        schema=SHARDS_SCHEMA,
    )
    pq.write_table(table, path)
    staged.data["shards"] = rel


def commit(store: Store, staged: Staged | None) -> None:
    """Put the staged generation in the output folder, the index last, then remove what no index names."""
    if staged is None:
        return
    try:
        for rel, path in staged.names.items():
            with open(path, "rb") as src, store.open_output(rel) as out:
                shutil.copyfileobj(src, out, 1 << 22)
        store.write_bytes(INDEX, json.dumps(staged.data, sort_keys=True).encode())
        named = {INDEX, *staged.data.get("runs", []), staged.data.get("shards"), staged.data.get("left")}
        named |= {f["map"] for f in staged.data.get("files", {}).values()}
        for info in store.files(DIR):
            if f"{DIR}/{info.base_name}" not in named:
                store.delete(f"{DIR}/{info.base_name}")
    finally:
        discard(staged)


def discard(staged: Staged | None) -> None:
    if staged is not None:
        shutil.rmtree(staged.folder, ignore_errors=True)


def file_stat(f: str) -> dict:
    """What says a source file is unchanged without reading it: its size and modification time."""
    from launcher.sources.prompts import filesystem

    if f.startswith("hf://"):  # the Hub gives no modification time: the blob's id (LFS sha256) says the content
        from launcher.sources.hub_source import content_id

        return {"size": None, "mtime": content_id(f.removeprefix("hf://"))}
    fs, p = filesystem(f)
    info = fs.get_file_info(p)
    mtime = info.mtime_ns if info.mtime_ns is not None else None
    if info.type == pafs.FileType.Directory:  # a save_to_disk folder: its files' sizes and times
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
        return {"size": sum(i.size or 0 for i in infos), "mtime": max((i.mtime_ns or 0) for i in infos)}
    return {"size": info.size, "mtime": mtime}


EDGE = 4096  # bytes of a text file's head and of its tail before its old end, whose digests say it only grew
GROWING = (".jsonl", ".txt", ".csv")  # formats that grow by appending lines; Parquet files and folders are units


def edges(f: str, stat: dict) -> dict:
    """For a text file read to its end as `stat` found it: digests of its first EDGE bytes and of its last EDGE,
    for `grown` to recognise the same bytes later. Nothing for other files, a size unknown (the Hub), or a file
    written to while it was read (where its rows end is not known: it is read whole next time)."""
    size = stat.get("size")
    if not size or not f.lower().endswith(GROWING) or file_stat(f) != stat:
        return {}
    head, tail = _edge_bytes(f, size)
    return {"head": _digest(head), "tail": _digest(tail)}


def grown(entry: dict | None, stat: dict, f: str) -> bool:
    """Whether a text file only grew at its end since `entry` was recorded: larger now, its old end a line end
    (\\n), no byte-order mark, and its head and old tail what they were. Anything else is read whole."""
    old = (entry or {}).get("size")
    if not entry or "tail" not in entry or not isinstance(old, int) or not 0 < old < (stat.get("size") or 0):
        return False
    head, tail = _edge_bytes(f, old)
    return (
        not head.startswith(b"\xef\xbb\xbf")
        and tail.endswith(b"\n")
        and _digest(head) == entry["head"]
        and _digest(tail) == entry["tail"]
    )


def _edge_bytes(f: str, size: int) -> tuple[bytes, bytes]:
    from launcher.sources.prompts import filesystem

    fs, p = filesystem(f)
    with fs.open_input_file(p) as fh:
        return fh.read_at(min(EDGE, size), 0), fh.read_at(min(EDGE, size), max(0, size - EDGE))


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
