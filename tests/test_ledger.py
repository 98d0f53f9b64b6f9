"""The control plane's pieces at small scale: the two prompt readers agree, and the ledger's index saves reads."""

import contextlib
import json

import pyarrow as pa
import pytest
from test_formats import ROWS, write_source

from launcher.ledger.states import Ledger, state_rel
from launcher.ledger.store import Store
from launcher.plan.shards import legacy_fingerprint, prompts_fingerprint
from launcher.sources.prompts import SCHEMA, Source, _batches, _exact_rows, source_files
from launcher.sources.prompts_fast import fast_batches


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "parquet", "saved"])
def test_the_fast_reader_gives_the_exact_readers_rows(tmp_path, fmt):
    rows = ROWS if fmt != "txt" else [{"prompt": r["prompt"]} for r in ROWS]
    rows = rows + [{"prompt": f"more {i}, with a comma"} for i in range(5)]
    [f] = source_files(str(write_source(tmp_path, fmt, rows)))
    src = Source(f)
    fast = pa.Table.from_batches(list(fast_batches(f, src, 0)), schema=SCHEMA)
    exact = pa.Table.from_batches(list(_batches(_exact_rows(f, src, 0))), schema=SCHEMA)
    assert fast.to_pylist() == exact.to_pylist() and fast.num_rows == len(rows)
    assert prompts_fingerprint(fast) == prompts_fingerprint(exact)


def test_fingerprints_see_every_field_and_old_ones_still_verify(tmp_path):
    t = pa.Table.from_pylist([{"id": "0", "prompt": "a", "seed": 1}, {"id": "1", "prompt": "b"}], schema=SCHEMA)
    edits = [{"prompt": "a!"}, {"id": "9"}, {"seed": 2}, {"height": 64}, {"negative_prompt": ""}]
    rows = t.to_pylist()
    fps = {prompts_fingerprint(pa.Table.from_pylist([{**rows[0], **e}, rows[1]], schema=SCHEMA)) for e in edits}
    assert len(fps | {prompts_fingerprint(t)}) == len(edits) + 1
    # A state file of an earlier version carries the json-of-rows fingerprint; it must still match.
    import hashlib

    h = hashlib.sha256()
    for r in ({"id": "0", "prompt": "a", "seed": 1}, {"id": "1", "prompt": "b"}):
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    assert legacy_fingerprint(t) == h.hexdigest()[:16]


def test_the_index_saves_a_read_per_unchanged_state(tmp_path):
    store = Store(tmp_path)
    for i in range(5):
        store.write_json(state_rel(i), {"status": "done", "rows": 2, "traceback": "long"})
    first = Ledger(store)
    assert len(first.refresh()) == 5 and first.reads == 5
    assert "traceback" not in first.states[0]  # the index keeps what readers use
    first.save_index()
    again = Ledger(store)
    read = store.read_bytes
    indexes = []
    store.read_bytes = lambda rel: indexes.append(rel) or read(rel)
    assert again.refresh() == first.states and again.reads == 0
    assert again.refresh() == first.states and indexes == ["state/index.json.gz"]  # read once, not at each look
    store.read_bytes = read
    store.write_json(state_rel(3), {"status": "failed", "rows": 2, "error": "boom, a longer one"})
    store.delete(state_rel(4))
    states = Ledger(store).refresh()
    assert states[3]["status"] == "failed" and 4 not in states
    later = Ledger(store)
    later.refresh()
    assert later.reads == 1  # only the state that changed since the index was written


