"""Fast tests of publishing (launcher/publish/push.py, push_targets.py) in this process, from a run folder written
here by hand as DESIGN.md lays it out (run.json, state/shard-N.json with each file's [size, sha256], data/, images/),
to a folder target: which files go, in which batches, what a second push sends, and what it removes. The Hub and
object-store targets are run end to end in test_publish.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

import pytest
from conftest import until

from launcher.errors import ConfigError


def shard(run: Path, index: int, files: dict[str, bytes], status: str = "done", record: dict | None = None) -> None:
    """A shard's files and its state, which records each file's size and sha256 (or `record` as given)."""
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    entries = record or {n: [len(d), hashlib.sha256(d).hexdigest()] for n, d in files.items()}
    (run / "state").mkdir(parents=True, exist_ok=True)
    state = {"status": status, "rows": 1, "files": entries}
    (run / "state" / f"shard-{index:05d}.json").write_text(json.dumps(state))


@pytest.fixture
def run(tmp_path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    shard(out, 0, {"data/shard-00000.parquet": b"P0", "images/shard-00000/a.png": b"img-a"})
    shard(out, 1, {"data/shard-00001.parquet": b"P1-longer"})
    shard(out, 2, {"data/shard-00002.parquet": b"P2"}, status="failed")
    (out / "logs").mkdir()
    (out / "logs" / "w.log").write_text("never sent")
    return out


def parquet_bytes(ids: list[str]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids}), buf)
    return buf.getvalue()


def as_written(run: Path) -> tuple[bytes, bytes]:
    """The run folder's run.json and shards 0 and 1 as a run writes them (the card reads both); their Parquet bytes."""
    config = {"name": "job", "device": "cpu", "model": {"path": "org/model", "dtype": "bfloat16"}, "job": "t2i"}
    config |= {"dataset": {"path": "/d/p.txt"}, "mesh": {"dp": 1, "tp": 2}, "generate": {"batch_size": 2}}
    meta = {"shards": 3, "shard_size": 2, "config": config, "settings": {"model": {}, "generate": {}}}
    (run / "run.json").write_text(json.dumps(meta))
    p0, p1 = parquet_bytes(["a", "b"]), parquet_bytes(["c"])
    shard(run, 0, {"data/shard-00000.parquet": p0, "images/shard-00000/a.png": b"img-a"})
    shard(run, 1, {"data/shard-00001.parquet": p1})
    return p0, p1


def sent_files(site: Path) -> dict[str, bytes]:
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()}


def test_a_push_sends_each_done_shards_recorded_files_once_and_nothing_else(run, tmp_path):
    from launcher.publish.push import publish

    site = tmp_path / "site"
    said = []
    sent = publish(str(run), str(site), card=False, say=said.append)
    assert sent == {"shards": 2, "files": 3, "bytes": 2 + 5 + 9, "card": False}
    files = sent_files(site)
    manifests = {n: json.loads(files.pop(n)) for n in list(files) if n.startswith(".meshgen-published/")}
    assert files == {
        "data/shard-00000.parquet": b"P0",
        "images/shard-00000/a.png": b"img-a",
        "data/shard-00001.parquet": b"P1-longer",
    }
    assert manifests[".meshgen-published/shard-00001.json"] == {
        "data/shard-00001.parquet": [9, hashlib.sha256(b"P1-longer").hexdigest()]
    }
    assert set(manifests) == {".meshgen-published/shard-00000.json", ".meshgen-published/shard-00001.json"}
    assert said == [f"{site}: commit 1/1: shards 0..1 (2) (3 files)"]
    # the same push again: everything there is the same size and hash
    assert publish(str(run), str(site), card=False) == {"shards": 0, "files": 0, "bytes": 0, "card": False}


def test_a_regenerated_shard_replaces_its_files_and_removes_those_it_no_longer_has(run, tmp_path):
    from launcher.publish.push import publish

    site = tmp_path / "site"
    publish(str(run), str(site), card=False)
    (site / "images" / "shard-00001").mkdir(parents=True)
    (site / "images" / "shard-00001" / "someone-elses.png").write_bytes(b"x")  # not in the shard's files
    (site / "data" / "shard-000010.parquet").write_bytes(b"x")  # shard 10's place, not shard 1's
    (run / "images" / "shard-00000" / "a.png").unlink()
    shard(run, 0, {"data/shard-00000.parquet": b"P0-new"})  # regenerated with its images embedded
    sent = publish(str(run), str(site), only=[0, 1], card=False)
    assert sent == {"shards": 2, "files": 1, "bytes": 6, "card": False}
    assert sent_files(site)["data/shard-00000.parquet"] == b"P0-new"
    assert not (site / "images" / "shard-00000" / "a.png").exists()
    assert not (site / "images" / "shard-00001" / "someone-elses.png").exists()
    assert (site / "data" / "shard-000010.parquet").exists()


def test_a_damaged_shard_is_left_out_with_a_warning_and_no_images_keeps_a_shard_without_data(run, tmp_path, caplog):
    from launcher.ledger.store import Store
    from launcher.publish.push import dataset_shards, publish

    (run / "data" / "shard-00001.parquet").write_bytes(b"cut")  # 3 bytes where its state recorded 9
    shard(run, 3, {"images/shard-00003/b.png": b"only-images"})  # output.parquet=false: the images are the dataset
    with caplog.at_level(logging.WARNING):
        shards = dataset_shards(Store(run), images=False)
    assert {s.index: sorted(s.files) for s in shards} == {
        0: ["data/shard-00000.parquet"],
        3: ["images/shard-00003/b.png"],
    }
    assert "data/shard-00001.parquet has 3 bytes, its state recorded 9 bytes" in caplog.text
    assert [s.index for s in dataset_shards(Store(run), only=[3, 2, 1])] == [3]
    assert publish(str(run), str(tmp_path / "site"), images=False, card=False)["files"] == 2


