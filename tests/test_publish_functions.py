"""Fast tests of publishing (launcher/publish/push.py, push_targets.py) in this process, from a run folder written
here by hand as DESIGN.md lays it out (run.json, state/shard-N.json with each file's [size, sha256], data/, images/),
to a folder target: which files go, in which batches, what a second push sends, and what it removes. The Hub and
object-store targets are run end to end in test_publish.py."""

from __future__ import annotations

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
