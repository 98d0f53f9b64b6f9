"""The background writer, in this process: `output.encode_workers` starts that many encoder processes, and
`output.queue_shards` is how many finished shards wait for the writer before generation waits."""

import subprocess
import sys
import threading

import numpy as np
import psutil
from conftest import pixels, read_rows, until

from launcher.config import load_config
from launcher.ledger.store import Store
from launcher.writer.bgwriter import BackgroundWriter, ShardJob


def _job(index: int, n: int = 3) -> ShardJob:
    rng = np.random.default_rng(index)
    samples = [
        {"id": f"{index}-{k}", "prompt": "p", "seed": k, "height": 16, "width": 24}
        | {"pixels": rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)}
        for k in range(n)
    ]
    state = {"status": "done", "rows": n, "seconds": 0.1}
    return ShardJob(index, f"shard-{index:05d}", samples, state, {s["id"]: k for k, s in enumerate(samples)})


def _encoders() -> int:
    """Encoder processes of this process's writer: the writer's own children."""
    writers = psutil.Process().children()
    return sum(len(w.children()) for w in writers if "multiprocessing" in " ".join(w.cmdline()))


def _close(writer: BackgroundWriter) -> bool:
    """writer.close(), or False when it has not returned in 30 s (then this test's writer processes are killed)."""
    closing = threading.Thread(target=writer.close, daemon=True)
    closing.start()
    closing.join(30)
    if closing.is_alive():
        for p in psutil.Process().children(recursive=True):
            p.kill()
        return False
    return True


def test_encode_workers_start_that_many_encoders_and_write_the_same_images(tmp_path):
    out = load_config("tiny").output
    closed = {}
    for workers in (1, 3):
        recorded = threading.Event()
        writer = BackgroundWriter(
            Store(tmp_path / str(workers)), out, workers, on_recorded=lambda i, e=recorded: e.set()
        )
        job = _job(0)
        expected = {s["id"]: s["pixels"].astype(np.int16).tolist() for s in job.samples}
        writer.submit(job)
        assert recorded.wait(120)
        assert _encoders() == (workers if workers > 1 else 0)  # one encoder is the writer process itself
        rows = read_rows(tmp_path / str(workers))
        assert {k: pixels(r["image"]["bytes"]).tolist() for k, r in rows.items()} == expected
        closed[workers] = _close(writer)
    # Found by this test: with a nested encoder pool the writer process's exit deadlocked, so close() never
    # returned and every run with output.encode_workers > 1 (the default on hosts with 4+ cores) hung at its end.
    assert closed == {1: True, 3: True}


def test_the_encoders_die_with_a_writer_process_killed(tmp_path, kills_a_process):
    """A writer process killed (out of memory, kill -9) takes its encoders with it: each waits on a queue whose
    write end it holds itself, so one orphaned would wait for ever."""
    recorded = threading.Event()
    writer = BackgroundWriter(Store(tmp_path), load_config("tiny").output, 2, on_recorded=lambda i: recorded.set())
    try:
        writer.submit(_job(0))
        assert recorded.wait(120)
        [proc] = [w for w in psutil.Process().children() if "spawn_main" in " ".join(w.cmdline())]
        until(lambda: len(proc.children()) == 2, timeout_s=120)  # spawned and imported: slow on a loaded host
        encoders = proc.children()
        proc.kill()
        _, alive = psutil.wait_procs(encoders, timeout=30)
        assert not alive, f"encoders outlived their writer process: {[e.pid for e in alive]}"
    finally:
        assert _close(writer)


class _Held(Store):
    """A store whose writer thread stops at its first shard until released."""

    def __init__(self, uri):
        super().__init__(uri)
        self.entered, self.release = threading.Event(), threading.Event()

    def delete(self, rel):
        self.entered.set()
        assert self.release.wait(120)
        super().delete(rel)


def test_queue_shards_finished_shards_wait_then_generation_waits(tmp_path):
    out = load_config("tiny", ["output.queue_shards=2"]).output
    store = _Held(tmp_path)
    writer = BackgroundWriter(store, out, 1, on_recorded=lambda i: None)
    writer.submit(_job(0))
    assert store.entered.wait(120)  # the writer holds shard 0; the queue is empty
    writer.submit(_job(1))
    writer.submit(_job(2))  # two shards wait: no wait yet
    job = _job(3)
    third = threading.Thread(target=writer.submit, args=(job,))
    third.start()
    third.join(3)
    assert third.is_alive()  # a third would exceed output.queue_shards=2: generation waits for the writer
    store.release.set()
    third.join(120)
    writer.close()
    # The wait is in its state, in seconds to the tenth of a millisecond (benchmarks add it to the shard's time).
    wait = job.state["stages"]["writer_wait"]
    assert 3.0 <= wait < 130 and wait == round(wait, 4) and wait % 1, wait
    assert sorted(read_rows(tmp_path)) == sorted(f"{i}-{k}" for i in range(4) for k in range(3))


# A rank that starts its writer and dies at once, before the writer process has run its first line (it spawns and
# imports for a second): a peer's failure makes torch elastic stop the rank exactly there.
DIES_AT_ONCE = """
import os, sys
from launcher.config import load_config
from launcher.ledger.store import Store
from launcher.writer.bgwriter import BackgroundWriter
w = BackgroundWriter(Store(sys.argv[1]), load_config("tiny").output, 1, on_recorded=lambda i: None)
print(*w._process._processes, flush=True)
os._exit(3)
"""


def test_a_writer_whose_rank_died_before_it_started_ends_too(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", DIES_AT_ONCE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    (writer,) = map(int, rank.stdout.readline().split())
    # Found in CI: the orphaned writer named init as the parent to die with, then waited for work for ever while
    # holding the rank's stdout and stderr, so the job's own output never ended (a test timed out after 300 s).
    try:
        rank.communicate(timeout=60)  # its end of file: nobody holds the rank's output any more
        assert rank.returncode == 3
        assert _gone(writer, 60)
    finally:
        if not _gone(writer, 0):
            psutil.Process(writer).kill()


def _gone(pid: int, timeout: float) -> bool:
    try:
        _, alive = psutil.wait_procs([psutil.Process(pid)], timeout=timeout)
        return not alive or alive[0].status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_writer_process_starts_without_pandas_or_hydra(tmp_path):
    """What the writer process imports is what it needs: not pandas (pyarrow would import it at the first Parquet
    write, 0.4 s) and not Hydra (the output settings reach it as plain values, not the config's dataclass)."""
    writer = BackgroundWriter(Store(str(tmp_path)), load_config("tiny").output, 1, on_recorded=lambda i: None)
    writer.submit(_job(0))
    # evaluated in the writer process, after its warm-up and a shard's Parquet write
    loaded = writer._process.submit(eval, "sorted(__import__('sys').modules)").result(timeout=120)
    writer.close()
    assert "pyarrow.parquet" in loaded and "numpy" in loaded
    assert not {"pandas", "hydra", "launcher.config"} & set(loaded)
    assert sorted(read_rows(tmp_path)) == [f"0-{k}" for k in range(3)]
