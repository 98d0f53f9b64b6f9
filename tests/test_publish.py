"""Publishing (issue 35): `python -m tools.publish OUTPUT_DIR TARGET` and `output.publish`, against the fake Hub on
loopback (tests/fake_hub.py) and the local S3 server; the pushed repo is loaded back with `datasets`."""

import hashlib
import json
import os
import shutil
import socket

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO_ID, TARGET, launch, load_from_hub, publish


def pushed(hub) -> dict[str, bytes]:
    return hub.repos[f"datasets/{REPO_ID}"].files


def test_push_sends_only_the_dataset_once_and_it_loads_back(run_job, hub, tmp_path):
    out = run_job()
    res = publish(out, TARGET, env=hub.env)
    assert res.returncode == 0, res.stderr[-3000:]
    files = pushed(hub)
    assert sorted(files) == ["README.md", *(f"data/shard-{i:05d}.parquet" for i in range(3))]
    for name, data in files.items():
        assert data == (out / name).read_bytes() or name == "README.md"
    repo = hub.repos[f"datasets/{REPO_ID}"]
    assert len(repo.commits) == 2  # the data in one commit, the card in the last
    assert [op["value"]["path"] for op in repo.commits[-1]["ops"]] == ["README.md"]
    assert all(op["key"] == "lfsFile" for op in repo.commits[0]["ops"])  # pre-uploaded, not inlined
    assert len(hub.requested("PUT")) == 3
    card = files["README.md"].decode()
    run = json.loads((out / "run.json").read_text())
    for private in (str(out), str(out.parent), run["config"]["model"]["path"], socket.gethostname(), "/tmp"):
        assert private not in card
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["configs"][0]["data_files"] == [{"split": "train", "path": "data/*.parquet"}]
    assert f'load_dataset("{REPO_ID}"' in card
    for component, digest in run["settings"]["model"]["weights"].items():
        assert f"weights of {component}: `{digest}`" in card
    [record] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert f"| {record['start']} | 0 | 3 | 20 | 0 |" in card  # the run by date, with its counts

    # Again: nothing new is sent, no commit is made.
    before = (len(repo.commits), len(hub.requested("PUT")))
    res = publish(out, TARGET, env=hub.env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (len(repo.commits), len(hub.requested("PUT"))) == before
    assert "sent 0 files" in res.stdout

    # `datasets` loads the pushed repo from the hub: the card's configs, the Parquet, the image feature.
    shown = "ds.num_rows, type(ds.features['image']).__name__, ds[0]['image'].size"
    printed = load_from_hub(hub, tmp_path / "ds", shown)
    assert printed.split() == ["20", "Image", "(64,", "64)"]


def test_a_regenerated_shard_replaces_its_file_alone(run_job, hub, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_job(), out, ignore=shutil.ignore_patterns("locks"))
    assert publish(out, TARGET, env=hub.env).returncode == 0
    repo = hub.repos[f"datasets/{REPO_ID}"]
    # Shard 1 made again (other bytes, its state recording them), as a damaged shard's rerun does.
    rel = "data/shard-00001.parquet"
    pq.write_table(pq.read_table(out / rel), out / rel, row_group_size=2)
    data = (out / rel).read_bytes()
    state_path = out / "state" / "shard-00001.json"
    state = json.loads(state_path.read_text())
    state["files"][rel] = [len(data), hashlib.sha256(data).hexdigest()]
    state_path.write_text(json.dumps(state))
    (out / "state" / "index.json.gz").unlink()
    commits = len(repo.commits)
    res = publish(out, TARGET, env=hub.env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(repo.commits) == commits + 2  # the shard's file alone, then the card (its sizes changed)
    assert [op["value"]["path"] for op in repo.commits[-2]["ops"]] == [rel]
    assert [op["value"]["path"] for op in repo.commits[-1]["ops"]] == ["README.md"]
    assert pushed(hub)[rel] == data


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"HF_TOKEN": "rtok"}, "the token is read-only"),
        ({"HF_TOKEN": ""}, "needs a token"),
        ({"HF_TOKEN": "wrong"}, "refused the token (401"),
        ({"target": "hf://datasets/org/missing"}, "org/missing on http://127.0.0.1"),
    ],
)
def test_a_refusal_is_one_line_before_anything_is_sent(run_job, hub, change, expected):
    target = change.pop("target", TARGET)
    res = publish(run_job(), target, env={**hub.env, **change})
    assert res.returncode == 2, res.stderr[-3000:]
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("error: ") and expected in line
    assert hub.requested("POST") == [] and hub.requested("PUT") == []


