"""The run's plan, made once by the launcher in one streaming pass over the prompt source.

Pass 1 reads the source batch by batch, cuts it into shards on fixed row boundaries (shard i = rows
i*size ... (i+1)*size-1), fingerprints each shard's rows and judges it against its state file; no shard's rows
are kept. If anything is to be generated, pass 2 reads the source again up to the last selected shard and writes
the selected shards' rows to a plan file in the output folder (`plans/<run id>.arrow`: Arrow IPC, one record
batch per shard), which every worker of every host reads when it claims a shard. So memory stays bounded by a
batch whatever the source's size, workers never re-plan, and no rank receives rows it does not generate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pyarrow as pa

from launcher.errors import ConfigError
from launcher.ledger.states import exhausted, select_shards, state_token
from launcher.ledger.store import Store
from launcher.plan import stale as stale_mod
from launcher.plan.shards import Shard, parse_selection, prompts_fingerprint, same_prompts
from launcher.sources import rejected as rejected_mod
from launcher.sources.prompts import SizeRule, Source, check_limit, read_batches, run_folder

PLANS_DIR = "plans"


@dataclass(frozen=True)
class ShardPlan:
    index: int
    rows: int
    fingerprint: str
    status: str  # done | failed | pending | stale | grown | damaged (done, but its files differ: verify.py)
    seen: str | None = None  # which attempt's state this plan read (state_token): see Claims.try_claim


@dataclass
class Plan:
    shards: list[ShardPlan]
    selected: list[int]  # to generate now, by any worker
    stale: list[int]
    rejected: list[dict] = field(default_factory=list)  # dataset.bad_rows=skip: rows set aside (rejected.py)
    late: tuple[tuple[int, str], ...] = ()  # of them, those found once every row was read (duplicate ids)
    held: list[int] = field(default_factory=list)  # failed run.max_attempts times: not retried (states.exhausted)
    ids: object = None  # with dataset.id_column: what the id map's pass 1 found (launcher/ids/idplan.py)

    @property
    def status(self) -> dict[int, str]:
        return {s.index: s.status for s in self.shards}

    def prompts(self, indices) -> int:
        return sum(self.shards[i].rows for i in indices)


def source(cfg, sizes: SizeRule | None = None) -> Source:
    from launcher.plan.sweep import n_variants, raw_sweep

    d, g, edit = cfg.dataset, cfg.generate, cfg.get("job", "text_to_image") == "edit"
    images = d.image_column if edit else None
    by_ref = edit and g.size_from_reference
    earlier = edit and run_folder(d.path)
    ids = d.id_column or ("id" if earlier else None)  # an earlier run's rows keep their ids
    variants = n_variants(g) if raw_sweep(g) else 0
    return Source(
        d.path,
        d.prompt_column,
        ids,
        sizes,
        g.images_per_prompt,
        image_column=images,
        size_from_reference=by_ref,
        row_settings=not earlier,
        variants=variants,
        bad_rows=d.get("bad_rows", "refuse"),
        keep_columns=_keep_spec(d.get("keep_columns")),
    )


def _keep_spec(spec) -> tuple[str, ...] | str:
    """dataset.keep_columns as Source holds it (hashable): a tuple of names, or "all"."""
    if isinstance(spec, str) or not spec:
        return spec or ()
    return tuple(str(n) for n in spec)


def shard_tables(src: Source, shard_size: int, limit: int | None) -> Iterator[tuple[int, pa.Table, pa.Table]]:
    """(index, the shard's rows within dataset.limit, its whole rows), shard by shard, in order.

    A shard inside one batch is a zero-copy slice of it; only a shard that straddles two batches is copied."""
    check_limit(limit)
    carry: pa.Table | None = None  # rows read but not yet a whole shard
    index = 0
    for batch in read_batches(src):
        t, pos = pa.Table.from_batches([batch]), 0
        if carry is not None:
            pos = shard_size - carry.num_rows
            carry = pa.concat_tables([carry, t.slice(0, pos)]).combine_chunks()
            if carry.num_rows < shard_size:
                continue
            t_shard, carry = carry, None
            yield from _limited(index, t_shard, shard_size, limit)
            index += 1
        while t.num_rows - pos >= shard_size:
            if limit is not None and index * shard_size >= limit:
                return
            yield from _limited(index, t.slice(pos, shard_size), shard_size, limit)
            index, pos = index + 1, pos + shard_size
        if limit is not None and index * shard_size >= limit:
            return
        carry = t.slice(pos) if pos < t.num_rows else None
    if carry is not None:
        yield from _limited(index, carry, shard_size, limit)


def _limited(index: int, table: pa.Table, shard_size: int, limit: int | None):
    seen = index * shard_size
    if limit is None or seen + table.num_rows <= limit:
        yield index, table, table
    elif seen < limit:
        yield index, table.slice(0, limit - seen), table


def shard_status(state: dict | None, table: pa.Table, whole: pa.Table, fingerprint: str) -> str:
    """done | failed | pending | stale (done, but its prompts changed) | grown (done, and rows were appended)."""
    if state is None:
        return "pending"
    if state.get("status") != "done":
        return "failed"
    fp = state.get("prompts_fingerprint")
    if stale_mod.is_kept(state, fingerprint):  # run.stale=keep kept it for exactly these prompts
        return "done"
    # A shard done in full is done under any dataset.limit.
    if same_prompts(fp, table, fingerprint) or (whole is not table and same_prompts(fp, whole)):
        return "done"
    n = state.get("prompts", state.get("rows", 0))  # rows count images; "prompts" is there when they differ
    if n < table.num_rows and same_prompts(fp, table.slice(0, n)):
        return "grown"
    return "stale"


def make_plan(cfg, states: dict[int, dict], sizes: SizeRule | None = None, store: Store | None = None) -> Plan:
    """Pass 1: every shard's size, fingerprint and status, and what to generate now (validates the source).

    `store`: where done shards' files are listed (launcher/ledger/verify.py), where a refusal of stale shards
    reads which samples changed, and where the rows that earlier runs set aside are read back (rejected.py)."""
    src = source(cfg, sizes)
    while True:
        try:
            return _make_plan(cfg, states, src, sizes, store)
        except rejected_mod.Recheck as again:  # ids found twice once all were read: plan once more without them
            if set(again.late) <= set(src.late):  # none new: planning again would find them again, for ever
                rows = ", ".join(str(p) for p, _ in again.late[:5])
                msg = f"planning set aside source rows {rows} and found them again: a bug of meshgen's"
                raise ConfigError(msg) from None
            src = replace(src, late=again.late)


def by_id(cfg) -> bool:
    """Whether shards hold ids (dataset.id_column set; a text-to-image job) rather than row positions."""
    return bool(cfg.dataset.id_column) and cfg.get("job", "text_to_image") == "text_to_image"


def _make_plan(cfg, states: dict[int, dict], src: Source, sizes: SizeRule | None, store: Store | None) -> Plan:
    from launcher.plan.sweep import check_sweep_columns

    if by_id(cfg):
        from launcher.plan.plan_ids import make_id_plan

        return make_id_plan(cfg, states, src, sizes, store)
    from launcher.ledger.verify import listed_damage, say_damage

    shards, stale_tables, set_aside = [], {}, []
    damaged = listed_damage(store, states) if store is not None else {}
    size = cfg.run.shard_size
    for i, rows, whole_rows in shard_tables(src, size, cfg.dataset.limit):
        t, bad = rejected_mod.split(rows, i, size)
        whole = t if whole_rows is rows else rejected_mod.split(whole_rows, i, size)[0]
        set_aside += bad
        check_sweep_columns(t, cfg)
        check_row_fields(t, cfg, sizes)
        fp = prompts_fingerprint(t)
        st = states.get(i)
        judged = "damaged" if i in damaged else shard_status(st, t, whole, fp)
        if judged == "stale" and rejected_mod.was_without(store, st, i, rows, size, prompts_fingerprint):  # ty: ignore[invalid-argument-type]
            judged = "grown"  # its only change: rows that it was generated without are fixed now
        shards.append(ShardPlan(i, t.num_rows, fp, judged, state_token(st)))
        if shards[-1].status == "stale" and len(stale_tables) < stale_mod.SHOWN:
            stale_tables[i] = t
    if set_aside and not any(s.rows for s in shards):
        rejected_mod.refuse_all(cfg.dataset.path, set_aside)
    say_damage(store, {s.index: damaged[s.index] for s in shards if s.status == "damaged"})  # ty: ignore[invalid-argument-type]
    status = {s.index: s.status for s in shards}
    selection = parse_selection(cfg.run.shards, len(shards))
    stale = [i for i, st in status.items() if st == "stale"]
    if stale and cfg.run.stale == "error" and selection != "all":
        stale_mod.refuse(cfg, store, stale, stale_tables)
    held = exhausted(states, status, cfg.run.max_attempts) if selection == "pending" else []  # run.max_attempts
    plan = Plan(shards, select_shards(status, selection, cfg.run.stale, frozenset(held)), stale, held=held)
    plan.rejected, plan.late = set_aside, src.late  # dataset.bad_rows=skip (launcher/sources/rejected.py)
    return plan


def check_row_fields(table: pa.Table, cfg, sizes: SizeRule | None) -> None:
    """Refuse a per-row column that the model's pipeline would ignore: the data would record what no image saw.
    (One shard's rows; a column empty throughout is no column.)"""
    import pyarrow.compute as pc

    for column, why in sizes.ignored if sizes else ():
        if column in table.schema.names and table.column(column).null_count < table.num_rows:
            first = table.column("id")[pc.index(pc.is_valid(table.column(column)), True).as_py()].as_py()
            raise ConfigError(
                f"dataset {cfg.dataset.path}: column {column!r} is set (first at id {first!r}), but {why}"
            )


def plan_kept_fields(src: Source) -> tuple[pa.Field, ...]:
    """The dataset.keep_columns fields (launcher/sources/keep.py), in the plan after the rows' own columns."""
    if not src.keep_columns:
        return ()
    from launcher.sources.keep import kept_fields
    from launcher.sources.prompts import source_files

    return kept_fields(src, tuple(source_files(src.path)))


def plan_rel(run_id: str) -> str:
    return f"{PLANS_DIR}/{run_id}.arrow"


def write_plan_file(store: Store, rel: str, cfg, plan: Plan, sizes: SizeRule | None = None) -> None:
    """Pass 2: the selected shards' rows, one record batch each, written whole or not at all."""
    from launcher.sources.prompts import SCHEMA
    from launcher.sources.references import REF_FIELDS

    wanted = set(plan.selected)
    order, tables = sorted(wanted), None
    if plan.ids is not None:  # shards of ids: gathered from wherever their rows are (launcher/ids/idpass2.py)
        from launcher.plan.plan_ids import id_tables

        order, tables = id_tables(store, cfg, plan, sizes)
    meta = {"shards": [[i, plan.shards[i].fingerprint, plan.shards[i].seen] for i in order]}
    schema = SCHEMA if source(cfg).image_column is None else pa.schema([*SCHEMA, *REF_FIELDS])
    kept = plan_kept_fields(source(cfg))
    meta["kept"] = [f.name for f in kept]
    schema = pa.schema([*schema, *kept]).with_metadata({"meshgen_plan": json.dumps(meta)})
    last = max(wanted)
    src = replace(source(cfg, sizes), late=plan.late)
    with store.open_output(rel) as out, pa.ipc.new_file(out, schema) as writer:
        for _, table in tables or ():
            writer.write_batch(table.select(schema.names).combine_chunks().to_batches()[0] if table else _empty(schema))
        for i, rows, _ in () if tables is not None else shard_tables(src, cfg.run.shard_size, cfg.dataset.limit):
            if i in wanted:
                table = rejected_mod.split(rows, i, cfg.run.shard_size)[0]
                if prompts_fingerprint(table) != plan.shards[i].fingerprint:
                    raise ConfigError(
                        f"the prompt source {cfg.dataset.path} changed while this run was planned (shard {i}); "
                        "run the same command again once it is complete"
                    )
                # no rows: all of them set aside (dataset.bad_rows=skip)
                writer.write_batch(table.combine_chunks().to_batches()[0] if table.num_rows else _empty(table.schema))
            if i >= last:
                break


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    """A batch of no rows, built without a Python list: pyarrow imports pandas at its first list conversion (even
    of an empty one), 0.4-0.9 s of a launcher that otherwise never needs it."""
    return pa.RecordBatch.from_arrays([pa.nulls(0, f.type) for f in schema], schema=schema)


def tidy(store: Store, lock) -> None:
    """At the end of a run that still holds its `lock` (launcher/ledger/lock.py's RunLock; one taken over looked
    dead itself, and judges nobody): the plan files and claims of runs that hold no lock (kill -9 skips their
    removal), its own plan included, and the claims/ and plans/ folders once empty. Each file is judged by its own
    run's lock, so live runs of other workers keep theirs."""
    import os

    from launcher.ledger.claims import forget_dead
    from launcher.ledger.lock import live_run_ids
    from launcher.ledger.states import CLAIMS_DIR

    if not lock.held():
        return
    plans = store.files(PLANS_DIR, ".arrow")  # before the locks are read: a run takes its lock before its plan
    live = live_run_ids(store) - {lock.run_id}
    for info in plans:
        if info.base_name.removesuffix(".arrow") not in live:
            store.delete(f"{PLANS_DIR}/{info.base_name}")
    forget_dead(store)
    if store.is_local:  # an object store has no folders
        for name in (PLANS_DIR, CLAIMS_DIR):
            try:
                os.rmdir(store.local(name))
            except OSError:  # not empty (claims of shards, a live run's plan), or not there
                pass


class PlanFile:
    """A worker's view of the plan: which shards to generate, and one shard's rows when it claims it."""

    def __init__(self, store: Store, rel: str):
        self._reader = pa.ipc.open_file(store.fs.open_input_file(store.path(rel)))
        meta = json.loads(self._reader.schema.metadata[b"meshgen_plan"])
        self._where = {i: (k, fp, seen) for k, (i, fp, seen) in enumerate(meta["shards"])}
        self._kept: tuple[pa.Field, ...] = tuple(self._reader.schema.field(n) for n in meta.get("kept", ()))
        self.selected: list[int] = sorted(self._where)

    def seen(self, index: int) -> str | None:
        """The attempt whose state the plan read for this shard (None: it had none)."""
        return self._where[index][2]

    def shard(self, index: int) -> Shard:
        k, fp, _ = self._where[index]
        rows = self._reader.get_batch(k).to_pylist()
        return Shard(index, tuple({c: v for c, v in r.items() if v is not None} for r in rows), fp, self._kept)
