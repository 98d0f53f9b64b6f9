"""The control plane's pieces at small scale: the two prompt readers agree, and the ledger's index saves reads."""

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
