"""The end of pass 1 with an id column (launcher/ids/idplan.py): seen-before ids resolved, duplicates found,
the shard table updated, and the next generation of the id map staged.

A duplicate id (twice in the changed files, or in a changed file and an unchanged one) is refused naming both
places, or with `dataset.bad_rows=skip` set aside by planning again with its later rows marked (rejected.Recheck).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from launcher.errors import ConfigError
from launcher.ids import idmap, idruns
from launcher.ids.rowhash import stems

SHOWN = 5
_COLS = ["id", "h", "fp", "shard", "pos"]


def finish(out, staged, new, spill, candidates, vanished, deltas, index, files, legacy_tables, left_before):
    try:
        return _finish(out, staged, new, spill, candidates, vanished, deltas, index, files, legacy_tables, left_before)
    except BaseException:
        idmap.discard(staged)
        raise


def _finish(out, staged, new, spill, candidates, vanished, deltas, index, files, legacy_tables, left_before):
    from launcher.sources import rejected

    run_rel, run_path = staged.add("hashes", ".u64")
    doubles = spill.finish(run_path)
    gone = pa.concat_tables(vanished) if vanished else _empty()
    cand = pa.concat_tables(candidates) if candidates else None
    patch: dict[str, pa.Table] = {}
    late = []
    if cand is not None:
        found = cand.join(gone.rename_columns(["id", "h0", "fp0", "shard", "pos"]), "id", join_type="left outer")
        found = found.sort_by([("file", "ascending"), ("row", "ascending")])
        moved = found.filter(pc.is_valid(found["shard"]))
        if moved.num_rows:
            gone = gone.filter(pc.invert(pc.is_in(gone["id"], value_set=moved["id"])))
            fp, fp0 = moved["fp"].to_numpy(), moved["fp0"].to_numpy()
            edited = fp != fp0
            e = pa.array(edited)
            deltas.append((moved["shard"].to_numpy()[edited], fp[edited], fp0[edited], moved["id"].filter(e)))
        rest = found.filter(pc.is_null(found["shard"]))
        twins = _in_files(index, [f for f in index.files if f in files and f not in staged_changed(staged)], rest)
        late += _duplicates(twins, rest, staged)
        rest = rest.filter(pc.invert(pc.is_in(rest["id"], value_set=twins["id"]))) if twins.num_rows else rest
        if rest.num_rows:  # a hash that a run holds for another id: new after all
            shard, pos = new.take(rest["fp"].to_numpy())
            rest = (
                rest.drop_columns(["shard", "pos"])
                .append_column("shard", pa.array(shard))
                .append_column("pos", pa.array(pos))
            )
        cols = ["file", "row", "shard", "pos"]
        patch_rows = pa.concat_tables([moved.select(cols), rest.select(cols).cast(moved.select(cols).schema)])
        for f in np.unique(patch_rows["file"].to_numpy(zero_copy_only=False)):
            patch[str(f)] = patch_rows.filter(pc.equal(patch_rows["file"], f))
    if len(doubles):
        late += _doubles(staged, doubles, out)
    if late:
        if out.skip:
            raise rejected.Recheck(tuple(sorted({*out.late, *((p, why) for p, why, *_ in late)})))
        _refuse(out, min(late, key=lambda d: d[0]))  # the first in the source, whichever check found it
    for f, rows in patch.items():
        _patch(staged, f, rows)
    _shards(out, staged, new, deltas, legacy_tables)
    _left(out, staged, gone, left_before)
    runs = [*index.data.get("runs", []), run_rel]
    if len(runs) > idruns.MAX_RUNS:
        rel, path = staged.add("hashes", ".u64")
        idruns.merged([*index.run_paths(), run_path], path)
        del staged.names[run_rel]
        runs = [rel]
    staged.data["runs"] = runs
    out.staged = staged
    return out


def staged_changed(staged) -> set[str]:
    return {f for f, e in staged.data["files"].items() if e["map"] in staged.names}


def _refuse(out, first: tuple[int, str]) -> None:
    """The refusal of a duplicate id, naming the lines of both (the exact reader's words), else ours."""
    from launcher.sources.prompts import _check_unique

    if out.src is not None and first[2:]:
        rid, files = first[2], first[3]
        _check_unique(pa.chunked_array([pa.array([rid, rid])]), out.src, files)
    raise ConfigError(first[1])


def _empty() -> pa.Table:
    types = [pa.string(), pa.uint64(), pa.uint64(), pa.int32(), pa.int32()]
    return pa.table({c: pa.array([], t) for c, t in zip(_COLS, types, strict=True)})


def _in_files(index, unchanged: list[str], rest: pa.Table) -> pa.Table:
    """Rows of unchanged files whose id is one of `rest`'s (their file name stem, to be exact)."""
    found = []
    if rest.num_rows:
        hs = pa.array(rest["h"].to_numpy(), pa.uint64())
        for f in unchanged:
            m = pq.read_table(index.store.fs.open_input_file(index.store.path(index.files[f]["map"])),
                              columns=["row", "id", "h"])  # fmt: skip
            m = m.filter(pc.is_in(m["h"], value_set=hs))
            if m.num_rows:
                found.append(m.append_column("file", pa.array([f] * m.num_rows)))
    if not found:
        return pa.table({"row": pa.array([], pa.int64()), "id": pa.array([], pa.string())})
    t = pa.concat_tables(found)
    return t.filter(pc.is_in(stems(t["id"].combine_chunks()), value_set=stems(rest["id"].combine_chunks())))


def _duplicates(twins: pa.Table, rest: pa.Table, staged) -> list[tuple[int, str]]:
    """Every row of `rest` whose id (its file name stem, to be exact) an unchanged file holds, each naming the first
    such row there: all of them at once, so that a file of many old ids costs one more pass, not one per id."""
    if not twins.num_rows:
        return []
    first: dict[str, dict] = {}
    for row, stem in zip(twins.to_pylist(), stems(twins["id"].combine_chunks()).to_pylist(), strict=True):
        first.setdefault(stem, row)
    late = []
    for dup, stem in zip(rest.to_pylist(), stems(rest["id"].combine_chunks()).to_pylist(), strict=True):
        if (f := first.get(stem)) is not None:
            why = _why(dup["id"], f["id"], dup["file"], f["file"], f["row"])
            late.append((_position(staged, dup["file"], dup["row"]), why, dup["id"], [f["file"], dup["file"]]))
    return late


def _why(rid: str, other: str, f: str, f0: str, row0: int) -> str:
    """Why the id `rid` of file `f` is set aside: `other`, row `row0` of `f0`, came first."""
    if rid == other:
        return f"dataset {f}: duplicate id {rid!r} (also row {row0} of {f0}); ids must be unique"
    return (
        f"dataset {f}: ids {other!r} and {rid!r} both become the file name {stems(pa.array([rid]))[0]}; make them "
        "differ in letters, digits, '-' or '_'"
    )


def _position(staged, f: str, row: int) -> int:
    return int(staged.data["files"][f].get("start", 0)) + int(row)


def _doubles(staged, doubles: np.ndarray, out) -> list[tuple[int, str]]:
    """Ids read twice this time: the first place of each (a row planned before first), and every later one named."""
    hs, rows = pa.array(doubles, pa.uint64()), []
    for f in staged_changed(staged):
        m = pq.read_table(staged.names[staged.data["files"][f]["map"]], columns=["row", "id", "h"])
        m = m.filter(pc.is_in(m["h"], value_set=hs))
        rows += [(f, r["row"], r["id"]) for r in m.to_pylist()]
    order = {f: k for k, f in enumerate(staged.data["files"])}

    def known(f: str, row: int) -> bool:  # a grown file's old rows: planned before, never read again to be set aside
        parts = staged.data["files"][f].get("parts")
        return bool(parts) and row < parts[-1][1]

    rows.sort(key=lambda r: (not known(r[0], r[1]), order[r[0]], r[1]))
    first, late = {}, []
    for f, row, rid in rows:
        stem = stems(pa.array([rid]))[0].as_py()
        if stem in first:
            f0, row0, rid0 = first[stem]
            late.append((_position(staged, f, row), _why(rid, rid0, f, f0, row0), rid, list(dict.fromkeys([f0, f]))))
        else:
            first[stem] = (f, row, rid)
    return late


def _patch(staged, f: str, rows: pa.Table) -> None:
    path = staged.names[staged.data["files"][f]["map"]]
    m = pq.read_table(path)
    shard, pos, row = m["shard"].to_numpy().copy(), m["pos"].to_numpy().copy(), m["row"].to_numpy()
    at = np.searchsorted(row, rows["row"].to_numpy())
    shard[at], pos[at] = rows["shard"].to_numpy(), rows["pos"].to_numpy()
    m = m.set_column(4, "shard", pa.array(shard)).set_column(5, "pos", pa.array(pos))
    pq.write_table(m, path, **idmap.MAP_WRITE)
    entry = staged.data["files"][f]
    placed = shard[shard >= 0]
    entry["lo"] = int(placed.min()) if len(placed) else 2**31  # 2**31: no row placed (past any int32 shard)
    entry["hi"] = int(placed.max()) if len(placed) else -1


def _shards(out, staged, new, deltas, legacy_tables) -> None:
    n = len(out.rows) + len(new.rows)
    rows = np.concatenate([out.rows, np.asarray(new.rows, np.int32)])
    total = np.concatenate([out.total, np.zeros(len(new.rows), np.uint64)])
    legacy = list(out.legacy) + [None] * len(new.rows)
    with np.errstate(over="ignore"):
        for shards, fp in new.added:
            np.add.at(total, shards.astype(np.int64), fp)
        for shards, fp, fp0, ids in deltas:
            np.add.at(total, shards.astype(np.int64), fp - fp0)
            for s in np.unique(shards).tolist():  # their fingerprints changed: no older one stands for them
                legacy[s] = None
                out.changed.setdefault(s, [])
            _name(out.changed, shards, ids)
    if legacy_tables is not None:
        for s, fp in legacy_tables.done().items():
            if s < n:
                legacy[s] = fp
    out.rows, out.total, out.legacy = rows, total, legacy
    idmap.write_shards(staged, rows, total, legacy)


def _name(changed: dict[int, list[str]], shards: np.ndarray, ids: pa.Array) -> None:
    """Up to SHOWN changed ids per shard, each once, for the refusal and kept_ids (no Python object per row: the
    first SHOWN rows of each shard are found vectorised)."""
    if not len(shards):
        return
    order = np.argsort(shards, kind="stable")
    ranked = shards[order]
    rank = np.arange(len(ranked)) - np.searchsorted(ranked, ranked)
    keep = order[rank < SHOWN]
    for s, rid in zip(shards[keep].tolist(), ids.take(pa.array(keep)).to_pylist(), strict=True):
        found = changed[s]
        if rid not in found and len(found) < SHOWN:
            found.append(rid)


def _left(out, staged, gone: pa.Table, left_before) -> None:
    fresh = gone
    if left_before is not None and left_before.num_rows:
        fresh = gone.filter(pc.invert(pc.is_in(gone["id"], value_set=left_before["id"])))
    out.left, out.left_count = fresh["id"].slice(0, SHOWN).to_pylist(), fresh.num_rows
    if gone.num_rows:
        rel, path = staged.add("left", ".parquet")
        pq.write_table(gone.select(_COLS), path)
        staged.data["left"] = rel
    else:
        staged.data["left"] = None
