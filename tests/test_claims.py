"""The claim protocol and the lock it relies on, on a local store, in one process."""

import json

import pytest
from conftest import launch

from launcher.errors import ConfigError, LockHeld
from launcher.ledger.claims import Claims
from launcher.ledger.lock import RunLock, run_alive
from launcher.ledger.states import state_token
from launcher.ledger.store import Store
from launcher.sources.prompts import read_prompts


def test_a_live_claim_is_respected_and_a_dead_one_taken_over(tmp_path):
    store = Store(tmp_path)
    lock_a = RunLock(store, 0, "run-a")
    lock_a.acquire()
    a, b = Claims(store, 0, "run-a"), Claims(store, 1, "run-b")
    assert a.try_claim(3)
    assert run_alive(store, 0, "run-a") and not run_alive(store, 0, "run-x")
    assert not b.try_claim(3) and 3 in b.skipped  # run-a holds its lock: the claim is live
    lock_a.release()  # run-a dies
    assert not run_alive(store, 0, "run-a")
    assert b.try_claim(3)  # the next generation
    assert sorted(p.name for p in (tmp_path / "claims" / "shard-00003").iterdir()) == ["g00000.json", "g00001.json"]
    assert json.loads((tmp_path / "claims" / "shard-00003" / "g00001.json").read_text())["run_id"] == "run-b"
    b.release(3)
    assert not (tmp_path / "claims" / "shard-00003").exists()


def test_a_shard_finished_since_the_ledger_was_read_is_given_up(tmp_path):
    """Another attempt's done state (not the one this run's plan read) means someone finished it meanwhile,
    whatever either host's clock says; the state the plan read (or a failed one) is generated again."""
    store = Store(tmp_path)
    store.write_json("state/shard-00002.json", {"status": "done", "attempt": "night-1/g00000", "finished_at": 9e9})
    assert not Claims(store, 0, "late").try_claim(2, seen=None)  # the plan saw no state: finished meanwhile
    assert not Claims(store, 0, "late").try_claim(2, seen="night-0/g00003")  # another attempt's since
    assert Claims(store, 0, "all").try_claim(2, seen="night-1/g00000")  # the state it chose to redo (shards=all)
    assert not (tmp_path / "claims" / "shard-00002" / "g00001.json").exists()
    store.write_json("state/shard-00003.json", {"status": "failed", "attempt": "night-1/g00000"})
    assert Claims(store, 0, "retry").try_claim(3, seen=None)  # failed since: still ours to generate
    legacy = {"status": "done", "finished_at": 100.0}  # written before attempts were recorded
    store.write_json("state/shard-00004.json", legacy)
    assert Claims(store, 0, "x").try_claim(4, seen=state_token(legacy))
    assert not Claims(store, 0, "y").try_claim(4, seen=state_token({"status": "done", "finished_at": 99.0}))


def test_a_claim_taken_over_is_no_longer_held(tmp_path):
    store = Store(tmp_path)
    a, b = Claims(store, 0, "run-a"), Claims(store, 1, "run-b")
    assert a.try_claim(5) and a.still_held(5) and a.attempt(5) == "run-a/g00000"
    assert b.try_claim(5)  # run-a holds no lock here: it looks dead to run-b, which takes over
    assert not a.still_held(5) and b.still_held(5) and b.attempt(5) == "run-b/g00001"
    a.drop(5)  # run-a leaves the shard alone: nothing of run-b's is deleted
    assert sorted(p.name for p in (tmp_path / "claims" / "shard-00005").iterdir()) == ["g00000.json", "g00001.json"]


def test_a_second_lock_names_the_holder(tmp_path):
    store = Store(tmp_path)
    with RunLock(store, 0, "first"):
        with pytest.raises(LockHeld, match=r"workers.index=0.*pid \d+"):
            RunLock(store, 0, "second").acquire()
        other = RunLock(store, 1, "other-index")
        other.acquire()  # other worker indexes never block each other
        other.release()  # its heartbeat thread and flock end with the test


def test_exclusive_create_never_shows_a_partial_file(tmp_path):
    store = Store(tmp_path)
    assert store.create_exclusive("x/y.json", b'{"a": 1}')
    assert not store.create_exclusive("x/y.json", b'{"a": 2}')
    assert store.read_json("x/y.json") == {"a": 1}
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["y.json"]  # no temporary file left


@pytest.mark.parametrize("when", ["inside-mkdir", "after-mkdir"])
def test_a_claim_survives_a_peer_removing_the_shards_empty_folder(tmp_path, monkeypatch, when):
    """A dp replica that finished shard 2 removes claims/shard-00002 once empty, just as another replica claims
    the shard (seen in `make test`: the claimer crashed with FileExistsError, and the job with it). The claim is
    made; the shard's done state then makes the claimer give it up."""
    from pathlib import Path

    store = Store(tmp_path)
    folder = tmp_path / "claims" / "shard-00002"
    folder.mkdir(parents=True)
    real_mkdir, removed = Path.mkdir, []

    def peer_removes(self, *args, **kwargs):
        if self == folder and not removed:  # the peer's rmdir lands in the middle, once
            removed.append(True)
            if when == "inside-mkdir":  # mkdir found the folder; is_dir() then finds none: pathlib raises
                folder.rmdir()
                raise FileExistsError(17, "File exists", str(folder))
            real_mkdir(self, *args, **kwargs)
            folder.rmdir()  # between our mkdir and our open
            return
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", peer_removes)
    store.write_json("state/shard-00002.json", {"status": "done", "attempt": "run-a/g00000"})
    late = Claims(store, 1, "run-a")
    assert not late.try_claim(2, seen=None) and removed  # claimed, then given up: it is done
    assert not folder.exists() and not late.held


