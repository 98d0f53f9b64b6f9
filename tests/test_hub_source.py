"""`dataset.path=hf://datasets/ORG/NAME[@REVISION][/glob]` (issue 33): a Hub dataset repo as a prompt source, read
through huggingface_hub's filesystem from the fake Hub on loopback (tests/fake_hub.py), with the checks of any other
source; a Hub that does not answer, a repo that is not there and a Hub address where nothing reads one are one line,
exit 2. Expected values come from the files put on the fake Hub and from Python's glob, never from the product."""

from __future__ import annotations

import glob
import io
import json
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import launch, read_rows
from fake_hub import Repo

from launcher.errors import ConfigError
from launcher.sources.prompts import Source, filesystem, read_batches, source_files

REPO = "org/prompts"
ADDRESS = f"hf://datasets/{REPO}"
PARQUET_ROWS = [{"id": "q-a", "prompt": "a red cube on a table"}, {"id": "q-b", "prompt": "a blue sphere"}]
JSONL_ROWS = [{"id": "q-c", "prompt": "a green cone, studio light"}, {"id": "q-d", "prompt": "a yellow torus"}]


def _parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


FILES = {  # the repo as a `datasets` user pushes it: data files, a card, git's attributes
    "data/train-00000.parquet": _parquet(PARQUET_ROWS),
    "data/train-00001.jsonl": _jsonl(JSONL_ROWS),
    "mirror/train-00001.jsonl": _jsonl(JSONL_ROWS),  # the same content again: one file, read once
    "README.md": b"---\nlicense: mit\n---\n# prompts\n",
    ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
}


@pytest.fixture
def hub_env(hub, monkeypatch) -> dict:
    """The fake Hub with REPO (and its tag v1, which holds one older file), its env set in this process too."""
    hub.repos[f"datasets/{REPO}"] = Repo(dict(FILES), revisions={"v1": {"old.txt": b"an older prompt\n"}})
    for k, v in hub.env.items():
        monkeypatch.setenv(k, v)
    return hub.env


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_launch_over_a_hub_glob_generates_the_sources_rows(tiny_model, hub, hub_env, tmp_path):
    """One real run over two files of the repo (Parquet and JSONL): one sample per source row, with its id and
    prompt; nothing is written to the Hub."""
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"dataset.path={ADDRESS}/data/train-*", "dataset.id_column=id"]
    res = launch(*args, f"output.dir={out}", "mesh.tp=1", env=hub_env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(out)
    assert {i: r["prompt"] for i, r in rows.items()} == {r["id"]: r["prompt"] for r in PARQUET_ROWS + JSONL_ROWS}
    assert not hub.requested("PUT") and not [p for p in hub.requested("POST") if "paths-info" not in p]


def test_a_glob_a_revision_and_a_whole_repo_resolve_to_their_files(hub, hub_env, monkeypatch):
    from launcher.ledger import store

    monkeypatch.setitem(store._OPENED, "remote", False)  # as in a fresh launcher
    assert source_files(f"{ADDRESS}/data/*.parquet") == [f"{ADDRESS}/data/train-00000.parquet"]
    assert store.opened_remote()  # an HTTP client's pooled connections: the workers' server is not forked from here
    # The whole repo: its data files in the formats read here, sorted; not its card, not .gitattributes, and the
    # mirrored file once (under its first name in sorted order).
    assert source_files(ADDRESS) == [f"{ADDRESS}/data/train-00000.parquet", f"{ADDRESS}/data/train-00001.jsonl"]
    assert source_files(f"{ADDRESS}/**/*.jsonl") == [f"{ADDRESS}/data/train-00001.jsonl"]
    assert source_files(f"{ADDRESS}@v1") == [f"{ADDRESS}@v1/old.txt"]  # huggingface_hub's @REVISION syntax
    rows = [r for b in read_batches(Source(f"{ADDRESS}@v1/*.txt")) for r in b.to_pylist()]
    assert [(r["id"], r["prompt"]) for r in rows] == [("0", "an older prompt")]
    # A repo whose name ends as a path's end may (a trailing slash is dropped, nothing else).
    hub.repos["datasets/org/prompts-FLUX"] = Repo({"p.txt": b"a prompt\n"})
    for given in ("hf://datasets/org/prompts-FLUX", "hf://datasets/org/prompts-FLUX/"):
        assert source_files(given) == ["hf://datasets/org/prompts-FLUX/p.txt"]


def test_globs_on_the_hub_match_as_python_glob_on_disk(hub, hub_env, tmp_path):
    files = ("top.txt", "a/one.txt", "a/b/deep.txt", "c/two.txt", ".h/hidden.txt", "a/.dot.txt", "a/b/c/d/far.txt")
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(f"a prompt from {f}\n")
    hub.add_folder("datasets/org/tree", tmp_path)
    for pattern in [
        "*/*.txt",
        "**/*.txt",
        "a/**/*.txt",
        "*.txt",
        "**/b/*.txt",
        "a/*/*.txt",
        "[ac]/*.txt",
        "?/b/**/*.txt",
    ]:
        want = [f.removeprefix(str(tmp_path)) for f in sorted(glob.glob(str(tmp_path / pattern), recursive=True))]
        got = [f.removeprefix("hf://datasets/org/tree") for f in source_files(f"hf://datasets/org/tree/{pattern}")]
        assert got == want, pattern


def test_a_bad_row_in_a_hub_file_is_named_with_its_address_and_line(hub, hub_env):
    hub.repos[f"datasets/{REPO}"].files["bad.jsonl"] = _jsonl([{"prompt": "fine"}, {"prompt": 7}])
    with pytest.raises(ConfigError, match=rf"^dataset {ADDRESS}/bad\.jsonl, line 2: the prompt .* is of type int"):
        list(read_batches(Source(f"{ADDRESS}/bad.jsonl")))


@pytest.mark.parametrize(
    "path, said",
    [
        ("hf://datasets/org/missing/*.txt", "has no dataset repo org/missing that this token may read"),
        (f"{ADDRESS}@v9/*.txt", "org/prompts has no revision 'v9'"),
        ("hf://org/a-model/prompts.txt", "is a model repo; prompts come from a Hub dataset"),
        ("hf://datasets/org/gated/p.txt", "the repo is gated: accept its conditions on the Hub, then set HF_TOKEN"),
    ],
)
def test_what_cannot_be_read_from_the_hub_is_one_line(hub, hub_env, path, said):
    hub.repos["datasets/org/gated"] = Repo({"p.txt": b"a prompt\n"}, gated=True)
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(path)))
    assert said in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def test_no_network_is_one_line_exit_2_in_a_dry_run(tiny_model, hub_env, tmp_path):
    from test_inputs import refused

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    args = [f"model.path={tiny_model}", f"dataset.path={ADDRESS}/data/*.jsonl", f"output.dir={tmp_path / 'o'}"]
    res = launch("--dry-run", *args, env={**hub_env, "HF_ENDPOINT": endpoint})
    refused(res, f"dataset.path {ADDRESS}/data/*.jsonl", f"does not answer at {endpoint}", "HF_ENDPOINT", "HF_TOKEN")
    assert not (tmp_path / "o").exists()