def test_verify_reads_every_done_file_and_names_what_differs_from_its_state(tmp_path):
    """DESIGN, done means verified (`tools/status.py --verify`): each done shard's recorded files are read whole
    and compared with the size and sha256 its state recorded; a state from before files were recorded has its
    Parquet footer compared with the rows and data bytes it recorded. A shard not done is not read, nor one whose
    state says otherwise by now."""
    import hashlib

    import pyarrow.parquet as pq

    from launcher.ledger.verify import hash_damage

    store = Store(str(tmp_path))
    states = {}

    def shard(i: int, state: dict, files: dict[str, bytes], old: bool = False) -> None:
        for name, data in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(data)
        recorded = {n: [len(d), hashlib.sha256(d).hexdigest()] for n, d in files.items()}
        states[i] = {"status": "done", "rows": 3, **({} if old else {"files": recorded}), **state}
        (tmp_path / "state").mkdir(exist_ok=True)
        (tmp_path / state_rel(i)).write_text(json.dumps(states[i]))

    def parquet(i: int, rows: int) -> bytes:
        path = tmp_path / f"p{i}.parquet"
        pq.write_table(pa.table({"id": [str(k) for k in range(rows)]}), path)
        return path.read_bytes()

    image = bytes(range(256)) * 40  # 10 KiB, its last byte flipped below: the whole file is hashed, not its start
    names = {i: (f"data/shard-{i:05d}.parquet", f"images/shard-{i:05d}/a.png") for i in range(10)}
    for i in range(4):
        shard(i, {}, {names[i][0]: parquet(i, 3), names[i][1]: image})
    flipped = bytearray(image)
    flipped[-1] ^= 1  # the last byte: the same size
    (tmp_path / names[1][1]).write_bytes(flipped)
    (tmp_path / names[2][0]).write_bytes(parquet(2, 3)[:-10])
    (tmp_path / names[3][1]).unlink()
    good = parquet(4, 3)
    footer = pq.ParquetFile(tmp_path / "p4.parquet").metadata
    data_bytes = sum(footer.row_group(g).total_byte_size for g in range(footer.num_row_groups))
    shard(4, {"data_bytes": data_bytes}, {names[4][0]: good}, old=True)  # an old state: no "files"
    shard(5, {"data_bytes": data_bytes + 1}, {names[5][0]: good}, old=True)
    shard(6, {"data_bytes": data_bytes, "rows": 2}, {names[6][0]: good}, old=True)
    shard(7, {"data_bytes": data_bytes}, {names[7][0]: good[:-12]}, old=True)  # cut short: no footer
    shard(8, {}, {}, old=True)  # an old state with neither: taken as done
    shard(9, {"status": "failed"}, {})  # not done: its files are not read
    (tmp_path / names[9][0]).parent.mkdir(exist_ok=True)
    states[9]["files"] = {names[9][0]: [1, "0" * 64]}  # (it has none)
    listed = dict(states)
    now = {"status": "failed", "files": states[0]["files"]}  # changed since it was listed: a failed attempt
    (tmp_path / state_rel(0)).write_text(json.dumps(now))
    (tmp_path / names[0][1]).unlink()
    got = hash_damage(store, listed)
    assert set(got) == {1, 2, 3, 5, 6, 7}, got
    assert (
        got[1]
        == f"{names[1][1]} has another sha256 than its state recorded ({hashlib.sha256(image).hexdigest()[:12]}...)"
    )
    assert got[2] == f"{names[2][0]} has {len(good) - 10} bytes, its state recorded {len(good)}"
    assert got[3] == f"{names[3][1]} is missing"
    assert got[5] == f"{names[5][0]} holds 3 rows in {data_bytes} bytes, its state recorded 3 rows"
    assert got[6] == f"{names[6][0]} holds 3 rows in {data_bytes} bytes, its state recorded 2 rows"
    assert got[7].startswith(f"{names[7][0]} cannot be read (Parquet magic bytes not found")
    assert len(got[7]) == len(f"{names[7][0]} cannot be read ()") + 80, got[7]  # the first 80 characters of why


def test_run_records_are_read_oldest_first_the_newest_readable_one_is_the_latest_and_overwrite_keeps_live_files(
    tmp_path,
):
    """The output folder's run records (runs/<run id>.json, read by tools/report.py and tools/status.py): a record
    that is damaged, empty or not an object is passed over, never a traceback; `run.overwrite` discards earlier
    results (DESIGN) and keeps what belongs to live runs: locks, claims and plans, and what is not ours."""
    from launcher.ledger.runs import discard_outputs, latest_record, read_records, write_record

    store = Store(str(tmp_path))
    assert read_records(store) == [] and latest_record(store) is None
    first = {"run_id": "20261201T010000-a-1", "start": "2026-12-01T01:00:00", "shards": 3}
    second = {"run_id": "20261202T010000-b-2", "start": "2026-12-02T01:00:00", "shards": 4}
    third = {"run_id": "20261202T010000-a-3", "start": "2026-12-02T01:00:00", "shards": 5}  # same start: by run id
    for rec in (second, third, first):
        write_record(store, rec)
    assert json.loads((tmp_path / "runs" / f"{first['run_id']}.json").read_text()) == first
    assert read_records(store) == [first, third, second]
    assert latest_record(store) == second
    for name, data in (("20261203T0-x.json", b'{"run_id": "cut'), ("20261204T0-y.json", b"[1, 2]"),
                       ("20261205T0-z.json", b"{}"), ("20261206T0-w.json", b"\xff\xfe")):  # fmt: skip
        (tmp_path / "runs" / name).write_bytes(data)
    assert read_records(store) == [first, third, second]
    assert latest_record(store) == second  # the newest four are damaged: the newest readable one
    ours = ["state/shard-00000.json", "data/shard-00000.parquet", "images/shard-00000/a.png", "webdataset/0.tar",
            "runs/x.json", "rejected/r.parquet", "sources/m.parquet", "run.json", "README.md", "report.html",
            "contact_sheet.png", "state/index.json.gz", "runs.jsonl"]  # fmt: skip
    live = ["locks/worker-00000.lock", "claims/shard-00001.json", "plans/20261207T0-q.arrow", "notes.txt"]
    for name in ours + live:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    discard_outputs(store)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(live)


def test_a_source_that_cannot_be_read_is_one_line_naming_it_and_what_to_check(monkeypatch):
    """A prompt source the store will not give: one line with the address, the store's first line of why (at most
    300 characters; its kind where it says nothing), and what to check for that kind of address."""
    from launcher.sources.prompts import unreadable

    long = OSError("x" * 400 + "\nsecond line")
    assert unreadable("/data/a.jsonl", long) == (
        f"dataset.path /data/a.jsonl cannot be read ({'x' * 300}); check that it exists and that you may read it"
    )
    assert unreadable("gs://b/a.jsonl", TimeoutError()) == (
        "dataset.path gs://b/a.jsonl cannot be read (TimeoutError); check the address, the network and the "
        "credentials (the AWS_* variables for s3://, gcloud application default credentials for gs://)"
    )
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    assert unreadable("hf://datasets/o/n/p.txt", OSError("  refused  \n")) == (
        "dataset.path hf://datasets/o/n/p.txt cannot be read from the Hub at http://127.0.0.1:9 (refused); check the "
        "network, HF_ENDPOINT, the repo name and revision, and HF_TOKEN (a private or gated repo)"
    )