def test_batches_hold_whole_shards_within_the_file_and_byte_bounds(monkeypatch):
    from launcher.publish import push as publish
    from launcher.publish.targets import StoreTarget

    class Target:
        same = staticmethod(StoreTarget.same)

        def listing(self):
            return {"data/shard-00001.parquet": (1, "h"), "data/shard-00004.parquet": (9, "old")}

    monkeypatch.setattr(publish, "COMMIT_FILES", 3)
    monkeypatch.setattr(publish, "COMMIT_BYTES", 100)
    one = {"data/shard-00000.parquet": (10, "a"), "images/shard-00000/x.png": (10, "b")}
    same = {"data/shard-00001.parquet": (1, "h")}  # at the target already: no batch
    four = {f"images/shard-00002/{i}.png": (1, str(i)) for i in range(4)}  # past the file bound: a batch alone
    big = {"data/shard-00003.parquet": (90, "c"), "webdataset/shard-00003.tar": (5, "d")}
    # shards 3 and 4 together are 3 files of 100 bytes: at both bounds, not past them
    changed = {"data/shard-00004.parquet": (5, "new")}
    shards = [publish.ShardFiles(i, f) for i, f in enumerate([one, same, four, big, changed])]
    batches = publish.plan_batches(shards, Target())
    assert [b.shards for b in batches] == [[0], [2], [3, 4]]
    assert sorted(batches[2].send) == [
        "data/shard-00003.parquet",
        "data/shard-00004.parquet",
        "webdataset/shard-00003.tar",
    ]
    assert [b.nbytes for b in batches] == [20, 4, 100] and batches[2].files[4] == changed
    assert publish._span([3]) == "3" and publish._span([3, 4, 9]) == "3..9 (3)"


