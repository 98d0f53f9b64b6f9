"""The nightly job over a source with ids: shards hold ids, so an inserted, deleted or edited row changes no other
shard, a new id is never lost, and each night costs what changed (DESIGN: `dataset.id_column`, `run.stale`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
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
    ids_before = {p: p.read_bytes() for p in (out / "sources").iterdir()}
    res = launch("--dry-run", *job)  # plans the new file, and writes nothing: the id map too stays as it was
    assert res.returncode == 0 and "1 of 5 shards to generate" in res.stdout, res.stdout + res.stderr[-2000:]
    assert {p: p.read_bytes() for p in (out / "sources").iterdir()} == ids_before
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
    from launcher.ids.rowhash import row_hashes

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

    from launcher.ids.idruns import Spill, open_runs, seen

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
    # several runs (an empty one among them): a hash is seen if any run holds it, past the end of one included
    a, b = np.array([10, 20, 30], np.uint64), np.array([5, 25, 40], np.uint64)
    asked = np.array([10, 40, 30, 5, 31, 41, 0, 25], np.uint64)
    want = [True, True, True, True, False, False, False, True]
    for runs in ([np.zeros(0, np.uint64), a, b], [a, np.zeros(0, np.uint64), b], [b, a]):
        assert seen(runs, asked).tolist() == want
    assert seen([], asked).tolist() == [False] * 8


class _Nights:
    """Plans a source with ids as a run does (make_plan, then commit_ids into the output folder), and marks the
    shards it selected done, as a run would; `plan` also returns pass 1's reads of the source: [offset, rows] per
    call of the reader, offset in bytes (`reads` after a refusal); `rows` reads a shard's rows as pass 2 does."""

    def __init__(self, tmp_path, monkeypatch, path, *overrides: str, out: str | None = None):
        from launcher.config import load_config
        from launcher.ledger.store import Store
        from launcher.sources import prompts

        job = [f"dataset.path={path}", "dataset.id_column=uid", "run.shard_size=4", *overrides]
        self.cfg, self.states, self.reads, self.sizes = load_config("tiny", job), {}, [], None
        self.store = Store(out or str(tmp_path / "out"))
        real = prompts.file_batches

        def spy(src, files, start=0, offset=0):
            self.reads.append(read := [offset, 0])
            for f, at, b in real(src, files, start, offset):
                read[1] += b.num_rows
                yield f, at, b

        monkeypatch.setattr(prompts, "file_batches", spy)

    def plan(self):
        from launcher.plan.plan import make_plan
        from launcher.plan.plan_ids import commit_ids

        self.reads = []  # this plan's reads, kept when it refuses
        plan, reads = make_plan(self.cfg, self.states, self.sizes, self.store), self.reads
        self.reads = []
        commit_ids(self.store, plan)
        for s in plan.shards:
            if s.index in plan.selected:
                self.states[s.index] = {"status": "done", "prompts_fingerprint": s.fingerprint, "rows": s.rows}
        return plan, reads

    def rows(self, plan, shard: int) -> list[tuple[str, str]]:
        from launcher.plan.plan import PlanFile, write_plan_file

        self.reads = []  # pass 2's reads
        write_plan_file(self.store, "plans/t.arrow", self.cfg, plan)
        return [(r["id"], r["prompt"]) for r in PlanFile(self.store, "plans/t.arrow").shard(shard).rows]


def append(path, rows) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


MORE = [{"uid": f"q{i}", "prompt": f"a drawing of a boat {i}"} for i in range(4)]


def test_a_jsonl_that_grew_is_read_from_its_old_end(tmp_path, monkeypatch):
    """DESIGN, `dataset.id_column`: a text file that only grew at its end is read from its old end; its new ids go
    to a new shard, and no planned shard changes."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # p000-p009: shards 0, 1, 2 of 4, 4, 2
    nights = _Nights(tmp_path, monkeypatch, src)
    first, read = nights.plan()
    assert read == [[0, 10]]
    old_end = src.stat().st_size
    append(src, MORE[:3])
    second, read = nights.plan()
    assert read == [[old_end, 3]]  # the three new lines, and nothing before them
    assert [(s.index, s.rows, s.status) for s in second.shards] == [
        (0, 4, "done"), (1, 4, "done"), (2, 2, "done"), (3, 3, "pending")]  # fmt: skip
    assert [s.fingerprint for s in second.shards[:3]] == [s.fingerprint for s in first.shards]
    assert second.selected == [3]
    assert nights.rows(second, 3) == [(r["uid"], r["prompt"]) for r in MORE[:3]]
    assert nights.reads == [[old_end, 3]]  # so does pass 2, which gathers the new shard's rows
    # It grows again: read from where the last plan stopped, its row in a shard of its own (shard 3 is planned).
    old_end = src.stat().st_size
    append(src, MORE[3:])
    third, read = nights.plan()
    assert read == [[old_end, 1]]
    assert [(s.rows, s.status) for s in third.shards[3:]] == [(3, "done"), (1, "pending")]
    assert nights.rows(third, 4) == [("q3", MORE[3]["prompt"])]
    assert nights.reads == [[old_end, 1]]


def test_a_source_of_one_row_whose_prompt_changed_is_stale_by_its_id(tmp_path, monkeypatch):
    """The smallest changed file: one row, its prompt edited after it was done. The shard is stale and its id named;
    the same row unchanged in a file that changed otherwise is not."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    write(src, ROWS[:1])
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    write(src, [{**ROWS[0], "prompt": "another"}])
    with pytest.raises(ConfigError, match=r"shards \[0\] are done but their prompts changed since \(samples p000\)"):
        nights.plan()
    write(src, [ROWS[0], ROWS[1]])  # changed by a new row (a new id: a new shard); p000 as it was
    plan, _ = nights.plan()
    assert [(s.index, s.status) for s in plan.shards] == [(0, "done"), (1, "pending")]


def test_an_id_map_on_an_object_store_plans_as_on_disk_and_fetches_its_hash_runs_once(tmp_path, monkeypatch, s3):
    """The id map of an output folder on S3: a rerun plans what the same folder on disk plans (an edit in a done
    shard caught as there), and fetches the map's hash runs once each, into one local folder, removed with the map
    (800 MB a night at 100M prompts)."""
    import gc
    import tempfile

    from launcher.errors import ConfigError
    from launcher.ids import idmap

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fetched = []
    real = idmap.Index._open
    monkeypatch.setattr(idmap.Index, "_open", lambda self, rel: fetched.append(rel) or real(self, rel))
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    on_disk = _Nights(tmp_path, monkeypatch, src)
    remote = _Nights(tmp_path, monkeypatch, src, out=f"s3://meshgen-test/{tmp_path.name}")
    plans = [(on_disk.plan()[0], remote.plan()[0])]
    append(src, MORE)
    plans.append((on_disk.plan()[0], remote.plan()[0]))
    for disk, s3_plan in plans:
        assert [(s.index, s.rows, s.status, s.fingerprint) for s in s3_plan.shards] == [
            (s.index, s.rows, s.status, s.fingerprint) for s in disk.shards
        ]
    assert remote.rows(plans[1][1], 3) == on_disk.rows(plans[1][0], 3) == [(r["uid"], r["prompt"]) for r in MORE]
    index = idmap.load(remote.store, 4)
    fetched.clear()
    paths = index.run_paths()  # the map's hash runs, memory-mapped from local copies
    assert paths and fetched == index.data["runs"] and all(p.parent == paths[0].parent for p in paths)
    assert [p.read_bytes() for p in paths] == [remote.store.read_bytes(rel) for rel in index.data["runs"]]
    assert [p.name for p in paths] == [rel.rsplit("/", 1)[1] for rel in index.data["runs"]]
    fetched.clear()
    assert index.run_paths() == paths and fetched == []  # fetched once a file
    assert paths[0].parent.parent == tmp_path / "tmp"
    del index, plans, disk, s3_plan
    gc.collect()
    assert not any((tmp_path / "tmp").glob("meshgen-idmap-*")), "the fetched id map outlived its plan"
    write(src, [{**ROWS[0], "prompt": "another"}, *ROWS[1:], *MORE])
    with pytest.raises(ConfigError, match=r"shards \[0\] are done but their prompts changed since \(samples p000\)"):
        remote.plan()


def test_pass_2_hands_each_shard_over_once_its_last_row_is_read(tmp_path, monkeypatch):
    """launcher/ids/idpass2.py: a selected shard's rows are handed to the plan file as soon as the batch holding
    its last row was read (a batch is held only until its shard is whole), in the order the maps foretold; a
    shard whose ids all left the source comes first, with no rows."""
    from launcher.plan.plan_ids import id_tables
    from launcher.sources import prompts, prompts_fast

    monkeypatch.setattr(prompts_fast, "_BLOCK", 4 * 54)  # JSON lines of 54 bytes: batches end where shards 0, 1 do
    src = tmp_path / "a.jsonl"
    write(src, [*ROWS, *MORE])  # shards of 4: p000-p003, p004-p007, p008 p009 q0 q1, q2 q3
    nights = _Nights(tmp_path, monkeypatch, src, "run.stale=regenerate")
    plan, _ = nights.plan()
    nights.states.clear()  # nothing done: every shard is selected again
    write(src, [*ROWS, *MORE[:2]])  # q2 and q3 left: shard 3 has no row now
    plan, _ = nights.plan()
    assert plan.selected == [0, 1, 2, 3]
    ends, real = [0], prompts.file_batches  # rows read when each batch was handed over

    def batches(*a):
        for got in real(*a):
            ends.append(ends[-1] + got[2].num_rows)
            yield got

    monkeypatch.setattr(prompts, "file_batches", batches)
    order, shards = id_tables(nights.store, nights.cfg, plan, None)
    seen = [(s, ends[-1], rows.num_rows if rows is not None else None) for s, rows in shards]
    assert order == [3, 0, 1, 2] and len(ends) >= 4  # three batches or more
    last_row = {0: 4, 1: 8, 2: 12}  # rows read up to and with each shard's last one
    assert seen == [(3, 0, None), *[(s, min(e for e in ends if e >= last_row[s]), 4) for s in (0, 1, 2)]], (seen, ends)
    assert {4, 8} <= set(ends), ends  # a batch that ends with a shard is handed over with it


