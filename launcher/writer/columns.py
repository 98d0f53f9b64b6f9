"""dataset.keep_columns on the worker's side: each sample gets its prompt row's kept values (launcher/sources/keep.py
read them; the plan file carried them with their Arrow types), which the writer adds as columns."""

from __future__ import annotations

from launcher.plan.shards import Shard
from launcher.writer.writer import KEPT_FIELDS


def carry_kept(samples: list[dict], shard: Shard) -> None:
    """In place: the kept values of each sample's row (found by its prompt's id), and the fields' types."""
    if not shard.kept or not samples:
        return
    rows = {r["id"]: r for r in shard.rows}
    for s in samples:
        row = rows[s.get("prompt_id", s["id"])]
        s.update({f.name: row.get(f.name) for f in shard.kept})
        s[KEPT_FIELDS] = shard.kept