def test_a_target_inside_the_run_or_of_another_kind_is_refused_before_anything_is_sent(run, tmp_path):
    from launcher.publish.push import publish

    for target, words in (
        (str(run / "pub"), f"cannot publish {run} into itself"),
        (str(run), f"cannot publish {run} into itself"),
        ("ftp://host/x", "cannot publish to ftp://host/x: give hf://datasets/ORG/NAME, s3://BUCKET/PATH"),
        ("hf://datasets/only-one-part", "a Hub target is hf://datasets/ORG/NAME (or ...@REVISION)"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            publish(str(run), target)
    assert not (run / "pub").exists()
    with pytest.raises(ConfigError, match="has no run.json: is it a meshgen output folder"):
        publish(str(tmp_path), str(tmp_path / "site"))
    assert publish(str(run), str(tmp_path / "runs-sibling"), card=False)["shards"] == 2  # a prefix, not inside


def test_the_publish_command_says_what_it_sent_and_exits_0_2_or_3(run, tmp_path, capsys, monkeypatch):
    """`python -m tools.publish OUTPUT_DIR TARGET` (launcher/publish/push.py main): 0 with a line of what was sent;
    2 and one line for a refusal before anything is sent; 3 and one line when the push stops part way."""
    from launcher.publish import push as publish

    p0, p1 = as_written(run)
    site = tmp_path / "site"
    assert publish.main([str(run), str(site), "--no-images"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{site}: sent 2 files of 2 shards ({len(p0) + len(p1)} bytes) and the card"
    card = (site / "README.md").read_text()
    assert not (site / "images").exists() and "# job: images generated with `org/model`" in card
    assert publish.main([str(run), str(site), "--images"]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said == f"{site}: sent 1 files of 1 shards (5 bytes) (the card was up to date)"
    assert publish.main([str(tmp_path / "nothing"), str(site)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tmp_path / 'nothing'} has no run.json: is it a meshgen output folder? (give the run's output.dir)"
    ]

    def broken(self, run, batch, message):
        raise ConnectionError("reset by peer\nmore lines")

    from launcher.publish.targets import StoreTarget

    monkeypatch.setattr(StoreTarget, "push", broken)
    assert publish.main([str(run), str(tmp_path / "other")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: the push to {tmp_path / 'other'} stopped (reset by peer); what reached it is whole: run the same "
        "command to finish it"
    ]


def test_a_bucket_target_takes_each_file_as_an_object_and_a_missing_bucket_is_one_line(run, s3, tmp_path):
    """An object-store target (the local S3 server): each file one object, beside them the manifests with the files'
    sizes and sha256; the next push compares with them and sends nothing; a target in a bucket that does not exist
    is refused before anything is sent."""
    import boto3

    from launcher.publish.push import publish

    target = "s3://meshgen-test/published/set"
    assert publish(str(run), target, card=False)["files"] == 3
    s3c = boto3.client("s3")
    listed = s3c.list_objects_v2(Bucket="meshgen-test", Prefix="published/set/")["Contents"]
    keys = {o["Key"].removeprefix("published/set/"): o for o in listed}
    assert set(keys) == {
        "data/shard-00000.parquet",
        "images/shard-00000/a.png",
        "data/shard-00001.parquet",
        ".meshgen-published/shard-00000.json",
        ".meshgen-published/shard-00001.json",
    }
    body = s3c.get_object(Bucket="meshgen-test", Key="published/set/data/shard-00001.parquet")["Body"].read()
    assert body == b"P1-longer"
    assert publish(str(run), target, card=False)["files"] == 0
    for f in (p for p in run.rglob("*") if p.is_file()):  # the same run kept in the bucket: object to object
        s3c.put_object(Bucket="meshgen-test", Key=f"runs/a/{f.relative_to(run)}", Body=f.read_bytes())
    assert publish("s3://meshgen-test/runs/a", "s3://meshgen-test/published/copy", card=False)["files"] == 3
    body = s3c.get_object(Bucket="meshgen-test", Key="published/copy/images/shard-00000/a.png")["Body"].read()
    assert body == b"img-a"
    with pytest.raises(ConfigError, match=r"^cannot publish to s3://no-such-bucket/x: bucket no-such-bucket does not "):
        publish(str(run), "s3://no-such-bucket/x", card=False)


@pytest.fixture
def hub_here(hub, monkeypatch):
    """The fake Hub (tests/fake_hub.py) for huggingface_hub in this process: its endpoint, a write token, no Xet
    (the fake speaks LFS), a 2 s wait; constants read at import are set where huggingface_hub reads them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    monkeypatch.setenv("HF_TOKEN", "wtok")
    return hub


def test_a_hub_push_is_one_commit_of_lfs_files_a_batch_and_a_second_push_sends_nothing(run, hub_here, monkeypatch):
    """targets.py's words: each batch is one commit, its LFS files pre-uploaded first; a file on the Hub is the same
    by its LFS sha256 (a git file by its blob id), so a second push sends nothing; a regenerated shard's old files
    go in its commit."""
    from conftest import REPO_ID, TARGET

    from launcher.publish import push

    repo = hub_here.repos[f"datasets/{REPO_ID}"]
    monkeypatch.setattr(push, "COMMIT_FILES", 2)  # shard 0's two files, then shard 1's one: two commits
    assert push.publish(str(run), TARGET, card=False) == {"shards": 2, "files": 3, "bytes": 16, "card": False}
    assert repo.files == {
        "data/shard-00000.parquet": b"P0",
        "images/shard-00000/a.png": b"img-a",
        "data/shard-00001.parquet": b"P1-longer",
    }
    assert [sorted(op["value"]["path"] for op in c["ops"]) for c in repo.commits] == [
        ["data/shard-00000.parquet", "images/shard-00000/a.png"],
        ["data/shard-00001.parquet"],
    ]
    assert all(op["key"] == "lfsFile" for c in repo.commits for op in c["ops"])
    assert len(hub_here.requested("PUT")) == 3  # each file's bytes uploaded once, before its commit
    assert push.publish(str(run), TARGET, card=False)["files"] == 0 and len(repo.commits) == 2
    (run / "images" / "shard-00000" / "a.png").unlink()
    shard(run, 0, {"data/shard-00000.parquet": b"P0-new"})
    assert push.publish(str(run), TARGET, only=[0], card=False)["files"] == 1
    assert sorted(repo.files) == ["data/shard-00000.parquet", "data/shard-00001.parquet"]
    assert repo.files["data/shard-00000.parquet"] == b"P0-new"


def test_a_hub_commit_answered_429_is_sent_again_when_its_limit_resets(run, hub_here, monkeypatch, caplog):
    from conftest import REPO_ID, TARGET

    from launcher.publish import targets
    from launcher.publish.push import publish

    waits = []
    monkeypatch.setattr(targets.time, "sleep", waits.append)
    hub_here.fail_commits = 2
    with caplog.at_level(logging.WARNING):
        assert publish(str(run), TARGET, card=False)["files"] == 3
    assert hub_here.fail_commits == 0 and len(hub_here.repos[f"datasets/{REPO_ID}"].commits) == 1
    assert len(waits) == 2 and f"{TARGET}: commit answered 429; sending it again in" in caplog.text


def test_a_hub_commit_answered_5xx_waits_1_then_2_s_and_one_answered_403_is_not_sent_again(
    run, hub_here, monkeypatch, caplog
):
    """targets.py: a commit the Hub answers 429 or 5xx is sent again, after the wait its rate limit names, else
    2**attempt seconds (1, 2, ...); any other refusal is final at once."""
    from conftest import REPO_ID, TARGET

    from launcher.publish import targets
    from launcher.publish.push import publish

    waits = []
    monkeypatch.setattr(targets.time, "sleep", waits.append)
    hub_here.fail_commits, hub_here.fail_status = 2, 503
    with caplog.at_level(logging.WARNING):
        assert publish(str(run), TARGET, card=False)["files"] == 3
    assert waits == [1, 2] and f"{TARGET}: commit answered 503; sending it again in 1 s" in caplog.text
    commits = [p for p in hub_here.requested("POST") if "/commit/" in p]
    hub_here.refuse_commits = True
    shard(run, 1, {"data/shard-00001.parquet": b"P1-new"})
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError, match="403"):
        publish(str(run), TARGET, only=[1], card=False)
    assert len([p for p in hub_here.requested("POST") if "/commit/" in p]) == len(commits) + 1 and waits == [1, 2]
    assert len(hub_here.repos[f"datasets/{REPO_ID}"].commits) == 1


def test_a_hub_push_to_a_branch_with_a_fine_grained_token_sends_everything_to_that_branch(run, hub_here, monkeypatch):
    """`hf://datasets/ORG/NAME@REVISION`: the probe, the upload modes and the commit all name the revision; a
    fine-grained token (role `fineGrained`, its rights per repo) is let through to the commit, which says."""
    from conftest import REPO_ID, TARGET

    from launcher.publish.push import publish

    hub_here.repos[f"datasets/{REPO_ID}"].revisions["v2"] = {}
    hub_here.tokens["ftok"] = "fineGrained"
    monkeypatch.setenv("HF_TOKEN", "ftok")
    assert publish(str(run), f"{TARGET}@v2", card=False)["files"] == 3
    posts = hub_here.requested("POST")
    assert [p for p in posts if "/preupload/" in p] and [p for p in posts if "/commit/" in p]
    assert all(p.endswith("/v2") for p in posts if "/preupload/" in p or "/commit/" in p), posts


@pytest.mark.parametrize(
    ("target", "token", "line"),
    [
        ("hf://datasets/org/ds", "", "publishing to org/ds on {url} needs a token: log in (hf auth login) or set "),
        ("hf://datasets/org/ds", "rtok", "publishing to org/ds on {url}: the token is read-only; use a token that "),
        ("hf://datasets/org/ds@v2", "wtok", "org/ds on {url} has no revision v2: create the branch or drop @v2"),
        ("hf://datasets/org/missing", "wtok", "org/missing on {url} is not a dataset repo (or a private one this "),
        ("hf://datasets/org/ds", "wrong", "org/ds on {url} refused the token (401: "),
        ("hf://org/ds", "wtok", "cannot publish to hf://org/ds: a Hub target is hf://datasets/ORG/NAME (or ..."),
    ],
)
def test_a_hub_target_that_cannot_take_the_push_is_one_line_before_anything_is_sent(
    run, hub_here, monkeypatch, target, token, line
):
    from huggingface_hub import constants

    from launcher.publish.push import publish

    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(run / "no-saved-token"))
    with pytest.raises(ConfigError) as e:
        publish(str(run), target, card=False)
    assert str(e.value).startswith(line.format(url=hub_here.url))
    assert hub_here.requested("POST") == [] and hub_here.requested("PUT") == []


@pytest.mark.parametrize(
    ("run_json", "why"),
    [
        (b"{}", "no shard count, config and settings"),
        (b'{"shards": "3", "config": {}, "settings": {}}', "no shard count, config and settings"),
        (b"\xff not json", "not JSON: "),
    ],
)
def test_a_card_of_a_run_json_meshgen_did_not_write_is_one_line(run, tmp_path, capsys, run_json, why):
    """A run.json that is not meshgen's (a project's own file, a damaged one) is one line naming it, exit 2, from
    the card and the publish tool alike: never a traceback, never "the push stopped"."""
    from launcher.publish import card, push

    (run / "run.json").write_bytes(run_json)
    line = f"error: {run}/run.json is not one meshgen wrote ({why}"
    assert card.main([str(run)]) == 2
    assert capsys.readouterr().err.startswith(line)
    assert push.main([str(run), str(tmp_path / "site")]) == 2
    [said] = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(line) and said.endswith("); give a meshgen run's output.dir")
    assert not (tmp_path / "site").exists()  # refused before anything was sent


def test_a_run_pushes_its_shards_as_they_are_done_and_the_rest_and_the_card_at_the_end(run, tmp_path, caplog):
    """publish/run.py's words (output.publish): each shard offered is pushed once, in the background; a failed push
    stops the pushing and is tried again whole at the end, and if that fails too, the run's last line names it
    and how to finish it."""
    from omegaconf import OmegaConf

    from launcher.ledger.store import Store
    from launcher.publish.run import start_publisher

    assert start_publisher(OmegaConf.create({"output": {"publish": None}}), Store(str(run))) is None
    as_written(run)
    site = tmp_path / "site"
    pub = start_publisher(OmegaConf.create({"output": {"publish": str(site)}}), Store(str(run)))
    pub.offer([0])
    until(lambda: pub.sent == {0})
    assert (site / "data" / "shard-00000.parquet").exists() and not (site / "data" / "shard-00001.parquet").exists()
    assert not (site / "README.md").exists()  # the card at the end, once: not with each shard
    pub.offer([0, 1])
    until(lambda: pub.sent == {0, 1})
    assert pub.finish() is None and (site / "README.md").exists()

    broken = tmp_path / "broken"
    pub = start_publisher(OmegaConf.create({"output": {"publish": str(broken)}}), Store(str(run)))
    broken.mkdir(exist_ok=True)
    (broken / "data").write_bytes(b"a file where the target's data folder goes")
    with caplog.at_level(logging.WARNING):
        pub.offer([1])
        until(lambda: pub.error is not None)
    assert f"the push of shards [1] to {broken} failed" in caplog.text
    pub.offer([0])  # after a failure nothing more is pushed during the run
    last = pub.finish()  # the whole push at the end fails too
    assert pub.sent == set() and last.startswith(f"the push to output.publish={broken} failed (")
    assert last.endswith(
        f"the generated shards are kept: run the same command, or python -m tools.publish {run} {broken}, to finish it"
    )
    mended = tmp_path / "mended"
    pub = start_publisher(OmegaConf.create({"output": {"publish": str(mended)}}), Store(str(run)))
    mended.mkdir(exist_ok=True)
    (mended / "data").write_bytes(b"in the way")
    pub.offer([1])
    until(lambda: pub.error is not None)
    (mended / "data").unlink()  # the target takes files again: the offer after the failure still waits for the end
    pub.offer([0])
    assert pub.finish() is None and pub.sent == set()
    assert (mended / "data" / "shard-00000.parquet").exists() and (mended / "data" / "shard-00001.parquet").exists()


def test_shards_offered_while_a_push_is_under_way_all_go_next_and_a_wordless_failure_is_named(
    run, tmp_path, monkeypatch
):
    """publish/run.py: shards offered one look after another while a push is under way are pushed together next,
    none dropped, and the shard being pushed (each look offers every done shard) is not pushed again; a push that
    fails with an error of no words names the error's type in the run's last line."""
    import threading

    from omegaconf import OmegaConf

    from launcher.ledger.store import Store
    from launcher.publish import run as publish_run

    as_written(run)
    shard(run, 2, {"data/shard-00002.parquet": parquet_bytes(["d"])})
    real, calls, entered, release = publish_run.publish, [], threading.Event(), threading.Event()

    def held(*args, **kw):  # the first push waits until both offers below were made
        calls.append(kw.get("only"))
        if len(calls) == 1:
            entered.set()
            assert release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(publish_run, "publish", held)
    pub = publish_run.start_publisher(
        OmegaConf.create({"output": {"publish": str(tmp_path / "site")}}), Store(str(run))
    )
    pub.offer([0])
    assert entered.wait(30)
    pub.offer([0, 1])  # the progress's looks: every done shard of the run each time
    pub.offer([0, 1, 2])
    release.set()
    until(lambda: len(calls) == 2)
    assert pub.finish() is None and calls == [[0], [1, 2], None] and pub.sent == {0, 1, 2}

    def wordless(*args, **kw):
        raise TimeoutError()

    monkeypatch.setattr(publish_run, "publish", wordless)
    site = tmp_path / "other"
    pub = publish_run.start_publisher(OmegaConf.create({"output": {"publish": str(site)}}), Store(str(run)))
    assert pub.finish().startswith(f"the push to output.publish={site} failed (TimeoutError); the generated shards")


def test_the_publish_tools_help_names_its_arguments_and_its_image_flags_exclude_each_other(capsys, monkeypatch):
    """DESIGN: `python -m tools.publish OUTPUT_DIR TARGET`; docs/operations.md: image files unless --no-images."""
    from launcher.publish import push

    with pytest.raises(SystemExit) as e:
        push.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert e.value.code == 0
    assert out.startswith("usage: python -m tools.publish [-h] [--images | --no-images] output_dir target")
    for said in (
        "`python -m tools.publish OUTPUT_DIR TARGET`: 0 all pushed; 2 a refusal before anything was sent",
        "output_dir the run's output.dir: a local folder, s3:// or gs://",
        "target hf://datasets/ORG/NAME[@REVISION], s3://BUCKET/PATH or gs://BUCKET/PATH",
        "--images image files (default)",
        "--no-images not the image files",
    ):
        assert said in out, said
    with pytest.raises(SystemExit) as e:
        push.main(["out", "s3://b/p", "--images", "--no-images"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    asked = []
    sent = {"files": 0, "shards": 0, "bytes": 0, "card": False}
    monkeypatch.setattr(push, "publish", lambda out, target, images, say: asked.append(images) or sent)
    for flags, images in (([], None), (["--images"], True), (["--no-images"], False)):
        assert push.main(["out", "s3://b/p", *flags]) == 0
        assert asked.pop() is images
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "s3://b/p: sent 0 files of 0 shards (0 bytes) (the card was up to date)"
    )


def test_a_hub_push_sends_the_card_once_and_an_unchanged_card_never_again(run, hub_here):
    """targets.py: the card is one commit after the shards; the Hub's README.md, the same bytes (its blob id), is
    not sent again by the next push."""
    from conftest import REPO_ID, TARGET

    from launcher.publish.push import publish

    as_written(run)
    repo = hub_here.repos[f"datasets/{REPO_ID}"]
    assert publish(str(run), TARGET)["card"] is True
    sent = len(repo.commits)
    assert repo.files["README.md"].startswith(b"---\n") and repo.commits[-1]["header"]["summary"] == (
        "meshgen: dataset card"
    )
    assert publish(str(run), TARGET)["card"] is False and len(repo.commits) == sent


def test_the_card_goes_to_the_file_given_or_into_the_run_folder(run, tmp_path):
    from launcher.publish.card import write_output

    assert write_output(str(run), "README.md", b"card", dest=tmp_path / "elsewhere" / "c.md") == str(
        tmp_path / "elsewhere" / "c.md"
    )
    assert (tmp_path / "elsewhere" / "c.md").read_bytes() == b"card" and not (run / "README.md").exists()
    write_output(str(run), "README.md", b"card here")
    assert (run / "README.md").read_bytes() == b"card here"


def test_a_folder_target_gets_a_shards_images_before_its_parquet(run, tmp_path):
    """targets.py: a shard's images are sent first, so that a Parquet file whose rows point at image files never
    arrives before them (a reader of the target mid-push finds every image its rows name)."""
    from launcher.publish.push import publish
    from launcher.publish.targets import StoreTarget

    target = StoreTarget(str(tmp_path / "copy"), None)
    order, real = [], target.store.open_output
    target.store.open_output = lambda name: order.append(name) or real(name)
    publish(str(run), str(tmp_path / "copy"), card=False, target=target)
    assert order.index("images/shard-00000/a.png") < order.index("data/shard-00000.parquet"), order


def card_folder(out: Path, shards: int = 4) -> dict[int, bytes]:
    """A run folder as DESIGN.md lays it out, by hand, for the card: run.json (a local model with no license note,
    the versions) and done shards 0-2, whose Parquet files declare `id` and an Image column in their Hugging Face
    metadata and keep a source column the metadata does not describe; shard 1 is an empty shard (every row set
    aside), shard 2's state recorded another size than its file has (damaged: not vouched for)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    config = {"name": "job", "device": "cpu", "model": {"path": "/models/mine", "dtype": "bfloat16"}}
    config |= {"dataset": {"path": "/d/p.txt"}, "mesh": {"dp": 1, "tp": 1}, "generate": {"batch_size": 2}}
    meta = {"shards": shards, "shard_size": 2, "config": config, "settings": {"model": {}, "generate": {}}}
    meta["versions"] = {"torch": "2.9.1", "diffusers": "0.36.0"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(meta))
    features = {"id": {"dtype": "string", "_type": "Value"}, "reference_image": {"_type": "Image"}}
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("id", pa.string()), ("reference_image", image), (KEPT_COLUMN, pa.string())])
    schema = schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    written = {}
    for i, ids in ((0, ["a", "b"]), (1, []), (2, ["c", "d"])):
        buf = io.BytesIO()
        rows = {"id": ids, "reference_image": [None] * len(ids), KEPT_COLUMN: ["x"] * len(ids)}
        pq.write_table(pa.table(rows, schema=schema), buf)
        written[i] = buf.getvalue()
        name = f"data/shard-{i:05d}.parquet"
        record = {name: [len(written[i]) + (1 if i == 2 else 0), "h"]}
        shard(out, i, {name: written[i]}, record=record)
        state = json.loads((out / "state" / f"shard-{i:05d}.json").read_text())
        state |= {"rows": len(ids), "data_bytes": 100 + i}
        (out / "state" / f"shard-{i:05d}.json").write_text(json.dumps(state))
    return written


# A kept source column: not ASCII, long and with spaces (the Hub reads its name from the card's features).
KEPT_COLUMN = " ".join(["légende"] + ["très longue"] * 12)


def test_the_card_vouches_for_sound_done_shards_and_says_what_the_run_left_undone(tmp_path):
    """DESIGN/card.py: the front matter names the done shards' Parquet files whose size is the recorded one (a
    glob once every file in data/ is a done shard's Parquet file), their rows (an empty shard adds none), the
    `dataset_size` and the config `default`; the features are the file's Hugging Face metadata, then the columns it
    does not describe from their Arrow types, each name written as is on one line. No license note: no license
    key, and the body says it is not stated. A local model is "a local pipeline" in the title; the body says the
    run is not complete, how many shards are in each state, and the library versions."""
    import yaml

    from launcher.ledger.store import Store
    from launcher.publish import card

    run = tmp_path / "run"
    written = card_folder(run)
    text = card.card_text(Store(run))
    raw = text.split("---\n")[1]
    front = yaml.safe_load(raw)
    assert "license" not in front
    assert front["configs"] == [
        {
            "config_name": "default",
            "data_files": [{"split": "train", "path": ["data/shard-00000.parquet", "data/shard-00001.parquet"]}],
        }
    ]
    assert front["dataset_info"]["splits"] == [{"name": "train", "num_bytes": 201, "num_examples": 2}]
    assert front["dataset_info"]["dataset_size"] == 201
    assert front["dataset_info"]["download_size"] == len(written[0]) + len(written[1])
    assert front["dataset_info"]["features"] == [
        {"name": "id", "dtype": "string"},
        {"name": "reference_image", "dtype": "image"},
        {"name": KEPT_COLUMN, "dtype": "string"},
    ]
    assert f"\n  - name: {KEPT_COLUMN}\n" in raw  # not escaped, not folded over lines
    body = text.split("---\n", 2)[2]
    assert body.startswith("\n# job: images generated with a local pipeline\n")
    assert "\n- license: not stated; see the model's page\n" in body
    assert (
        "\n## Contents\n\nThis run is not complete: the card names only the done shards' data. 4 shards of 2 "
        "prompts: 3 done, 0 failed, 1 pending; 4 images.\n"
    ) in body
    assert body.endswith("\nVersions: torch 2.9.1, diffusers 0.36.0\n")

    state = json.loads((run / "state" / "shard-00002.json").read_text())
    state["files"]["data/shard-00002.parquet"][0] -= 1  # its recorded size now: sound
    (run / "state" / "shard-00002.json").write_text(json.dumps(state))
    shard(run, 3, {"data/shard-00003.parquet": written[0]})
    (run / "data" / "notes.txt").write_text("not a shard's file, not a Parquet file: the glob does not take it")
    text = card.card_text(Store(run))
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["configs"][0]["data_files"] == [{"split": "train", "path": "data/*.parquet"}]
    assert "\n## Contents\n\n4 shards of 2 prompts: 4 done, 0 failed, 0 pending; 5 images.\n" in text


def test_a_folders_summary_takes_times_from_states_and_a_damaged_states_file_time(tmp_path):
    """card.py summarize: seconds summed over the shards that ran (a state without `seconds` adds none) and
    rounded to the millisecond; the span from the first shard's start to the last finish; `time_source` says
    `finished_at` while every time is a state's own. A shard whose state file is damaged is pending, and its
    file's time is when it finished (the state file is written last), even past shard 9999; files in state/ that
    are not a shard's state are not shards."""
    import os

    from launcher.ledger.store import Store
    from launcher.publish.card import summarize

    run = tmp_path / "run"
    (run / "state").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"shards": 10002, "config": {}, "settings": {}}))
    states = {
        0: {"status": "done", "rows": 1, "seconds": 0.0625, "finished_at": 1000.0625},
        1: {"status": "done", "rows": 0, "finished_at": 990.0},  # an empty shard, of a run that kept no seconds
    }
    for i, st in states.items():
        (run / "state" / f"shard-{i:05d}.json").write_text(json.dumps(st))
    s = summarize(Store(run))
    assert (s["images"], s["seconds"], s["span_seconds"], s["time_source"]) == (1, 0.062, 10.062, "finished_at")
    assert s["counts"] == {"done": 2, "failed": 0, "pending": 10000}
    (run / "state" / "shard-10001.json").write_text("{damaged")
    os.utime(run / "state" / "shard-10001.json", (980.0, 980.0))
    for name in ("shard-abc.json", "shard-x0001.json", "shard-0001x.json", "shard-1.json"):
        (run / "state" / name).write_text("{}")
    s = summarize(Store(run))
    assert s["shards"][10001]["status"] == "pending" and s["shards"][10001]["finished_at"] == 980.0
    assert (s["span_seconds"], s["time_source"]) == (20.062, "state file mtime")
    assert s["counts"] == {"done": 2, "failed": 0, "pending": 10000}


def test_the_card_command_prints_where_it_wrote_and_leaves_an_unchanged_card_untouched(run, capsys):
    """`python -m launcher.publish.card OUTPUT_DIR`: exit 0 and the card's path; a second run with nothing new
    does not write the card again (a rerun leaves the folder untouched)."""
    import os

    from launcher.publish import card

    as_written(run)
    assert card.main([str(run)]) == 0
    assert capsys.readouterr().out == f"{run / 'README.md'}\n"
    os.utime(run / "README.md", ns=(10**9, 10**9))
    assert card.main([str(run)]) == 0 and (run / "README.md").stat().st_mtime_ns == 10**9
    with pytest.raises(SystemExit):
        card.main(["--help"])
    assert "\n\nWrite OUTPUT_DIR/README.md, the dataset card of a run folder.\n\n" in capsys.readouterr().out


def test_the_cards_words_for_paths_licenses_kept_ids_runs_and_a_damaged_run_json(tmp_path):
    from launcher.ledger.store import Store
    from launcher.publish.card import hub_license, kept_text, run_meta
    from launcher.publish.card_facts import public, runs_section

    assert public("prompts/") == "prompts" and public("/data/BOX") == "BOX"  # a folder, a name ending in X
    assert hub_license("X11 License") == {"license": "other", "license_name": "x11-license"}
    five = {"shards": [{"kept_stale": True, "kept_ids": ["a", "b", "c", "d", "e"]}]}
    assert kept_text(five).startswith(" 1 done shards are kept-stale (samples a, b, c, d, e): their prompts")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r.json").write_text(json.dumps({"exit_code": 2}))  # a record of an older meshgen
    assert runs_section(Store(tmp_path)).splitlines()[-1] == "| ? | 2 | 0 | 0 | 0 | 0 | 0 | 0 |"
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"\(not JSON: Expecting property name enclosed in double quotes"):
        run_meta(Store(tmp_path))