def test_ids_that_collide_as_file_names_are_refused(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "key": "a/b"}\n{"prompt": "b", "key": "a_b"}\n')
    with pytest.raises(ConfigError, match=r"'a/b' and 'a_b' both become the file name a_b.png"):
        read_prompts(str(tmp_path / "p.jsonl"), id_column="key")


def test_a_lower_dataset_limit_keeps_done_shards_done(run_job, tiny_model, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run_job(), out)
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "dataset.limit=12")  # cuts shard 1 in half
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nothing to do" in res.stderr
    assert "shards: 2 done, 0 failed, 0 pending" in res.stderr  # the cut shard counts as done, not stale


def test_claim_edges_out_of_space_a_lost_create_and_the_finish_boundary(tmp_path):
    import errno

    from launcher.ledger.claims import held_elsewhere

    class Full(Store):
        def create_exclusive(self, rel, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    full = Claims(Full(tmp_path), 0, "r")
    assert full.out_of_space is False
    assert full.try_claim(0) is False and full.out_of_space is True

    class Broken(Store):
        def create_exclusive(self, rel, data):
            raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError, match="I/O error"):
        Claims(Broken(tmp_path), 0, "r").try_claim(0)

    class Rival(Store):  # another worker creates the same generation between our listing and our create
        def create_exclusive(self, rel, data):
            super().create_exclusive(rel, b'{"worker": 9, "run_id": "rival"}')
            return super().create_exclusive(rel, data)

    loser = Claims(Rival(tmp_path), 0, "r")
    assert loser.try_claim(1) is False and loser.skipped == {1} and loser.held == {}
    (tmp_path / "claims" / "shard-00001" / ".g00001.json.tmp-1").write_text("")  # a killed writer's leftover
    winner = Claims(Store(tmp_path), 0, "r")
    winner.skipped.add(1)
    assert winner.try_claim(1) and winner.skipped == set() and winner.held == {1: 1}  # the rival's run is dead
    assert held_elsewhere(Store(tmp_path), 1, "r") is None  # our own claim
    assert held_elsewhere(Store(tmp_path), 1, "another") is None  # run r holds no lock: dead
    store = Store(tmp_path)
    store.write_json("state/shard-00007.json", {"status": "done", "finished_at": 200.0})
    assert not Claims(store, 0, "a").try_claim(7, seen=None)  # done since the plan read it: by another
    store.write_json("state/shard-00008.json", {"status": "failed"})  # no finish time (an old state file)
    assert Claims(store, 0, "b").try_claim(8, seen=None)


@pytest.mark.parametrize("where", ["disk", "s3", "gs"])
def test_the_end_of_a_run_deletes_dead_claims_and_keeps_live_ones(where, tmp_path, request):
    """A run killed between a shard's state and its claim's release leaves the claim on a done shard, which no
    later run claims again: the end of a run that shares the folder with no live run deletes it (and on disk the
    empty folders), and keeps a live run's claim. Seen once as a finished folder that kept claims/ (test_faults)."""
    from launcher.plan.plan import plan_rel, tidy

    if where != "disk":
        request.getfixturevalue({"s3": "s3", "gs": "gcs"}[where])  # the local S3 or GCS server
    store = Store(str(tmp_path) if where == "disk" else f"{where}://meshgen-test/tidy")
    store.write_json("state/shard-00001.json", {"status": "done", "attempt": "killed/g00000"})
    assert Claims(store, 0, "killed").try_claim(1, seen="killed/g00000")  # run "killed" holds no lock: dead
    live, ending = RunLock(store, 3, "live"), RunLock(store, 0, "ending")  # `ending`: the run whose end it is
    live.acquire()
    ending.acquire()
    for run in ("killed", "live", "ending"):  # each run's plan file; and a stranger's file in plans/
        store.write_bytes(plan_rel(run), run.encode())
    store.write_bytes("plans/notes.txt", b"not a plan")
    try:
        assert Claims(store, 3, "live").try_claim(4)
        tidy(store, ending)
        left = [f.base_name for i in (1, 4) for f in store.files(f"claims/shard-{i:05d}")]
        assert left == ["g00000.json"] and store.read_json("claims/shard-00004/g00000.json")["run_id"] == "live"
        if where == "disk":
            assert not (tmp_path / "claims" / "shard-00001").exists()
        # the killed run's plan and the ending run's own go; the live run's stays, as does what is no plan
        assert sorted(f.base_name for f in store.files("plans")) == ["live.arrow", "notes.txt"]
        assert store.read_bytes(plan_rel("live")) == b"live"
    finally:
        live.release()
    tidy(store, ending)
    ending.release()
    assert store.files("claims/shard-00004") == []
    assert [f.base_name for f in store.files("plans")] == ["notes.txt"]
    if where == "disk":
        assert not (tmp_path / "claims").exists() and (tmp_path / "plans").is_dir()  # plans/ is not empty
