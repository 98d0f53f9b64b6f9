"""What a folder says about the runs that made it: run.json (the job's settings) and one record per run.

run.json fingerprints what determines the images; it is written when the folder is new and rewritten only when
the source has grown (its shard count), so concurrent workers that start together write the same bytes. Each
run's own record is `runs/<run id>.json`, created by that run alone: no history is read, modified and written
back, so none is lost to a race on an object store.
"""

from __future__ import annotations

import time

from launcher.errors import ConfigError
from launcher.ledger.states import DATA_DIR, IMAGES_DIR, INDEX, STATE_DIR, WDS_DIR
from launcher.ledger.store import TMP_MARK, Store
from launcher.plan.shards import fingerprint_of, settings, settings_diff

RUNS_DIR = "runs"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("meshgen", "torch", "diffusers", "transformers", "torch_tpu"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


# What a meshgen folder may hold before its first run.json is written (a run stopped in its first seconds, or
# another worker that started at the same moment, writing it).
EARLY = {"locks", "claims", "plans", "logs", "runs", STATE_DIR}
RUN_JSON_TMP = f".run.json{TMP_MARK}"  # store.tmp_name("run.json") of any host and process


def check_ours(store: Store) -> None:
    """Refuse a non-empty folder that is not meshgen's (no run.json): a run would write into it, and replace a
    README.md of its own (a cloned dataset repo, say) with the dataset card. Nothing is written to check."""
    import pyarrow.fs as pafs

    if store.exists("run.json"):
        read_run_json(store)  # refuses one of another making
        return
    infos = store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))
    if any(i.base_name == "run.json" for i in infos):  # written by a worker that started with us, since we looked
        return
    foreign = sorted(
        i.base_name
        for i in infos
        if i.base_name not in EARLY and not i.base_name.startswith((TMP_MARK, RUN_JSON_TMP)) and _holds_a_file(store, i)
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"output.dir {store} is not empty and is not a meshgen folder (no run.json; it holds {shown}); "
            "choose an empty or new folder"
        )


def read_run_json(store: Store) -> dict | None:
    """run.json as meshgen wrote it (None where there is none). One that meshgen did not write (a project's own file
    of that name) must not make the folder ours: a resume would crash on it, and run.overwrite would delete the
    folder's README.md and data/."""
    try:
        old = store.read_json("run.json")
    except ValueError as e:  # not JSON, or not UTF-8
        why = f"not JSON: {str(e).splitlines()[0][:80]}"
    else:
        shaped = isinstance(old, dict) and isinstance(old.get("fingerprint"), str)
        if old is None or (shaped and isinstance(old.get("settings"), dict)):
            return old  # None: gone since we looked, as after a run.overwrite by another worker
        why = "no fingerprint and settings"
    raise ConfigError(
        f"output.dir {store} holds a run.json that meshgen did not write ({why}); choose an empty or new folder "
        "(or remove that run.json if the folder is a meshgen run's)"
    )


def _holds_a_file(store: Store, info) -> bool:
    """A file, or a folder with a file somewhere inside: empty folders (mount points made for the run, say) hold
    no byte a run could change."""
    import pyarrow.fs as pafs

    if info.type != pafs.FileType.Directory:
        return True
    inside = store.fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
    return any(i.type == pafs.FileType.File for i in inside)