def test_a_state_from_before_files_were_recorded_sends_its_parquet_and_a_shard_changed_since_the_listing_waits(
    run, tmp_path, monkeypatch
):
    """push.py: a done state that records no files (an older run) vouches for its Parquet file, hashed when pushed
    (none there: nothing, as for an older run without Parquet); a shard whose state is gone or no longer done when
    read again after the listing is left to the next push, and the shards after it still go."""
    from launcher.publish import push

    old = b"old-parquet"
    shard(run, 3, {"data/shard-00003.parquet": old})
    (run / "state" / "shard-00003.json").write_text(json.dumps({"status": "done", "rows": 1}))
    (run / "state" / "shard-00004.json").write_text(json.dumps({"status": "done", "rows": 1}))  # no Parquet
    [three, four] = [s for s in push.dataset_shards(push.Store(str(run))) if s.index in (3, 4)]
    assert three.files == {"data/shard-00003.parquet": (len(old), hashlib.sha256(old).hexdigest())}
    assert four.files == {}
    real = push.read_state
    gone = {0: None, 1: {"status": "failed"}}
    monkeypatch.setattr(push, "read_state", lambda store, i: gone[i] if i in gone else real(store, i))
    assert [s.index for s in push.dataset_shards(push.Store(str(run)))] == [3, 4]


