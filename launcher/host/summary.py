"""What a run tells its user: a progress bar while it runs, and a summary (and runs.jsonl record) at the end.

Both read only the run folder's state files, like tools/status.py: the launcher, not a worker, shows the bar
for the whole run (all dp replicas), and the workers stay quiet. A shard belongs to this run when its state
file carries this run's id.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from launcher.ledger import states as ledger
from launcher.ledger.shards import Shard
from launcher.ledger.store import Store


class Progress:
    """A tqdm bar over the run's samples, fed by polling the state files every few seconds."""

    def __init__(self, store: Store, total: int, run_id: str):
        self.store, self.run_id = store, run_id
        self._seen: dict[str, tuple] = {}  # state file name -> ((name, mtime), state)
        self._stop = threading.Event()
        interactive = sys.stderr.isatty()
        self._bar = tqdm(
            total=total,
            unit="img",
            desc="generating",
            dynamic_ncols=True,
            mininterval=1 if interactive else 30,
            smoothing=0.1,
        )
        self._every = 1.0 if store.is_local else 10.0  # listing an object store costs requests
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._update()
        self._bar.close()

    def _poll(self) -> None:
        while not self._stop.wait(self._every):
            self._update()

    def _update(self) -> None:
        # One listing per poll; a state file is read again only when it changed (a shard may be redone).
        for info in self.store.files(ledger.STATE_DIR, ".json"):
            key = (info.base_name, info.mtime_ns)
            if self._seen.get(info.base_name, (None,))[0] != key:
                self._seen[info.base_name] = (key, self.store.read_json(f"{ledger.STATE_DIR}/{info.base_name}") or {})
        mine = [st for _, st in self._seen.values() if st.get("run_id") == self.run_id]
        done = sum(st["rows"] for st in mine if st["status"] == "done")
        self._bar.set_postfix(failed_shards=sum(st["status"] == "failed" for st in mine), refresh=False)
        self._bar.update(done - self._bar.n)


def code_version() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return (
            subprocess.run(
                ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def summarize(
    store: Store,
    shards: list[Shard],
    run_id: str,
    start: float,
    exit_code: int,
    rerun: list[str],
) -> tuple[list[str], dict]:
    """The end-of-run summary lines, and the record appended to runs.jsonl."""
    states = ledger.read_states(store)
    status = ledger.statuses(states, shards)
    ran = {i: st for i, st in states.items() if st.get("run_id") == run_id}
    images = sum(st["rows"] for st in ran.values() if st["status"] == "done")
    wall = time.time() - start
    stages: dict[str, float] = {}
    for st in ran.values():
        for k, v in st.get("stages", {}).items():
            stages[k] = round(stages.get(k, 0.0) + v, 3)
    truncated = sum(st.get("truncated") or 0 for st in ran.values() if st["status"] == "done")
    failed = sorted(i for i, s in status.items() if s == "failed")
    counts = {k: sum(v == k for v in status.values()) for k in ("done", "failed", "pending", "stale")}
    record = {
        "start": _iso(start),
        "end": _iso(time.time()),
        "run_id": run_id,
        "exit_code": exit_code,
        "generated": len(ran),
        "failed_now": sorted(i for i, st in ran.items() if st["status"] != "done"),
        **counts,
        "images": images,
        "seconds": round(wall, 2),
        "images_per_s": round(images / wall, 3) if wall else None,
        "stages": stages,
        "truncated_prompts": truncated,
        "code": code_version(),
        "versions": ledger.versions(),
    }
    lines = [
        f"shards: {counts['done']} done, {counts['failed']} failed, {counts['pending']} pending"
        + (f", {counts['stale']} stale (kept)" if counts["stale"] else ""),
        f"this run: {images} images from {len(ran)} shards in {wall:.1f} s ({record['images_per_s']} images/s)",
        "time per stage (s, summed over shards): " + ", ".join(f"{k} {v}" for k, v in stages.items()),
        f"outputs: {store}",
    ]
    if truncated:
        lines.append(f"{truncated} prompts were longer than generate.max_sequence_length and were truncated")
    if failed:
        lines.append(f"failed shards {failed}; rerun them with: {shlex.join([*rerun, 'run.shards=failed'])}")
    return lines, record


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
