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
from conftest import LAUNCH, file_snapshot, launch, read_rows, shifted_clock, slow_job

N = 24  # prompts, in shards of 2: long enough (about 0.5 s a shard) to interrupt mid-run


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    return slow_job(tiny_model, tmp_path_factory.mktemp("prompts"), N)


@pytest.fixture(scope="module")
def clean(job, tmp_path_factory):
    # Workers started as torchrun starts them (a fresh interpreter each, as on TPU and CUDA hosts): every rerun
    # below, forked on this CPU host, must give these same bytes.
    out = tmp_path_factory.mktemp("clean")
    res = launch(*job, f"output.dir={out}", env={"MESHGEN_WORKER_START": "subprocess"})
    assert res.returncode == 0 and "workers start as fresh interpreters" in res.stderr, res.stderr[-2000:]
    return out


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


def rerun_matches_clean(job: list[str], out: Path, clean: Path) -> None:
    """The same command again finishes the interrupted job, with the same bytes as a clean run."""
    res = launch(*job, f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert_same_as_clean(out, clean)
    # A killed run's plan file and the finished folder's empty claims/ and plans/ are gone (issue 21).
    assert not (out / "plans").exists() and not (out / "claims").exists()


def assert_same_as_clean(out: Path, clean: Path, n: int = N) -> None:
    data = lambda d: {k: v[0] for k, v in file_snapshot(d).items() if k.startswith(("data/", "images/"))}  # noqa: E731
    assert data(out) == data(clean)
    assert len(read_rows(out)) == n
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".stale" in p.name]


def test_kill9_of_the_whole_job_then_the_same_command_finishes_it(job, clean, tmp_path):
    out = tmp_path / "out"
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 2)
    launcher = psutil.Process(proc.pid)
    everyone = launcher.children(recursive=True)  # workers, their writer processes and encoders
    assert len(everyone) > len(workers_of(out)) == 2
    victims = [launcher, *workers_of(out)]
    for p in victims:
        p.kill()
    proc.wait()
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, f"orphans: {[' '.join(p.cmdline())[:80] for p in alive]}"
    assert 2 <= done_count(out) < N // 2
    rerun_matches_clean(job, out, clean)


def test_sigterm_to_the_launcher_alone_stops_the_job(job, clean, tmp_path):
    out = tmp_path / "out"
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 1)
    workers = workers_of(out)
    assert len(workers) == 2
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    stop_s = time.time() - t0
    print(f"SIGTERM stopped the job in {stop_s:.2f} s")
    assert code == 128 + signal.SIGTERM
    assert stop_s < 15
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive and not workers_of(out)
    assert done_count(out) < N // 2
    rerun_matches_clean(job, out, clean)


def test_sigint_to_the_launcher_exits_130_and_stops_the_workers(job, tmp_path):
    out = tmp_path / "out"
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 1)
    workers = workers_of(out)
    assert len(workers) == 2
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive and not workers_of(out)


def test_kill9_of_the_launcher_alone_takes_its_workers_with_it(job, tmp_path):
    """Nobody is left to stop them: the workers, their writers and encoders die with their parent (PDEATHSIG)."""
    out = tmp_path / "out"
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 1)
    everyone = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers_of(out)) == 2
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(everyone, timeout=20)
    assert not alive, f"orphans: {[' '.join(p.cmdline())[:80] for p in alive]}"
    assert done_count(out) < N


def test_a_dead_rank_fails_the_job_quickly_and_a_rerun_completes(job, clean, tmp_path):
    out = tmp_path / "out"
    proc = start(*job, f"output.dir={out}")
    wait_for(lambda: done_count(out) >= 1)
    victim = max(workers_of(out), key=lambda p: p.pid)
    t0 = time.time()
    victim.kill()
    code = proc.wait(timeout=120)
    notice_s = time.time() - t0
    print(f"a dead rank ended the job in {notice_s:.2f} s")
    assert code == 128 + signal.SIGKILL and notice_s < 30  # the README's "within about a second" is measured
    assert not workers_of(out)
    rerun_matches_clean(job, out, clean)


def test_an_injected_failure_on_the_last_tp_rank_fails_only_that_shard(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"output.dir={out}"]
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


def test_a_failed_write_fails_only_that_shard(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"output.dir={out}"]
    (out / "data" / "shard-00001.parquet").mkdir(parents=True)  # in the way of the writer's final rename
    # The same job's run.json: a folder with data/ but no run.json is not meshgen's, and is refused (issue 21).
    shutil.copy(run_job() / "run.json", out / "run.json")
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
    res = launch(*args)  # the same command again: only shard 1 is written
    assert res.returncode == 0, res.stderr[-2000:]
    assert "this run: 8 images from 1 shards" in res.stderr
    assert read_rows(out) == read_rows(run_job())


def test_abort_stops_at_the_first_failure(tiny_model, tmp_path):
    out = tmp_path / "out"
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "testing.fail_shards=[0]", "run.on_error=abort")
    assert res.returncode == 3, res.stderr[-2000:]
    assert json.loads((out / "state" / "shard-00000.json").read_text())["status"] == "failed"
    assert not (out / "state" / "shard-00001.json").exists()


def test_other_settings_are_refused_until_overwrite(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    assert launch(f"model.path={tiny_model}", f"output.dir={out}", "run.shards=[0]").returncode == 0
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "generate.seed=5")
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert "generate.seed: 0 -> 5" in last and "run.overwrite=true" in last and "Traceback" not in res.stderr
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "generate.seed=5", "run.overwrite=true")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "run.json").read_text())["settings"]["generate"]["seed"] == 5
    assert len(read_rows(out)) == 20


def test_a_second_launch_on_a_busy_folder_exits_4(job, clean, tmp_path):
    """Also when the live run's host clock runs 90 s ahead: liveness never compares two hosts' clocks."""
    out = tmp_path / "out"
    first = start(*job, f"output.dir={out}", env=shifted_clock(tmp_path, 90))
    wait_for(lambda: done_count(out) >= 1)
    res = launch(*job, f"output.dir={out}")
    assert res.returncode == 4
    assert "another run is active" in res.stderr and f"pid {first.pid}" in res.stderr
    assert first.wait(timeout=120) == 0
    assert_same_as_clean(out, clean)


def test_leftovers_of_a_killed_write_are_cleaned(run_job, tiny_model, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run_job(), out)
    (out / "state" / "shard-00001.json").unlink()  # killed after writing data, before marking it done
    (out / "data" / ".shard-00001.parquet.tmp-999999999").write_bytes(b"half")
    (out / "images" / ".shard-00001.tmp-999999999").mkdir()
    (out / "data" / ".shard-00002.parquet.tmp-999999999").write_bytes(b"half")  # a done shard's leftover
    # The folder is shared with other nodes (NFS): another node's write in flight is kept, whatever its pid
    # means here; another node's leftover untouched for longer than the lock's timeout goes.
    here = socket.gethostname()
    (out / "data" / f".shard-00001.parquet.tmp-{here}-999999999").write_bytes(b"dead writer of this host")
    live = out / "data" / f".shard-00001.parquet.tmp-node-b-{os.getpid()}"
    live.write_bytes(b"in flight on another node")
    old = out / "images" / ".shard-00002.tmp-node-c-1"
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    res = launch(f"model.path={tiny_model}", f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert [p for p in out.rglob("*") if ".tmp-" in p.name] == [live]
    assert read_rows(out) == read_rows(run_job())