def check_run_json(store: Store, cfg) -> None:
    """Refuse to resume into a folder made with other settings or other weights (exit 2 naming what differs).

    A folder made before the weights were fingerprinted (its run.json has none) is accepted when all else is the
    same, and write_run_json records the weights then: the weights it was made with are unknown, and refusing it
    would strand every folder made so far. Where this host does not have the model yet (a hub id the run
    downloads), the rest is judged now and the weights once it is here (the launcher checks again)."""
    old = read_run_json(store)
    new = settings(cfg)
    if old is None or old["fingerprint"] == fingerprint_of(new):
        return
    before, now = weights_of(old["settings"]), weights_of(new)
    if (before is None or now is None) and fingerprint_of(without_weights(old["settings"])) == fingerprint_of(
        without_weights(new)
    ):
        return
    diffs = settings_diff(old["settings"], new)
    changed = sorted(c for c in {*before, *now} if before.get(c) != now.get(c)) if before and now else []
    if changed:
        shown = "; ".join(f"{c}: {_short(before.get(c))} -> {_short(now.get(c))}" for c in changed)
        also = f"; other settings differ too: {'; '.join(diffs)}" if diffs else ""
        raise ConfigError(
            f"model.path {cfg.model.path}: the weights of {', '.join(changed)} changed since output.dir {store} was "
            f"made ({shown}){also}; choose a new output.dir or run.overwrite=true"
        )
    if any(d.startswith("generate.sweep:") for d in diffs):  # even one more value numbers the variants anew
        raise ConfigError(
            f"{store} holds a run made with another sweep ({'; '.join(diffs)}); a changed sweep, grown ones too, "
            "numbers its variants anew: choose a new output.dir for it (or run.overwrite=true to discard this one)"
        )
    raise ConfigError(
        f"{store} holds a run made with other settings ({'; '.join(diffs)}); "
        "rerun with run.overwrite=true to discard it, or choose a new output.dir"
    )


def weights_of(settings_: dict) -> dict[str, str] | None:
    """The weights' digest per component in a run's settings (None: not known when they were taken)."""
    return settings_.get("model", {}).get("weights")


def without_weights(settings_: dict) -> dict:
    model = {k: v for k, v in settings_.get("model", {}).items() if k != "weights"}
    return {**settings_, "model": model} if model else {k: v for k, v in settings_.items() if k != "model"}


def _short(digest: str | None) -> str:
    return f"sha256 {digest[:12]}" if digest else "none"


def write_run_json(store: Store, cfg, n_shards: int) -> None:
    """Written when the folder is new, when the source has grown, and when the weights were not yet recorded."""
    from omegaconf import OmegaConf

    from launcher.weights import model_weights

    old = store.read_json("run.json") or {}
    new = settings(cfg)
    recorded = weights_of(old.get("settings", {})) is not None or weights_of(new) is None
    if old and old.get("shards", 0) >= n_shards and recorded:
        return  # settings are the same (checked), and the source has not grown
    found = model_weights(str(cfg.model.path))
    store.write_json(
        "run.json",
        {
            "fingerprint": fingerprint_of(new),
            "settings": new,
            "config": old.get("config") or OmegaConf.to_container(cfg),
            "shards": max(n_shards, old.get("shards", 0)),
            "shard_size": cfg.run.shard_size,
            "versions": versions(),
            "created": old.get("created", time.strftime("%Y-%m-%dT%H:%M:%S%z")),
            **({"model_revision": found.revision} if found and found.revision else {}),
        },
    )


def record_rel(run_id: str) -> str:
    return f"{RUNS_DIR}/{run_id}.json"


def write_record(store: Store, record: dict) -> None:
    store.write_json(record_rel(record["run_id"]), record)


def read_records(store: Store) -> list[dict]:
    """Every run's readable record, oldest first (run ids start with their start time)."""
    out = [rec for info in store.files(RUNS_DIR, ".json") if (rec := _record(store, info.base_name))]
    return sorted(out, key=lambda r: (str(r.get("start", "")), str(r.get("run_id", ""))))


def latest_record(store: Store) -> dict | None:
    """The newest run's readable record: one listing, one read (one more for each newer record that is damaged)."""
    for name in sorted((i.base_name for i in store.files(RUNS_DIR, ".json")), reverse=True):
        if rec := _record(store, name):
            return rec
    return None


def _record(store: Store, name: str) -> dict | None:
    try:
        rec = store.read_json(f"{RUNS_DIR}/{name}")
    except ValueError:  # its run died while the object store wrote it, or it is no record: nothing to say
        return None
    return rec if isinstance(rec, dict) and rec else None


def discard_outputs(store: Store) -> None:
    """run.overwrite: remove earlier results (not locks, claims and plans: they belong to live runs)."""
    for name in (STATE_DIR, DATA_DIR, IMAGES_DIR, WDS_DIR, RUNS_DIR, "rejected", "sources"):
        store.delete_dir(name)
    for name in ("run.json", "README.md", "report.html", "contact_sheet.png", INDEX, "runs.jsonl"):
        store.delete(name)
