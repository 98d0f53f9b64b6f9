"""The plan with an id column: shards of ids (launcher/ids/idplan.py), judged against their states.

A done shard is stale only when the row of one of its own ids changed; its fingerprint is the sum of its rows'
hashes, left ids included, so an id that left the source changes nothing, and a new id never joins a done shard.
With `dataset.limit`, the shards that hold the first `limit` ids in shard order are planned, the last one cut.
"""

from __future__ import annotations

import logging

from launcher.errors import ConfigError
from launcher.ids.rowhash import shard_fingerprint
from launcher.ledger.states import exhausted, select_shards, state_token
from launcher.plan import stale as stale_mod

logger = logging.getLogger(__name__)
CUT = "-first"  # a shard cut by dataset.limit: "<its whole fingerprint>-first<rows planned>"


def id_status(state: dict | None, fingerprint: str, legacy: str | None, cut: str | None = None) -> str:
    """done | failed | pending | stale (a row of its ids changed) | grown (done with the first rows that a lower
    `dataset.limit` let it have, and asked for more now); `cut`: the fingerprint it has under the limit now."""
    if state is None:
        return "pending"
    if state.get("status") != "done":
        return "failed"
    fp = state.get("prompts_fingerprint")
    if fp in (fingerprint, cut) or (legacy is not None and fp == legacy) or fp is None:
        return "done"
    if stale_mod.is_kept(state, fingerprint):  # run.stale=keep kept it for exactly these rows
        return "done"
    head, mark, done_rows = fp.partition(CUT) if isinstance(fp, str) else ("", "", "")
    if mark and head == fingerprint and done_rows.isdigit():
        if cut is None or int(done_rows) < int(cut.partition(CUT)[2]):
            return "grown"
    return "stale"


def make_id_plan(cfg, states: dict[int, dict], src, sizes, store):
    from launcher.ids import idmap

    try:
        return _make_id_plan(cfg, states, src, sizes, store)
    except idmap.Damaged as e:  # a file of the output folder never stops a run with a traceback
        idmap.warn_damaged(store, str(e))
        return _make_id_plan(cfg, states, src, sizes, store, fresh=True)


def _make_id_plan(cfg, states: dict[int, dict], src, sizes, store, fresh: bool = False):
    from launcher.ids.idplan import plan_ids
    from launcher.ledger.verify import listed_damage, say_damage
    from launcher.plan.plan import Plan, ShardPlan, check_row_fields
    from launcher.plan.shards import parse_selection
    from launcher.plan.sweep import check_sweep_columns
    from launcher.sources.prompts import check_limit, source_files

    def check(t):
        check_sweep_columns(t, cfg)
        check_row_fields(t, cfg, sizes)

    check_limit(cfg.dataset.limit)
    found = plan_ids(src, source_files(src.path), cfg.run.shard_size, store, states, check, fresh)
    if not len(found.rows):
        from launcher.sources import rejected as rejected_mod

        if found.rejected:
            rejected_mod.refuse_all(cfg.dataset.path, found.rejected)
        raise ConfigError(f"dataset {src.path} holds no prompts; add prompts or point dataset.path elsewhere")
    if found.staged is not None and (src.images_per_prompt > 1 or src.variants):
        from launcher.plan.shards import check_sample_ids

        check_sample_ids(_all_ids(found), src.images_per_prompt, f"dataset {src.path}", src.variants)
    damaged = listed_damage(store, states) if store is not None else {}
    shards, before, limit = [], 0, cfg.dataset.limit
    for i, (rows, total) in enumerate(zip(found.rows.tolist(), found.total.tolist(), strict=True)):
        if limit is not None and before >= limit:
            break
        fp, st, cut = shard_fingerprint(total), states.get(i), None
        if limit is not None and before + rows > limit:
            found.cut = {i: limit - before}
            cut = f"{fp}{CUT}{limit - before}"
        judged = "damaged" if i in damaged else id_status(st, fp, found.legacy[i], cut)
        shards.append(ShardPlan(i, min(rows, limit - before) if limit else rows, cut or fp, judged, state_token(st)))
        before += rows
    say_damage(store, {s.index: damaged[s.index] for s in shards if s.status == "damaged"})
    if found.left_count:
        more = f" and {found.left_count - len(found.left)} more" if found.left_count > len(found.left) else ""
        logger.warning(
            "%d ids left the prompt source since the last run (%s%s): their samples stay in the output",
            found.left_count, ", ".join(found.left), more,
        )  # fmt: skip
    status = {s.index: s.status for s in shards}
    selection = parse_selection(cfg.run.shards, len(shards))
    stale = [i for i, s in status.items() if s == "stale"]
    if stale and cfg.run.stale == "error" and selection != "all":
        refuse(cfg, stale, found.changed)
    held = exhausted(states, status, cfg.run.max_attempts) if selection == "pending" else []
    plan = Plan(shards, select_shards(status, selection, cfg.run.stale, frozenset(held)), stale, held=held)
    plan.rejected, plan.late, plan.ids = found.rejected, src.late, found
    if plan.selected and found.index.files:
        _read_old_maps(found, set(plan.selected))
    return plan


def _read_old_maps(found, selected: set[int]) -> None:
    """The old maps that pass 2 reads for the selected shards, read now as it will (their shard column): a damaged
    one then means planning afresh (idmap.Damaged), not a run that fails at its plan file."""
    from launcher.ids import idmap
    from launcher.ids.idpass2 import shard_order

    try:
        shard_order(found.index, selected)
    except idmap.Damaged:
        idmap.discard(found.staged)
        raise


def _all_ids(found):
    """Every id the map gives a shard now, file by file (a sample id of one prompt must not be another's id: with
    images per prompt or a sweep, a changed source is checked whole, from the maps, not from the source)."""
    import pyarrow.parquet as pq

    from launcher.ids import idmap

    staged = found.staged
    try:
        for f, e in staged.data["files"].items():
            if e["map"] in staged.names:
                m = pq.read_table(staged.names[e["map"]], columns=["id"])
            else:  # an unchanged file's: its old map
                m = found.index.read_map(f, ["id"])
            yield from m["id"].to_pylist()
    except BaseException:
        idmap.discard(staged)
        raise


def refuse(cfg, stale: list[int], changed: dict[int, list[str]]) -> None:
    """The stale refusal of an id-keyed plan: each stale shard's changed ids are known (nothing is shifted)."""
    raise ConfigError(stale_mod.stale_message(cfg, {s: (changed.get(s, []), False, []) for s in stale}))


def id_tables(store, cfg, plan, sizes):
    """(the selected shards in plan-file order, an iterator of (shard, rows)) for write_plan_file."""
    from dataclasses import replace

    from launcher.ids import idmap
    from launcher.ids.idpass2 import shard_order, shard_rows
    from launcher.plan.plan import source

    if plan.ids.staged is not None:  # a plan made outside a run's books: its id map goes in with its plan file
        commit_ids(store, plan)
    index = idmap.load(store, cfg.run.shard_size)
    order, keys = shard_order(index, set(plan.selected))
    src = replace(source(cfg, sizes), late=plan.late)
    return order, shard_rows(src, index, order, keys, getattr(plan.ids, "cut", {}) or {})


def commit_ids(store, plan) -> None:
    """The id map this plan made, into the output folder (under the run's lock, before any shard is claimed)."""
    from launcher.ids import idmap

    if plan.ids is not None and plan.ids.staged is not None:
        idmap.commit(store, plan.ids.staged)
        plan.ids.staged = None
