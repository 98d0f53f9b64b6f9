"""The promise (every sample once, a truthful exit code) against what real multi-host jobs meet: another worker
finishing shards while this one plans, a host clock that drifted, and a folder that turns read-only mid-run.
(Strangers on the network: tests/test_hosts.py; a shared NFS folder's temporary files: tests/test_faults.py.)
"""

import re
import subprocess

import pytest
from conftest import launch, read_rows, shifted_clock, slow_job
from test_faults import assert_same_as_clean, done_count, start, wait_for

from launcher.ledger.store import Store

N = 8  # prompts, in shards of 2


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    return slow_job(tiny_model, tmp_path_factory.mktemp("prompts"), N, "mesh.tp=1", "mesh.dp=1")


@pytest.fixture(scope="module")
def clean(slow_clean):
    return slow_clean(1)


def test_shards_finished_while_a_worker_plans_are_not_generated_again(job, clean, tmp_path):
    """Worker 0 reads the ledger, then (held) plans while worker 1 generates every shard: worker 0 must take
    none of them up again, nor delete their done states, whatever the clocks say."""
    out, go = tmp_path / "out", tmp_path / "go"
    two = [*job, f"output.dir={out}", "workers.count=2"]
    late = start(*two, "workers.index=0", f"testing.hold_after_ledger_read={go}")
    wait_for(lambda: (tmp_path / "go.waiting").exists(), timeout=180)  # it has read the (empty) ledger
    res = launch(*two, "workers.index=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(map(int, re.findall(r"shard (\d+) done", res.stderr))) == [0, 1, 2, 3]
    by_worker_1 = {p.name: p.read_bytes() for p in (out / "state").glob("shard-*.json")}
    go.touch()
    _, err = late.communicate(timeout=300)
    assert late.returncode == 0, err[-3000:]
    assert not re.findall(r"shard (\d+) done", err), err[-3000:]  # generated nothing
    assert {p.name: p.read_bytes() for p in (out / "state").glob("shard-*.json")} == by_worker_1
    assert_same_as_clean(out, clean, N)


def test_a_live_s3_lock_survives_a_host_clock_90_s_behind(tiny_model, s3, tmp_path):
    """On S3 liveness is the lock's LastModified against the store's own clock: a holder whose clock runs 90 s
    behind is alive to a second launch, whose clock is right (or 90 s ahead), and that launch exits 4."""
    url, n = "s3://meshgen-test/skew", 40
    job = slow_job(tiny_model, tmp_path, n, "mesh.tp=1", "mesh.dp=1", f"output.dir={url}")
    first = start(*job, env={**s3, **shifted_clock(tmp_path, -90)})
    store = Store(url)
    wait_for(lambda: len(store.files("state", ".json")) >= 1, timeout=180)
    for env in (s3, {**s3, **shifted_clock(tmp_path, 90)}):
        res = launch(*job, env=env)
        assert res.returncode == 4, res.stderr[-3000:]
        assert "another run is active" in res.stderr and f"pid {first.pid}" in res.stderr
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert len(read_rows(url)) == n
    run_ids = {store.read_json(f"state/{f.base_name}")["run_id"] for f in store.files("state", ".json")}
    assert len(run_ids) == 1 and str(first.pid) in run_ids.pop()  # every shard by the live run, untouched


BOOKS = ("data", "images", "state", "claims", "runs", "plans")  # what a run writes, but its lock and logs


@pytest.fixture
def books_on_tmpfs(tmp_path):
    """An output folder whose bookkeeping and data folders are each a tmpfs that the test can remount read-only
    (the lock and the logs stay open for writing all run long, and an open file makes a remount busy)."""
    out = tmp_path / "out"
    mounts = [out / d for d in BOOKS]
    for m in mounts:
        m.mkdir(parents=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(m)], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"SKIPPED LOUDLY: cannot mount a tmpfs here ({res.stderr.strip()}); this test needs root")
    yield out, mounts
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)


def remount(mount, mode: str) -> None:
    """remount,ro waits for a moment when no file under it is open for writing (between two shards' writes)."""
    cmd = ["mount", "-o", f"remount,{mode}", str(mount)]
    wait_for(lambda: subprocess.run(cmd, capture_output=True).returncode == 0)


def test_a_folder_turned_read_only_mid_run_stops_cleanly_and_the_same_command_finishes(job, clean, books_on_tmpfs):
    out, mounts = books_on_tmpfs
    run = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 1, timeout=180)
    for m in mounts:
        remount(m, "ro")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "shards: " in err  # the summary is still printed
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out} refuses writes (") and "Read-only file system" in last, last
    assert last.endswith("make it writable again and run the same command to finish"), last
    done = read_rows(out)
    assert 0 < len(done) < N
    for m in mounts:
        remount(m, "rw")
    res = launch(*job, f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_as_clean(out, clean, N)
