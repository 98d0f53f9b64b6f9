"""Per-shard status of a run folder: `python tools/status.py OUTPUT_DIR [--json] [--verify]`.

Reads only the run folder (run.json, the newest run record, and state/ through its index: one listing of
state/ plus reads of what the index does not know), so it works while a run is going, after it, or on a copy.
A done shard whose files are missing or of another size than its state recorded is damaged (one recursive
listing of each output folder, as a rerun makes); with --verify, also one whose files' sha256 differ (every done
file read whole).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from launcher.errors import ConfigError, error_line
from launcher.ledger.runs import latest_record
from launcher.ledger.states import Ledger
from launcher.ledger.store import Store
from launcher.ledger.verify import hash_damage, listed_damage
from launcher.plan.stale import KEPT_IDS, kept_stale

STATUSES = ("done", "failed", "pending", "damaged", "kept-stale")


def collect(out: str, verify: bool = False) -> dict:
    store = Store(out)
    try:
        run = store.read_json("run.json")
    except ValueError:
        run = None
    if not isinstance(run, dict) or not isinstance(run.get("shards"), int):
        raise ConfigError(f"{store} has no readable run.json; is it a meshgen output folder?")
    shards, errors = {}, {}
    ledger = Ledger(store)
    states = ledger.refresh()
    try:
        last = latest_record(store) or {}
    except ValueError:  # a run record cut short: the command to rerun falls back to the conf's
        last = {}
    files = listed_damage(store, states)  # after the states: a shard done since has its files listed
    if verify:
        files.update(hash_damage(store, {i: st for i, st in states.items() if i not in files}))
    for i in range(max(run["shards"], last.get("shards", 0))):
        st = states.get(i, {})
        damaged = i in ledger.damaged or i in files
        shards[str(i)] = "damaged" if damaged else "kept-stale" if kept_stale(st) else st.get("status", "pending")
        if i in ledger.damaged:
            errors[str(i)] = f"its state file is damaged: {ledger.damaged[i]}"
        elif i in files:
            errors[str(i)] = f"its files differ from its state: {files[i]}"
        elif shards[str(i)] == "failed":
            errors[str(i)] = st.get("error", "")
    counts = {k: sum(v == k for v in shards.values()) for k in STATUSES}
    counts["kept_stale"] = counts.pop("kept-stale")
    counts["done"] += counts["kept_stale"]  # done, with the images of the prompts as they were
    kept = [rid for i, v in shards.items() if v == "kept-stale" for rid in states[int(i)].get(KEPT_IDS, [])]
    return {
        **counts,
        "kept_ids": kept,
        "store": store.url(),
        "shards": shards,
        "errors": errors,
        "conf": run["config"]["name"],
        "command": last.get("command"),
    }


def rerun_command(out: str, info: dict) -> str:
    failed = [int(i) for i, s in info["shards"].items() if s in ("failed", "damaged")]
    ids = "[" + ",".join(map(str, failed)) + "]"
    # The job's own command (from run.json) keeps its overrides: dataset, model, settings.
    command = info.get("command") or ["./launch.sh", f"conf={info['conf']}"]
    if not any(a.startswith("output.dir=") for a in command):
        command = [*command, f"output.dir={out}"]
    return shlex.join([*command, f"run.shards={ids}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output_dir", help="the run folder: a local path, gs://... or s3://...")
    parser.add_argument("--json", action="store_true", help="print the counts and per-shard status as JSON")
    parser.add_argument("--verify", action="store_true", help="also read every done file and check its sha256")
    args = parser.parse_args(argv)
    try:
        info = collect(args.output_dir, args.verify)
    except (ConfigError, OSError) as e:  # not a run folder, or a store that does not answer
        print(error_line(e), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: info[k] for k in (*STATUSES[:-1], "kept_stale", "kept_ids", "shards")}))
        return 0
    total = len(info["shards"])
    damaged = f", {info['damaged']} damaged" if info["damaged"] else ""
    if info["kept_stale"]:  # run.stale=keep: done, with the images of prompts that changed since
        named = f" (samples {', '.join(info['kept_ids'][:5])})" if info["kept_ids"] else ""
        damaged += f", {info['kept_stale']} kept-stale{named}"
    print(
        f"{info['store']}: {total} shards: {info['done']} done, {info['failed']} failed, "
        f"{info['pending']} pending{damaged}"
    )
    if info["errors"]:
        print("failed or damaged shards:")
        for i, err in info["errors"].items():
            print(f"  {int(i):5d}  {err[:150]}")
        print(f"rerun them with:\n  {rerun_command(args.output_dir, info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