@pytest.mark.parametrize("edit", ["prompt", "id"])
def test_a_source_edited_between_the_two_passes_is_refused(edit, tmp_path, monkeypatch):
    """launcher/ids/idpass2.py: pass 2 gathers the rows pass 1 mapped, and checks them (their ids and row
    hashes): a row edited in between (its prompt, or its id, at the same length) stops the run with one line."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    plan, _ = nights.plan()
    changed = (
        {**ROWS[5], "prompt": ROWS[5]["prompt"].replace("city", "town")}
        if edit == "prompt"
        else {**ROWS[5], "uid": "p999"}
    )
    write(src, [*ROWS[:5], changed, *ROWS[6:]])
    with pytest.raises(ConfigError) as e:
        nights.rows(plan, 1)  # the plan file, whose shard 1 holds that row
    assert str(e.value) == (
        f"the prompt source {src} changed while this run was planned; run the same command again once it is complete"
    )


def test_pass_2_reads_only_the_files_that_hold_a_selected_shards_rows(tmp_path, monkeypatch):
    """A rerun costs what changed: with two files, a failed shard whose rows are all in the second is gathered from
    the second alone (the map says which rows of which file each shard holds)."""
    d = tmp_path / "src"
    d.mkdir()
    write(d / "a.jsonl", ROWS)  # p000-p009: shards 0, 1, 2
    write(d / "b.jsonl", MORE)  # q0-q3: with p008 and p009 shard 2, then shard 3 (q2, q3)
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    first, _ = nights.plan()
    assert [s.rows for s in first.shards] == [4, 4, 4, 2]
    del nights.states[3]  # its run failed
    again, read = nights.plan()
    assert again.selected == [3] and read == []  # no file changed: pass 1 read nothing
    assert nights.rows(again, 3) == [(r["uid"], r["prompt"]) for r in MORE[2:]]
    assert nights.reads == [[0, 4]]  # b.jsonl's rows, and not a.jsonl's ten
    del nights.states[1], nights.states[2]  # shard 2 spans both files
    again, _ = nights.plan()
    assert again.selected == [1, 2] and nights.rows(again, 1) == [(r["uid"], r["prompt"]) for r in ROWS[4:8]]
    assert len(nights.reads) == 2 and nights.reads[0][0] == 0  # now both files, each once


def test_a_file_whose_old_tail_changed_is_read_whole(tmp_path, monkeypatch):
    """An edit before the old end (in the last line or the first, the same length, so the old end is still a line
    end) makes a file that grew a changed one: read whole, and the edit is caught. So is a file that shrank."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    rows = [{"uid": f"p{i:03d}", "prompt": f"a photo of city number {i}"} for i in range(200)]  # 10 kB: its head
    write(src, rows)  # and its tail differ; shards 0-49
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    edited = {"uid": "p199", "prompt": rows[199]["prompt"].replace("city", "town")}
    write(src, [*rows[:199], edited, *MORE[:3]])
    with pytest.raises(ConfigError, match=r"shards \[49\] are done but their prompts changed since \(samples p199\)"):
        nights.plan()
    assert nights.reads == [[0, 203]]
    write(src, rows[:198])  # shrank: p198 and p199 left the source
    plan, read = nights.plan()
    assert read == [[0, 198]] and plan.ids.left == ["p198", "p199"]
    edited = {"uid": "p000", "prompt": rows[0]["prompt"].replace("city", "town")}  # far from the tail: the head
    write(src, [edited, *rows[1:198], MORE[0]])
    with pytest.raises(ConfigError, match=r"shards \[0\] are done but their prompts changed since \(samples p000\)"):
        nights.plan()
    assert nights.reads == [[0, 199]]
    town = [{**r, "prompt": r["prompt"].replace("city", "town")} for r in rows[:6]]  # shards of 4: 0 and 1
    write(src, [*town[:3], rows[3], *town[4:], *rows[6:198]])
    with pytest.raises(ConfigError) as e:
        nights.plan()
    assert str(e.value) == (
        "shards [0, 1] are done but their prompts changed since (samples p000, p001, p002, p004, p005); rerun with "
        "run.stale=regenerate to redo them, or run.stale=keep to keep the old images"
    )
    write(src, [*town[:6], {**rows[6], "prompt": "x"}, *rows[7:198]])
    with pytest.raises(ConfigError, match=r"shards \[0, 1\] .* \(samples p000, p001, p002, p003, p004 and 2 more\);"):
        nights.plan()


def test_a_failed_shard_whose_ids_all_left_the_source_plans_no_row(tmp_path, monkeypatch):
    """DESIGN: with an id column a shard's ids are fixed when it is first planned, and a deleted row changes no
    other shard. Shard 1 (p004-p007) failed, then its four rows left the source: the rerun's plan file holds shard
    1 with no row, and shard 2 keeps its own."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    nights.states[1] = {"status": "failed"}
    write(src, [*ROWS[:4], *ROWS[8:]])
    plan, _ = nights.plan()
    assert plan.selected == [1]
    assert nights.rows(plan, 1) == []


@pytest.mark.parametrize("how", ["a byte-order mark", "no line end at its old end"])
def test_a_grown_file_with_an_unusual_start_or_end_is_read_whole(tmp_path, monkeypatch, how):
    src = tmp_path / "a.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in ROWS)
    src.write_text("\ufeff" + text if how == "a byte-order mark" else text.rstrip("\n"))
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    with open(src, "a") as f:
        f.write(("" if how == "a byte-order mark" else "\n") + json.dumps(MORE[0]) + "\n")
    plan, read = nights.plan()
    assert read == [[0, 11]]
    assert nights.rows(plan, 3) == [("q0", MORE[0]["prompt"])]


@pytest.mark.parametrize("blank", [b"\r\n", b"\r"], ids=["crlf", "a lone cr"])
def test_a_bad_row_in_the_appended_part_is_named_by_its_line(tmp_path, monkeypatch, blank):
    """The old part holds a blank line (a lone CR ends a line too) and CRLF line ends, so lines are not rows: the
    bad row stands on line 14."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    lines = [json.dumps(r).encode() + b"\r\n" + (blank if k == 4 else b"") for k, r in enumerate(ROWS)]
    src.write_bytes(b"".join(lines))  # lines 1-11: ten rows and a blank line
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    old_end = src.stat().st_size
    append(src, [*MORE[:2], {"uid": "q2", "prompt": 5}])  # lines 12, 13, 14
    with pytest.raises(ConfigError, match=rf"^dataset {src}, line 14: the prompt \('prompt'\) is of type int"):
        nights.plan()
    assert nights.reads and {offset for offset, _ in nights.reads} == {old_end}
    # With dataset.bad_rows=skip the row is set aside, named by its line and placed after the old rows (12).
    nights.cfg.dataset.bad_rows = "skip"
    plan, read = nights.plan()
    assert read == [[old_end, 3]]
    assert [(r["line"], r["position"], r["id"]) for r in plan.rejected] == [(14, 12, "q2")]
    assert nights.rows(plan, 3) == [(r["uid"], r["prompt"]) for r in MORE[:2]]


def test_a_csv_that_grew_is_read_from_its_old_end_under_its_header(tmp_path, monkeypatch):
    from launcher.errors import ConfigError
    from launcher.sources import prompts_exact

    src = tmp_path / "a.csv"
    src.write_text('uid,prompt\np0,"a cat, asleep"\np1,a dog\np2,a tree\np3,a sky\np4,a boat\n')  # lines 1-6
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    old_end = src.stat().st_size
    with open(src, "a") as f:
        f.write('p5,"a fox, running"\np6,a hen\np7,a cow\n')  # lines 7-9
    with monkeypatch.context() as m:  # the fast reader reads them, under the file's header (no row-by-row reading)
        m.setattr(prompts_exact, "exact_rows", None)
        plan, read = nights.plan()
    assert read == [[old_end, 3]]
    assert nights.rows(plan, 2) == [("p5", "a fox, running"), ("p6", "a hen"), ("p7", "a cow")]
    with open(src, "a") as f:
        f.write("p8,a pig,3\n")  # line 10
    with pytest.raises(ConfigError, match=rf"^dataset {src}, line 10: expected 2 fields \(uid, prompt\), got 3"):
        nights.plan()


def test_an_appended_id_that_the_old_part_holds_is_a_duplicate(tmp_path, monkeypatch):
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    old_end = src.stat().st_size
    append(src, [{"uid": "p001", "prompt": "a photo of city number 1, again"}])  # line 11
    with pytest.raises(ConfigError, match=rf"^dataset {src}, line 11: duplicate id 'p001' \(first at {src}, line 2\)"):
        nights.plan()
    assert nights.reads == [[old_end, 1]]


def test_a_grown_source_with_kept_columns_is_read_whole(tmp_path, monkeypatch):
    """Kept columns are read from the top of each file, row for row beside its rows: such a file is read whole."""
    src = tmp_path / "a.jsonl"
    write(src, [{**r, "city": f"c{k}"} for k, r in enumerate(ROWS)])
    nights = _Nights(tmp_path, monkeypatch, src, "dataset.keep_columns=[city]")
    nights.plan()
    append(src, [{**MORE[0], "city": "Osaka"}])
    plan, read = nights.plan()
    assert read == [[0, 11]]
    nights.rows(plan, 3)
    from launcher.plan.plan import PlanFile

    assert [r["city"] for r in PlanFile(nights.store, "plans/t.arrow").shard(3).rows] == ["Osaka"]