def test_a_batch_closes_where_the_next_shard_would_pass_the_byte_bound(monkeypatch):
    from launcher.publish import push
    from launcher.publish.targets import StoreTarget

    class Target:
        same = staticmethod(StoreTarget.same)

        def listing(self):
            return {}

    monkeypatch.setattr(push, "COMMIT_BYTES", 100)
    shards = [push.ShardFiles(i, {f"data/shard-{i:05d}.parquet": (60, str(i))}) for i in range(2)]
    assert [b.shards for b in push.plan_batches(shards, Target())] == [[0], [1]]


def test_the_publish_command_names_a_failure_of_no_words_and_cuts_a_long_one(run, tmp_path, capsys, monkeypatch):
    from launcher.publish import push
    from launcher.publish.targets import StoreTarget

    as_written(run)
    for error, why in ((TimeoutError(), "TimeoutError"), (OSError("x" * 300 + "\nmore"), "x" * 200)):

        def broken(self, run, batch, message, error=error):
            raise error

        monkeypatch.setattr(StoreTarget, "push", broken)
        assert push.main([str(run), str(tmp_path / "site"), "--no-images"]) == 3
        assert capsys.readouterr().err == (
            f"error: the push to {tmp_path / 'site'} stopped ({why}); what reached it is whole: run the same command "
            "to finish it\n"
        )


