"""Several workers on one job, on local disk and on object stores (local S3 and GCS servers): shards shared, none
lost or doubled."""

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import LAUNCH, first_rows, first_shards, launch, read_rows, slow_job

from launcher.ledger.store import Store

N = 16  # prompts in shards of 2


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    return slow_job(tiny_model, tmp_path_factory.mktemp("prompts"), N, "mesh.tp=1")


@pytest.fixture(scope="module")
def one_worker(slow_clean) -> Path:
    """One worker's clean run of the first N prompts and more: compare with first_rows and first_shards."""
    return slow_clean(1)


def run_two_workers(
    job,
    out: str,
    env: dict | None = None,
    codes: tuple[int, ...] = (0,),
    each: tuple[tuple[str, ...], ...] = ((), ()),
    started: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Launch workers 0 and 1 of 2 at once (worker i with the overrides each[i]), call `started`, and wait for both;
    each exits with one of `codes`, and one with the last of them. The shards each one generated."""
    import os

    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    procs = [
        subprocess.Popen(
            [LAUNCH, *job, *each[i], f"output.dir={out}", f"workers.index={i}", "workers.count=2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        for i in range(2)
    ]
    try:
        if started:
            started()
        logs = [p.communicate(timeout=300)[1] for p in procs]
    finally:  # a test that failed or timed out leaves no worker running
        for p in procs:
            if p.poll() is None:
                for q in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        q.kill()
                p.communicate()
    got = [p.returncode for p in procs]
    assert set(got) <= set(codes) and codes[-1] in got, f"exit codes {got}\n" + "\n".join(x[-3000:] for x in logs)
    # One line per shard event on the terminal: "shard 3 done: ..." by the worker that generated it.
    return [[int(m) for m in re.findall(r"shard (\d+) done", log)] for log in logs]


def assert_same_layout(store, local: Path) -> None:
    """The same data, image and state files on the object store as in a local run folder (its first N prompts')."""
    want = sorted(
        first_shards(
            {
                str(p.relative_to(local)): p
                for p in local.rglob("*")
                if p.is_file() and p.parts[len(local.parts)] in ("data", "images", "state")
            },
            N,
        )
    )
    got = [f"{d}/{f.base_name}" for d in ("data", "state") for f in store.files(d)]
    shard_dirs = sorted({p.split("/")[1] for p in want if p.startswith("images/")})
    got += [f"images/{d}/{f.base_name}" for d in shard_dirs for f in store.files(f"images/{d}")]
    assert sorted(got) == want


def assert_each_shard_once(done: list[list[int]], expected: list[int]) -> None:
    assert sorted(done[0] + done[1]) == expected, done


def test_two_workers_on_local_disk(job, one_worker, tmp_path):
    done = run_two_workers(job, str(tmp_path / "out"))
    assert_each_shard_once(done, list(range(N // 2)))
    assert done[0] and done[1]
    assert read_rows(tmp_path / "out") == first_rows(one_worker, N)


def test_a_rerun_of_a_few_shards_is_split_between_workers(slow, one_worker, tmp_path):
    """Both workers plan from the same ledger (each holds after reading it until both have): each tries its own
    share of the three pending shards first, and every shard is generated once. Which worker generates which shard
    is a race (a worker that starts late finds its share taken), so that is not asserted."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(one_worker, out)  # and its own job: all SLOW_N prompts
    for i in (0, 2, 4):  # all three belong to worker 0 by the modulo split
        (out / "state" / f"shard-{i:05d}.json").unlink()
    before = set((out / "logs").iterdir())
    holds = [tmp_path / f"hold-{i}" for i in range(2)]

    def release_once_both_read_the_ledger() -> None:
        deadline = time.monotonic() + 120
        while not all(Path(f"{h}.waiting").exists() for h in holds):
            assert time.monotonic() < deadline, "a worker never read the ledger"
            time.sleep(0.05)
        for h in holds:
            h.touch()

    each = tuple((f"testing.hold_after_ledger_read={h}",) for h in holds)
    done = run_two_workers([*slow[0], "mesh.tp=1"], str(out), each=each, started=release_once_both_read_the_ledger)
    assert_each_shard_once(done, [0, 2, 4])
    # Each worker's plan: the same three shards, its own share first (the modulo split of the selection).
    logs = "".join(p.read_text() for d in set((out / "logs").iterdir()) - before for p in d.glob("rank-*.log"))
    assert sorted(re.findall(r"3 shards to generate by 2 workers; dp replica 0 tries (\[.*\]) first", logs)) == [
        "[0, 4]",
        "[2]",
    ], logs[-3000:]
    assert read_rows(out) == read_rows(one_worker)


def test_object_store_two_workers_failure_and_resume(job, one_worker, store_env):
    scheme, s3 = store_env  # s3:// and gs:// alike
    url = f"{scheme}://meshgen-test/run1"
    # Shard 3 fails, the rest are done. The folder's ledger decides each worker's code (tests/test_contract_ledger.py):
    # 3 once shard 3's failed state is written, 0 for a worker that ended while the other still held shard 3. The
    # same command resumes it, all on the object store.
    done = run_two_workers([*job, "testing.fail_shards=[3]"], url, s3, codes=(0, 3))
    assert_each_shard_once(done, [i for i in range(N // 2) if i != 3])
    status = json.loads(subprocess.check_output([sys.executable, "tools/status.py", url, "--json"], text=True))
    assert status["shards"]["3"] == "failed" and status["done"] == N // 2 - 1
    res = launch(*job, f"output.dir={url}", env=s3)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.findall(r"shard (\d+) done", res.stderr) == ["3"]  # one line per shard event
    assert read_rows(url) == first_rows(one_worker, N)
    assert_same_layout(Store(url), one_worker)
    for tool in ("report.py", "contact_sheet.py"):  # the inspection tools read and write the bucket too
        subprocess.run([sys.executable, f"tools/{tool}", url], check=True, capture_output=True)
    assert Store(url).read_bytes("report.html").startswith(b"<!doctype html>")
    assert Store(url).read_bytes("contact_sheet.png").startswith(b"\x89PNG")
    assert b"dtype: image" in Store(url).read_bytes("README.md")
    status = json.loads(subprocess.check_output([sys.executable, "tools/status.py", url, "--json"], text=True))
    assert status["done"] == N // 2
    res = launch(*job, f"output.dir={url}", "generate.seed=9", env=s3)
    assert res.returncode == 2 and "generate.seed: 0 -> 9" in res.stderr.strip().splitlines()[-1]


def test_unreachable_bucket_is_a_clear_error(job, s3, tmp_path):
    res = launch(*job, "output.dir=s3://no-such-bucket/x", env=s3)
    assert res.returncode == 2 and "cannot be reached" in res.stderr.strip().splitlines()[-1]
    assert "Traceback" not in res.stderr


class Flaky:
    """A pyarrow filesystem whose every method fails its first `fails` calls, as S3 does now and then."""

    def __init__(self, fs, fails: int):
        self.fs, self.fails, self.calls = fs, fails, {}

    def __getattr__(self, name):
        real = getattr(self.fs, name)

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.calls[name] <= self.fails:
                raise OSError("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response stream")
            return real(*args, **kwargs)

        return call


def test_object_store_calls_are_tried_again_after_transient_errors(s3, monkeypatch):
    import launcher.ledger.store

    monkeypatch.setattr(launcher.ledger.store, "RETRY_DELAY_S", 0.0)
    store = Store("s3://meshgen-test/flaky")
    real = store.fs
    store.fs = flaky = Flaky(real, 2)
    store.write_json("a/x.json", {"k": 1})
    assert store.read_json("a/x.json") == {"k": 1}
    assert [f.base_name for f in store.files("a")] == ["x.json"]
    store.delete("a/x.json")
    assert flaky.calls == {"open_output_stream": 3, "open_input_stream": 3, "get_file_info": 3, "delete_file": 3}
    assert store.read_json("a/x.json") is None
    assert flaky.calls["open_input_stream"] == 4  # a missing file is an answer, not an error to try again
    store.fs = Flaky(real, launcher.ledger.store.RETRIES)  # failing more often than it is tried: the error is raised
    with pytest.raises(OSError, match="INTERNAL_FAILURE"):
        store.read_bytes("a/x.json")