def test_a_file_written_to_while_it_is_read_is_read_whole_next_time(tmp_path, monkeypatch):
    """Its old end is not known (the plan may have read past the size it found), so it is not read from there."""
    from launcher.sources import prompts

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    reader = prompts.file_batches

    def written_meanwhile(*args):  # the source's writer appends a line once the plan found the file's size
        append(src, MORE[:1])
        monkeypatch.setattr(prompts, "file_batches", reader)
        return reader(*args)

    monkeypatch.setattr(prompts, "file_batches", written_meanwhile)
    first, read = nights.plan()
    assert read == [[0, 11]]
    second, read = nights.plan()
    assert read == [[0, 11]] and second.selected == []


def test_a_shards_map_rows_are_read_from_the_row_groups_that_hold_them(tmp_path):
    """Pass 2 reads a map's shard column, then only the row groups (one per planned batch) holding the wanted
    shards: a map of four row groups, wanted shards in the second and the fourth, gives exactly their rows."""
    from launcher.ids import idmap
    from launcher.ids.idpass2 import _map
    from launcher.ledger.store import Store

    (tmp_path / "sources").mkdir()
    rows = [list(range(g * 10, g * 10 + 10)) for g in range(4)]  # a shard of 10 ids in each group, 10 rows each
    with pq.ParquetWriter(tmp_path / "sources" / "m.parquet", idmap.MAP_SCHEMA) as w:
        for g, rs in enumerate(rows):
            cols = {"row": rs, "id": [f"u{r}" for r in rs], "h": rs, "fp": rs, "shard": [g] * 10}
            w.write_table(pa.table({**cols, "pos": list(range(10))}, schema=idmap.MAP_SCHEMA))
    assert pq.ParquetFile(tmp_path / "sources" / "m.parquet").num_row_groups == 4
    index = idmap.Index(Store(tmp_path), {"files": {"f": {"map": "sources/m.parquet"}}})
    got = _map(index, "f", ["row", "id", "shard"], pa.array([1, 3], pa.int32()))
    assert got["row"].to_pylist() == [*range(10, 20), *range(30, 40)]
    assert got["id"].to_pylist() == [f"u{r}" for r in [*range(10, 20), *range(30, 40)]]
    assert _map(index, "f", ["row", "shard"], pa.array([7], pa.int32())).num_rows == 0  # no shard there


DAMAGES = {  # what is done to the committed index.json -> the reason its warning must give
    "the map file gone": "{map} is missing",
    "the shards file gone": "{shards} is missing",
    "the run file gone": "{run} is missing",
    "a name that is not a string": "7 is missing",
    "an entry of the wrong type": "a source file's entry is not what it should be",
    "a generation that is not a number": "its fields have the wrong types",
    "files that are not a mapping": "its fields have the wrong types",
    "runs that are not a list": "its fields have the wrong types",
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_id_map_is_planned_afresh_with_a_warning(tmp_path, monkeypatch, caplog, damage):
    """A file of the output folder never stops a run with a traceback: an index.json that names a missing file, or
    holds the wrong types, is read as no map, with a warning that says why; the unchanged source then plans to the
    same done shards."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    first, _ = nights.plan()
    index = tmp_path / "out" / "sources" / "index.json"
    data = json.loads(index.read_text())
    names = {"map": data["files"][str(src)]["map"], "shards": data["shards"], "run": data["runs"][0]}
    if damage.endswith("gone"):
        (tmp_path / "out" / names[damage.split()[1]]).unlink()
    else:
        key, value = {
            "a name that is not a string": ("shards", 7),
            "a generation that is not a number": ("gen", "1"),
            "files that are not a mapping": ("files", []),
            "runs that are not a list": ("runs", {}),
        }.get(damage, (None, None))
        if key is None:
            data["files"][str(src)]["rows_all"] = "ten"
        else:
            data[key] = value
        index.write_text(json.dumps(data))
    again, read = nights.plan()
    assert f"the id map {index} is damaged ({DAMAGES[damage].format(**names)}): the source is planned afresh" in (
        caplog.text
    )
    assert read == [[0, 10]]  # read whole again
    assert [(s.index, s.rows, s.status) for s in again.shards] == [(0, 4, "done"), (1, 4, "done"), (2, 2, "done")]


def test_a_source_planned_afresh_after_a_damaged_map_is_still_checked_against_the_model(tmp_path, monkeypatch):
    """The plan made afresh for a damaged id map checks the rows as every plan does: a column the family's pipeline
    would ignore is refused, naming the first id that sets it (DESIGN: refused at planning with its id)."""
    from launcher.errors import ConfigError
    from launcher.sources.prompts import SizeRule

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    data = json.loads((tmp_path / "out" / "sources" / "index.json").read_text())
    damaged = tmp_path / "out" / data["files"][str(src)]["map"]  # the map file cut short: found only when read
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    write(src, [*ROWS, {"uid": "p010", "prompt": "a new row", "negative_prompt": "blurry"}])
    why = "FLUX.2's pipeline takes no negative prompt"
    nights.sizes = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10, (("negative_prompt", why),))
    with pytest.raises(ConfigError, match=rf"column 'negative_prompt' is set \(first at id 'p010'\), but {why}$"):
        nights.plan()


@pytest.mark.parametrize("then", ["the source grew", "a failed shard is rerun", "the shard table is cut short"])
def test_a_map_file_cut_short_is_planned_afresh_with_a_warning(tmp_path, monkeypatch, caplog, then):
    """A map file the listing shows but that is damaged inside (cut to half its bytes) never stops a run with a
    traceback, whether pass 1 reads it (its source grew) or pass 2 would (a failed shard of an unchanged source):
    the source is planned afresh, the warning names the file, and every id is planned once."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    data = json.loads((tmp_path / "out" / "sources" / "index.json").read_text())
    rel = data["shards"] if then == "the shard table is cut short" else data["files"][str(src)]["map"]
    damaged = tmp_path / "out" / rel
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    if then == "the source grew":
        write(src, [*ROWS, {"uid": "p010", "prompt": "a new one"}])
    else:
        nights.states[1] = {"status": "failed"}
    again, _ = nights.plan()
    assert f"the id map {tmp_path / 'out' / 'sources' / 'index.json'} is damaged ({rel}: " in caplog.text
    status = {s.index: s.status for s in again.shards}
    assert status[0] == "done" and (status[1] == "done") == (then == "the source grew")
    ids = [i for s in again.selected for i, _ in nights.rows(again, s)]
    want = ["p010"] if then == "the source grew" else [f"p{i:03d}" for i in range(4, 8)]
    assert ids == want


def test_duplicates_set_aside_name_the_file_of_the_later_row_and_the_place_of_the_first(tmp_path, monkeypatch):
    """DESIGN, `dataset.bad_rows=skip`: each set-aside row with its reason. An id of a new file that an unchanged
    file holds, and one twice in the new file: the later row is set aside, at its own position, and its reason
    names its own file and the first row's file and row."""
    d = tmp_path / "src"
    d.mkdir()
    a, b = d / "a.jsonl", d / "b.jsonl"
    write(a, ROWS)  # positions 0-9
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "dataset.bad_rows=skip")
    nights.plan()
    write(b, [{"uid": "q9", "prompt": "new"}, {"uid": "p003", "prompt": "again"}, {"uid": "q9", "prompt": "twice"}])
    plan, reads = nights.plan()
    assert reads == [[0, 3], [0, 3]]  # both set aside after one read: one more read plans without them
    assert [(r["position"], r["id"], r["reason"]) for r in plan.rejected] == [
        (11, "p003", f"dataset {b}: duplicate id 'p003' (also row 3 of {a}); ids must be unique"),
        (12, "q9", f"dataset {b}: duplicate id 'q9' (also row 0 of {b}); ids must be unique"),
    ]
    assert [s.rows for s in plan.shards[3:]] == [1]  # q9 alone is new


def _shards(plan) -> list[tuple[int, int, str]]:
    return [(s.index, s.rows, s.status) for s in plan.shards]