def test_a_done_state_damaged_since_the_last_look_is_not_done_and_said_once(tmp_path, caplog):
    """DESIGN, done means verified: a state file damaged after it was read done makes its shard not done at the
    next look, said in one warning naming the file and why (not one per look), and a state written again is done."""
    import logging
    import os

    store = Store(str(tmp_path))
    (tmp_path / "state").mkdir()
    path = tmp_path / state_rel(4)
    path.write_text(json.dumps({"status": "done", "rows": 2}))
    ledger = Ledger(store)
    assert ledger.refresh()[4]["status"] == "done"
    path.write_text('{"status": "done", "rows": ')  # cut short
    os.utime(path, ns=(1, 1))  # another size and time: a look reads it again
    with caplog.at_level(logging.WARNING):
        assert 4 not in ledger.refresh()
        os.utime(path, ns=(2, 2))  # touched, as damaged as it was: read again, not said again
        assert 4 not in ledger.refresh() and ledger.reads == 3
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{store.url(state_rel(4))} is damaged (not JSON (")
    assert said[0].endswith("); shard 4 counts as not done: a run generates it again") and 4 in ledger.damaged
    path.write_text(json.dumps({"status": "done", "rows": 3}))
    assert ledger.refresh()[4]["rows"] == 3 and 4 not in ledger.damaged


def test_the_store_clock_is_the_time_a_probe_file_gets_there_not_this_hosts(tmp_path, monkeypatch):
    """DESIGN, liveness by the store's clock: `Store.now` is the modification time that a file written now gets
    in the output folder (this host's clock may be off: here by an hour), and leaves no probe file behind; only
    where the probe vanished at once is this host's clock all it has."""
    import time

    store = Store(str(tmp_path))
    (tmp_path / "locks").mkdir()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    before = real()
    got = store.now()
    assert before - 1 <= got <= real() + 1 and list((tmp_path / "locks").iterdir()) == []
    monkeypatch.setattr(Store, "mtime", lambda self, rel: None)  # removed under us
    assert store.now() >= before + 3600


def test_the_exact_reader_names_a_missing_column_a_damaged_file_and_each_malformed_csv_line(tmp_path):
    """launcher/sources/prompts_raw.py, the reader that names each row's place: a Parquet file or saved dataset
    without the column it was asked for names the column and its role; a file pyarrow cannot read is named as
    such; a CSV's malformed header, a file with no header and a malformed record are each one line."""
    import datasets
    import pyarrow.parquet as pq

    from launcher.errors import ConfigError
    from launcher.sources.prompts_raw import csv_header, raw_rows

    def refusal(f, col="prompt", role="prompt") -> str:
        with pytest.raises(ConfigError) as e:
            list(raw_rows(str(f), col, None, role=role))
        return str(e.value)

    pq.write_table(pa.table({"text": ["a"], "n": [1]}), tmp_path / "p.parquet")
    datasets.Dataset.from_list([{"text": "a"}]).save_to_disk(str(tmp_path / "saved"))
    for f, names in ((tmp_path / "p.parquet", "text, n"), (tmp_path / "saved", "text")):
        assert (
            refusal(f) == f"dataset {f} has no prompt column 'prompt' (dataset.prompt_column); columns found: {names}"
        )
        assert refusal(f, "picture", "image") == (
            f"dataset {f} has no image column 'picture' (dataset.image_column); columns found: {names}"
        )
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "p.parquet").read_bytes()[:-9])
    assert refusal(tmp_path / "cut.parquet").startswith(
        f"dataset {tmp_path / 'cut.parquet'}: not a readable Parquet file ("
    )
    (tmp_path / "saved" / "state.json").write_text("{")
    assert refusal(tmp_path / "saved").startswith(f"dataset {tmp_path / 'saved'}: not a readable save_to_disk folder (")
    huge = "x" * 140_000  # past the csv module's field limit (131,072 characters), within a line's bound
    (tmp_path / "h.csv").write_text(f"prompt,{huge}\nx,1\n")
    assert refusal(tmp_path / "h.csv").startswith(f"dataset {tmp_path / 'h.csv'}, line 1: malformed CSV header (")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(ValueError, match="^no CSV header$"):
        csv_header(str(tmp_path / "e.csv"))
    (tmp_path / "rows.csv").write_text("prompt,id\na,1\n")
    assert csv_header(str(tmp_path / "rows.csv")) == ["prompt", "id"]
    (tmp_path / "r.csv").write_text(f"prompt,id\na,1\nb{huge},2\nc,3\n")
    rows = list(raw_rows(str(tmp_path / "r.csv"), "prompt", "id"))
    assert [w for w, _ in rows] == [f"dataset {tmp_path / 'r.csv'}, line {n}" for n in (2, 3, 4)]
    assert rows[0][1] == {"prompt": "a", "id": "1"} and rows[2][1] == {"prompt": "c", "id": "3"}
    assert rows[1][1].reason == "malformed CSV (field larger than field limit (131072)); fix that line"