def test_a_hub_that_does_not_answer_is_one_line_within_the_wait(run_job, hub, silent_hub):
    url, _ = silent_hub
    res = publish(run_job(), TARGET, env={**hub.env, "HF_ENDPOINT": url, "HF_HUB_ETAG_TIMEOUT": "1"})
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert "did not answer within 1" in line


def test_a_rate_limited_commit_is_sent_again(run_job, hub):
    hub.fail_commits = 1
    res = publish(run_job(), TARGET, env=hub.env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "data/shard-00002.parquet" in pushed(hub) and hub.fail_commits == 0


def test_push_to_a_bucket_sends_what_changed_only(run_job, store_env, tmp_path):
    """On S3 and on GCS (the local servers): only the dataset arrives, byte for byte; again, nothing is sent."""
    import pyarrow.fs as pafs

    scheme, env = store_env
    out = run_job()
    target = f"{scheme}://meshgen-test/published"
    res = publish(out, target, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    fs, root = pafs.FileSystem.from_uri(target) if scheme == "s3" else (gcs_fs(), "meshgen-test/published")
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    data = {i.path.removeprefix(root + "/") for i in infos if i.type == pafs.FileType.File}
    data = {k for k in data if not k.startswith(".meshgen-published/")}
    assert data == {"README.md", *(f"data/shard-{i:05d}.parquet" for i in range(3))}
    with fs.open_input_stream(f"{root}/data/shard-00000.parquet") as f:
        assert f.read() == (out / "data/shard-00000.parquet").read_bytes()
    res = publish(out, target, env=env)
    assert res.returncode == 0 and "sent 0 files" in res.stdout, res.stdout + res.stderr[-2000:]
    res = publish(out, f"{scheme}://no-such-bucket/x", env=env)
    assert res.returncode == 2 and "no-such-bucket" in res.stderr.strip().splitlines()[-1]


def gcs_fs():
    """pyarrow's GCS client on the local server (it does not read STORAGE_EMULATOR_HOST itself)."""
    import pyarrow.fs as pafs

    host = os.environ["STORAGE_EMULATOR_HOST"].removeprefix("http://")
    return pafs.GcsFileSystem(endpoint_override=host, scheme="http", anonymous=True)


def test_output_publish_pushes_during_the_run_and_a_failed_push_is_finished_by_the_same_command(
    tiny_model, hub, tmp_path
):
    out = tmp_path / "out"
    args = (f"model.path={tiny_model}", f"output.dir={out}", f"output.publish={TARGET}")
    hub.refuse_commits = True  # the hub takes no commit (a token revoked mid-run, say): the push fails, not the shards
    res = launch(*args, env=hub.env)
    assert res.returncode == 3, res.stderr[-3000:]
    assert "the push to output.publish=" in res.stderr.strip().splitlines()[-1]
    assert len(list((out / "data").glob("*.parquet"))) == 3  # generated and kept
    # Pushed as shards were done (the watcher's push, refused), then once more at the end: two commits tried.
    assert hub.requested("POST").count(f"/api/datasets/{REPO_ID}/commit/main") >= 2
    hub.refuse_commits = False
    res = launch(*args, env=hub.env)  # nothing to generate; the push is finished
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(pushed(hub)) == ["README.md", *(f"data/shard-{i:05d}.parquet" for i in range(3))]
    assert not any(name.startswith(("state/", "runs/", "logs/")) for name in pushed(hub))


def test_output_publish_probe_refuses_before_generating(tiny_model, hub, tmp_path):
    out = tmp_path / "out"
    args = (f"model.path={tiny_model}", f"output.dir={out}", f"output.publish={TARGET}")
    res = launch(*args, env={**hub.env, "HF_TOKEN": "rtok"})
    assert res.returncode == 2 and "read-only" in res.stderr.strip().splitlines()[-1]
    assert not (out / "data").exists()