def test_a_limit_plans_the_first_ids_and_a_shard_done_cut_grows_once_a_higher_limit_asks_for_more(
    tmp_path, monkeypatch
):
    """DESIGN, `dataset.limit` (use only the first N rows; how the work is run, not what it makes) with ids: the
    shards that hold the first N ids in shard order are planned, the last one cut to its first rows. A shard done
    in full is done under any limit; one done cut is generated again, as a grown shard, once a higher limit (or
    none) asks for more of its rows: never refused as changed."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # p000-p009: shards 0, 1, 2 of 4, 4, 2
    nights = _Nights(tmp_path, monkeypatch, src, "dataset.limit=6")
    plan, _ = nights.plan()
    assert _shards(plan) == [(0, 4, "pending"), (1, 2, "pending")] and plan.selected == [0, 1]
    assert nights.rows(plan, 1) == [(r["uid"], r["prompt"]) for r in ROWS[4:6]]
    again, _ = nights.plan()
    assert _shards(again) == [(0, 4, "done"), (1, 2, "done")] and again.selected == []
    nights.cfg.dataset.limit = 4  # shard 0 whole: nothing cut, no shard of no rows
    assert _shards(nights.plan()[0]) == [(0, 4, "done")]
    nights.cfg.dataset.limit = 7
    higher, _ = nights.plan()
    assert _shards(higher) == [(0, 4, "done"), (1, 3, "grown")] and higher.selected == [1]
    assert nights.rows(higher, 1) == [(r["uid"], r["prompt"]) for r in ROWS[4:7]]
    nights.cfg.dataset.limit = None
    whole, _ = nights.plan()
    assert _shards(whole) == [(0, 4, "done"), (1, 4, "grown"), (2, 2, "pending")] and whole.selected == [1, 2]
    assert _shards(nights.plan()[0]) == [(0, 4, "done"), (1, 4, "done"), (2, 2, "done")]
    # A limit at a shard's end cuts nothing: the shard is done whole, under no limit too.
    exact = _Nights(tmp_path, monkeypatch, src, "dataset.limit=8", out=str(tmp_path / "exact"))
    assert _shards(exact.plan()[0]) == [(0, 4, "pending"), (1, 4, "pending")]
    exact.cfg.dataset.limit = None
    assert _shards(exact.plan()[0]) == [(0, 4, "done"), (1, 4, "done"), (2, 2, "pending")]
    # A shard done cut whose rows changed since is stale, as any other.
    write(src, [*ROWS[:5], {**ROWS[5], "prompt": "another"}, *ROWS[6:]])
    edited = _Nights(tmp_path, monkeypatch, src, "dataset.limit=6", "run.stale=regenerate", out=str(tmp_path / "e"))
    write(src, ROWS)
    edited.plan()
    write(src, [*ROWS[:5], {**ROWS[5], "prompt": "another"}, *ROWS[6:]])
    edited.cfg.dataset.limit = None
    assert _shards(edited.plan()[0])[1] == (1, 4, "stale")


def _refusal(tmp_path, monkeypatch, rows, *overrides, sizes=None) -> str:
    from launcher.errors import ConfigError

    tmp_path.mkdir()
    src = tmp_path / "a.jsonl"
    write(src, rows)
    nights = _Nights(tmp_path, monkeypatch, src, *overrides)
    nights.sizes = sizes
    with pytest.raises(ConfigError) as e:
        nights.plan()
    return str(e.value).replace(str(src), "SRC")


def test_the_id_plan_refuses_a_bad_source_at_planning_with_one_line_naming_it(tmp_path, monkeypatch):
    """The plan with ids checks what the plan by row number checks, each in one line that names the source: a
    limit of no rows, a sweep key that a column also sets, a column the model's pipeline would not see (the first
    id that sets it, past the first shard), a source with no rows, one whose every row was set aside."""
    from launcher.sources.prompts import SizeRule

    assert _refusal(tmp_path / "1", monkeypatch, ROWS, "dataset.limit=0") == (
        "dataset.limit=0 selects no prompts; use 1 or more, or null for all rows"
    )
    swept = [{**r, "guidance_scale": 3.0} if r["uid"] == "p006" else r for r in ROWS]
    assert _refusal(tmp_path / "2", monkeypatch, swept, "generate.sweep={guidance_scale:[2.5,4.0]}") == (
        "dataset SRC has a column 'guidance_scale', which generate.sweep.guidance_scale also sets; "
        "drop the column or the sweep key"
    )
    negative = [{**r, "negative_prompt": "blur"} if r["uid"] in ("p005", "p007") else r for r in ROWS]
    rule = SizeRule(16, 4 * 1024 * 1024, 64, 64, ignored=(("negative_prompt", "this model takes none"),))
    assert _refusal(tmp_path / "3", monkeypatch, negative, sizes=rule) == (
        "dataset SRC: column 'negative_prompt' is set (first at id 'p005'), but this model takes none"
    )
    assert _refusal(tmp_path / "4", monkeypatch, []) == (
        "dataset SRC holds no prompts; add prompts or point dataset.path elsewhere"
    )
    bad = [{"uid": "", "prompt": "x"}, {"uid": "a\x01b", "prompt": "y"}]  # ids that cannot name a file
    got = _refusal(tmp_path / "5", monkeypatch, bad, "dataset.bad_rows=skip")
    assert got == (
        "dataset SRC: every row was set aside (dataset.bad_rows=skip), e.g. SRC, line 1: the id ('uid') is empty; "
        "give the row an id (it names the row's image files)"
    )


def test_with_n_images_a_prompt_id_that_another_prompts_sample_id_repeats_is_refused_in_any_file(tmp_path, monkeypatch):
    """DESIGN, sample ids (`<id>-<k>` with images per prompt, `<id>@<v>` with a sweep): a prompt id may not be
    another prompt's sample id. With ids, each night checks every id the map holds, the unchanged files' too; a
    night where nothing changed checks nothing, and so does one image a prompt without a sweep."""
    from launcher.errors import ConfigError

    d = tmp_path / "src"
    d.mkdir()
    write(d / "a.jsonl", ROWS)
    ok = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "generate.images_per_prompt=2", out=str(tmp_path / "ok"))
    assert [s.rows for s in ok.plan()[0].shards] == [4, 4, 2]
    assert ok.plan()[0].selected == []  # nothing changed, nothing to check
    write(d / "b.jsonl", [{"uid": "p003-1", "prompt": "a clash"}])  # a.jsonl unchanged: its old map is read
    for n, clash in (("generate.images_per_prompt=2", "p003-1"), ("generate.sweep={seed:[1,2]}", "p003@1")):
        write(d / "b.jsonl", [{"uid": clash, "prompt": "a clash"}])
        nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", n, out=str(tmp_path / clash))
        write(d / "b.jsonl", [])
        nights.plan()
        write(d / "b.jsonl", [{"uid": clash, "prompt": "a clash"}])
        with pytest.raises(ConfigError) as e:
            nights.plan()
        what = "generate.images_per_prompt=2" if "-" in clash else "generate.sweep"
        assert str(e.value) == (
            f"dataset {d}/*.jsonl: with {what}, prompt 'p003' has a sample id {clash!r}, which is also the id of "
            "another prompt; rename one of them (or use dataset.id_column)"
        )
    plain = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", out=str(tmp_path / "plain"))
    assert [s.rows for s in plain.plan()[0].shards] == [4, 4, 3]  # one image a prompt: p003-1 is an id like any


def test_a_done_shard_whose_files_are_missing_is_damaged_and_planned_again(tmp_path, monkeypatch, caplog):
    """DESIGN, done means verified: with ids too, a done shard whose recorded files the listing lacks is damaged,
    said in a warning, and generated again by the same command."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    nights.states[1]["files"] = {"data/shard-00001.parquet": [10, "0" * 64]}
    plan, _ = nights.plan()
    assert _shards(plan) == [(0, 4, "done"), (1, 4, "damaged"), (2, 2, "done")] and plan.selected == [1]
    assert f"{nights.store}: shard 1 is damaged (data/shard-00001.parquet is missing)" in caplog.text


def test_a_row_moved_to_another_file_keeps_its_shard_and_its_edit_is_caught_there(tmp_path, monkeypatch):
    """DESIGN, `dataset.id_column`: a moved row changes no shard. An id that left one file for another keeps its
    shard and place (a failed shard gathers it from its new file); edited on the way, its shard is stale, naming
    it, and no other."""
    from launcher.errors import ConfigError

    d = tmp_path / "src"
    d.mkdir()
    write(d / "a.jsonl", ROWS)  # p000-p009: shards 0, 1, 2
    write(d / "b.jsonl", MORE)  # q0-q3: shards 2 (q0, q1) and 3
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    first, _ = nights.plan()
    write(d / "a.jsonl", [r for r in ROWS if r["uid"] not in ("p001", "p005")])
    write(d / "b.jsonl", [ROWS[5], *MORE, ROWS[1]])  # p005 first, p001 last
    del nights.states[1]  # shard 1 failed: it is gathered again, p005 from b.jsonl
    moved, _ = nights.plan()
    assert [(s.index, s.rows, s.fingerprint) for s in moved.shards] == [
        (s.index, s.rows, s.fingerprint) for s in first.shards
    ]
    assert [s.status for s in moved.shards] == ["done", "pending", "done", "done"] and moved.selected == [1]
    assert nights.rows(moved, 1) == [(r["uid"], r["prompt"]) for r in ROWS[4:8]]
    write(d / "b.jsonl", [{**ROWS[5], "prompt": "a moved and edited row"}, *MORE, ROWS[1]])
    with pytest.raises(ConfigError, match=r"^shards \[1\] are done but their prompts changed since \(samples p005\)"):
        nights.plan()


def test_past_max_runs_the_hash_runs_are_merged_into_one_that_still_knows_every_id(tmp_path, monkeypatch):
    """launcher/ids/idruns.py: each plan that reads new rows adds a run of their hashes; past MAX_RUNS a plan
    merges them into one, and an id seen in any earlier run is still a duplicate, not a new row."""
    from launcher.errors import ConfigError
    from launcher.ids import idmap, idruns

    monkeypatch.setattr(idruns, "MAX_RUNS", 2)
    src = tmp_path / "a.jsonl"
    write(src, ROWS[:4])
    nights = _Nights(tmp_path, monkeypatch, src)
    counts = []
    for night in range(1, 4):  # three more nights, four new ids each
        nights.plan()
        counts.append(len(idmap.load(nights.store, 4).data["runs"]))
        append(src, [{"uid": f"n{night}-{i}", "prompt": f"night {night} prompt {i}"} for i in range(4)])
    plan, _ = nights.plan()
    index = idmap.load(nights.store, 4)
    assert counts == [1, 2, 1] and len(index.data["runs"]) == 2  # the third run merged the first three
    assert [(s.rows, s.status) for s in plan.shards] == [(4, "done")] * 3 + [(4, "pending")]
    merged = np.fromfile(index.run_paths()[0], np.uint64)
    assert len(merged) == 12 and (np.diff(merged.astype(np.float64)) >= 0).all()  # one sorted run, every hash once
    append(src, [{"uid": "n1-2", "prompt": "an id of the second night again"}])
    with pytest.raises(ConfigError, match="n1-2"):
        nights.plan()


