"""What a run tells its user: a progress bar while it runs, a summary at the end, one line in runs.jsonl.

Both read only the run folder's state files, like tools/status.py: the launcher, not a worker, shows the bar
for the whole run (all dp replicas), and the workers stay quiet.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from launcher import ledger
from launcher.shards import Shard


def _states_since(out: Path, shards: list[Shard], since: float) -> dict[int, dict]:
    """State files of these shards written by this run (not by an earlier one)."""
    states = {}
    for s in shards:
        st = ledger.read_state(out, s.index)
        if st and st.get("finished_at", 0) >= since:
            states[s.index] = st
    return states


class Progress:
    """A tqdm bar over the run's samples, fed by polling the state files once a second."""

    def __init__(self, out: Path, shards: list[Shard], since: float):
        self.out, self.shards, self.since = out, shards, since
        self._stop = threading.Event()
        interactive = sys.stderr.isatty()
        self._bar = tqdm(
            total=sum(len(s.rows) for s in shards),
            unit="img",
            desc="generating",
            dynamic_ncols=True,
            mininterval=1 if interactive else 30,
            smoothing=0.1,
        )
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
        while not self._stop.wait(1.0):
            self._update()

    def _update(self) -> None:
        states = _states_since(self.out, self.shards, self.since)
        done = sum(st["rows"] for st in states.values() if st["status"] == "done")
        failed = sum(st["status"] == "failed" for st in states.values())
        self._bar.set_postfix(failed_shards=failed, refresh=False)
        self._bar.update(done - self._bar.n)


def code_version() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        return (
            subprocess.run(
                ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def summarize(
    out: Path,
    all_shards: list[Shard],
    selected: list[int],
    start: float,
    exit_code: int,
    rerun: list[str],
    truncated: int | None = None,
) -> tuple[list[str], dict]:
    """The end-of-run summary lines, and the record appended to runs.jsonl."""
    status = {s.index: ledger.shard_status(out, s) for s in all_shards}
    ran = _states_since(out, [all_shards[i] for i in selected], start)
    images = sum(st["rows"] for st in ran.values() if st["status"] == "done")
    wall = time.time() - start
    stages: dict[str, float] = {}
    for st in ran.values():
        for k, v in st.get("stages", {}).items():
            stages[k] = round(stages.get(k, 0.0) + v, 3)
    failed = sorted(i for i, s in status.items() if s == "failed")
    counts = {k: sum(v == k for v in status.values()) for k in ("done", "failed", "pending", "stale")}
    record = {
        "start": _iso(start),
        "end": _iso(time.time()),
        "exit_code": exit_code,
        "generated": len(ran),
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
        f"outputs: {out}",
    ]
    if truncated:
        lines.append(f"{truncated} prompts were longer than generate.max_sequence_length and were truncated")
    if failed:
        lines.append(f"failed shards {failed}; rerun them with: {shlex.join([*rerun, 'run.shards=failed'])}")
    return lines, record


def append_run_record(out: Path, record: dict) -> None:
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