def test_the_index_keeps_each_file_size_and_an_image_folder_as_its_count_and_bytes():
    """launcher/ledger/verify.py index_form: what the ledger's index keeps of a state's files: each file's size (not
    its hash), and a shard's image folder as one entry of [files, bytes]; a folder entry is kept as it is."""
    from launcher.ledger.verify import index_form

    files = {
        "data/shard-00001.parquet": [1000, "sha-a"],
        "images/shard-00001/a.png": [30, "sha-b"],
        "images/shard-00001/b.png": [12, "sha-c"],
        "images/shard-00002/": [4, 100],
        "webdataset/shard-00001.tar": [777, "sha-d"],
    }
    assert index_form(files) == {
        "data/shard-00001.parquet": [1000],
        "images/shard-00001/": [2, 42],
        "images/shard-00002/": [4, 100],
        "webdataset/shard-00001.tar": [777],
    }


def test_credentials_are_masked_in_every_address_and_wherever_an_endpoints_user_name_appears(monkeypatch):
    """docs/operations.md: a refusal shows `s3://***@bucket/run`; the user information of an address in the
    environment (an S3 endpoint) is masked wherever it appears, from 3 characters (shorter ones are words)."""
    from launcher.errors import ConfigError
    from launcher.ledger.addresses import check_address, masked

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://alice:pw@minio.local:9000")
    assert masked("s3://KEY:SECRET@bucket/run") == "s3://***@bucket/run"
    assert masked("cannot resolve alice on minio.local; pw stays") == "cannot resolve *** on minio.local; pw stays"
    with pytest.raises(ConfigError) as e:
        check_address("s3://KEY:SECRET@bucket/run", "output.dir")
    assert str(e.value).startswith("output.dir=s3://***@bucket/run carries credentials in its address; remove them")
    with pytest.raises(ConfigError) as e:
        check_address("s3://KEY:SECRET@bucket/run")
    assert str(e.value).startswith("s3://***@bucket/run carries credentials in its address; remove them")


class _Bucket(Store):
    """A folder on disk taken the way an object store is (one PUT a write, a conditional create, no flock, no
    temporary names): the object-store paths of the ledger without a server."""

    def __init__(self, folder, *made: str):
        super().__init__(folder)
        self.is_local = False
        for name in ("locks", *made):
            (self.local_root / name).mkdir(parents=True, exist_ok=True)

    @property
    def local_root(self):
        from pathlib import Path

        return Path(self.root)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        try:
            with open(self.local_root / rel, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True


def test_an_endpoints_three_character_user_name_is_masked_and_the_environment_is_checked_first(monkeypatch):
    """addresses.py: an endpoint's user information is masked from 3 characters on (`bob`, as `alice`); and the
    environment's endpoints are checked before any key of the config, so the refusal names the endpoint whatever
    the config holds."""
    from omegaconf import OmegaConf

    from launcher.errors import ConfigError
    from launcher.ledger.addresses import check_config, masked

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://bob:pwd@minio.local:9000")
    assert masked("cannot resolve bob; pwd unknown; bo stays") == "cannot resolve ***; *** unknown; bo stays"
    cfg = OmegaConf.create({"name": "s3://KEY:SECRET@bucket/run", "model": {"path": "m"}})
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value).startswith("AWS_ENDPOINT_URL=http://***@minio.local:9000 carries credentials in its address")


def test_a_claim_past_generation_9999_is_read_by_its_whole_number(tmp_path):
    """claims.py: a claim's generation is the number in its name, g<N>.json, five digits and more: a live run's
    g10000 holds the shard (it is not g0000), and a dead run's g10000 is followed by g10001."""
    from launcher.ledger.claims import Claims
    from launcher.ledger.lock import RunLock

    store = Store(tmp_path)
    live = RunLock(store, 0, "live")
    live.acquire()
    try:
        store.write_bytes("claims/shard-00000/g10000.json", b'{"worker": 0, "run_id": "live"}')
        store.write_bytes("claims/shard-00001/g10000.json", b'{"worker": 5, "run_id": "dead"}')
        other = Claims(store, 1, "other")
        assert other.try_claim(0) is False and other.skipped == {0}
        assert other.try_claim(1) is True and other.held == {1: 10001}
        assert (tmp_path / "claims" / "shard-00001" / "g10001.json").exists()
    finally:
        live.release()


def test_releasing_a_claim_on_a_full_output_is_quiet_and_any_other_error_is_raised(tmp_path):
    """claims.py release: a claim that cannot be deleted because the output takes no more writes is left (the next
    claimer creates the next generation); any other error is raised."""
    import errno

    from launcher.ledger.claims import Claims

    class Full(Store):
        def delete(self, rel):
            raise OSError(errno.ENOSPC, "No space left on device")

    class Broken(Store):
        def delete(self, rel):
            raise OSError(errno.EIO, "I/O error")

    full = Claims(Full(tmp_path), 0, "r")
    assert full.try_claim(2)
    full.release(2)
    assert full.held == {} and (tmp_path / "claims" / "shard-00002" / "g00000.json").exists()
    broken = Claims(Broken(tmp_path), 0, "r2")
    assert broken.try_claim(3)
    with pytest.raises(OSError, match="I/O error"):
        broken.release(3)