@pytest.mark.parametrize("cr", [None, 2, 144], ids=["lf", "a lone cr in the first block", "one in the second"])
def test_a_bad_row_appended_to_a_file_past_one_counting_block_is_named_by_its_line(tmp_path, monkeypatch, cr):
    """The lines before the old end are counted in blocks of 4 MiB: a file past one block still names the bad row
    of its appended part by its line in the whole file (a lone CR in either block makes each line count, from the
    file's first byte: a blank first line)."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    rows = [{"uid": f"r{i:03d}", "prompt": f"{i} " + "x" * 30_000} for i in range(145)]  # 4.35 MB: two blocks
    lines = [json.dumps(r).encode() + b"\n" for r in rows]
    if cr is not None:
        lines.insert(cr, b"\r")  # a blank line ended by a lone CR
        lines.insert(0, b"\n")
    src.write_bytes(b"".join(lines))
    assert src.stat().st_size > 1 << 22
    nights = _Nights(tmp_path, monkeypatch, src, "run.shard_size=50")
    nights.plan()
    append(src, [*MORE[:2], {"uid": "q2", "prompt": 5}])
    line = len(lines) + 3
    with pytest.raises(ConfigError, match=rf"^dataset {src}, line {line}: the prompt \('prompt'\) is of type int"):
        nights.plan()


def test_a_file_edited_in_its_middle_at_the_same_size_is_read_whole(tmp_path, monkeypatch):
    """A file whose size is what it was is no grown file, whatever its head and tail say: an edit in its middle
    (same length, so every line end stays where it was) is read, and caught."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    rows = [{"uid": f"p{i:03d}", "prompt": f"a photo of city number {i}"} for i in range(200)]  # head, tail apart
    write(src, rows)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    size = src.stat().st_size
    write(src, [*rows[:100], {**rows[100], "prompt": rows[100]["prompt"].replace("city", "town")}, *rows[101:]])
    assert src.stat().st_size == size
    with pytest.raises(ConfigError, match=r"shards \[25\] are done but their prompts changed since \(samples p100\)"):
        nights.plan()
    assert nights.reads == [[0, 200]]


def test_a_file_is_unchanged_by_its_size_and_time_and_a_saved_dataset_by_all_of_its_files(tmp_path):
    """What says a source is unchanged without reading it: a file's size and modification time (ns); a saved
    dataset (a folder) sums its files' sizes, nested ones included, and takes the latest of their times."""
    from launcher.ids.idmap import file_stat

    one = tmp_path / "a.jsonl"
    one.write_bytes(b"x" * 7)
    os.utime(one, ns=(1_700_000_000_123_456_789,) * 2)
    assert file_stat(str(one)) == {"size": 7, "mtime": 1_700_000_000_123_456_789}
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    for name, size, ns in (
        ("state.json", 3, 1_600_000_000_000_000_000),
        ("train/data-00000.arrow", 11, 1_650_000_000_000_000_005),
    ):
        (saved / name).write_bytes(b"y" * size)
        os.utime(saved / name, ns=(ns, ns))
    os.utime(saved / "train", ns=(1_500_000_000_000_000_000,) * 2)
    assert file_stat(str(saved)) == {"size": 14, "mtime": 1_650_000_000_000_000_005}


def test_a_file_gone_from_the_glob_leaves_its_ids_and_its_rows_found_in_another_file_keep_their_shards(
    tmp_path, monkeypatch
):
    """DESIGN: with an id column an inserted, deleted or moved row changes no other shard. A whole file leaves the
    glob: its ids that another file now holds keep their shards (done); its others leave the source (their
    shards are done with fewer rows, never refused); a shard that must be made again reads them where they are."""
    from launcher.errors import ConfigError

    d = tmp_path / "src"
    d.mkdir()
    write(d / "a.jsonl", ROWS[:6])  # p000-p005: shards 0 (p000-p003) and 1 (p004, p005, q0, q1)
    write(d / "b.jsonl", MORE)  # q0-q3
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    first, _ = nights.plan()
    assert [(s.index, s.rows) for s in first.shards] == [(0, 4), (1, 4), (2, 2)]
    (d / "b.jsonl").unlink()
    write(d / "a.jsonl", [*ROWS[:6], MORE[1], MORE[2]])  # q1 and q2 moved into a.jsonl; q0 and q3 left
    del nights.states[1]  # shard 1 failed: it is gathered again, q1 from a.jsonl
    moved, _ = nights.plan()
    assert [s.status for s in moved.shards] == ["done", "pending", "done"] and moved.selected == [1]
    assert nights.rows(moved, 1) == [(r["uid"], r["prompt"]) for r in (*ROWS[4:6], MORE[1])]
    write(d / "a.jsonl", [*ROWS[:6], MORE[1], {**MORE[2], "prompt": "a moved and edited row"}])
    with pytest.raises(ConfigError, match=r"^shards \[2\] are done but their prompts changed since \(samples q2\)"):
        nights.plan()


@pytest.mark.parametrize("n", [1, 2])
def test_a_folder_planned_by_row_positions_keeps_its_done_shards_when_the_id_map_is_first_built(
    tmp_path, monkeypatch, n
):
    """launcher/ids/idplan.py's migration: an output folder whose shards were planned by row positions (states with
    the row planner's fingerprints, before the id map existed) keeps every done shard when the map is first built:
    a done last shard of fewer prompts keeps exactly those, and rows added since go to new shards. With N images a
    prompt a state's `rows` are its samples and `prompts` its prompts (launcher/worker/runner.py)."""
    from launcher.plan.plan import shard_tables, source
    from launcher.plan.shards import prompts_fingerprint

    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # p000-p009: shards of 4, 4 and 2 rows by position
    nights = _Nights(tmp_path, monkeypatch, src, f"generate.images_per_prompt={n}")
    for i, t, _ in shard_tables(source(nights.cfg), 4, None):
        counts = {"rows": t.num_rows * n, **({"prompts": t.num_rows} if n > 1 else {})}
        nights.states[i] = {"status": "done", **counts, "prompts_fingerprint": prompts_fingerprint(t)}
    write(src, [*ROWS, *MORE])
    plan, _ = nights.plan()
    assert _shards(plan) == [(0, 4, "done"), (1, 4, "done"), (2, 2, "done"), (3, 4, "pending")]
    assert plan.selected == [3] and nights.rows(plan, 3) == [(r["uid"], r["prompt"]) for r in MORE]


def test_pass_2_hands_over_each_failed_shard_whose_ids_all_left_and_then_the_shards_with_rows(tmp_path, monkeypatch):
    """Shards of 2: shards 0 and 1 (p000-p003) failed and all their ids left the source; shard 3 (p006, p007)
    failed and keeps its rows. The plan file holds shards 0 and 1 with no row and shard 3 with its two."""
    from launcher.plan.plan import PlanFile, write_plan_file

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src, "run.shard_size=2")
    nights.plan()
    for i in (0, 1, 3):
        nights.states[i] = {"status": "failed"}
    write(src, ROWS[4:])
    plan, _ = nights.plan()
    assert plan.selected == [0, 1, 3]
    write_plan_file(nights.store, "plans/t.arrow", nights.cfg, plan)
    pf = PlanFile(nights.store, "plans/t.arrow")
    assert [[r["id"] for r in pf.shard(i).rows] for i in (0, 1, 3)] == [[], [], ["p006", "p007"]]


def test_an_id_plan_holds_back_exhausted_shards_says_which_ids_left_and_names_the_attempt_it_read(
    tmp_path, monkeypatch, caplog
):
    """DESIGN run.max_attempts: a shard that failed that many times alike is not retried by run.shards=pending, and
    run.shards=failed retries it; ids that left the source are said (up to 5, "and N more") and their samples stay;
    the plan file names the attempt whose state each shard was judged by."""
    from launcher.config import load_config
    from launcher.plan.plan import PlanFile, write_plan_file

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()  # shards 0 (p000-p003), 1 (p004-p007), 2 (p008, p009), all done
    nights.states[0] = {"status": "failed", "attempts": 3, "attempt": "r1-g3"}
    nights.states[1] = {"status": "failed", "attempts": 1, "attempt": "r1-g4"}
    write(src, [*ROWS[:6], {"uid": "p010", "prompt": "a new one"}])  # p006-p009 left; shard 2 keeps none of its
    with caplog.at_level("WARNING"):
        plan, _ = nights.plan()
    assert (plan.selected, plan.held) == ([1, 3], [0])
    assert "4 ids left the prompt source since the last run (p006, p007, p008, p009): their samples stay" in caplog.text
    write_plan_file(nights.store, "plans/t.arrow", nights.cfg, plan)
    assert [PlanFile(nights.store, "plans/t.arrow").seen(i) for i in (1, 3)] == ["r1-g4", None]
    nights.cfg = load_config(
        "tiny", [f"dataset.path={src}", "dataset.id_column=uid", "run.shard_size=4", "run.shards=failed"]
    )
    plan, _ = nights.plan()
    assert (plan.selected, plan.held) == ([0], [])  # shard 1 was made by the plan before
    write(src, [{"uid": f"n{i}", "prompt": f"new {i}"} for i in range(3)])  # every old id leaves: 7 of them
    caplog.clear()
    with caplog.at_level("WARNING"):
        nights.plan()
    assert "7 ids left the prompt source since the last run (p000, p001, p002, p003, p004 and 2 more)" in caplog.text


def test_ids_whose_hashes_collide_are_still_told_apart(tmp_path, monkeypatch):
    """The id map keeps 64-bit hashes of ids, and checks the ids themselves wherever two hashes match: with a hash
    of 2 bits (every id collides with others) a night's plan is still the one DESIGN asks for: each id once, its
    shard fixed, a new id new, an edited row's shard stale, a repeated id a duplicate."""
    from launcher.errors import ConfigError
    from launcher.ids import idpass2, idplan, rowhash

    def two_bits(ids):
        return rowhash.id_hashes(ids) & np.uint64(3)

    monkeypatch.setattr(idplan, "id_hashes", two_bits)
    monkeypatch.setattr(idpass2, "id_hashes", two_bits)
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    first, _ = nights.plan()
    assert _shards(first) == [(0, 4, "pending"), (1, 4, "pending"), (2, 2, "pending")]
    write(src, [*ROWS, *MORE])  # q0-q3 are new, though their hashes are those of old ids
    grown, _ = nights.plan()
    assert _shards(grown) == [(0, 4, "done"), (1, 4, "done"), (2, 2, "done"), (3, 4, "pending")]
    assert nights.rows(grown, 3) == [(r["uid"], r["prompt"]) for r in MORE]
    write(src, [*ROWS, *MORE, {**ROWS[2], "prompt": "the same id again"}])
    with pytest.raises(ConfigError, match=r"duplicate id 'p002'"):
        nights.plan()
    write(src, [{**ROWS[0], "prompt": "an edited prompt"}, *ROWS[1:], *MORE])
    with pytest.raises(ConfigError, match=r"^shards \[0\] are done but their prompts changed since \(samples p000\)"):
        nights.plan()


