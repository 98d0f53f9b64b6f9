"""Done means verified: a done shard's files, checked against what its state recorded.

A done state records every file it vouches for, `"files": {"data/shard-00000.parquet": [size, sha256], ...}`
(names relative to the output folder), hashed by the writer from the bytes it wrote. Each rerun checks every done
shard's files for existence and size against listings, never a request per shard: `listed_damage` lists each
folder that a done state names once, recursively (data/, webdataset/, images/ with its shard folders; on an object
store one request per 1,000 files, on disk one directory read per folder). The states come from the ledger, which
may have them from its index: the index is only a cache of the state files, the listing is the truth about the
files. The ledger keeps each file's size, and of a shard's image folder the count and total size of its files
(`index_form`). A file missing or of another size makes its shard `damaged`: planned like a pending shard and
generated again, its files replaced. `hash_damage` (tools/status.py --verify) reads the files and compares their
sha256.

States written before "files" existed are checked for what they recorded: a state with `data_bytes` wrote a
Parquet file, which must be listed (`data_bytes` is the data's uncompressed size, not the file's, so only
`--verify` compares it, with the file's footer); one with neither is taken as done.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from launcher.ledger.states import DATA_DIR, IMAGES_DIR, READERS, read_state
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)


def parquet_rel(index: int) -> str:
    return f"{DATA_DIR}/shard-{index:05d}.parquet"


def recorded(index: int, state: dict) -> dict[str, list | None]:
    """The files a done state vouches for: name -> [size], or "folder/" -> [count, bytes] (see index_form); None
    where an old state recorded no size."""
    files = state.get("files")
    if files is not None:
        return files
    return {parquet_rel(index): None} if state.get("data_bytes") is not None else {}


def index_form(files: dict) -> dict:
    """What the ledger keeps of a state's files (states.py _slim): each file's [size], without its hash, and a
    shard's image folder as one `"images/shard-N/": [count, bytes]`: a name per image would make the index ~50x
    bigger (11 against 0.2 MB of JSON for 1,000 shards of 256 images, and as much more memory in every launcher)."""
    slim: dict[str, list] = {}
    for name, entry in files.items():
        if name.endswith("/") or not name.startswith(f"{IMAGES_DIR}/"):
            slim[name] = entry if name.endswith("/") else entry[:1]
        else:
            folder = name.rpartition("/")[0] + "/"
            count, size = slim.get(folder, (0, 0))
            slim[folder] = [count + 1, size + entry[0]]
    return slim


def listed_damage(store: Store, states: dict[int, dict]) -> dict[int, str]:
    """shard -> what is wrong with its files, for the done states whose files are missing or of another size."""
    wanted = {i: recorded(i, st) for i, st in states.items() if st.get("status") == "done"}
    folders = sorted({name.split("/", 1)[0] for files in wanted.values() for name in files})
    listed: dict[str, list] = {}  # name -> [size]; "folder/" -> [count, bytes] of the files in it
    skip = len(store.path("")) + 1
    for folder in folders:  # one listing each (paged by 1,000 on an object store), after the states were read
        for info in store.files(folder, recursive=True):
            name = info.path[skip:]
            listed[name] = [info.size]
            count, size = listed.get(parent := name.rpartition("/")[0] + "/", (0, 0))
            listed[parent] = [count + 1, size + info.size]
    damage = {}
    for i, files in wanted.items():
        for name, entry in files.items():
            got = listed.get(name)
            if got is None:
                damage[i] = f"{name} is missing"
            elif entry is not None and got != entry[: len(got)]:
                damage[i] = f"{name} {_what(got, True)}, its state recorded {_what(entry, False)}"
            else:
                continue
            break
    return damage


def _what(entry: list, listed: bool) -> str:
    if len(entry) == 2 and type(entry[1]) is int:  # a folder: [count, bytes]
        return f"{'holds ' if listed else ''}{entry[0]} files of {entry[1]} bytes"
    return f"{'has ' if listed else ''}{entry[0]} bytes"


def say_damage(store: Store, damage: dict[int, str]) -> None:
    for i, why in sorted(damage.items()):
        logger.warning("%s: shard %d is damaged (%s); run.shards=pending generates it again", store, i, why)


def hash_damage(store: Store, states: dict[int, dict]) -> dict[int, str]:
    """shard -> what is wrong, for the done states one of whose files does not have the recorded sha256 (each
    state file read again, for its hashes: the index keeps only sizes; then every file read whole). States without
    hashes: their Parquet's footer against the recorded rows and `data_bytes`."""
    done = sorted(i for i, st in states.items() if st.get("status") == "done")
    with ThreadPoolExecutor(max(1, min(READERS, len(done)))) as pool:
        found = dict(zip(done, pool.map(lambda i: _hash_problem(store, i), done), strict=True))
    return {i: why for i, why in found.items() if why}


def _hash_problem(store: Store, index: int) -> str | None:
    state = read_state(store, index)
    if state is None or state.get("status") != "done":
        return None  # changed since the listing: the ledger's next look judges it
    if state.get("files") is None:
        return _footer_problem(store, index, state)
    for name, entry in state["files"].items():
        data = store.read_bytes(name)
        if data is None:
            return f"{name} is missing"
        if len(data) != entry[0]:
            return f"{name} has {len(data)} bytes, its state recorded {entry[0]}"
        if len(entry) > 1 and hashlib.sha256(data).hexdigest() != entry[1]:
            return f"{name} has another sha256 than its state recorded ({entry[1][:12]}...)"
    return None


def _footer_problem(store: Store, index: int, state: dict) -> str | None:
    if state.get("data_bytes") is None:
        return None
    rel = parquet_rel(index)
    try:
        meta = store.parquet(rel).metadata
    except (OSError, pa.ArrowException) as e:  # missing, or cut short
        return f"{rel} cannot be read ({str(e).splitlines()[0][:80]})"
    data_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    if data_bytes != state["data_bytes"] or meta.num_rows != state.get("rows", meta.num_rows):
        return f"{rel} holds {meta.num_rows} rows in {data_bytes} bytes, its state recorded {state.get('rows')} rows"
    return None
