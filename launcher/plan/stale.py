"""Done shards whose prompts changed: which samples changed, what the likely cause is, and `run.stale=keep` recorded.

A shard's state keeps only its prompts' fingerprint; which samples changed is read back from its Parquet data
(two columns), for the first few stale shards only, and only when the run is about to refuse them.
"""

from __future__ import annotations

import pyarrow as pa

from launcher.errors import ConfigError
from launcher.ledger.states import DATA_DIR, read_state, state_rel
from launcher.ledger.store import Store

SHOWN = 5  # sample ids named in the message
KEPT = "kept_fingerprint"  # the state's record of run.stale=keep: the changed prompts it was kept for
KEPT_IDS = "kept_ids"  # and, with an id column, which ids changed


def is_kept(state: dict, fingerprint: str) -> bool:
    return state.get(KEPT) == fingerprint


def record_kept(store: Store, shards: dict[int, str], ids: dict[int, list[str]] | None = None) -> None:
    """run.stale=keep, recorded in each kept shard's state (shard -> the new prompts' fingerprint; with an id column,
    `kept_ids`: the ids whose rows changed), so that the same command without it finds them done, and status, report
    and card show them as kept-stale. The images stay what they were; `prompts_fingerprint` stays theirs."""
    for i, fingerprint in shards.items():
        state = read_state(store, i)
        if state is not None and state.get("status") == "done":
            kept = {KEPT: fingerprint, **({KEPT_IDS: ids[i]} if ids and ids.get(i) else {})}
            store.write_json(state_rel(i), {**state, **kept})


def kept_stale(state: dict | None) -> bool:
    """Whether a done shard was kept by run.stale=keep although its prompts had changed."""
    return bool(state) and state.get("status") == "done" and KEPT in state


def changed_ids(store: Store | None, index: int, table: pa.Table) -> tuple[list[str], bool, list[str]]:
    """(the prompt ids of shard `index` whose prompt or reference images changed, were added or removed; whether the
    change looks like shifted row numbers: most changed prompts are still there, under other ids; the references
    whose content changed, by path, where a row's prompt did not)."""
    if store is None:
        return [], False, []
    try:
        old = store.parquet(f"{DATA_DIR}/shard-{index:05d}.parquet")
        names = old.schema_arrow.names
        key = "prompt_id" if "prompt_id" in names else "id"
        rows = old.read(columns=[key, "prompt", *(["reference"] if "reference" in names else [])]).to_pylist()
    except (OSError, ValueError, pa.ArrowException):
        return [], False, []  # no data to compare (image files only): the message names the shard alone
    before = {r[key]: r["prompt"] for r in rows}
    refs_before = {r[key]: r.get("reference") or [] for r in rows}
    now = dict(zip(table.column("id").to_pylist(), table.column("prompt").to_pylist(), strict=True))
    shas = table.column("ref_sha256").to_pylist() if "ref_sha256" in table.schema.names else [None] * len(now)
    refs = []  # an edit job: the same instruction over another image is a change of its own
    for i, sha in zip(now, shas, strict=True):
        old_refs = refs_before.get(i)
        if sha and old_refs is not None and before.get(i) == now[i]:
            refs += [r["path"] for r, s in zip(old_refs, sha.split(), strict=False) if r["sha256"] != s]
    changed = [i for i in now if before.get(i) != now[i]] + [i for i in before if i not in now]
    changed += [
        i for i, sha in zip(now, shas, strict=True) if sha and i not in changed and _refs_differ(refs_before, i, sha)
    ]
    # a row whose prompt is the same (its references changed) has not moved
    moved = sum(1 for i in changed if i in now and before.get(i) != now[i] and now[i] in before.values())
    return changed, len(changed) > 1 and moved * 2 >= len(changed), refs


def _refs_differ(before: dict, rid: str, sha: str) -> bool:
    return rid in before and [r["sha256"] for r in before[rid]] != sha.split()


def stale_message(cfg, stale: dict[int, tuple[list[str], bool, list[str]] | None]) -> str:
    """The refusal of a run over stale shards (shard -> (changed ids, shifted?, changed references), None where not
    looked at)."""
    ids = [i for found in stale.values() if found for i in found[0]]
    refs = [r for found in stale.values() if found for r in found[2]]
    unread = any(found is None for found in stale.values())
    named = ""
    if ids:
        more = " and more" if unread else f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else ""
        named = f" (samples {', '.join(ids[:SHOWN])}{more})"
    shifted = ""
    if cfg.dataset.id_column is None and any(found and found[1] for found in stale.values()):
        shifted = (
            "; the prompts look shifted, as by a line inserted or deleted before them (ids are row numbers): "
            "set dataset.id_column to a column of stable ids so that done work keeps its ids"
        )
    what = "their prompts changed"
    if refs:
        what = f"their reference images changed ({', '.join(refs[:SHOWN])}{' and more' if len(refs) > SHOWN else ''})"
    return (
        f"shards {sorted(stale)} are done but {what} since{named}{shifted}; rerun with "
        "run.stale=regenerate to redo them, or run.stale=keep to keep the old images"
    )


def refuse(cfg, store: Store | None, stale: list[int], tables: dict[int, pa.Table]) -> None:
    """Raise the stale refusal, naming up to SHOWN changed samples of the first stale shards (`tables`)."""
    found, shown = {}, 0
    for i in stale:
        found[i] = changed_ids(store, i, tables[i]) if shown < SHOWN and i in tables else None
        shown += len(found[i][0]) if found[i] else 0
    raise ConfigError(stale_message(cfg, found))