def test_asking_whether_a_process_lives_sends_it_nothing_and_one_of_another_user_lives(monkeypatch):
    """liveness.py pid_alive: signal 0 only (a SIGHUP would end the process asked about: a live run on this host);
    a process we may not signal (another user's) is alive."""
    import errno
    import os
    import subprocess

    from launcher.ledger.liveness import pid_alive

    sent, real_kill = [], os.kill

    def kill(pid, sig):  # what is sent, then sent: the process asked about lives on after a signal 0
        sent.append(sig)
        real_kill(pid, sig)

    p = subprocess.Popen(["sleep", "30"])
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "kill", kill)
            assert pid_alive(p.pid)
        assert sent == [0] and p.poll() is None  # still running
    finally:
        p.kill()
        p.wait()
    assert not pid_alive(p.pid)

    def refused(pid, sig):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)
    assert pid_alive(p.pid)


def test_a_lock_file_a_killed_run_left_is_dead_and_a_held_one_alive(tmp_path):
    """lock.py on disk: whether a run lives is whether its flock is held, whatever its record says (a kill -9
    leaves the record behind)."""
    from launcher.ledger.lock import RunLock, look

    store = Store(tmp_path)
    (tmp_path / "locks").mkdir()
    left = {"host": "h", "pid": 1, "run_id": "killed", "started": "2026-12-01T00:00:00+0000", "beat": 3}
    (tmp_path / "locks" / "worker-00000.lock").write_text(json.dumps(left))
    assert look(store, 0) == (left, False)
    with RunLock(store, 0, "live"):
        record, alive = look(store, 0)
        assert record["run_id"] == "live" and alive


def test_a_disk_lock_waits_out_a_probe_refuses_a_live_holder_at_once_and_is_an_ordinary_file(tmp_path, monkeypatch):
    """lock.py on disk: another launcher's liveness probe holds the flock for an instant, which a starting run
    waits out; a live holder is refused within half a second (5 tries 0.1 s apart: 4 waits); the lock file is
    rw-r--r-- as the folder's other files (umask 022), executable by none. The probe lets go during the starting
    run's first wait (an event, not a timer racing the retries)."""
    import fcntl
    import os
    import time

    from launcher.errors import LockHeld
    from launcher.ledger import lock as lock_mod
    from launcher.ledger.lock import RunLock

    store = Store(tmp_path)
    (tmp_path / "locks").mkdir()
    probe = os.open(tmp_path / "locks" / "worker-00000.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    waits: list[float] = []
    probing = [probe]

    class Clock:  # lock.py's time, its waits recorded (not slept): the first one ends the probe
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            while probing:
                os.close(probing.pop())
            waits.append(seconds)

    monkeypatch.setattr(lock_mod, "time", Clock())
    first = RunLock(store, 0, "first")
    first.acquire()
    try:
        assert waits == [0.1]  # the probe was waited out
        waits.clear()
        with pytest.raises(LockHeld, match="another run is active"):
            RunLock(store, 0, "second").acquire()
        assert waits == [0.1] * 4
        umask = os.umask(0o022)
        try:
            with RunLock(store, 1, "third"):
                assert (tmp_path / "locks" / "worker-00001.lock").stat().st_mode & 0o777 == 0o644
        finally:
            os.umask(umask)
    finally:
        first.release()


def test_an_object_store_lock_says_why_it_cannot_be_taken_and_who_won_a_takeover(tmp_path, monkeypatch):
    """lock.py on an object store: a store that refuses writes is named with the first 200 characters of its
    error's first line; of two launchers taking a dead run's lock over, the loser names the winner's host, pid and
    start; a store that does not answer is a lock not held."""
    import errno
    import subprocess

    from launcher.errors import LockHeld, OutputRefused
    from launcher.ledger import lock as lock_mod
    from launcher.ledger.liveness import PID_SPACE

    class Refusing(_Bucket):
        def create_exclusive(self, rel, data):
            raise OSError(errno.EACCES, "AccessDenied " + "x" * 300 + "\nsecond line")

    with pytest.raises(OutputRefused) as e:
        lock_mod.RunLock(Refusing(tmp_path / "a"), 0, "r").acquire()
    why = f"[Errno {errno.EACCES}] AccessDenied " + "x" * 300
    assert str(e.value).startswith(f"{tmp_path / 'a'} refuses writes ({why[:200]}): its lock cannot be taken")

    store = _Bucket(tmp_path / "b")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid of this machine that runs no more: its holder is dead at once
    dead = {"host": "h", "pid": gone.pid, "pid_space": PID_SPACE, "run_id": "dead", "started": "s", "beat": 1}
    store.write_bytes("locks/worker-00000.json", json.dumps(dead).encode())
    winner = {"host": "winner-host", "pid": 4242, "run_id": "winner", "started": "2026-12-05T01:02:03+0000"}
    monkeypatch.setattr(
        lock_mod.time, "sleep", lambda s: store.write_bytes("locks/worker-00000.json", json.dumps(winner).encode())
    )
    with pytest.raises(LockHeld) as e:
        lock_mod.RunLock(store, 0, "loser").acquire()
    assert "host winner-host, pid 4242, started 2026-12-05T01:02:03+0000" in str(e.value)

    class Silent(_Bucket):
        def read_bytes(self, rel):
            raise OSError(errno.ETIMEDOUT, "timed out")

    assert lock_mod.RunLock(Silent(tmp_path / "c"), 0, "r").held() is False


def test_releasing_an_object_store_lock_waits_for_a_beat_under_way_but_not_for_a_hung_one(tmp_path, monkeypatch):
    """lock.py release: a heartbeat write under way would put the lock back after release removed it (the next run
    would wait STALE_S for it), so release waits for it, up to two beats; a beat that hangs is not waited for
    past that. Events, not sleeps: the beat's write is held until release starts waiting for it. The beat comes
    at once (HEARTBEAT_S 0.05 s); for a beat under way, the beats are made long once it has begun (a wait of
    2 x 30 s, which a slow host never reaches), for a hung one they stay short (0.1 s, then release goes on)."""
    import threading

    from launcher.ledger import lock as lock_mod

    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 0.05)
    entered, gate = threading.Event(), threading.Event()

    class Slow(_Bucket):
        def write_bytes(self, rel, data):
            if rel.startswith("locks/worker-"):
                entered.set()
                gate.wait(60)
            super().write_bytes(rel, data)

    class Waited:  # the heartbeat thread, as release waits for it: the wait asked for is recorded
        def __init__(self, thread, opens: bool):
            self.thread, self.opens, self.timeouts = thread, opens, []

        def join(self, timeout=None):
            self.timeouts.append(timeout)
            if self.opens:
                gate.set()  # the beat's write goes on only once release waits for it
            self.thread.join(timeout)

    store = Slow(tmp_path)
    lock = lock_mod.RunLock(store, 0, "r")
    lock.acquire()
    assert entered.wait(30)  # a beat is under way
    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 30)
    beat = lock._beating = Waited(lock._beating, opens=True)
    lock.release()
    gate.set()
    beat.thread.join(30)
    assert not beat.thread.is_alive()
    assert store.read_bytes("locks/worker-00000.json") is None  # the beat's write came before the removal
    assert beat.timeouts == [60]  # two beats

    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 0.05)
    entered.clear(), gate.clear()
    hung = lock_mod.RunLock(store, 1, "h")
    hung.acquire()
    try:
        assert entered.wait(30)
        beat = hung._beating = Waited(hung._beating, opens=False)
        ending = threading.Thread(target=hung.release, daemon=True)
        ending.start()
        ending.join(30)
        assert not ending.is_alive() and beat.timeouts == [0.1]  # two beats, not the hung write's 60 s
    finally:
        gate.set()
        hung._stop.set()
        beat.thread.join(30)  # the hung write ends with the test, as does its thread
    assert not beat.thread.is_alive()


