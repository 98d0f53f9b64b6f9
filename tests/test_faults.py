"""Never lose or duplicate a sample: kills, signals, injected failures, settings changes, concurrent launches.

Every test runs real jobs through launch.sh and compares the result with a clean run, byte for byte.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import LAUNCH, SLOW_N, file_snapshot, first_shards, launch, read_rows, shifted_clock, unslowed

N = SLOW_N


@pytest.fixture(scope="module")
def job(slow) -> list[str]:
    return slow[0]


@pytest.fixture(scope="module")
def clean(slow) -> Path:
    return slow[1]


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.Popen([LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(predicate, timeout: float = 120.0) -> None:
    end = time.time() + timeout
    while not predicate():
        assert time.time() < end, "timed out"
        time.sleep(0.05)


def done_count(out: Path) -> int:
    return len(list((out / "state").glob("shard-*.json"))) if (out / "state").exists() else 0


def workers_of(out: Path) -> list[psutil.Process]:
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "launcher.worker.main" in cmd and f"output.dir={out}" in cmd:
            procs.append(p)
    return procs


def assert_same_as_clean(out: Path, clean: Path, n: int = N) -> None:
    """The run in `out` holds the slow job's first n prompts, with the files of those shards in `clean`."""
    data = lambda d: {k: v[0] for k, v in file_snapshot(d).items() if k.startswith(("data/", "images/"))}  # noqa: E731
    assert data(out) == first_shards(data(clean), n)
    assert len(read_rows(out)) == n
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".stale" in p.name]


