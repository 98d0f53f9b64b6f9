"""Issue 32, finding 6: done means verified. A done shard's state records each file's size and sha256; every rerun
checks existence and sizes from listings (whatever the ledger's index says), `tools/status.py --verify` the
hashes, and the same command regenerates exactly the damaged shards."""

from __future__ import annotations

import hashlib
import importlib
import json
import shlex
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, launch, read_rows

from launcher.ledger.states import Ledger
from launcher.ledger.store import Store
from launcher.publish.card import card_text

# The default tiny job's 20 prompts in 5 shards of 4, with every kind of output file; one worker.
JOB = ("mesh.tp=1", "run.shard_size=4", "output.image_files=true", "output.webdataset=true")


@pytest.fixture
def status(monkeypatch, capsys):
    """status(out, *args) -> (exit code, stdout) of tools/status.py, run in this process as its script runs."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    module = importlib.import_module("status")

    def run(out, *args: str) -> tuple[int, str]:
        code = module.main([str(out), *args])
        return code, capsys.readouterr().out

    return run


def shard_files(out: Path, i: int) -> dict[str, bytes]:
    """Every file of shard i (data, images, webdataset), by its name in the folder, with its bytes."""
    names = [f"data/shard-{i:05d}.parquet", f"webdataset/shard-{i:05d}.tar"]
    names += [str(p.relative_to(out)) for p in sorted((out / "images" / f"shard-{i:05d}").glob("*"))]
    return {n: (out / n).read_bytes() for n in names if (out / n).exists()}


def damaged(out, status, *args: str) -> list[str]:
    code, text = status(out, "--json", *args)
    assert code == 0
    return [i for i, s in json.loads(text)["shards"].items() if s == "damaged"]


def test_a_done_state_records_each_file_with_its_size_and_sha256(run_job):
    out = run_job(*JOB)
    for i in range(5):
        state = json.loads((out / "state" / f"shard-{i:05d}.json").read_text())
        files = shard_files(out, i)
        assert len(files) == 1 + 4 + 1  # the Parquet, 4 images, the tar
        assert state["files"] == {n: [len(b), hashlib.sha256(b).hexdigest()] for n, b in files.items()}


def test_damaged_files_are_found_from_the_listing_and_regenerated_by_the_same_command(
    run_job, tiny_model, status, tmp_path
):
    clean = run_job(*JOB)
    out = tmp_path / "out"
    shutil.copytree(clean, out, ignore=shutil.ignore_patterns("locks"))
    parquet = out / "data" / "shard-00000.parquet"
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])  # 0: cut in half
    flipped = sorted((out / "images" / "shard-00001").glob("*.png"))[1]  # 1: one byte flipped, the same size
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (out / "data" / "shard-00002.parquet").unlink()  # 2: a Parquet deleted
    sorted((out / "images" / "shard-00003").glob("*.png"))[2].unlink()  # 3: an image file deleted
    before = {i: shard_files(out, i) for i in range(5)}  # 4: untouched

    # The index says every shard is done, and no state file is read: the damage is found from the listings.
    ledger = Ledger(Store(out))
    assert sorted(ledger.refresh()) == [0, 1, 2, 3, 4] and ledger.reads == 0

    assert damaged(out, status) == ["0", "2", "3"]
    assert damaged(out, status, "--verify") == ["0", "1", "2", "3"]
    code, text = status(out, "--verify")
    assert code == 0 and "1 done, 0 failed, 0 pending, 4 damaged" in text, text
    assert f"{flipped.relative_to(out)} has another sha256" in text and "shard-00002.parquet is missing" in text
    page = importlib.import_module("report").report_html(out)  # the report marks them as status does
    assert "5: 2 done, 0 failed, 0 pending, 3 damaged" in page
    assert [i for i in range(5) if f'<tr class="damaged"><td>{i}</td>' in page] == [0, 2, 3]
    card = card_text(Store(out))  # names the sound Parquet files only: `datasets` would fail on the cut one
    assert [i for i in range(5) if f"data/shard-{i:05d}.parquet" in card] == [1, 3, 4]

    res = launch(f"model.path={tiny_model}", *JOB, f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 damaged shards regenerated: [0, 2, 3]" in res.stderr, res.stderr[-3000:]
    after = {i: shard_files(out, i) for i in range(5)}
    assert after[1] == before[1] and after[4] == before[4]  # not rewritten (shard 1's flip needs --verify)
    rows, clean_rows = read_rows(out), read_rows(clean)
    for i in (0, 2, 3):
        assert after[i] == shard_files(clean, i)  # every file back, as the clean run wrote it
        table = pq.read_table(out / "data" / f"shard-{i:05d}.parquet")
        assert table.column("id").to_pylist() == [str(k) for k in range(4 * i, 4 * i + 4)]
        assert all(rows[k] == clean_rows[k] for k in table.column("id").to_pylist())
    assert damaged(out, status) == [] and damaged(out, status, "--verify") == ["1"]

    # The command that status prints regenerates the shard that only --verify finds, and nothing else.
    code, text = status(out, "--verify")
    command = shlex.split(text.strip().splitlines()[-1])
    assert command[0] == str(REPO / "launch.sh") and command[-1] == "run.shards=[1]", command
    # The run record names the folder it was made in (the clean run's): this copy is elsewhere.
    res = launch(*[a for a in command[1:] if not a.startswith("output.dir=")], f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    final = {i: shard_files(out, i) for i in range(5)}
    assert final[1] == shard_files(clean, 1) and all(final[i] == after[i] for i in (0, 2, 3, 4))
    assert damaged(out, status, "--verify") == []


def test_the_check_costs_one_listing_per_folder_whatever_the_number_of_shards(tmp_path, monkeypatch):
    from launcher.ledger.verify import index_form, listed_damage

    listings = []
    files = Store.files
    monkeypatch.setattr(Store, "files", lambda self, *a, **kw: listings.append(a) or files(self, *a, **kw))
    for n in (3, 60):
        store, states = Store(tmp_path / str(n)), {}
        for i in range(n):
            names = [f"data/shard-{i:05d}.parquet", f"webdataset/shard-{i:05d}.tar"]
            names += [f"images/shard-{i:05d}/{k}.png" for k in range(3)]
            for name in names:
                store.write_bytes(name, b"x" * i)
            states[i] = {"status": "done", "rows": 3, "files": {name: [i] for name in names}}
        (store.local(f"images/shard-{n - 2:05d}") / "1.png").unlink()
        listings.clear()
        assert listed_damage(store, states) == {n - 2: f"images/shard-{n - 2:05d}/1.png is missing"}
        assert sorted(listings) == [("data",), ("images",), ("webdataset",)]  # one each, recursive: not one per shard
    # As the ledger holds them (an image folder as its count and bytes): an image cut short is found too.
    (store.local("images/shard-00007") / "2.png").write_bytes(b"x" * 6)
    store.write_bytes("data/shard-00004.parquet", b"x" * 3)  # a file cut short: its size tells
    slim = {i: {**st, "files": index_form(st["files"])} for i, st in states.items()}
    assert slim[7]["files"]["images/shard-00007/"] == [3, 21]
    assert listed_damage(store, slim) == {
        4: "data/shard-00004.parquet has 3 bytes, its state recorded 4 bytes",
        7: "images/shard-00007/ holds 3 files of 20 bytes, its state recorded 3 files of 21 bytes",
        n - 2: f"images/shard-{n - 2:05d}/ holds 2 files of {2 * (n - 2)} bytes, its state recorded 3 files of "
        f"{3 * (n - 2)} bytes",
    }


def test_a_state_from_before_files_were_recorded_is_checked_for_its_parquet_only_where_it_recorded_its_size(tmp_path):
    """launcher/ledger/verify.py recorded: a done state without "files" (an earlier version's) names its Parquet
    file when it recorded data_bytes, and nothing otherwise; a failed state is not checked."""
    from launcher.ledger.verify import listed_damage

    store = Store(tmp_path)
    store.write_bytes("data/shard-00002.parquet", b"x")
    states = {
        0: {"status": "done", "rows": 2, "data_bytes": 10},  # its Parquet is gone
        1: {"status": "done", "rows": 2},  # nothing recorded: nothing to check
        2: {"status": "done", "rows": 2, "data_bytes": 10},  # there (its size was never recorded)
        3: {"status": "failed", "error": "x", "data_bytes": 10},
    }
    assert listed_damage(store, states) == {0: "data/shard-00000.parquet is missing"}


def test_states_from_before_files_were_recorded_are_checked_for_what_they_recorded(run_job, status, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_job(*JOB), out, ignore=shutil.ignore_patterns("locks"))
    for i in range(5):  # as earlier versions wrote them: no "files"; shard 2's without data_bytes either
        path = out / "state" / f"shard-{i:05d}.json"
        state = json.loads(path.read_text())
        del state["files"]
        if i == 2:
            del state["data_bytes"]
        path.write_text(json.dumps(state))
    (out / "data" / "shard-00000.parquet").unlink()  # recorded data_bytes: its Parquet must be there
    cut = out / "data" / "shard-00001.parquet"  # its size was never recorded: only --verify's footer read tells
    cut.write_bytes(cut.read_bytes()[:-100])
    (out / "data" / "shard-00002.parquet").unlink()  # nothing recorded: nothing to check, taken as done
    (out / "images" / "shard-00003" / "12.png").unlink()  # image files were never recorded
    assert damaged(out, status) == ["0"]
    assert damaged(out, status, "--verify") == ["0", "1"]


def test_the_summary_says_which_damaged_shards_were_regenerated_and_a_damaged_one_left_is_not_done(tmp_path):
    from launcher.host.summary import summarize
    from launcher.plan.plan import Plan, ShardPlan

    store = Store(tmp_path)
    old = {"status": "done", "rows": 2, "run_id": "old", "attempt": "old/g00000", "prompts_fingerprint": "fp"}
    store.write_json("state/shard-00000.json", {**old, "run_id": "now", "attempt": "now/g00000"})  # regenerated
    store.write_json("state/shard-00001.json", old)  # damaged, selected, not regenerated (a lost host)
    store.write_json("state/shard-00002.json", old)  # damaged, not selected
    plan = Plan([ShardPlan(i, 2, "fp", "damaged", "old/g00000") for i in range(3)], [0, 1], [])
    lines, record = summarize(store, Ledger(store), plan, "now", 0.0, 0, ["./launch.sh"])
    assert record["exit_code"] == 3 and record["not_done"]["pending"] == [1]
    assert record["damaged_regenerated"] == [0] and record["damaged"] == 2 and record["done"] == 1
    assert lines[0] == "shards: 1 done, 0 failed, 0 pending, 2 damaged"
    assert "1 damaged shards regenerated: [0]" in lines


@pytest.mark.parametrize(
    "files",
    [{"data/x.parquet": 5}, {"data/x.parquet": [5, 6]}, {"../../etc/passwd": [1, "ab"]}, {"state/x.json": [1]}],
    ids=["not-a-list", "hash-not-a-string", "outside-the-folder", "not-a-data-folder"],
)
def test_a_state_whose_files_are_not_files_of_a_shard_is_a_damaged_state(files):
    from launcher.ledger.states import parse_state

    state, why = parse_state(json.dumps({"status": "done", "rows": 1, "files": files}).encode())
    assert state is None and why.startswith("'files' holds"), why