def test_an_object_store_address_is_the_folder_written_options_and_all(monkeypatch):
    """store.py and gcs.py: the folder a gs:// or s3:// address names is the one written and the one printed, to its
    last character (`night-X`, a trailing space); an address with options (`?...`) goes to pyarrow's parser, which
    reads them, and keeps its scheme when an option is itself a URL; opening one is remembered (launch.py forks
    nothing from a process with an object store's client). No request is made: clients connect on first use."""
    from launcher.ledger import store as store_mod
    from launcher.ledger.gcs import gcs_emulator

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://GCS-X/")
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    assert gcs_emulator() == "http://GCS-X"
    monkeypatch.setitem(store_mod._OPENED, "remote", False)
    for address, root in (("gs://b/night-X", "b/night-X"), ("gs://b/night-X/", "b/night-X"), ("gs://b/run ", "b/run ")):
        store = Store(address)
        assert (store.root, store.url()) == (root, f"gs://{root}")
    assert store_mod.opened_remote()
    with_options = Store("gs://b/run?retry_limit_seconds=3")
    assert with_options.root == "b/run" and with_options.scheme == "gs"
    assert type(with_options.fs).__name__ == "GcsFileSystem"
    endpoint = Store("s3://b/run?endpoint_override=http://127.0.0.1:9&scheme=http")
    assert (endpoint.root, endpoint.scheme) == ("b/run", "s3")


def test_an_object_store_write_keeps_a_gz_files_bytes_as_given(tmp_path):
    """store.py: an object is written as the bytes given: the ledger's index (state/index.json.gz) is gzip already,
    and pyarrow would compress a `.gz` name again by default (its readers would then find it damaged)."""
    import gzip

    store = _Bucket(tmp_path, "state")
    data = gzip.compress(b'{"version": 1, "states": {}}')
    store.write_bytes("state/index.json.gz", data)
    assert (tmp_path / "state" / "index.json.gz").read_bytes() == data and store.read_bytes(
        "state/index.json.gz"
    ) == data


def test_the_index_is_read_for_a_ledger_of_more_than_64_shards(tmp_path):
    """states.py: the index may inflate to 1 MiB plus 16 KiB per listed state file: a folder of 70 shards (past
    1 MiB / 16 KiB) is answered from its index, with no state file read."""
    store = Store(tmp_path)
    for i in range(70):
        store.write_json(state_rel(i), {"status": "done", "rows": 2})
    first = Ledger(store)
    first.refresh()
    first.save_index()
    again = Ledger(store)
    assert len(again.refresh()) == 70 and again.reads == 0