def interrupted(job: list[str], out: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A run of `job` into `out`, once it has finished one more shard than the folder held: (launcher, workers)."""
    before = done_count(out)
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) > before)
    workers = workers_of(out)
    assert len(workers) == 2
    return proc, workers


def test_every_way_a_job_is_stopped_then_the_same_command_finishes_it(job, clean, tmp_path, kills_a_process):
    """One folder, stopped five ways in turn; each run adds shards, and the same command finishes it once, with the
    bytes of a clean run, while a second launch on the busy folder is refused."""
    out = tmp_path / "out"

    proc, workers = interrupted(job, out)  # Ctrl-C
    # The workers' server was forked from the launcher, sharing its torch import (launcher/host/worker_start.py)
    [server] = {w.parent() for w in workers}
    assert server.ppid() == proc.pid and f"meshgen, pid {proc.pid}" in " ".join(server.cmdline())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive and not workers_of(out)

    proc, workers = interrupted(job, out)  # systemctl stop, a scheduler's preemption
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    stop_s = time.time() - t0
    print(f"SIGTERM stopped the job in {stop_s:.2f} s")
    assert code == 128 + signal.SIGTERM
    assert stop_s < 15
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive and not workers_of(out)

    proc, workers = interrupted(job, out)  # a rank dies (OOM killer)
    victim = max(workers, key=lambda p: p.pid)
    t0 = time.time()
    victim.kill()
    code = proc.wait(timeout=120)
    notice_s = time.time() - t0
    print(f"a dead rank ended the job in {notice_s:.2f} s")
    assert code == 128 + signal.SIGKILL and notice_s < 30  # the README's "within about a second" is measured
    assert not workers_of(out)

    # kill -9 of the launcher alone: nobody is left to stop the workers, their writers and encoders; they die with
    # their parent (PDEATHSIG).
    proc, _ = interrupted(job, out)
    everyone = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(everyone, timeout=20)
    assert not alive, f"orphans: {[' '.join(p.cmdline())[:80] for p in alive]}"

    proc, workers = interrupted(job, out)  # kill -9 of the whole job, a lost VM
    launcher = psutil.Process(proc.pid)
    everyone = launcher.children(recursive=True)  # workers, their writer processes and encoders
    assert len(everyone) > len(workers)
    for p in (launcher, *workers):
        p.kill()
    proc.wait()
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, f"orphans: {[' '.join(p.cmdline())[:80] for p in alive]}"
    assert 5 <= done_count(out) < N // 2
    kills_a_process.accept()  # the killed runs' temporary files; the runs below must leave none

    # The same command finishes it. Its host clock runs 90 s ahead, and a second launch meanwhile is refused:
    # liveness never compares two hosts' clocks.
    # The second launch starts first and waits, its interpreter up and the ledger read, until the finishing run
    # holds the lock and its workers hold their first batch: then it only has to reach the lock (on a loaded host,
    # starting from nothing took longer than the shards that were left). Once it is refused, the finishing run
    # goes on at full speed. testing.* is not fingerprinted.
    go, batches = tmp_path / "go", tmp_path / "batches"
    second = start(*job, f"output.dir={out}", f"testing.hold_after_ledger_read={go}")
    wait_for(lambda: Path(f"{go}.waiting").exists())
    held = done_count(out)
    last = start(
        *unslowed(job), f"output.dir={out}", f"testing.hold_batches_until={batches}", env=shifted_clock(tmp_path, 90)
    )
    wait_for(lambda: Path(f"{batches}.waiting").exists())
    go.touch()
    err = second.communicate(timeout=120)[1]
    assert second.returncode == 4, err[-2000:]
    assert "another run is active" in err and f"pid {last.pid}" in err
    assert last.poll() is None and done_count(out) == held  # it held its batches until now
    batches.touch()
    assert last.wait(timeout=120) == 0, last.stderr.read()[-2000:]
    assert_same_as_clean(out, clean)
    # The killed runs' plan files and the finished folder's empty claims/ and plans/ are gone (issue 21).
    assert not (out / "plans").exists() and not (out / "claims").exists()


def test_an_injected_failure_on_the_last_tp_rank_fails_only_that_shard(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"output.dir={out}"]
    # run.on_error=abort stops at the first failure: shard 0 failed, shard 1 never started.
    res = launch(*args, "testing.fail_shards=[0]", "run.on_error=abort", "dataset.limit=16")
    assert res.returncode == 3, res.stderr[-2000:]
    assert json.loads((out / "state" / "shard-00000.json").read_text())["status"] == "failed"
    assert not (out / "state" / "shard-00001.json").exists()
    # The default goes on past a failure; the plain run retries the failed shard 0.
    res = launch(*args, "testing.fail_shards=[1]", "dataset.limit=16")  # shards 0 and 1 of the 3
    assert res.returncode == 3, res.stderr[-2000:]
    status = json.loads(subprocess.check_output([sys.executable, "tools/status.py", str(out), "--json"]))
    assert status["shards"] == {"0": "done", "1": "failed"}
    assert (status["done"], status["failed"], status["pending"]) == (1, 1, 0)
    state = json.loads((out / "state" / "shard-00001.json").read_text())
    assert state["error"].startswith("InjectedFailure") and "Traceback" in state["traceback"]
    assert not (out / "data" / "shard-00001.parquet").exists()
    text = subprocess.check_output([sys.executable, "tools/status.py", str(out)], text=True)
    assert "InjectedFailure" in text and "run.shards=[1]" in text
    before = file_snapshot(out)
    res = launch(*args, "run.shards=failed")  # shard 1 only: not shard 2, pending now that the limit is gone
    assert res.returncode == 0, res.stderr[-2000:]  # every selected shard is done
    assert "this run: 8 images from 1 shards" in res.stderr and "0 failed, 1 pending" in res.stderr
    after = file_snapshot(out)
    for name in before:  # the done shards' files are untouched
        if "00001" not in name and name != "run.json":
            assert after[name] == before[name], name
    assert not (out / "state" / "shard-00002.json").exists()
    res = launch(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_rows(out) == read_rows(run_job())


def test_a_failed_write_fails_only_that_shard_and_a_killed_writes_leftovers_go(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"output.dir={out}", "mesh.tp=1"]  # one worker: the writer is the subject
    args.append("output.image_files=true")  # image folders too: a failed shard's and leftovers must go
    (out / "data" / "shard-00001.parquet").mkdir(parents=True)  # in the way of the writer's final rename
    # The same job's run.json: a folder with data/ but no run.json is not meshgen's, and is refused (issue 21).
    shutil.copy(run_job("mesh.tp=1") / "run.json", out / "run.json")
    res = launch(*args)
    assert res.returncode == 3, res.stderr[-2000:]
    assert "failed shards [1]" in res.stderr
    states = {i: json.loads((out / "state" / f"shard-0000{i}.json").read_text()) for i in range(3)}
    assert [states[i]["status"] for i in range(3)] == ["done", "failed", "done"]
    assert states[1]["error"].startswith("IsADirectoryError while writing")
    assert "its files could not be removed: IsADirectoryError" in states[1]["error"]  # the obstacle stays
    assert "Traceback" in states[1]["traceback"]
    assert not (out / "images" / "shard-00001").exists()  # no image of a failed shard stays readable
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    (out / "data" / "shard-00001.parquet").rmdir()
    done = {k: v for k, v in file_snapshot(out).items() if "00002" in k}

    # Shard 0 as a run killed after writing its data and before marking it done leaves it, with the leftovers of
    # killed writes: this host's, whatever their pid means now, and a done shard's.
    (out / "state" / "shard-00000.json").unlink()
    (out / "data" / ".shard-00000.parquet.tmp-999999999").write_bytes(b"half")
    (out / "images" / ".shard-00000.tmp-999999999").mkdir()
    (out / "data" / ".shard-00002.parquet.tmp-999999999").write_bytes(b"half")
    # The folder is shared with other nodes (NFS): another node's write in flight is kept, whatever its pid
    # means here; another node's leftover untouched for longer than the lock's timeout goes.
    here = socket.gethostname()
    (out / "data" / f".shard-00000.parquet.tmp-{here}-999999999").write_bytes(b"dead writer of this host")
    live = out / "data" / f".shard-00001.parquet.tmp-node-b-{os.getpid()}"
    live.write_bytes(b"in flight on another node")
    old = out / "images" / ".shard-00002.tmp-node-c-1"
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    res = launch(*args)  # the same command again: shards 0 and 1 only
    assert res.returncode == 0, res.stderr[-2000:]
    assert "this run: 16 images from 2 shards" in res.stderr
    assert {k: v for k, v in file_snapshot(out).items() if "00002" in k} == done  # the done shard is untouched
    assert [p for p in out.rglob("*") if ".tmp-" in p.name] == [live]
    assert read_rows(out) == read_rows(run_job("mesh.tp=1"))


def test_other_settings_are_refused_until_overwrite(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_job("mesh.tp=1"), out)
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "generate.seed=5")
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert "generate.seed: 0 -> 5" in last and "run.overwrite=true" in last and "Traceback" not in res.stderr
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "generate.seed=5", "run.overwrite=true", "mesh.tp=1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "run.json").read_text())["settings"]["generate"]["seed"] == 5
    assert len(read_rows(out)) == 20