def test_a_one_bit_edit_anywhere_in_a_string_or_its_length_changes_its_hash():
    """An edited row is found by its hash alone (launcher/ids/rowhash.py): strings of lengths around each word and
    the 256 bytes hashed word by word, each with each of the 7 bits of each (ASCII) byte flipped in turn, or one
    byte longer, all hash apart; and a string hashes alike at any place of a sliced column (a reader's batch is a
    slice)."""
    from launcher.ids.rowhash import row_hashes

    def hashes_of(prompts: pa.Array) -> list:
        return row_hashes(pa.RecordBatch.from_arrays([prompts], ["prompt"])).tolist()

    texts = set()
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 63, 255, 256, 257, 300):
        base = "".join(chr(0x41 + (i * 7) % 26) for i in range(n))
        texts |= {base, base + "\0"}
        texts |= {base[:i] + chr(ord(base[i]) ^ (1 << b)) + base[i + 1 :] for i in range(n) for b in range(7)}
    texts = sorted(texts)
    hashes = hashes_of(pa.array(texts, pa.string()))
    assert len(set(hashes)) == len(texts)
    padded = pa.array(["pad", *texts, "pad"], pa.string()).slice(1, len(texts))
    assert hashes_of(padded) == hashes
    assert hashes_of(pa.array(["x", ""]).slice(1)) == hashes_of(pa.array([""]))
    longs = ["y" * 260, "z" * 300]  # two strings past 256 bytes: the second's hash must not depend on the first
    assert hashes_of(pa.array(longs))[1] == hashes_of(pa.array(longs[1:]))[0]


@pytest.mark.parametrize(
    "values, other",
    [
        (pa.array(["a", "bb", None], pa.large_string()), "cc"),
        (pa.array([1, 2, None], pa.int32()), 3),
        (pa.array([2**64 - 1, 2**63, None], pa.uint64()), 5),  # past int64's maximum: hashed, not refused
        (pa.array([0.5, 1.5, None], pa.float32()), 2.5),
        (pa.array([True, False, None]), True),
        (pa.array([[1], [2, 3], None], pa.list_(pa.int64())), [2, 4]),
        (pa.array([{"k": 1}, {"k": 2}, None], pa.struct([("k", pa.int64())])), {"k": 3}),
    ],
    ids=lambda v: str(v.type) if isinstance(v, pa.Array) else "",
)
def test_a_kept_column_of_any_type_hashes_each_rows_value_whatever_its_batch(values, other):
    """A kept column is part of what a row contributes (DESIGN `dataset.keep_columns`): an edit of its value is an
    edit of the row, a value moved to another column too, and a row hashes alike alone or in any batch."""
    from launcher.ids.rowhash import row_hashes

    def batch(vals, name="extra"):
        return pa.RecordBatch.from_arrays([pa.array([f"id{i}" for i in range(len(vals))]), vals], ["id", name])

    whole = row_hashes(batch(values))
    for k in range(len(values)):
        alone = pa.RecordBatch.from_arrays([pa.array([f"id{k}"]), values.slice(k, 1)], ["id", "extra"])
        assert row_hashes(alone)[0] == whole[k], k
    edited = pa.concat_arrays([values.slice(0, 1), pa.array([other], values.type), values.slice(2)])
    assert row_hashes(batch(edited)).tolist()[1] != whole[1]
    assert row_hashes(batch(edited)).tolist()[0::2] == whole.tolist()[0::2]
    assert row_hashes(batch(values, "other")).tolist()[:2] != whole.tolist()[:2]


def test_an_id_that_left_keeps_its_shard_when_it_comes_back_nights_later(tmp_path, monkeypatch, caplog):
    """launcher/ids/idmap.py: ids that left the source keep their shard if they come back, however many nights
    later (each night's map carries the ids that left before); a map whose file of them is gone is damaged."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # shards 0 (p000-p003), 1 (p004-p007), 2 (p008, p009)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    write(src, [r for r in ROWS if r["uid"] != "p005"])  # p005 leaves
    nights.plan()
    write(src, [r for r in ROWS if r["uid"] != "p005"] + [{"uid": "q0", "prompt": "new"}])  # another night
    nights.plan()
    write(src, [*ROWS, {"uid": "q0", "prompt": "new"}])  # p005 is back
    back, _ = nights.plan()
    assert [(s.index, s.rows) for s in back.shards] == [(0, 4), (1, 4), (2, 2), (3, 1)]  # q0: a new shard
    del nights.states[1]
    again, _ = nights.plan()
    assert again.selected == [1] and [i for i, _ in nights.rows(again, 1)] == ["p004", "p005", "p006", "p007"]

    write(src, [r for r in ROWS if r["uid"] != "p001"])  # p001 leaves too: a file of left ids is written
    nights.plan()
    index = tmp_path / "out" / "sources" / "index.json"
    left = json.loads(index.read_text())["left"]
    (tmp_path / "out" / left).unlink()
    write(src, [*ROWS, {"uid": "q0", "prompt": "new"}])  # planned afresh, as the shards were first planned
    afresh, _ = nights.plan()
    assert [(s.index, s.rows, s.status) for s in afresh.shards][-1] == (3, 1, "done")
    assert f"the id map {index} is damaged ({left} is missing): the source is planned afresh" in caplog.text


def test_a_new_file_of_many_old_ids_is_set_aside_in_one_more_pass(tmp_path, monkeypatch):
    """dataset.bad_rows=skip: never retried forever. A night's new file that repeats six ids of an unchanged file
    (an export that re-includes old rows) sets all six aside at once: one more read of the new file, not one per
    id; each names its own place and the first row's file and row, or the id whose file name it would take."""
    d = tmp_path / "src"
    d.mkdir()
    a, b = d / "a.jsonl", d / "b.jsonl"
    write(a, [*ROWS, {"uid": "x_1", "prompt": "x"}])  # positions 0-10
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "dataset.bad_rows=skip")
    nights.plan()
    again = [{"uid": r["uid"], "prompt": "again"} for r in ROWS[5::-1]]
    write(b, [{"uid": "q0", "prompt": "new"}, *again, {"uid": "x/1", "prompt": "x"}])
    plan, reads = nights.plan()
    assert reads == [[0, 8], [0, 8]]
    assert [(r["position"], r["id"], r["reason"]) for r in plan.rejected] == [
        (
            12 + k,
            f"p{5 - k:03d}",
            f"dataset {b}: duplicate id 'p{5 - k:03d}' (also row {5 - k} of {a}); ids must be unique",
        )
        for k in range(6)
    ] + [(18, "x/1", f"dataset {b}: ids 'x_1' and 'x/1' both become the file name x_1; make them differ in letters, "
          "digits, '-' or '_'")]  # fmt: skip
    assert [s.rows for s in plan.shards[3:]] == [1]  # q0 alone is new


def test_a_hub_source_with_ids_is_unchanged_by_its_files_content_ids(hub, tmp_path, monkeypatch):
    """An hf://datasets source (the Hub gives no modification time): a night whose files the Hub still holds as they
    were reads none of them; a file pushed again with new rows is read again, and only it."""
    from fake_hub import Repo

    for k, v in hub.env.items():
        monkeypatch.setenv(k, v)
    files = {"a.jsonl": ROWS[:4], "b.jsonl": ROWS[4:]}

    def push() -> None:
        from huggingface_hub import HfFileSystem

        hub.repos["datasets/org/nightly"] = Repo(
            {f: "".join(json.dumps(r) + "\n" for r in rows).encode() for f, rows in files.items()}
        )
        HfFileSystem.clear_instance_cache()  # each night is a new launcher: nothing of the last night's listing

    push()
    nights = _Nights(tmp_path, monkeypatch, "hf://datasets/org/nightly/*.jsonl")
    first, reads = nights.plan()
    assert reads == [[0, 4], [0, 6]] and [s.rows for s in first.shards] == [4, 4, 2]
    _, reads = nights.plan()
    assert reads == []
    files["b.jsonl"] = [*ROWS[4:], {"uid": "q0", "prompt": "new"}]
    push()
    grown, reads = nights.plan()
    assert reads == [[0, 7]] and [s.rows for s in grown.shards] == [4, 4, 2, 1]


@pytest.mark.timeout(120)
def test_duplicates_past_the_first_read_block_are_set_aside_at_their_rows_and_a_plan_never_loops(tmp_path, monkeypatch):
    """Fixtures past the reader's blocks: the rows set aside after a first read are marked again by their place in
    the whole source on the next read, whichever block holds them; a plan that found the same rows to set aside
    again (its marks lost) stops with a line, never planning for ever."""
    from launcher.errors import ConfigError
    from launcher.sources import prompts_fast, rejected

    monkeypatch.setattr(prompts_fast, "_BLOCK", 160)  # ~3 rows a block
    src = tmp_path / "a.jsonl"
    rows = [*ROWS[:7], {"uid": "p001", "prompt": "again"}, ROWS[7], {"uid": "p002", "prompt": "again"}]
    write(src, rows)
    nights = _Nights(tmp_path, monkeypatch, src, "dataset.bad_rows=skip")
    plan, reads = nights.plan()
    assert len(reads) == 2 and [(r["position"], r["id"]) for r in plan.rejected] == [(7, "p001"), (9, "p002")]
    assert [s.rows for s in plan.shards] == [4, 4]
    real = rejected.marked
    monkeypatch.setattr(rejected, "marked", lambda b, at, late: real(b, at, ()))
    with pytest.raises(ConfigError, match=r"^planning set aside source rows 7, 9 and found them again: a bug of "):
        _Nights(tmp_path, monkeypatch, src, "dataset.bad_rows=skip", out=str(tmp_path / "other")).plan()