def test_a_failed_state_that_counted_no_attempts_is_retried_and_a_damaged_ones_reason_is_cut():
    """states.py: a failed state from before attempts were counted has made none as far as run.max_attempts is
    concerned (run.shards=pending retries it even at max_attempts=1); what makes a file damaged (said by
    tools/status.py and the report) quotes at most 80 characters of the JSON error, 60 of a file name and 40 of its
    entry."""
    from launcher.ledger.states import exhausted, parse_state

    assert exhausted(
        {3: {"status": "failed"}, 4: {"status": "failed", "attempts": 1}}, {3: "failed", 4: "failed"}, 1
    ) == [4]
    cut = ("\n" * 100_000 + "{x").encode()  # json's message names line 100001: longer than 80 characters
    with pytest.raises(ValueError) as e:
        json.loads(cut)
    assert len(str(e.value)) > 80
    assert parse_state(cut) == (None, f"not JSON ({str(e.value)[:80]})")
    name = "data/" + "n" * 70
    state = {"status": "done", "files": {name: [1, "s" * 50, 3]}}
    assert parse_state(json.dumps(state).encode()) == (None, f"'files' holds 'data/{'n' * 55}': [1, '{'s' * 35}")


def test_leftovers_that_cannot_be_judged_are_passed_over_and_the_rest_of_their_folder_cleaned(tmp_path):
    """states.py clean_tmp: another host's leftover is judged by the store's clock; where that look fails for one
    (its writer just committed it, or the probe write failed), the folder's other leftovers are still judged."""
    import os

    from launcher.ledger.states import clean_tmp

    failed = []

    class Flaky(Store):
        def now(self):
            if not failed:
                failed.append(1)
                raise OSError("the probe write failed")
            return super().now()

    store = Flaky(tmp_path)
    (tmp_path / "data").mkdir()
    for i in (1, 2):
        p = tmp_path / "data" / f".shard-0000{i}.parquet.tmp-another-host-12"
        p.write_bytes(b"x")
        os.utime(p, (0, 0))  # long unchanged
    clean_tmp(store)
    assert failed and len(list((tmp_path / "data").iterdir())) == 1


def test_a_write_makes_its_whole_folder_path_again_on_its_last_try(tmp_path, monkeypatch):
    """store.py: a write whose folder another process removes, whole (claims/ goes once a run is finished), 4 times
    in a row, makes the folder and the ones above it on its 5th and last try."""
    import builtins
    import shutil

    from launcher.ledger import store as store_mod

    store, refused = Store(tmp_path), []

    def racing_open(path, mode):
        if len(refused) < 4 and mode == "wb":
            refused.append(path)
            shutil.rmtree(tmp_path / "claims")  # the remover takes the folder and its parent
            raise FileNotFoundError(path)
        return builtins.open(path, mode)

    monkeypatch.setattr(store_mod, "open", racing_open, raising=False)
    store.write_bytes("claims/shard-00003/g00001.json", b"{}")
    assert (tmp_path / "claims" / "shard-00003" / "g00001.json").read_bytes() == b"{}" and len(refused) == 4


def test_run_records_are_the_json_files_of_runs_ordered_by_start_then_run_id(tmp_path):
    """runs.py: a record is runs/<run id>.json (a stray file of another name, a JSON object though it be, is no
    run's); records are ordered by start, then run id, where a record that says neither sorts first (one run id may
    be the start of another: two hosts named gpu and gpu-12, started in one second)."""
    from launcher.ledger.runs import latest_record, read_records, write_record

    store = Store(tmp_path)
    a = {"run_id": "20261202T010000-gpu-12", "start": "2026-12-02T01:00:00"}
    b = {"run_id": "20261202T010000-gpu-12-5", "start": "2026-12-02T01:00:00"}
    c = {"run_id": "20261203T010000-gpu-7", "start": "2026-12-03T01:00:00"}
    for rec in (c, b, a):
        write_record(store, rec)
    no_start = {"run_id": "20261201T000000-old-1", "shards": 1}  # a record from a writer that kept no start
    no_id = {"start": "2026-12-02T01:00:00", "shards": 2}
    (tmp_path / "runs" / "20261130T0-old-1.json").write_text(json.dumps(no_start))
    (tmp_path / "runs" / "20261202T0-noid.json").write_text(json.dumps(no_id))
    (tmp_path / "runs" / "zz-notes.txt").write_text(json.dumps({"run_id": "zz", "start": "2099-01-01T00:00:00"}))
    assert read_records(store) == [no_start, no_id, a, b, c]
    assert latest_record(store) == c


