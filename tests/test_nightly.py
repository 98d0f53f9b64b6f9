"""The nightly job over a source with ids: shards hold ids, so an inserted, deleted or edited row changes no other
shard, a new id is never lost, and each night costs what changed (DESIGN: `dataset.id_column`, `run.stale`)."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import REPO, file_snapshot, launch, read_rows

ROWS = [{"uid": f"p{i:03d}", "prompt": f"a photo of city number {i}"} for i in range(10)]


def write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def shard_files(out, shards) -> dict:
    return {k: v for k, v in file_snapshot(out).items() if any(f"shard-{s:05d}" in k for s in shards)}


def status(out) -> dict:
    res = subprocess.run([sys.executable, str(REPO / "tools" / "status.py"), str(out), "--json"], capture_output=True)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_source_that_changes_every_night_keeps_every_id_once(tiny_model, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    job = [
        f"model.path={tiny_model}", f"dataset.path={src}/*", f"output.dir={out}", "dataset.id_column=uid",
        "run.shard_size=4", "mesh.tp=1", "generate.batch_size=2",
    ]  # fmt: skip
    # Night 1: ten ids in shards of four: shards 0, 1, 2 hold p000-p003, p004-p007, p008-p009.
    write(src / "a.jsonl", ROWS)
    res = launch(*job)
    assert res.returncode == 0, res.stderr[-3000:]
    night1 = shard_files(out, [0, 1, 2])
    # Night 2: a row inserted at the top, p005 deleted, p009's prompt edited. Only shard 2 holds a changed row,
    # and the refusal names its one changed id, once.
    rows = [{"uid": "pNEW", "prompt": "a new prompt"}, *ROWS]
    rows[10] = {"uid": "p009", "prompt": "Osaka at night"}
    del rows[6]  # p005
    write(src / "a.jsonl", rows)
    res = launch(*job)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "shards [2]" in last and "(samples p009)" in last, last
    assert "pNEW" not in last and "p005" not in last and "p007" not in last
    assert shard_files(out, [0, 1, 2]) == night1
    # Night 3: run.stale=keep keeps shard 2 as it is, and still generates the new id, in a new shard (3).
    res = launch(*job, "run.stale=keep")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "p005" in res.stderr and "left the prompt source" in res.stderr
    kept = {k: v for k, v in night1.items() if "state/" not in k or "00002" not in k}  # its state records the keep
    assert {k: v for k, v in shard_files(out, [0, 1, 2]).items() if k in kept} == kept  # byte for byte
    got = read_rows(out)
    assert sorted(got) == sorted([r["uid"] for r in ROWS] + ["pNEW"])  # p005 left the source; its sample stays
    assert got["pNEW"]["prompt"] == "a new prompt" and got["p009"]["prompt"] == ROWS[9]["prompt"]
    info = status(out)
    assert info["shards"] == {"0": "done", "1": "done", "2": "kept-stale", "3": "done"}, info
    assert info["kept_stale"] == 1 and info["kept_ids"] == ["p009"], info
    assert "1 done shards are kept-stale (samples p009)" in (out / "README.md").read_text()
    # Night 4: the same command without run.stale=keep finds nothing to do; a new Parquet file's ids go to a new
    # shard, and nothing else is read again or written again.
    res = launch(*job)
    assert res.returncode == 0 and "nothing to do" in res.stderr, res.stderr[-3000:]
    before = file_snapshot(out)
    more = [{"uid": f"q{i}", "prompt": f"a drawing of a boat {i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(more), src / "b.parquet")
    res = launch(*job)
    assert res.returncode == 0, res.stderr[-3000:]
    after = file_snapshot(out)
    assert {k: v for k, v in after.items() if "shard-00004" not in k and "/" in k and k.split("/")[0] in (
        "data", "images", "state")} == {k: v for k, v in before.items() if "/" in k and k.split("/")[0] in (
        "data", "images", "state")}  # fmt: skip
    got = read_rows(out)
    source_ids = [r["uid"] for r in rows] + [r["uid"] for r in more]
    assert sorted(got) == sorted({*source_ids, "p005"})  # every id present exactly once (read_rows keys are ids)
    assert sum(pq.read_table(f).num_rows for f in (out / "data").glob("*.parquet")) == len(got)


def test_a_rows_hash_is_the_same_in_any_batch():
    """The id map compares a row's hash from one night with the next: it must not depend on the other rows of its
    batch (their widths, their nulls, a column that only they set)."""
    from launcher.ledger.rowhash import row_hashes

    long = "x" * 300  # past the bytes hashed word by word
    rows = [
        {"id": "a", "prompt": "short", "seed": None},
        {"id": "b", "prompt": "a much longer prompt than the others " * 3, "seed": 7},
        {"id": "c", "prompt": long, "seed": None},
        {"id": "d", "prompt": "", "seed": None},
    ]
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64())])
    whole = row_hashes(pa.RecordBatch.from_pylist(rows, schema=schema))
    for k, r in enumerate(rows):
        alone = row_hashes(pa.RecordBatch.from_pylist([r], schema=schema))
        assert alone[0] == whole[k], r["id"]
    assert len(set(whole.tolist())) == len(rows)
    edited = row_hashes(pa.RecordBatch.from_pylist([{**rows[2], "prompt": long + "y"}], schema=schema))
    assert edited[0] != whole[2]  # a change past the first 256 bytes is a change
    seeded = row_hashes(pa.RecordBatch.from_pylist([{**rows[0], "seed": 0}], schema=schema))
    assert seeded[0] != whole[0]  # a seed of 0 is not no seed


def test_duplicate_hashes_are_found_across_buckets_with_the_run_sorted(tmp_path):
    import numpy as np

    from launcher.ledger.idruns import Spill, open_runs, seen

    rng = np.random.default_rng(1)
    values = rng.integers(0, 2**63, 50_000, dtype=np.uint64) * np.uint64(2)  # 16 buckets by the top bits
    twice = values[[3, 30_000, 49_999]]
    spill = Spill(tmp_path / "spill")
    for part in np.array_split(np.concatenate([values, twice]), 7):
        spill.add(part)
    doubles = spill.finish(tmp_path / "run.u64")
    assert sorted(doubles.tolist()) == sorted(twice.tolist())
    (run,) = open_runs([tmp_path / "run.u64"])
    assert run.tolist() == sorted(set(values.tolist()))  # sorted, each hash once
    assert seen([run], np.array([values[5], values[5] + np.uint64(1)], np.uint64)).tolist() == [True, False]