def test_a_new_files_id_that_a_grown_files_old_part_holds_is_set_aside_in_the_new_file(tmp_path, monkeypatch):
    """dataset.bad_rows=skip: a row planned before is never the one set aside. A file that grew keeps its old
    rows (they are not read again); a new file listed before it that repeats one of their ids is the duplicate:
    set aside there, at its own place, once (before, the old row was set aside, never to be read again to mark it,
    and planning went on for ever)."""
    d = tmp_path / "src"
    d.mkdir()
    write(d / "b.jsonl", ROWS[:6])
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "dataset.bad_rows=skip")
    nights.plan()
    append(d / "b.jsonl", [{"uid": "q1", "prompt": "new"}])
    write(d / "a.jsonl", [{"uid": "p002", "prompt": "again"}])  # listed first: position 0
    plan, reads = nights.plan()
    assert [(r["position"], r["id"]) for r in plan.rejected] == [(0, "p002")] and len(reads) == 4
    assert plan.rejected[0]["reason"].startswith(f"dataset {d / 'a.jsonl'}: duplicate id 'p002' (also row 2 of ")


def test_pass_2_finds_a_selected_shards_rows_in_whichever_file_holds_them_now(tmp_path, monkeypatch):
    """launcher/ids/idpass2.py gathers a selected shard from every file whose map holds its rows: a file of shard 0
    alone, one that holds shards on both sides of the selected one but none of its rows (passed over, not the end
    of the search), and a file that took rows over from a file gone. A night with nothing changed stages no new
    generation of the map (each night costs what changed)."""
    d = tmp_path / "src"
    d.mkdir()
    a, b = d / "a.jsonl", d / "b.jsonl"
    write(a, ROWS[:4])  # shard 0
    write(b, ROWS[4:6])  # shard 1
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    first, _ = nights.plan()
    assert _shards(first) == [(0, 4, "pending"), (1, 2, "pending")]
    assert nights.rows(first, 0) == [(r["uid"], r["prompt"]) for r in ROWS[:4]]  # a.jsonl holds shard 0 only
    append(a, MORE)  # a.jsonl: shards 0 and 2
    second, _ = nights.plan()
    assert second.selected == [2]
    del nights.states[1]  # shard 1's run failed
    index = tmp_path / "out" / "sources" / "index.json"
    before = index.read_bytes()
    third, _ = nights.plan()
    assert third.selected == [1] and index.read_bytes() == before  # nothing changed: no new generation of the map
    assert nights.rows(third, 1) == [(r["uid"], r["prompt"]) for r in ROWS[4:6]]  # past a.jsonl, in b.jsonl
    # a.jsonl goes; its rows come back at the end of b.jsonl, and keep shards 0 and 2 there
    a.unlink()
    append(b, [*ROWS[:4], *MORE])
    del nights.states[0]
    fourth, _ = nights.plan()
    assert _shards(fourth) == [(0, 4, "pending"), (1, 2, "done"), (2, 4, "done")]
    assert nights.rows(fourth, 0) == [(r["uid"], r["prompt"]) for r in ROWS[:4]]


def test_set_aside_rows_are_placed_by_their_row_in_the_whole_source_across_files(tmp_path, monkeypatch):
    """docs/guide.md, dataset.bad_rows=skip: a set-aside row's `position` is its row number in the whole source (the
    files in listing order, from 0), and with an id column it gets no shard. Rows are counted so in every file each
    night, the files that did not change included; a row of one file set aside never takes a row of another with
    it, and a read block of bad rows alone ends nothing."""
    from launcher.sources import prompts, prompts_fast

    monkeypatch.setattr(prompts_fast, "_BLOCK", 54)  # one JSON line of ROWS a block
    monkeypatch.setattr(prompts, "BATCH_ROWS", 1)  # a file of bad rows is read by rows: a bad row is a batch alone
    d = tmp_path / "src"
    d.mkdir()
    a, b, c, e = (d / f"{n}.jsonl" for n in "abce")
    bad = [{"uid": f"bad{k}"} for k in range(2)]  # no prompt
    write(a, ROWS[:2])
    write(b, ROWS[2:4])
    write(c, ROWS[4:6])
    write(e, [bad[0], ROWS[6]])
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "dataset.bad_rows=skip")
    first, _ = nights.plan()
    assert [(r["position"], r["id"], r["shard"]) for r in first.rejected] == [(6, "bad0", None)]
    assert _shards(first) == [(0, 4, "pending"), (1, 3, "pending")]
    assert [i for i, _ in nights.rows(first, 1)] == ["p004", "p005", "p006"]  # p006 after a block of a bad row
    append(c, [ROWS[7]])  # c.jsonl grows (a new shard); e.jsonl too, by a bad row; a.jsonl and b.jsonl are as they were
    append(e, [bad[1]])
    second, _ = nights.plan()
    assert [(r["position"], r["id"], r["shard"]) for r in second.rejected] == [(9, "bad1", None)]  # 2 + 2 + 3 + 2
    assert _shards(second)[2:] == [(2, 1, "pending")]
    # c.jsonl grows again, by a new id and one that a.jsonl holds (set aside: its position is 4 + 4); e.jsonl, as
    # it was, now starts at row 9: its p006 (row 8 if e.jsonl were counted from where it started before) stays
    append(c, [ROWS[8], {"uid": "p000", "prompt": "again"}])
    del nights.states[1]
    third, _ = nights.plan()
    assert [(r["position"], r["id"]) for r in third.rejected] == [(8, "p000")]
    assert third.selected == [1, 3]
    assert [i for i, _ in nights.rows(third, 1)] == ["p004", "p005", "p006"]


def test_a_positional_folder_whose_last_done_shard_has_one_prompt_keeps_it_when_the_id_map_is_first_built(
    tmp_path, monkeypatch
):
    """launcher/ids/idplan.py's migration (as the test above), at its edges: a done last shard of one prompt keeps
    exactly that one, and a done state that records no row count (rows and prompts are optional in a state:
    launcher/ledger/states.py) is a whole shard, not a short one, and no error."""
    from launcher.plan.plan import shard_tables, source
    from launcher.plan.shards import prompts_fingerprint

    src = tmp_path / "a.jsonl"
    write(src, ROWS[:9])  # by position: shards of 4, 4 and 1 rows
    nights = _Nights(tmp_path, monkeypatch, src)
    for i, t, _ in shard_tables(source(nights.cfg), 4, None):
        counts = {"rows": t.num_rows} if i else {}  # shard 0's state says no count
        nights.states[i] = {"status": "done", **counts, "prompts_fingerprint": prompts_fingerprint(t)}
    write(src, [*ROWS, *MORE])
    plan, _ = nights.plan()
    assert _shards(plan) == [(0, 4, "done"), (1, 4, "done"), (2, 1, "done"), (3, 4, "pending"), (4, 1, "pending")]
    assert [i for i, _ in nights.rows(plan, 3)] == ["p009", "q0", "q1", "q2"]


def test_an_id_map_made_with_another_shard_size_is_not_used(tmp_path, monkeypatch):
    """launcher/ids/idmap.py load: a map made with another run.shard_size is none (its shards are of the other size);
    the source is planned afresh, in shards of the size asked for."""
    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    _Nights(tmp_path, monkeypatch, src).plan()  # shards of 4: 4, 4, 2
    nights = _Nights(tmp_path, monkeypatch, src, "run.shard_size=3")
    plan, read = nights.plan()
    assert [s.rows for s in plan.shards] == [3, 3, 3, 1] and read == [[0, 10]]


def test_an_id_back_from_the_left_ids_is_a_duplicate_when_another_file_repeats_it_later(tmp_path, monkeypatch):
    """The map's ids that left the source are those gone now: once an id that left is back, it is no longer among
    them, so a later file that repeats it is refused as a duplicate, not taken as the id moving again."""
    from launcher.errors import ConfigError

    d = tmp_path / "src"
    d.mkdir()
    a, b, c = d / "a.jsonl", d / "b.jsonl", d / "c.jsonl"
    write(a, ROWS[:2])
    write(b, ROWS[2:3])
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    nights.plan()
    b.unlink()  # p002 leaves
    nights.plan()
    write(b, ROWS[2:3])  # and comes back: no id has left now
    nights.plan()
    write(c, [{"uid": "p002", "prompt": "again"}])
    with pytest.raises(ConfigError, match="duplicate id 'p002'"):
        nights.plan()