def test_a_folder_with_a_file_only_in_a_subfolder_is_not_empty_and_a_run_json_that_is_not_json_is_named(tmp_path):
    """runs.py: output.dir must be empty or meshgen's: a file anywhere below a folder makes it not empty (an empty
    folder alone does not); a run.json that is not JSON is refused naming the first 80 characters of why."""
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_ours

    (tmp_path / "a" / "empty").mkdir(parents=True)
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "notes.txt").write_text("x")
    store = Store(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_ours(store)
    assert str(e.value) == (
        f"output.dir {tmp_path} is not empty and is not a meshgen folder (no run.json; it holds b); "
        "choose an empty or new folder"
    )
    bad = ("\n" * 100_000 + "{x").encode()
    with pytest.raises(ValueError) as why:
        json.loads(bad)
    (tmp_path / "run.json").write_bytes(bad)
    with pytest.raises(ConfigError) as e:
        check_ours(store)
    assert str(e.value).startswith(
        f"output.dir {tmp_path} holds a run.json that meshgen did not write (not JSON: {str(why.value)[:80]}); "
    )


def test_the_versions_recorded_name_torch_tpu_where_it_is_installed(monkeypatch):
    """runs.py versions (run.json, each run's record, the dataset card, the hosts' agreement): the TPU extra's
    package (pyproject: torch-tpu) is named where it is installed, as a TPU host's are."""
    import importlib.metadata

    from launcher.ledger.runs import versions

    monkeypatch.setattr(importlib.metadata, "version", lambda name: f"v-{name}")
    assert versions() == {n: f"v-{n}" for n in ("meshgen", "torch", "diffusers", "transformers", "torch_tpu")}


def test_verify_takes_an_old_state_without_rows_and_a_file_recorded_without_its_hash_by_size(tmp_path):
    """verify.py (tools/status.py --verify): a state from before rows were recorded has its Parquet footer compared
    with its data bytes only; a file recorded with its size alone is checked for its size."""
    import pyarrow.parquet as pq

    from launcher.ledger.verify import hash_damage

    store = Store(tmp_path)
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"]}), tmp_path / "data" / "shard-00000.parquet")
    footer = pq.ParquetFile(tmp_path / "data" / "shard-00000.parquet").metadata
    data_bytes = sum(footer.row_group(g).total_byte_size for g in range(footer.num_row_groups))
    store.write_json(state_rel(0), {"status": "done", "data_bytes": data_bytes})
    (tmp_path / "data" / "x.bin").write_bytes(b"12345")
    store.write_json(state_rel(1), {"status": "done", "rows": 1, "files": {"data/x.bin": [5]}})
    assert hash_damage(store, {0: {"status": "done"}, 1: {"status": "done"}}) == {}


def test_a_conditional_create_on_s3_is_bounded_in_connecting_answering_and_tries(monkeypatch):
    """store.py boto_bounds: boto3's conditional create (claims and locks on S3) waits at most S3_TIMEOUT_S to
    connect and twice that for an answer, 2 tries (boto3's own defaults: 60 s, 60 s, 5 tries), as the client
    botocore builds reads them; an endpoint that never answers, or never completes a connection, is an error
    after 2 connections, not a wait for ever; two conditional writes of one key at once (S3's 409
    ConditionalRequestConflict) is a create lost, as an existing key's 412 is. Counted, not timed: a slow host
    stretches every wait."""
    import socket
    import threading
    import time

    import boto3
    from botocore.exceptions import ClientError

    from launcher.ledger import store as store_mod

    monkeypatch.setattr(store_mod, "S3_TIMEOUT_S", 0.25)
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    made, real_client = [], boto3.client
    monkeypatch.setattr(boto3, "client", lambda *a, **kw: made.append(real_client(*a, **kw)) or made[-1])

    def create(server: socket.socket) -> tuple[BaseException | None, int]:
        """The create against `server`'s port: what it raised, and how many connections it made (each accepted
        here while it runs; those still queued once it returned are counted after)."""
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        raised, conns = [], []
        worker = threading.Thread(
            target=lambda: _raised(lambda: store_mod._s3_create_exclusive("b", "lock", b"{}"), raised), daemon=True
        )
        worker.start()
        deadline = time.monotonic() + 60
        server.settimeout(0.05)
        try:
            while worker.is_alive():
                assert time.monotonic() < deadline, "the create still waits after 60 s"
                with contextlib.suppress(TimeoutError):
                    conns.append(server.accept()[0])
            server.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    conns.append(server.accept()[0])
        finally:
            for conn in conns:
                conn.close()
        worker.join()
        return (raised[0] if raised else None), len(conns)

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    with silent:
        error, tries = create(silent)
    assert isinstance(error, OSError) and tries == 2, (error, tries)
    config = made[-1].meta.config
    assert (config.connect_timeout, config.read_timeout) == (0.25, 0.5)
    assert config.retries["total_max_attempts"] == 2
    full = socket.socket()  # a listener whose queue is full: a connection is never completed
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    queued = [socket.socket() for _ in range(3)]
    for q in queued:
        q.setblocking(False)
        q.connect_ex(full.getsockname())
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{full.getsockname()[1]}")
        raised = []
        worker = threading.Thread(
            target=lambda: _raised(lambda: store_mod._s3_create_exclusive("b", "lock", b"{}"), raised), daemon=True
        )
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the create still waits on a connection never completed after 60 s"
        assert isinstance(raised[0], OSError), raised
    finally:
        for q in [*queued, full]:
            q.close()

    class Client:
        def __init__(self, code):
            self.code = code

        def put_object(self, **kw):
            raise ClientError({"Error": {"Code": self.code, "Message": "m"}}, "PutObject")

    monkeypatch.setattr(boto3, "client", lambda *a, **kw: Client("ConditionalRequestConflict"))
    assert store_mod._s3_create_exclusive("b", "k", b"") is False
    monkeypatch.setattr(boto3, "client", lambda *a, **kw: Client("AccessDenied"))
    with pytest.raises(ClientError):
        store_mod._s3_create_exclusive("b", "k", b"")


def _raised(fn, into: list) -> None:
    try:
        fn()
    except Exception as e:  # what the client says
        into.append(e)
