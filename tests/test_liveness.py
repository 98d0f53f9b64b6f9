"""Liveness on an object store survives clock steps, a killed run's lock is taken over, and a run whose lock was
taken over (it was frozen, and looked dead) deletes nothing of the run that took it.

Units run on the local S3 server (tests/s3_server.py) with the clock stepped in this process; the killed-run case
runs the same command twice through launch.sh, on S3 and on disk.
"""

import json
import re
import signal
import time

import psutil
import pytest
from conftest import read_rows, slow_job
from test_faults import start, wait_for

from launcher.errors import LockHeld
from launcher.ledger import lock as lock_mod
from launcher.ledger.claims import Claims, held_elsewhere
from launcher.ledger.lock import RunLock, read_lock
from launcher.ledger.store import Store
from launcher.plan.plan import plan_rel, tidy

STEP_S = 120


def _url(tmp_path, what: str) -> str:
    return f"s3://meshgen-test/{what}-{tmp_path.name}"


def _all_files(store: Store, rel: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = store.fs.get_file_info(pafs.FileSelector(store.path(rel), allow_not_found=True, recursive=True))
    return [i.path for i in infos if i.type == pafs.FileType.File]


def _step_clock(monkeypatch, seconds: float) -> None:
    """This process's wall clock jumps by `seconds`, as an NTP step or a resumed VM does (time.monotonic does not)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_a_watcher_whose_clock_steps_120_s_ahead_leaves_a_live_holder_alone(s3, tmp_path, monkeypatch):
    url = _url(tmp_path, "ahead")
    with RunLock(Store(url), 0, "live"):
        assert Claims(Store(url), 0, "live").try_claim(2)
        watcher_store = Store(url)
        watcher = Claims(watcher_store, 1, "other")
        assert not watcher.try_claim(2)  # a first look: the holder wrote its lock a moment ago
        _step_clock(monkeypatch, STEP_S)
        for _ in range(3):
            assert not watcher.try_claim(2), "a live run's claim was taken over after a clock step"
        assert held_elsewhere(watcher_store, 2, "other") == 0
        with pytest.raises(LockHeld, match="another run is active"):
            RunLock(watcher_store, 0, "second").acquire()


def test_a_silent_lock_is_dead_after_stale_s_even_when_the_watchers_clock_steps_back(s3, tmp_path, monkeypatch):
    """A holder on another host that stopped (killed, no heartbeat since): its claim and its lock are taken over
    once its lock has not changed for STALE_S, not before, whatever the watcher's wall clock does meanwhile."""
    stale_s = 3
    monkeypatch.setattr(lock_mod, "STALE_S", stale_s)
    url = _url(tmp_path, "silent")
    store = Store(url)
    holder = {"host": "elsewhere", "pid": 1, "run_id": "silent", "pid_space": "another machine", "beat": 7}
    store.write_bytes("locks/worker-00000.json", json.dumps(holder).encode())
    written = time.monotonic()
    assert Claims(store, 0, "silent").try_claim(1)  # its claim, left behind
    watcher = Claims(Store(url), 1, "other")
    assert not watcher.try_claim(1)  # a first look: written a moment ago by the store's clock
    _step_clock(monkeypatch, -STEP_S)
    wait_for(lambda: watcher.try_claim(1), timeout=30)
    # Never before STALE_S (less the store's 1 s resolution of LastModified) since its last write.
    assert time.monotonic() - written >= stale_s - 1
    with RunLock(store, 0, "next") as taken:
        assert read_lock(store, 0)["run_id"] == "next" and taken.held()


def test_a_run_whose_lock_was_taken_over_deletes_nothing_of_its_successor(s3, tmp_path, monkeypatch):
    """A run frozen past its lock's life (SIGSTOP, a paused VM) is taken over; when it wakes and ends, it deletes
    neither the new run's plan, nor its claims, nor its lock, nor judges any other run dead (a killed run's claim
    stays). The new run's end then removes the frozen one's plan and the killed one's claim."""
    monkeypatch.setattr(lock_mod, "STALE_S", 2)
    url = _url(tmp_path, "frozen")
    store = Store(url)
    frozen = RunLock(store, 0, "frozen")
    frozen.acquire()
    store.write_bytes(plan_rel("frozen"), b"the frozen run's plan")
    frozen._stop.set()  # frozen: its heartbeat stops writing

    successor = RunLock(Store(url), 0, "successor")

    def took_over() -> bool:
        try:
            successor.acquire()
        except LockHeld:
            return False
        return True

    wait_for(took_over, timeout=30)
    try:
        store.write_bytes(plan_rel("successor"), b"the successor's plan")
        assert Claims(store, 0, "successor").try_claim(4)
        ghost = "claims/shard-00006/g00000.json"  # a claim of a killed run of worker 3, which holds no lock
        store.write_bytes(ghost, json.dumps({"worker": 3, "run_id": "ghost"}).encode())

        # The frozen run wakes and ends as the launcher does (launcher/host/launch.py's keep_books).
        assert not frozen.held()
        tidy(store, frozen)
        frozen.release()
        assert store.read_bytes(plan_rel("successor")) == b"the successor's plan"
        assert [f.base_name for f in store.files("claims/shard-00004")] == ["g00000.json"]
        assert read_lock(store, 0)["run_id"] == "successor" and store.exists(ghost)

        tidy(store, successor)  # the live successor's end: the frozen and the killed runs are dead
        assert not store.exists(plan_rel("frozen")) and not store.exists(ghost)
        assert store.exists("claims/shard-00004/g00000.json")
    finally:
        successor.release()
    assert read_lock(store, 0) is None


STEP_BACK = """import os, time
_real, _flag, _step = time.time, {flag!r}, []
def _time():
    if not _step and os.path.exists(_flag):
        _step.append({seconds!r})
    return _real() + (_step[0] if _step else 0.0)
time.time = _time
time.time_ns = lambda: int(_time() * 1e9)
"""


def clock_stepped_on(flag, folder, seconds: float) -> dict:
    """The env of a run whose processes' wall clock steps by `seconds` once `flag` exists (a sitecustomize)."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(STEP_BACK.format(flag=str(flag), seconds=seconds))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize("where", ["disk", "s3", "gs"])
def test_the_same_command_takes_over_the_lock_of_a_killed_run(where, tiny_model, tmp_path, request, kills_a_process):
    """kill -9 of a whole run (launcher and workers: no heartbeat, no release), then the same command: it takes the
    lock over at once (on S3 too: the lock names a dead process of this machine) and finishes every sample once.
    Its wall clock steps back 120 s mid-run: no duration it prints is negative."""
    env = request.getfixturevalue({"s3": "s3", "gs": "gcs"}[where]) if where != "disk" else {}
    out = _url(tmp_path, "killed").replace("s3://", f"{where}://") if where != "disk" else str(tmp_path / "out")
    store, n = Store(out), 8
    job = slow_job(tiny_model, tmp_path, n, "mesh.tp=1", "mesh.dp=1", f"output.dir={out}")
    first = start(*job, env=env)
    wait_for(lambda: len(store.files("state", ".json")) >= 1, timeout=180)
    everyone = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    for p in everyone:
        p.send_signal(signal.SIGKILL)
    first.wait()
    psutil.wait_procs(everyone, timeout=20)
    assert read_lock(store, 0)["pid"] == first.pid  # left behind, never released
    kills_a_process.accept()  # the killed run's temporary files; the run that takes over must leave none

    flag = tmp_path / "step-now"
    again = start(*job, env={**env, **clock_stepped_on(flag, tmp_path / "site", -STEP_S)})
    wait_for(lambda: str(again.pid) in (read_lock(store, 0) or {}).get("run_id", "") or again.poll() is not None)
    flag.touch()  # the run has begun (its lock is taken): its clock steps back
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    m = re.search(r"this run: \d+ images from \d+ shards in (\S+) s \((\S+) images/s\)", err)
    assert m and float(m.group(1)) >= 0 and float(m.group(2)) >= 0, err[-3000:]
    startup = re.search(r"start-up (\S+) s", err)
    assert startup and float(startup.group(1)) >= 0, err[-3000:]
    assert len(read_rows(out)) == n  # each sample once (read_rows refuses a duplicate)
    assert _all_files(store, "plans") == [] and _all_files(store, "claims") == []  # the killed run's too
    assert read_lock(store, 0) is None
