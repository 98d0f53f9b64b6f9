"""`dataset.bad_rows=skip`: rows that cannot be generated are set aside, each with its reason, and the rest runs.

A rejected row keeps its place in the source's order: the readers (launcher/sources/prompts.py) yield it with a
`rejected` column (JSON: where it is and why), so shard i still holds rows i*size ... (i+1)*size-1 and no good row
moves to another shard when a bad one is fixed or turns bad. The plan (launcher/plan/plan.py) takes a shard's
accepted rows only: they are what it generates and fingerprints. The run writes the rows it set aside to
`rejected/<run id>.parquet`, which a later run reads back: a done shard whose only change is that a row it left
out is fixed now is regenerated as grown (`was_without`), not refused as stale.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.compute as pc

from launcher.errors import ConfigError

FIELD = pa.field("rejected", pa.string())
DIR = "rejected"
FILE_SCHEMA = pa.schema(
    [
        ("file", pa.string()),  # the source file (or save_to_disk folder) that holds the row
        ("line", pa.int64()),  # its line (text files) or row (Parquet, save_to_disk) there, as messages name it
        ("position", pa.int64()),  # its row number in the whole source, from 0: what shards are cut by
        ("shard", pa.int64()),
        ("id", pa.string()),  # null where the row has none that could be read
        ("reason", pa.string()),  # the one-line refusal, with its fix
    ]
)
_WHERE = re.compile(r"^dataset (.*), (?:line|row) (\d+)$")


class Recheck(Exception):  # noqa: N818  (not an error: planning reads the source again with more rows set aside)
    """Rows found bad only once every row was read (an id that another row has too): plan again without them."""

    late: tuple[tuple[int, str], ...]  # declared: a mutated __init__ (make mutants) must not change its type elsewhere

    def __init__(self, late: tuple[tuple[int, str], ...]):
        super().__init__(f"{len(late)} rows to set aside")
        self.late = late


def rel(run_id: str) -> str:
    return f"{DIR}/{run_id}.parquet"


def rejected_row(where: str, rid, message: str) -> dict:
    """The stand-in of a row that failed `message` (a ConfigError's text, which starts with `where`)."""
    return {"id": None if rid is None else str(rid), "rejected": rejection(where, message)}


def rejection(where: str, message: str) -> str:
    """The `rejected` value of a row that failed `message`: where it is, and why, without saying where twice."""
    return json.dumps({"where": where, "reason": message.removeprefix(where).removeprefix(":").strip()})


def marked(b: pa.RecordBatch, at: int, late: tuple[tuple[int, str], ...]) -> pa.RecordBatch:
    """The batch (its first row at source position `at`) with its `rejected` column, and the late rejections in it."""
    if FIELD.name not in b.schema.names:
        b = b.append_column(FIELD, pa.nulls(b.num_rows, pa.string()))
    mine = {p - at: why for p, why in late if at <= p < at + b.num_rows}
    if not mine:
        return b
    i = b.schema.get_field_index(FIELD.name)
    values = b.column(i).to_pylist()
    for k, why in mine.items():
        values[k] = json.dumps({"where": f"row {at + k} of the source", "reason": why})
    return b.set_column(i, FIELD, pa.array(values, pa.string()))


def good_ids(b: pa.RecordBatch) -> pa.Array:
    """The batch's ids, null where the row is rejected (its id takes part in no uniqueness check)."""
    return pc.if_else(pc.is_null(b.column(FIELD.name)), b.column("id"), pa.scalar(None, pa.string()))


def check_unique(ids: pa.ChunkedArray, src) -> None:
    """Every id but the first of each file name stem (one id twice, or two that differ only in characters a file
    name cannot hold) is set aside: raises Recheck with them, vectorised; returns when there are none."""
    import numpy as np

    from launcher.plan.shards import FILE_STEM_UNSAFE

    stems = pc.replace_substring_regex(ids, FILE_STEM_UNSAFE, "_")
    if pc.count_distinct(stems).as_py() == len(ids) - ids.null_count:
        return
    t = pa.table({"stem": stems, "pos": pa.array(np.arange(len(ids), dtype=np.int64))}).filter(pc.is_valid(stems))
    groups = t.group_by("stem").aggregate([("pos", "min"), ("pos", "count")])
    twice = groups.filter(pc.greater(groups["pos_count"], 1))
    first = dict(zip(twice["stem"].to_pylist(), twice["pos_min"].to_pylist(), strict=True))
    clash = t.filter(pc.is_in(t["stem"], value_set=twice["stem"]))
    late = []
    for stem, pos in zip(clash["stem"].to_pylist(), clash["pos"].to_pylist(), strict=True):
        if pos != first[stem]:
            rid, other = ids[pos].as_py(), ids[first[stem]].as_py()
            why = (
                f"duplicate id {rid!r} (also row {first[stem]} of the source); ids must be unique"
                if rid == other
                else f"ids {other!r} (row {first[stem]}) and {rid!r} both become the file name {stem}; make them "
                "differ in letters, digits, '-' or '_'"
            )
            late.append((pos, why))
    raise Recheck(tuple(sorted({*src.late, *late})))


def split(table: pa.Table, shard: int, shard_size: int) -> tuple[pa.Table, list[dict]]:
    """(the shard's accepted rows without the `rejected` column, its rejected rows as records for the file)."""
    if FIELD.name not in table.schema.names:
        return table, []
    col = table.column(FIELD.name)
    good = table.filter(pc.is_null(col)).drop_columns([FIELD.name])
    if col.null_count == len(col):
        return good, []
    out = []
    for k, (rid, value) in enumerate(zip(table.column("id").to_pylist(), col.to_pylist(), strict=True)):
        if value is not None:
            found = json.loads(value)
            m = _WHERE.match(found["where"])
            out.append(
                {
                    "file": m.group(1) if m else None,
                    "line": int(m.group(2)) if m else None,
                    "position": shard * shard_size + k,
                    "shard": shard,
                    "id": rid,
                    "reason": found["reason"],
                }
            )
    return good, out


def write(store, run_id: str, rows: list[dict]) -> None:
    """rejected/<run id>.parquet, whole or not at all (nothing where no row was set aside)."""
    import pyarrow.parquet as pq

    if rows:
        with store.open_output(rel(run_id)) as out:
            pq.write_table(pa.Table.from_pylist(rows, schema=FILE_SCHEMA), out)


def was_without(store, state: dict, shard: int, table: pa.Table, shard_size: int, fingerprint_of) -> bool:
    """Whether a done shard's state is that of `table` (all of the shard's rows now, `rejected` column included)
    without the rows that the run which generated it set aside: they are fixed now, and the shard has grown."""
    if store is None or not state.get("run_id"):
        return False
    try:
        found = store.parquet(rel(state["run_id"])).read(columns=["shard", "position"])
    except (OSError, ValueError, pa.ArrowException):
        return False
    left_out = found.filter(pc.equal(found["shard"], shard))["position"]
    if not len(left_out):
        return False
    positions = pa.array(range(shard * shard_size, shard * shard_size + table.num_rows), pa.int64())
    keep = pc.invert(pc.is_in(positions, value_set=left_out))
    if FIELD.name in table.schema.names:
        keep = pc.and_(keep, pc.is_null(table.column(FIELD.name)))
        table = table.drop_columns([FIELD.name])
    return state.get("prompts_fingerprint") == fingerprint_of(table.filter(keep))


def refuse_all(path: str, rows: list[dict]) -> None:
    """A source of which every row was set aside generates nothing: that is a bad input, not a run."""
    first = rows[0]
    raise ConfigError(
        f"dataset {path}: every row was set aside (dataset.bad_rows=skip), e.g. {first['file'] or path}, "
        f"line {first['line']}: {first['reason']}"
    )
