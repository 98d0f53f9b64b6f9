"""Pass 1 with an id column: every shard's rows and fingerprint from the id map, reading only what changed.

An unchanged file (same size and mtime as the map recorded) is not read. A text file that only grew at its end
(idmap.grown: its head and old tail as they were) keeps its old map and is read from its old end, its new rows
read as a new file's are. Another new or changed file is read in batches: each id found in the file's old map keeps
its shard and place (a changed row hash updates its shard's fingerprint and names the id); an id whose hash no run
holds is new and goes to the next new shard, in source order; an id a run does hold was seen before, and is resolved
once every changed file was read (moved from another changed file: it keeps its shard; in an unchanged file: a
duplicate; neither: a hash collision, so new). Ids of a changed or removed file that are nowhere now have left the
source: reported, their samples stay, and they keep their shard if they come back. Memory: one file's old map
(sorted hashes) and one batch, never the source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from launcher.ids import idmap, idruns
from launcher.ids.rowhash import id_hashes, row_hashes, stems

SHOWN = 5


@dataclass
class IdShards:
    """What pass 1 learnt: per shard its rows, fingerprint total and legacy fingerprint; what changed."""

    rows: np.ndarray
    total: np.ndarray
    legacy: list
    changed: dict[int, list[str]] = field(default_factory=dict)  # shard -> ids whose rows changed (each once)
    left: list[str] = field(default_factory=list)  # ids that left the source this time (up to SHOWN), and
    left_count: int = 0
    rejected: list[dict] = field(default_factory=list)
    late: tuple = ()  # the rows set aside after an earlier try (dataset.bad_rows=skip)
    skip: bool = False
    src: object = None
    staged: idmap.Staged | None = None
    index: idmap.Index | None = None


class _New:
    """Hands out new shards in source order (a shard's ids are fixed when it is first planned), and adds each new
    row's hash to its shard's total."""

    def __init__(self, first: int, size: int, cap=None):
        self.first, self.shard, self.pos, self.cap = first, first, 0, cap or (lambda s: size)
        self.rows: list[int] = []
        self.added: list[tuple[np.ndarray, np.ndarray]] = []  # (shards, row hashes)

    def take(self, fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(fp)
        shards, pos = np.empty(n, np.int32), np.empty(n, np.int32)
        at = 0
        while at < n:
            k = min(self.cap(self.shard) - self.pos, n - at)
            shards[at : at + k], pos[at : at + k] = self.shard, np.arange(self.pos, self.pos + k)
            while len(self.rows) <= self.shard - self.first:
                self.rows.append(0)
            self.rows[self.shard - self.first] += k
            at, self.pos = at + k, self.pos + k
            if self.pos == self.cap(self.shard):
                self.shard, self.pos = self.shard + 1, 0
        starts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]]) if n else np.zeros(0, np.int64)
        with np.errstate(over="ignore"):  # the sums wrap mod 2**64 on purpose (rowhash.shard_fingerprint)
            self.added.append((shards[starts], np.add.reduceat(fp.astype(np.uint64), starts) if n else fp))
        return shards, pos


def plan_ids(src, files: list[str], size: int, store, states: dict, check, fresh: bool = False) -> IdShards:
    """Pass 1 over `files` (listing order) with `src.id_column`; `check(table)` runs the row checks of new rows.
    `fresh`: as if the output folder held no id map (idmap.Damaged was raised reading it)."""
    from launcher.sources import rejected
    from launcher.sources.prompts import file_batches

    index = idmap.Index(store) if fresh else idmap.load(store, size)
    rows, total, legacy = index.read_shards()
    stats = {f: idmap.file_stat(f) for f in files}
    old, reads = index.files, _reads(src)
    again = index.data.get("reads") != reads  # rows read otherwise now: read every file
    changed = [f for f in files if again or not _same(old.get(f), stats[f])]
    # References and kept columns are read from the top, row for row beside the rows: such a source is read whole.
    whole = bool(src.image_column or src.keep_columns or again)
    grown = {f for f in changed if not whole and idmap.grown(old.get(f), stats[f], f)}
    removed = [f for f in old if f not in stats]
    out = IdShards(rows, total, legacy, index=index, late=src.late, skip=src.bad_rows == "skip", src=src)
    if not changed and not removed and [f for f in old] == files:
        return out
    staged = idmap.stage(index)
    staged.data["shard_size"], staged.data["reads"] = size, reads
    try:
        new = _New(len(rows), size, _migration_caps(states, size) if not old else None)
        with idmap.reading("its runs of id hashes"):
            runs = idruns.open_runs(index.run_paths())
        spill = idruns.Spill(staged.folder / "spill")
        vanished, candidates, deltas, starts, start = [], [], [], {}, 0
        staged.data["files"] = {}
        legacy_tables = _LegacyTables(states) if not old else None
        for f in files:
            starts[f] = start
            if f not in changed:
                staged.data["files"][f] = {**old[f], "start": start}
                start += old[f]["rows_all"]
                continue
            own = _Own(index.read_map(f)) if f in old and f not in grown else None
            rel, path = staged.add("map", ".parquet")
            n_all, lo, hi, offset = 0, 2**31, -1, 0
            with pq.ParquetWriter(path, idmap.MAP_SCHEMA, **idmap.MAP_WRITE) as writer:
                if f in grown:  # its old rows are as they were: their map is copied, their ids count as read
                    for m in index.map_batches(f):
                        writer.write_batch(m)
                        spill.add(m.column("h").to_numpy())
                    n_all, lo, hi, offset = old[f]["rows_all"], old[f]["lo"], old[f]["hi"], old[f]["size"]
                for _, at, b in file_batches(src, [f], start + n_all, offset):
                    n_all += b.num_rows
                    t, bad = rejected.split(pa.Table.from_batches([b]), 0, 0)
                    for r in bad:
                        r.update(position=at + r["position"], shard=None)
                    out.rejected += bad
                    good = np.arange(b.num_rows) if not bad else np.flatnonzero(pc.is_null(b.column("rejected")))
                    if not t.num_rows:
                        continue
                    check(t)
                    ids = t.column("id").combine_chunks()
                    h = id_hashes(ids)
                    fp = row_hashes(t.combine_chunks().to_batches()[0], h)
                    row = (at - start) + good
                    shard, pos = np.full(len(h), -1, np.int32), np.zeros(len(h), np.int32)
                    known = own.find(ids, h) if own else np.full(len(h), -1)
                    hit = known >= 0
                    if hit.any():
                        shard[hit], pos[hit] = own.shard[known[hit]], own.pos[known[hit]]
                        own.matched[known[hit]] = True
                        edited = hit & (own.fp[np.maximum(known, 0)] != fp)
                        deltas.append((shard[edited], fp[edited], own.fp[known[edited]], ids.filter(pa.array(edited))))
                    rest = ~hit
                    before = idruns.seen(runs, h[rest]) if runs else np.zeros(int(rest.sum()), bool)
                    fresh = np.flatnonzero(rest)[~before]
                    if len(fresh):
                        shard[fresh], pos[fresh] = new.take(fp[fresh])
                        if legacy_tables is not None:
                            legacy_tables.add(t.take(pa.array(fresh)), shard[fresh])
                    seen_before = np.flatnonzero(rest)[before]
                    if len(seen_before):
                        candidates.append(pa.table({"id": ids.take(pa.array(seen_before)), "h": h[seen_before],
                                                    "fp": fp[seen_before], "file": [f] * len(seen_before),
                                                    "row": row[seen_before]}))  # fmt: skip
                    spill.add(h)
                    placed = shard[shard >= 0]
                    if len(placed):
                        lo, hi = min(lo, int(placed.min())), max(hi, int(placed.max()))
                    writer.write_table(pa.table([row, ids, h, fp, shard, pos], schema=idmap.MAP_SCHEMA))
            if own is not None:
                vanished.append(own.unmatched())
            staged.data["files"][f] = {
                **stats[f],
                "rows_all": n_all,
                "start": starts[f],
                "map": rel,
                "lo": lo,
                "hi": hi,
                **idmap.edges(f, stats[f]),  # to know next time that it only grew
                # its old ends (byte, row), where pass 2 may start reading (launcher/ids/idpass2.py)
                **({"parts": [*old[f].get("parts", []), [offset, old[f]["rows_all"]]]} if f in grown else {}),
            }
            start += n_all
        for f in removed:
            vanished.append(index.read_map(f).select(["id", "h", "fp", "shard", "pos"]))
        left_before = index.read_left()
        if left_before is not None:
            vanished.append(left_before.select(["id", "h", "fp", "shard", "pos"]))
    except BaseException:
        idmap.discard(staged)
        raise
    from launcher.ids.idresolve import finish

    return finish(out, staged, new, spill, candidates, vanished, deltas, index, files, legacy_tables, left_before)


def _reads(src) -> dict:
    """How a row is read, as the id map's index.json keeps it. A row read otherwise now (another id, prompt,
    reference or kept column) hashes otherwise: every file is then read again, whole, as a changed one, so that each
    shard's fingerprint is that of its rows as they are read now (done ones found stale, as without ids), and pass 2
    finds the rows it reads as pass 1 mapped them."""
    keep = src.keep_columns if isinstance(src.keep_columns, str) else list(src.keep_columns)
    return {
        "id": src.id_column,
        "prompt": src.prompt_column,
        "references": src.image_column,
        "size_from_reference": src.size_from_reference,
        "row_settings": src.row_settings,
        "keep": keep,
    }


def _same(entry: dict | None, stat: dict) -> bool:
    return entry is not None and entry.get("size") == stat["size"] and entry.get("mtime") == stat["mtime"]


def _migration_caps(states: dict, size: int):
    """A folder planned by row positions before the map existed: a done shard of fewer rows (the source's last,
    then) keeps exactly those; the map starts out as the positions were, so every other done shard is kept too."""
    short = {i: int(s.get("prompts", s.get("rows", 0))) for i, s in states.items() if s.get("status") == "done"}
    short = {i: n for i, n in short.items() if 0 < n < size}
    return lambda s: short.get(s, size)


class _Own:
    """A changed file's old map, sorted by id hash, to find each id read now in it."""

    def __init__(self, table: pa.Table):
        h = table["h"].to_numpy()
        self.order = np.argsort(h, kind="stable")
        self.h: np.ndarray = h[self.order]
        self.table = table
        self.ids = table["id"].combine_chunks()
        self.fp = table["fp"].to_numpy()
        self.shard, self.pos = table["shard"].to_numpy(), table["pos"].to_numpy()
        self.matched = np.zeros(len(h), bool)

    def find(self, ids: pa.Array, h: np.ndarray) -> np.ndarray:
        """Each id's row in the old map, or -1; an id matched twice is a duplicate (the second gets -1)."""
        if not len(self.h):
            return np.full(len(h), -1)
        at = np.minimum(np.searchsorted(self.h, h), len(self.h) - 1)
        k = self.order[at]
        hit = self.h[at] == h
        if hit.any():
            same = pc.equal(stems(self.ids.take(pa.array(k[hit]))), stems(ids.filter(pa.array(hit))))
            hit[np.flatnonzero(hit)[~np.asarray(same.fill_null(False))]] = False
        k = np.where(hit, k, -1)
        first = np.zeros(len(k), bool)
        if hit.any():
            _, where = np.unique(k[hit], return_index=True)
            first[np.flatnonzero(hit)[where]] = True
        return np.where(first & ~self.matched[np.maximum(k, 0)], k, -1)

    def unmatched(self) -> pa.Table:
        return self.table.filter(pa.array(~self.matched)).select(["id", "h", "fp", "shard", "pos"])


class _LegacyTables:
    """On the map's first build over a folder planned by positions: each shard whose done state has an older
    fingerprint gets its rows' fingerprint as that planner computed it, so its done state stays done."""

    def __init__(self, states: dict):
        self.wanted = {i for i, s in states.items() if not str(s.get("prompts_fingerprint") or "v3-").startswith("v3-")}
        self.parts: dict[int, list[pa.Table]] = {}
        self.fingerprints: dict[int, str] = {}

    def add(self, t: pa.Table, shards: np.ndarray) -> None:
        for s in np.unique(shards):
            if int(s) in self.wanted:
                self.parts.setdefault(int(s), []).append(t.filter(pa.array(shards == s)))

    def done(self) -> dict[int, str]:
        from launcher.plan.shards import prompts_fingerprint

        cols = None
        for s, parts in self.parts.items():
            t = pa.concat_tables(parts)
            cols = cols or [c for c in t.schema.names if c != "rejected"]
            self.fingerprints[s] = prompts_fingerprint(t.select(cols))
        return self.fingerprints
