"""A job over two hosts, on one machine: two launchers on loopback (NODE_RANK=0/1, MASTER_ADDR=127.0.0.1).

kill -9 of the second host's launcher and workers mid-run must stop the first host within 30 s with exit 3 and
its done shards kept; the same command on both hosts then finishes the job, with the images of a clean run on
one host, while strangers knock on the job's port all along (a port scan, a silent connection, an HTTP probe, a
fake rank). Once with the dp axis across the hosts, once with the tp axis across them.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import LAUNCH, PROMPTS, launch, read_rows, slow_job
from test_faults import assert_same_as_clean, done_count, wait_for

N = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTED: list[subprocess.Popen] = []  # every launcher start_hosts started, ended after its test however it ended


@pytest.fixture(autouse=True)
def end_started_hosts():
    """A test that fails or times out waiting (on the first host, after the second's kill) leaves no host running."""
    yield
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            for q in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                try:
                    q.kill()
                except psutil.NoSuchProcess:
                    pass
        p.wait()
        for f in (p.stdout, p.stderr):
            f.close()


def start_hosts(job: list[str], port: int, extra: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    """Both hosts' launchers; `extra`: overrides only one host adds."""
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHON": sys.executable, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(port))
        args = [LAUNCH, *job, *(extra or {}).get(node, [])]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        STARTED.append(procs[-1])
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each launcher's exit code and stderr, within `timeout` in all (past it, end_started_hosts kills them)."""
    deadline = time.monotonic() + timeout
    errs = [p.communicate(timeout=max(deadline - time.monotonic(), 1))[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def test_hosts_started_with_other_settings_all_refuse_before_anything_is_written(tiny_model, tmp_path):
    """Host 1 joins host 0's job with its own generation settings and its own way of storing images: every host
    exits 2 naming what differs, before any worker starts or a byte is written (it used to generate its share
    with them, and exit 0). Its own metrics file is its own business."""
    out = tmp_path / "out"
    job = [f"model.path={tiny_model}", PROMPTS, "mesh.nodes=2", "mesh.dp=2", "mesh.tp=1", f"output.dir={out}"]
    procs = start_hosts(
        job,
        free_port(),
        extra={
            1: [
                "generate.guidance_scale=9",
                "generate.seed=5",
                "output.embed_images=false",
                f"output.metrics={tmp_path / 'h1.prom'}",
            ]
        },
    )
    ended = finish(procs, timeout=240)
    line = (
        "error: host 1's settings differ from host 0's: generate.guidance_scale 9.0 != 4.0, generate.seed 5 != 0, "
        "config.output.image_files true != false, config.output.embed_images false != true; "
        "start every host with the same job"
    )
    for node, (code, err) in enumerate(ended):
        assert (code, err.strip().splitlines()[-1:]) == (2, [line]), f"host {node}: {err[-3000:]}"
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_a_lost_host_stops_the_job_and_the_same_command_finishes_it(
    axis, tiny_model, slow_clean, tmp_path, kills_a_process
):
    mesh = ["mesh.dp=2", "mesh.tp=1"] if axis == "dp" else ["mesh.dp=1", "mesh.tp=2"]
    job = slow_job(tiny_model, tmp_path, N, *mesh)
    clean = slow_clean(1 if axis == "dp" else 2)  # one host, the same tp
    out = tmp_path / "out"
    multi = [*job, "mesh.nodes=2", f"output.dir={out}"]
    first, second = start_hosts(multi, free_port())
    wait_for(lambda: done_count(out) >= 1, timeout=180)
    victim = psutil.Process(second.pid)
    tree = [victim, *victim.children(recursive=True)]
    for p in tree:
        p.kill()
    t0 = time.time()
    code = first.wait(timeout=60)
    stop_s = time.time() - t0
    err = first.stderr.read()
    print(f"{axis} across hosts: the first host stopped {stop_s:.2f} s after the kill, exit {code}")
    assert code == 3, err[-3000:]
    assert stop_s < 30
    assert "lost a host" in err and "not done:" in err and "finish them with the same command" in err
    kept = done_count(out)
    assert 1 <= kept < N // 2
    second.wait()
    kills_a_process.accept()  # the killed host's temporary files; the runs below must leave none
    # The same command on both hosts completes it; the dead run's claims are taken over. Strangers on the job's
    # port (the rendezvous store the launchers' heartbeats live in) neither stop, block nor blind it.
    port = free_port()
    first, second = start_hosts(multi, port)
    stop = threading.Event()
    knocks = threading.Thread(target=strangers, args=(port, stop), daemon=True)
    knocks.start()
    codes = [p.wait(timeout=300) for p in (first, second)]
    stop.set()
    knocks.join()
    assert codes == [0, 0], first.stderr.read()[-3000:] + second.stderr.read()[-3000:]
    assert len(read_rows(out)) == N
    assert_same_as_clean(out, clean, N)


def strangers(port: int, stop: threading.Event) -> None:
    """Connect-and-close, a silent connection held open, an HTTP request and a fake rank, over and over."""
    held = []
    while not stop.wait(0.3):
        for payload in (None, b"", b"GET / HTTP/1.0\r\n\r\n", b"1\n", b"-1\n"):
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                continue  # not up yet, or between the two runs
            if payload is None:
                conn.close()
                continue
            if payload:
                conn.sendall(payload)
            held.append(conn)  # kept open and silent, as a stuck health probe would
    for conn in held:
        conn.close()


def test_a_port_in_use_is_one_line_at_start(tiny_model, tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        job = [f"model.path={tiny_model}", "mesh.nodes=2", "mesh.dp=2", "mesh.tp=1", f"output.dir={tmp_path / 'o'}"]
        res = launch(*job, env=env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        f"error: MASTER_PORT {port} cannot be bound on this host (Address already in use); another program holds "
        "it: pick a free port and set MASTER_PORT to it on every host"
    ]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("alive", [False, True])
def test_after_a_failure_a_host_counts_as_alive_only_if_its_beat_changes_twice(alive):
    """settle(), after this host's workers failed: was another host lost? Its first beat that the watch reads
    afterwards may be the last one of a host killed just before (the watch reads every second), so that alone is
    no sign of life: taken as one, a lost host's job exited 1 (a crash) instead of 3, once on a loaded machine."""
    from launcher.host.peers import PeerWatch

    watch = PeerWatch(0, 2, "127.0.0.1", 1)  # not entered: no store, no threads; the test plays the watch

    def beats() -> None:
        for value in range(7, 12 if alive else 8):  # a dead host's counter changes once more, then never
            time.sleep(0.3)
            watch._seen[1] = (value, time.monotonic())
        time.sleep(0.5)
        watch.lost = watch.lost or "host 1 (node rank 1) stopped answering"  # as the watch says LOST_AFTER_S later

    threading.Thread(target=beats, daemon=True).start()
    assert watch.settle() == (None if alive else "host 1 (node rank 1) stopped answering")
