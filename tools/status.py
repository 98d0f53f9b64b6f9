"""Per-shard status of a run folder: `python tools/status.py OUTPUT_DIR [--json]`.

Reads only the run folder (run.json, the newest run record, and state/ through its index: one listing of
state/ plus reads of what the index does not know), so it works while a run is going, after it, or on a copy.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from launcher.ledger.runs import latest_record
from launcher.ledger.states import read_states
from launcher.ledger.store import Store


def collect(out: str) -> dict:
    store = Store(out)
    run = store.read_json("run.json")
    if run is None:
        print(f"error: {out} has no run.json; is it a meshgen output folder?", file=sys.stderr)
        raise SystemExit(2)  # bad input, as the other tools and the launcher say it
    shards, errors = {}, {}
    states = read_states(store)
    last = latest_record(store) or {}
    for i in range(max(run["shards"], last.get("shards", 0))):
        st = states.get(i, {})
        shards[str(i)] = st.get("status", "pending")
        if shards[str(i)] == "failed":
            errors[str(i)] = st.get("error", "")
    counts = {k: sum(v == k for v in shards.values()) for k in ("done", "failed", "pending")}
    return {**counts, "shards": shards, "errors": errors, "conf": run["config"]["name"], "command": last.get("command")}


def rerun_command(out: str, info: dict) -> str:
    failed = [int(i) for i, s in info["shards"].items() if s == "failed"]
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
    args = parser.parse_args(argv)
    info = collect(args.output_dir)
    if args.json:
        print(json.dumps({k: info[k] for k in ("done", "failed", "pending", "shards")}))
        return 0
    total = len(info["shards"])
    print(f"{args.output_dir}: {total} shards: {info['done']} done, {info['failed']} failed, {info['pending']} pending")
    if info["errors"]:
        print("failed shards:")
        for i, err in info["errors"].items():
            print(f"  {int(i):5d}  {err[:150]}")
        print(f"rerun them with:\n  {rerun_command(args.output_dir, info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
