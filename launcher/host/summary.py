"""What a run tells its user: a progress bar while it runs, and a summary (and the run's record) at the end.

Both read only the run folder's state files, like tools/status.py: the launcher, not a worker, shows the bar
for the whole run (all dp replicas), and the workers stay quiet. A shard belongs to this run when its state
file carries this run's id.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from launcher.errors import EXIT_OK, EXIT_SHARDS_FAILED
from launcher.host.metrics import numbers
from launcher.ledger.claims import held_elsewhere
from launcher.ledger.runs import versions
from launcher.ledger.states import Ledger, state_token
from launcher.ledger.store import Store
from launcher.plan.plan import Plan
from launcher.sources.rejected import rel as rejected_rel

logger = logging.getLogger(__name__)

GIT_TIMEOUT_S = 5  # code_version's bound on `git describe`


class Progress:
    """A tqdm bar over the run's samples, fed by refreshing the ledger every few seconds (one listing each)."""

    def __init__(self, ledger: Ledger, total: int, run_id: str, on_done=None, metrics=None):
        self.ledger, self.run_id = ledger, run_id
        self.on_done = on_done  # called with this run's done shards at each look (output.publish pushes them)
        self.metrics = metrics  # output.metrics: launcher/host/metrics.py's MetricsFile, updated at each look
        self._stop = threading.Event()
        interactive = sys.stderr.isatty()
        self._bar = tqdm(
            total=total,
            unit="img",
            desc="starting workers",
            dynamic_ncols=True,
            mininterval=1 if interactive else 30,
            smoothing=0.1,
        )
        self._every = 1.0 if ledger.store.is_local else 10.0  # listing an object store costs requests
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        from launcher.host.terminal import stage_listeners

        stage_listeners.append(self._stage)  # rank 0's stages before its first image: loading, compile warm-up
        self._thread.start()
        return self

    def _stage(self, text: str) -> None:
        if self._bar.n == 0:  # once images flow, the bar's rate and ETA say the rest
            self._bar.set_description_str(text)

    def __exit__(self, *exc):
        from launcher.host.terminal import stage_listeners

        stage_listeners.remove(self._stage)
        self._stop.set()
        self._thread.join()
        self._update()
        self._bar.close()

    def _poll(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._update()
            except OSError as e:  # a store that does not answer for a moment: the bar waits, the run goes on
                logger.debug("progress: %s", e)

    def _update(self) -> None:
        ours = {i: st for i, st in self.ledger.refresh().items() if st.get("run_id") == self.run_id}
        mine = list(ours.values())
        done = sum(st["rows"] for st in mine if st["status"] == "done")
        if self.on_done is not None:  # a state is written last: the shard's files are final
            self.on_done([i for i, st in ours.items() if st["status"] == "done"])
        if self.metrics is not None:
            self.metrics.update(ours)
        self._bar.set_postfix(failed_shards=sum(st["status"] == "failed" for st in mine), refresh=False)
        if done and not self._bar.n:
            self._bar.set_description_str("generating", refresh=False)
        self._bar.update(done - self._bar.n)


def code_version() -> str | None:
    """`git describe` of the checkout holding launcher/, or None: no git, no checkout, or a git that does not answer
    within GIT_TIMEOUT_S (a hung network file system must not hold up the run's record)."""
    try:
        root = Path(__file__).resolve().parents[2]
        git = ["git", "-C", str(root), "describe", "--always", "--dirty"]
        return subprocess.run(git, capture_output=True, text=True, timeout=GIT_TIMEOUT_S).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def summarize(
    store: Store,
    ledger: Ledger,
    plan: Plan,
    run_id: str,
    start: float,
    exit_code: int,
    rerun: list[str],
) -> tuple[list[str], dict]:
    """The end-of-run summary lines and the run's record, with the exit code the ledger decides.

    0 only if every selected shard is done now; a selected shard that is not done (failed, or left pending by a
    stopped worker or a lost host) makes it 3, unless another live run holds it (that run answers for it).
    A signal's or a crash's own code stays.
    """
    states = ledger.refresh()  # one listing; only this run's new state files are read
    status = {s.index: _status(states.get(s.index), s) for s in plan.shards}
    ran = {i: st for i, st in states.items() if st.get("run_id") == run_id}
    repaired = sorted(s.index for s in plan.shards if s.status == "damaged" and status[s.index] == "done")
    images = sum(st["rows"] for st in ran.values() if st["status"] == "done")
    wall = time.monotonic() - start  # `start`: time.monotonic() at the launch; the wall clock may step mid-run
    end = time.time()
    stages: dict[str, float] = {}
    for st in ran.values():
        for k, v in st.get("stages", {}).items():
            stages[k] = round(stages.get(k, 0.0) + v, 3)
    truncated = sum(st.get("truncated") or 0 for st in ran.values() if st["status"] == "done")
    began = [st["started_at"] for st in ran.values() if st.get("started_at")]
    # Launch, imports, model load: no shard's time. The workers' own clock says when a shard began; held within
    # the run's duration, which a step of the wall clock between the two readings would put it out of.
    startup = round(min(max(min(began) - (end - wall), 0.0), wall), 2) if began else None
    open_ = [i for i in plan.selected if status[i] != "done"]
    elsewhere = {i: w for i in open_ if (w := held_elsewhere(store, i, run_id)) is not None}
    failed = [i for i in open_ if status[i] == "failed" and i not in elsewhere]
    held = [i for i in plan.held if status.get(i) == "failed"]  # failed run.max_attempts times: not retried
    pending = [i for i in open_ if status[i] != "failed" and i not in elsewhere]
    if exit_code in (EXIT_OK, EXIT_SHARDS_FAILED):
        exit_code = EXIT_SHARDS_FAILED if failed or pending or held else EXIT_OK
    counts = {k: sum(v == k for v in status.values()) for k in ("done", "failed", "pending", "stale")}
    damaged = sum(v == "damaged" for v in status.values())  # judged damaged by the plan and not generated since
    record = {
        "run_id": run_id,
        "start": _iso(end - wall),
        "end": _iso(end),
        "exit_code": exit_code,
        "command": rerun,
        "shards": len(plan.shards),
        "selected": len(plan.selected),
        "generated": len(ran),
        "failed_now": sorted(i for i, st in ran.items() if st["status"] != "done"),
        "not_done": {
            "failed": failed,
            "pending": pending,
            "held_by_other_runs": sorted(elsewhere),
            **({"not_retried": held} if held else {}),
        },
        **counts,
        "images": images,
        "seconds": round(wall, 2),
        "images_per_s": round(images / wall, 3) if wall else None,
        "stages": stages,
        "metrics": numbers(ran, wall),  # what output.metrics's textfile says at the end (launcher/host/metrics.py)
        "startup_s": startup,
        "truncated_prompts": truncated,
        "code": code_version(),
        "versions": versions(),
    }
    if plan.rejected:  # dataset.bad_rows=skip: the rows set aside, listed with their reasons in the file
        record.update(rejected=len(plan.rejected), rejected_file=rejected_rel(run_id))
    if any(s.status == "damaged" for s in plan.shards):  # files that differed from their states: verify.py
        record.update(damaged=damaged, damaged_regenerated=repaired)
    lines = [
        f"shards: {counts['done']} done, {counts['failed']} failed, {counts['pending']} pending"
        + (f", {counts['stale']} stale (kept)" if counts["stale"] else "")
        + (f", {damaged} damaged" if damaged else ""),
        f"this run: {images} images from {len(ran)} shards in {wall:.1f} s ({record['images_per_s']} images/s)",
        "time per stage (s, summed over shards): "
        + ", ".join(f"{k} {v}" for k, v in stages.items())
        + (f"; start-up {startup} s (launch to the first shard: imports, model load)" if startup is not None else ""),
        f"outputs: {store}",
    ]
    if plan.rejected:
        first = plan.rejected[0]
        at = f"{first['file']}, line {first['line']}" if first["file"] else f"row {first['position']}"
        lines.append(
            f"{len(plan.rejected)} bad rows set aside (dataset.bad_rows=skip), each with its reason in "
            f"{store.url(rejected_rel(run_id))}; the first: {at}: {first['reason']}"
        )
    if repaired:
        lines.append(f"{len(repaired)} damaged shards regenerated: {_short(repaired)}")
    if truncated:
        lines.append(f"{truncated} prompts were longer than generate.max_sequence_length and were truncated")
    if elsewhere:
        lines.append(f"shards {_short(sorted(elsewhere))} are being generated by other live workers")
    if held:
        lines.append(_held_line(states, held, rerun))
    if failed or pending:
        what = "; ".join(f"{k} shards {_short(v)}" for k, v in (("failed", failed), ("pending", pending)) if v)
        lines.append(f"not done: {what}; finish them with the same command: {shlex.join(rerun)}")
    return lines, record


def _held_line(states: dict[int, dict], held: list[int], rerun: list[str]) -> str:
    """Why shards that fail every time were not retried, and how to retry them."""
    first = states[held[0]]
    samples = first.get("samples") or []
    where = f" at samples {', '.join(map(repr, samples[:5]))}" if samples else ""
    return (
        f"not retried: shards {_short(held)} failed {first.get('attempts')} times in a row with the same error "
        f"(shard {held[0]}: {first.get('error_class')}{where}: {(first.get('error') or '')[:200]}); a rerun fails "
        f"them again: fix the row(s), then run {shlex.join([*rerun, 'run.shards=failed'])}"
    )


def _status(state: dict | None, shard) -> str:
    if state is None:
        return "pending"
    if state.get("status") != "done":
        return "failed"
    if shard.status == "damaged" and state_token(state) == shard.seen:  # the state whose files were found damaged
        return "damaged"
    # Done by this run (its fingerprint is the plan's) or judged by the plan before the run started.
    return "done" if state.get("prompts_fingerprint") == shard.fingerprint or shard.status == "done" else shard.status


def _short(ids: list[int], n: int = 20) -> str:
    return str(ids) if len(ids) <= n else f"{ids[:n]}".rstrip("]") + f", ... ({len(ids)} in all)]"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