def test_hash_runs_longer_than_a_read_block_are_merged_whole_each_hash_spilled_once(tmp_path, monkeypatch):
    """launcher/ids/idruns.py merged: runs are read in blocks of 2**22 hashes (bounded memory); a run longer than a
    block is merged whole (a hash left out would make its id new again, a second shard for it), each hash spilled
    once."""
    from launcher.ids import idruns

    n = (1 << 22) + 5000
    long = np.arange(n, dtype=np.uint64) * np.uint64(2**64 // n)  # sorted, unique, in every bucket
    short = np.array([7, 2**63 + 1, 2**64 - 2], np.uint64)
    long.astype("<u8").tofile(tmp_path / "long.u64")
    short.astype("<u8").tofile(tmp_path / "short.u64")
    spilled, real = [0], idruns.Spill.add

    def add(self, hashes):
        spilled[0] += len(hashes)
        assert spilled[0] <= len(long) + len(short), "a hash spilled twice"
        real(self, hashes)

    monkeypatch.setattr(idruns.Spill, "add", add)
    idruns.merged([tmp_path / "long.u64", tmp_path / "short.u64"], tmp_path / "out.u64")
    out = np.fromfile(tmp_path / "out.u64", dtype="<u8")
    assert spilled[0] == len(long) + len(short)
    assert np.array_equal(out, np.insert(long, np.searchsorted(long, short), short))  # sorted, each hash once


def test_a_shards_fingerprint_is_the_sum_of_its_rows_hashes_however_the_map_reached_it(tmp_path, monkeypatch):
    """launcher/ids/rowhash.py shard_fingerprint: the sum of a shard's row hashes mod 2**64, 16 hex digits. A map
    that met an edit on a later night (its shard's sum updated by the row's change) gives each shard the
    fingerprint a map built afresh over the source as it is now gives: a map planned afresh (a damaged one) keeps
    a regenerated shard done."""
    from launcher.ids.rowhash import shard_fingerprint

    assert shard_fingerprint(0) == "v3-0000000000000000"
    assert shard_fingerprint(2**64 - 1) == "v3-ffffffffffffffff"
    assert shard_fingerprint(2**64 + 5) == "v3-0000000000000005"
    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # one read batch over shards 0, 1, 2
    nights = _Nights(tmp_path, monkeypatch, src, "run.stale=regenerate")
    nights.plan()
    edited = [*ROWS]
    edited[1] = {**ROWS[1], "prompt": "Osaka at night"}
    write(src, edited)
    later, _ = nights.plan()
    assert later.selected == [0]  # regenerated
    afresh, _ = _Nights(tmp_path, monkeypatch, src, out=str(tmp_path / "afresh")).plan()
    assert [(s.rows, s.fingerprint) for s in afresh.shards] == [(s.rows, s.fingerprint) for s in later.shards]


def test_a_night_that_only_removes_a_file_and_then_a_row_above_a_files_only_row_keep_every_shard(tmp_path, monkeypatch):
    """Two small nights: a file removed and nothing read (a run of no new id hashes is written, and read back the
    night after), then a row inserted above the only row of a file (its old map of one row, where each id read now
    is looked up). The old id keeps its shard, done; the new one gets a new shard."""
    d = tmp_path / "src"
    d.mkdir()
    a, b = d / "a.jsonl", d / "b.jsonl"
    write(a, ROWS[:1])
    write(b, ROWS[1:2])
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl")
    nights.plan()
    b.unlink()  # p001 leaves
    gone, read = nights.plan()
    assert read == [] and _shards(gone) == [(0, 2, "done")]
    write(a, [{"uid": "q0", "prompt": "a new first row"}, ROWS[0]])
    plan, _ = nights.plan()
    assert _shards(plan) == [(0, 2, "done"), (1, 1, "pending")]
    assert nights.rows(plan, 1) == [("q0", "a new first row")]


def test_a_source_cut_short_between_the_two_passes_is_refused(tmp_path, monkeypatch):
    """launcher/ids/idpass2.py: a shard whose last mapped row pass 2 never reads (the file lost its last rows after
    pass 1) is not handed over short: the run stops with the one line of a source changed while it was planned."""
    from launcher.errors import ConfigError

    src = tmp_path / "a.jsonl"
    write(src, ROWS)  # shards 0, 1, 2 (p008, p009)
    nights = _Nights(tmp_path, monkeypatch, src)
    plan, _ = nights.plan()
    write(src, ROWS[:9])  # p009 is gone: shard 2 would be p008 alone, and p009, back later, never generated
    with pytest.raises(ConfigError) as e:
        nights.rows(plan, 2)
    assert str(e.value) == (
        f"the prompt source {src} changed while this run was planned; run the same command again once it is complete"
    )


def _model_string_hash(s: str) -> int:
    """launcher/ids/rowhash.py's string hash, one string at a time, as its docstring describes it: the length times
    M1, then each 8-byte little-endian word of the first 256 bytes (the last one zero-padded) mixed in by
    multiply-xorshift; a longer string's whole text mixed in by pandas' hash; a final xorshift and multiply."""
    import pandas as pd

    m1, m2, mask = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 2**64 - 1
    data = s.encode()
    h = len(data) * m1 & mask
    for j in range(max(1, -(-min(len(data), 256) // 8))):
        word = int.from_bytes(data[8 * j : 8 * j + 8].ljust(8, b"\0"), "little")
        h = (h ^ word) * m2 & mask
        h ^= h >> 29
    if len(data) > 256:
        rest = int(pd.util.hash_pandas_object(pd.Series([s], dtype=object), index=False).iloc[0])
        h = (h ^ rest) * m2 & mask
    h ^= h >> 31
    return h * m1 & mask


def test_a_rows_hash_is_the_word_by_word_mix_its_docstring_describes():
    """The id map keeps row hashes from one night (and one release) to the next: a hash that changed its formula
    would find every row edited. launcher/ids/rowhash.py's vectorised hashes against a one-row-at-a-time model of
    what they are: each column's hash (strings word by word, an id by its file stem, an integer by pandas' hash)
    xored with the sha256 salt of its name (little-endian), mixed into the row's by multiply-xorshift in name
    order; a null adds nothing; `rejected` and `ref_loc` are left out."""
    import hashlib
    import re

    import pandas as pd

    from launcher.ids.rowhash import id_hashes, row_hashes
    from launcher.plan.shards import FILE_STEM_UNSAFE

    mix, mask = 0x9E3779B97F4A7C15, 2**64 - 1
    prompts = ["", "short", "eight by", "nine byte", "x" * 17, "y" * 256, "z" * 300, "é" * 130]
    rows = [
        {
            "id": f"id {k}/x" if k % 2 else f"id_{k}",
            "prompt": p,
            "seed": None if k % 3 else k * 1000,
            "ref_loc": "a",
            "rejected": None if k else "bad",
        }  # fmt: skip
        for k, p in enumerate(prompts)
    ]
    batch = pa.RecordBatch.from_pylist(rows)
    got = row_hashes(batch, id_hashes(batch.column("id")))

    def column_hash(name, value):
        if name == "id":
            return _model_string_hash(re.sub(FILE_STEM_UNSAFE, "_", value))
        if name == "seed":
            return int(pd.util.hash_pandas_object(pd.Series([value], dtype="int64"), index=False).iloc[0])
        return _model_string_hash(value)

    for k, r in enumerate(rows):
        out = 0
        for name in ("id", "prompt", "seed"):  # sorted by name; ref_loc and rejected are left out
            if r[name] is None:
                continue
            salt = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
            out = (out ^ column_hash(name, r[name]) ^ salt) * mix & mask
            out ^= out >> 31
        assert int(got[k]) == out, r


# ids room (second)


@pytest.mark.parametrize("setting", ["dataset.keep_columns", "dataset.prompt_column"])
def test_a_source_read_with_other_columns_is_read_again_and_its_done_shards_are_stale(tmp_path, monkeypatch, setting):
    """A row's hash covers what it gives its images (launcher/ids/rowhash.py), so another prompt column or a kept
    column added changes every row, as it changes a shard's fingerprint without ids (tests/test_outputs.py): every
    file is read again, whole (one unchanged, and one that grew: its old part was mapped as read before), its done
    shards stale (run.stale decides), and a pending shard's rows are the rows as they are read now, not refused in
    pass 2 as a source that changed while it was planned. The night after reads nothing again."""
    d = tmp_path / "src"
    d.mkdir()
    tagged = [{**r, "tag": f"tag {i}"} for i, r in enumerate(ROWS)]
    a, b = d / "a.jsonl", d / "b.jsonl"
    write(a, tagged[:8])  # shards 0, 1
    write(b, tagged[8:])  # shard 2
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "run.stale=regenerate")
    nights.plan()
    old_end = b.stat().st_size
    append(b, [{**r, "tag": f"more {i}"} for i, r in enumerate(MORE)])  # grown: shard 3, read from the old end
    assert nights.plan()[1] == [[old_end, 4]]
    del nights.states[2]  # shard 2's run failed
    if setting == "dataset.keep_columns":
        nights.cfg.dataset.keep_columns = ["tag"]
    else:
        nights.cfg.dataset.prompt_column = "tag"
    append(b, [{"uid": "r0", "prompt": "a new row", "tag": "new"}])  # b.jsonl grew again; a.jsonl is as it was
    plan, read = nights.plan()
    assert read == [[0, 8], [0, 7]]  # both files, whole, from their tops
    assert _shards(plan) == [(0, 4, "stale"), (1, 4, "stale"), (2, 2, "pending"), (3, 4, "stale"), (4, 1, "pending")]
    assert plan.selected == [0, 1, 2, 3, 4]
    rows = [_plan_rows(nights, plan, s) for s in (2, 4)]
    assert [[r["id"] for r in shard] for shard in rows] == [["p008", "p009"], ["r0"]]
    prompts = {"p008": ROWS[8]["prompt"], "p009": ROWS[9]["prompt"], "r0": "a new row"}
    tags = {"p008": "tag 8", "p009": "tag 9", "r0": "new"}
    if setting == "dataset.keep_columns":
        assert [(r["prompt"], r["tag"]) for s in rows for r in s] == [(prompts[k], tags[k]) for k in prompts]
    else:
        assert [r["prompt"] for s in rows for r in s] == list(tags.values())
    again, read = nights.plan()
    assert read == [] and [s.status for s in again.shards] == ["done"] * 5


def _plan_rows(nights, plan, shard: int) -> list[dict]:
    """A shard's rows as pass 2 writes them to the plan file, every column."""
    from launcher.plan.plan import PlanFile, write_plan_file

    write_plan_file(nights.store, "plans/t.arrow", nights.cfg, plan)
    return PlanFile(nights.store, "plans/t.arrow").shard(shard).rows


def test_hash_runs_are_only_read_and_a_run_of_no_hash_adds_none(tmp_path):
    """launcher/ids/idruns.py: a plan reads the runs of id hashes memory-mapped, read-only, so a run this account
    may not write (an output folder another account made, planned by a dry run) is read, not taken for a damaged
    map; a run of no hash (a night that read no new id) is an empty array: no hash is seen in it, and a merge of it
    adds none."""
    from launcher.ids.idruns import merged, open_runs, seen

    full, empty = tmp_path / "full.u64", tmp_path / "empty.u64"
    values = [3, 2**40, 2**63 + 5]
    np.array(values, np.uint64).astype("<u8").tofile(full)
    empty.write_bytes(b"")
    full.chmod(0o444)
    run, none = open_runs([full, empty])
    assert run.tolist() == values and not run.flags.writeable
    assert none.dtype == np.uint64 and len(none) == 0
    assert seen([none], np.array([0, 3], np.uint64)).tolist() == [False, False]
    merged([empty, full], tmp_path / "out.u64")
    assert np.fromfile(tmp_path / "out.u64", "<u8").tolist() == values