def test_the_publish_tool_says_a_damaged_shard_in_its_own_words(run, tmp_path):
    """tools.publish prints the libraries' and the launcher's warnings as their words alone (its logging set up
    with `%(message)s`), in a process of its own as a user runs it."""
    from conftest import publish

    _, p1 = as_written(run)
    (run / "data" / "shard-00001.parquet").write_bytes(b"cut")
    res = publish(run, str(tmp_path / "site"), "--no-images")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == (
        f"{run}: shard 1 is damaged (data/shard-00001.parquet has 3 bytes, its state recorded {len(p1)} bytes); "
        "run.shards=pending generates it again"
    )


def test_a_runs_failed_push_names_the_errors_first_line_cut_to_200_characters(run, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from launcher.ledger.store import Store
    from launcher.publish import run as publish_run

    site = tmp_path / "site"
    for error, why in ((OSError("disk gone\nsecond line"), "disk gone"), (OSError("y" * 300), "y" * 200)):
        monkeypatch.setattr(publish_run, "publish", lambda *a, error=error, **kw: (_ for _ in ()).throw(error))
        pub = publish_run.start_publisher(OmegaConf.create({"output": {"publish": str(site)}}), Store(str(run)))
        assert pub.finish().startswith(f"the push to output.publish={site} failed ({why}); the generated shards")


def test_a_hub_branch_is_compared_with_its_own_files_and_the_card_names_the_repo(run, hub_here):
    """targets.py: a push to `@REVISION` lists that revision (main's files are not the branch's), and the card pushed
    to the Hub loads the dataset by the repo's id."""
    from conftest import REPO_ID, TARGET

    from launcher.publish.push import publish

    as_written(run)
    repo = hub_here.repos[f"datasets/{REPO_ID}"]
    assert publish(str(run), TARGET)["card"] is True
    repo.revisions["v2"] = {}
    assert f'ds = load_dataset("{REPO_ID}", split="train")'.encode() in repo.files["README.md"]
    sent = publish(str(run), f"{TARGET}@v2")  # (the fake Hub applies a branch's commits to main)
    assert sent["files"] == 3 and sent["card"] is True


def test_a_hub_commit_is_tried_six_times_500_included_after_the_waits_its_answers_name(run, hub_here, monkeypatch):
    """targets.py: COMMIT_TRIES commits at most, for 429 and 5xx (500 is one), after the RateLimit header's reset
    (the fake Hub's: 1 s) or else 2**attempt s; the sixth refusal is the push's error."""
    from conftest import REPO_ID, TARGET
    from huggingface_hub.errors import HfHubHTTPError

    from launcher.publish import targets
    from launcher.publish.push import publish

    waits = []
    monkeypatch.setattr(targets.time, "sleep", waits.append)
    hub_here.fail_commits = 2
    assert publish(str(run), TARGET, card=False)["files"] == 3 and waits == [1, 1]
    waits.clear()
    hub_here.fail_commits, hub_here.fail_status = 5, 500
    shard(run, 1, {"data/shard-00001.parquet": b"P1-new"})
    assert publish(str(run), TARGET, card=False)["files"] == 1 and waits == [1, 2, 4, 8, 16]
    hub_here.fail_commits = 6
    shard(run, 1, {"data/shard-00001.parquet": b"P1-newer"})
    with pytest.raises(HfHubHTTPError, match="500"):
        publish(str(run), TARGET, card=False)
    assert hub_here.repos[f"datasets/{REPO_ID}"].files["data/shard-00001.parquet"] == b"P1-new"


def test_a_hub_that_refuses_or_never_answers_is_one_line_naming_why_within_the_wait(
    run, hub_here, silent_hub, monkeypatch
):
    """targets.py _probe: the Hub's refusal in its own words (the first 120 characters); a hub that cannot be
    reached or never answers, one line within HF_HUB_ETAG_TIMEOUT naming the error and what to check."""
    import threading

    from conftest import TARGET
    from huggingface_hub import constants

    from launcher.publish.targets import HubTarget

    def refusal(make, uri):
        try:
            make(uri)
        except ConfigError as e:
            return str(e)

    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(ConfigError) as e:
        HubTarget("hf://datasets/org/ds")
    why = str(e.value).split(" refused the token (401: ", 1)[1].removesuffix("); log in again (hf auth login)")
    assert why.startswith("Invalid user token.") and len(why) == 120
    monkeypatch.setenv("HF_TOKEN", "wtok")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
    for endpoint, error in (("http://127.0.0.1:1", "ConnectError"), (silent_hub[0], "ReadTimeout")):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        said = []
        probe = threading.Thread(target=lambda said=said: said.append(refusal(HubTarget, TARGET)), daemon=True)
        probe.start()
        probe.join(10)  # a probe without its bound would wait for ever: the test fails instead
        assert not probe.is_alive()
        assert said[0] == (
            f"publishing to org/ds on {endpoint}: the hub did not answer within 0.5 s ({error}); check the network "
            "and HF_ENDPOINT (HF_HUB_ETAG_TIMEOUT sets the wait)"
        )


def test_a_hub_push_streams_a_local_runs_files_and_reads_a_bucket_runs(run, hub_here, s3, monkeypatch):
    """targets.py push: a local run's files go to the Hub from their paths (a batch may be 4 GiB: never read into
    memory); a run folder on an object store, by its bytes."""
    import boto3
    from conftest import REPO_ID, TARGET

    from launcher.ledger.store import Store
    from launcher.publish.push import publish

    read, real = [], Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda self, rel: read.append(rel) or real(self, rel))
    assert publish(str(run), TARGET, card=False)["files"] == 3
    assert not [r for r in read if r.startswith(("data/", "images/"))], read
    s3c = boto3.client("s3")
    for f in (p for p in run.rglob("*") if p.is_file()):
        s3c.put_object(Bucket="meshgen-test", Key=f"hubrun/{f.relative_to(run)}", Body=f.read_bytes())
    repo = hub_here.repos[f"datasets/{REPO_ID}"]
    repo.files = {}
    assert publish("s3://meshgen-test/hubrun", TARGET, card=False)["files"] == 3
    assert repo.files["data/shard-00001.parquet"] == b"P1-longer"