def test_the_hub_is_read_only_and_refused_where_nothing_reads_it(hub_env):
    from launcher.ledger.addresses import check_address
    from launcher.ledger.store import Store

    fs, p = filesystem(f"{ADDRESS}/new.txt")
    with pytest.raises(PermissionError, match="read, never written"):
        fs.open_output_stream(p)
    assert fs.get_file_info(p).type == pafs.FileType.NotFound
    with pytest.raises(ConfigError, match=f"^{ADDRESS}/run: a Hub address is not read or written here; a run folder"):
        Store(f"{ADDRESS}/run")  # tools/status, tools/report, a run folder
    with pytest.raises(ConfigError, match="^output.dir=hf://.*output.publish=hf://datasets/ORG/NAME or tools/publish"):
        check_address(ADDRESS, "output.dir")
    with pytest.raises(ConfigError, match="^model.path=hf://org/m: .* give the Hub's id as ORG/NAME"):
        check_address("hf://org/m", "model.path")
    check_address(ADDRESS, "output.publish")  # what pushes to the Hub


def test_hub_paths_are_refused_for_the_output_folder_by_the_launcher(launcher_main, tiny_model, capsys, tmp_path):
    prompts = Path(__file__).parent.parent / "conf" / "prompts" / "tiny.txt"
    args = ["--dry-run", f"model.path={tiny_model}", f"dataset.path={prompts}", f"output.dir={ADDRESS}"]
    assert launcher_main(args) == 2
    assert f"error: output.dir={ADDRESS}: a Hub address is not read or written here" in capsys.readouterr().err


def test_a_hub_that_never_answers_is_one_line_within_the_timeout(silent_hub, monkeypatch):
    """A proxy or a stranger that holds the connection open: the repo's check gives up after HF_HUB_ETAG_TIMEOUT."""
    import time

    from huggingface_hub import constants

    endpoint, paths = silent_hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)  # read once, at huggingface_hub's import
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"^dataset.path {ADDRESS}/p.txt: the Hub does not answer at {endpoint}"):
        source_files(f"{ADDRESS}/p.txt")
    assert time.monotonic() - start < 10 and paths == [f"/api/datasets/{REPO}"]
