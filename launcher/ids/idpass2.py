"""Pass 2 with an id column: the selected shards' rows, gathered by id from the files that hold them.

A shard's rows are where its ids are now, in one file or several. The id map says which rows of which file belong
to a selected shard; only the files whose map names one are read. Each shard is written to the plan file when its
last row was read, so a batch is held only until its shard is whole; the order of those moments is known from the
maps before the source is read, and is the order the plan file's metadata lists the shards in.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from launcher.errors import ConfigError
from launcher.ids import idmap
from launcher.ids.rowhash import id_hashes, row_hashes


def shard_order(index: idmap.Index, wanted: set[int]) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """The selected shards in the order their last rows are read (shards with no row in the source first), and
    where each one's last row is: (file number, row)."""
    last: dict[int, tuple[int, int]] = {}
    values = pa.array(sorted(wanted), pa.int32())
    for k, (f, e) in enumerate(index.files.items()):
        if not _holds(e, wanted):
            continue
        m = _map(index, f, ["row", "shard"], values)
        if m.num_rows:
            g = m.group_by("shard").aggregate([("row", "max")])
            for s, r in zip(g["shard"].to_pylist(), g["row_max"].to_pylist(), strict=True):
                last[s] = max(last.get(s, (k, r)), (k, r))
    return sorted(wanted, key=lambda s: last.get(s, (-1, -1))), last


def shard_rows(
    src, index: idmap.Index, order: list[int], keys: dict, cut: dict[int, int]
) -> Iterator[tuple[int, pa.Table | None]]:
    """(shard, its rows in place order, `rejected` column dropped), in `order`; a shard in `cut` keeps that many."""
    from launcher.sources import rejected
    from launcher.sources.prompts import file_batches

    wanted, parts, done = set(order), {s: [] for s in order}, 0
    values = pa.array(sorted(wanted), pa.int32())
    for s in order:
        if s in keys:
            break
        done += 1
        yield s, None  # all its ids left the source
    for k, (f, e) in enumerate(index.files.items()):
        if not _holds(e, wanted):
            continue
        m = _map(index, f, ["row", "id", "fp", "shard", "pos"], values).sort_by("row")
        if not m.num_rows:
            continue
        rows = m["row"].to_numpy()
        offset, first = _resume(src, e, int(rows[0]))
        for _, at, b in file_batches(src, [f], e["start"] + first, offset):
            t, _ = rejected.split(pa.Table.from_batches([b]), 0, 0)
            good = np.arange(b.num_rows) if t.num_rows == b.num_rows else np.flatnonzero(pc.is_null(b["rejected"]))
            row = at - e["start"] + good
            j = np.minimum(np.searchsorted(rows, row), len(rows) - 1)
            hit = rows[j] == row
            if hit.any():
                sel, j = t.filter(pa.array(hit)), j[hit]
                _check_same(f, sel, m, j)
                sel = sel.append_column("__shard", m["shard"].take(pa.array(j)))
                sel = sel.append_column("__pos", m["pos"].take(pa.array(j)))
                for s in np.unique(sel["__shard"].to_numpy()):
                    parts[int(s)].append(sel.filter(pc.equal(sel["__shard"], s)))
            if len(row):
                reached = (k, int(row[-1]))
                for s, t_ in _ready(order[done:], done, lambda s, r=reached: keys.get(s, (-1, -1)) <= r, parts, cut):
                    done += 1
                    yield s, t_
    if done < len(order):  # a shard whose last mapped row was not read again: its file lost rows since pass 1
        raise _changed(list(index.files)[keys[order[done]][0]])


def _ready(order, done, is_ready, parts, cut):
    for s in order:
        if not is_ready(s):
            return
        yield s, _whole(parts.pop(s), cut.get(s))


def _whole(parts: list[pa.Table], cut: int | None) -> pa.Table | None:
    if not parts:
        return None
    t = pa.concat_tables(parts).sort_by("__pos").drop_columns(["__shard", "__pos"])
    return t.slice(0, cut) if cut is not None else t


def _resume(src, entry: dict, row: int) -> tuple[int, int]:
    """(byte, row) to read a file from for its rows from `row` on: the last old end of a text file that grew
    before it (launcher/ids/idplan.py), or its top (always, with references or kept columns)."""
    parts = [(o, r) for o, r in entry.get("parts", []) if r <= row and not (src.image_column or src.keep_columns)]
    return max(parts, key=lambda p: p[1], default=(0, 0))


def _holds(entry: dict, wanted: set[int]) -> bool:
    return entry.get("hi", -1) >= min(wanted) and entry.get("lo", 2**31) <= max(wanted)


def _map(index: idmap.Index, f: str, columns: list[str], values: pa.Array) -> pa.Table:
    """The map rows of `f` whose shard is in `values`: its shard column read whole, then only the row groups (one
    per batch planned) that hold such rows, since a shard's ids sit together in its file."""
    with idmap.reading(index.files[f]["map"]):
        pf = index.map_file(f)
        hit = np.flatnonzero(pc.is_in(pf.read(columns=["shard"])["shard"], value_set=values).to_numpy(False))
        ends = np.cumsum([pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        groups = np.unique(np.searchsorted(ends, hit, side="right")).tolist()
        m = pf.read_row_groups(groups, columns=columns) if groups else pf.schema_arrow.empty_table().select(columns)
    return m.filter(pc.is_in(m["shard"], value_set=values))


def _check_same(f: str, sel: pa.Table, m: pa.Table, j: np.ndarray) -> None:
    """The rows read now are those pass 1 mapped: the same ids, the same hashes."""
    same = pc.equal(sel["id"], m["id"].take(pa.array(j)))
    ids = sel["id"].combine_chunks()
    fp = row_hashes(sel.combine_chunks().to_batches()[0], id_hashes(ids)) if sel.num_rows else np.zeros(0, np.uint64)
    if not pc.all(same).as_py() or not np.array_equal(fp, m["fp"].to_numpy()[j]):
        raise _changed(f)


def _changed(f: str) -> ConfigError:
    return ConfigError(
        f"the prompt source {f} changed while this run was planned; run the same command again once it is complete"
    )