def test_a_folder_target_is_refused_inside_the_run_whatever_its_name_ends_with_and_a_listing_error_is_one_line(
    run, tmp_path, monkeypatch
):
    from launcher.ledger.store import Store
    from launcher.publish import targets

    for name in ("runX", "run "):
        folder = tmp_path / name
        folder.mkdir()
        with pytest.raises(ConfigError, match="into itself"):
            targets.StoreTarget(str(folder / "pub"), Store(str(folder)))
    site = tmp_path / ("t" * 250)
    site.mkdir()
    (site / "data").write_bytes(b"a file where the target's data folder goes")
    with pytest.raises(ConfigError) as e:
        targets.StoreTarget(str(site), None)
    why = str(e.value).removeprefix(f"cannot publish to {site}: ")
    assert why.startswith("[Errno 20] Cannot list directory") and len(why) == 200
    opened = []
    monkeypatch.setattr(targets, "StoreTarget", lambda uri, run: opened.append(uri))
    targets.open_target("gs://bucket/set")
    targets.open_target("s3://bucket/set")
    assert opened == ["gs://bucket/set", "s3://bucket/set"]


def test_a_folder_target_streams_a_large_file_in_pieces_of_at_most_1_mib(run, tmp_path):
    """targets.py push to a folder: a shard's file is streamed (a batch may be 4 GiB), never held whole: a 3 MiB
    image arrives in writes of at most 1 MiB, whole and equal."""
    import os

    from launcher.publish.push import publish
    from launcher.publish.targets import StoreTarget

    big = os.urandom(3 * 2**20 + 5)
    shard(run, 3, {"data/shard-00003.parquet": b"P3", "images/shard-00003/big.png": big})
    target = StoreTarget(str(tmp_path / "copy"), None)
    writes, real = [], target.store.open_output

    class Counted:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            writes.append(len(b))
            return self.f.write(b)

    @contextlib.contextmanager
    def counted(name):
        with real(name) as f:
            yield Counted(f) if name.endswith("big.png") else f

    target.store.open_output = counted
    publish(str(run), str(tmp_path / "copy"), card=False, target=target)
    assert (tmp_path / "copy" / "images/shard-00003/big.png").read_bytes() == big
    assert sum(writes) == len(big) and max(writes) <= 2**20, writes
