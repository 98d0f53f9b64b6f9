"""Issue 20, what comes from outside: damaged ledger files, unbounded rows, globs and links, unreachable sources,
credentials in addresses, and printed paths on S3. Each case injects the fault found, on the real code path."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, launch, read_rows

from launcher.errors import ConfigError
from launcher.ledger.store import Store
from launcher.sources.bounds import TEXT_BYTES
from launcher.sources.prompts import SCHEMA, Source, _batches, _exact_rows, _GiveUp, source_files
from launcher.sources.prompts_fast import fast_batches

# A tool run as a script finds the package through the path; this checkout's, not the venv's editable install.
TOOL_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def status(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools/status.py"), str(out), *args], capture_output=True, text=True, env=TOOL_ENV
    )


def refused(res: subprocess.CompletedProcess, *parts: str) -> str:
    """The run exited 2 with one `error:` last line holding `parts`, and no traceback; that line."""
    last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert last.startswith("error: "), res.stderr[-3000:]
    for part in parts:
        assert part in last, f"{part!r} not in the last line: {last}"
    return last


# -- 6. damaged ledger files


def test_damaged_ledger_files_are_named_shown_and_generated_again(slow, slow_clean, tmp_path):
    job, clean = [*slow[0], "mesh.tp=1"], slow_clean(1)  # the slow job's 32 prompts in 16 shards, and its clean run
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    state = out / "state"
    whole = (state / "shard-00001.json").read_bytes()
    damage = {
        0: b"",  # empty
        1: whole[: len(whole) // 2],  # half-written
        2: b"[]",  # not an object
        3: b'{"status": "finished", "rows": 2}',  # the wrong shape: neither done nor failed
        4: b'{"status": "done", "rows": "two"}',  # a field of the wrong type
    }
    for i, data in damage.items():
        (state / f"shard-{i:05d}.json").write_bytes(data)
    (state / "shard-1.json").write_text('{"status": "failed", "error": "not ours"}')  # not the ledger's name
    (state / "index.json.gz").write_bytes(gzip.compress(b"[1, 2]"))  # an index that decodes to a list

    res = status(out, "--json")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    info = json.loads(res.stdout)
    assert info["damaged"] == 5 and info["done"] == 11 and info["failed"] == 0
    assert [s for s, v in info["shards"].items() if v == "damaged"] == ["0", "1", "2", "3", "4"]
    res = status(out)
    assert res.returncode == 0 and "11 done, 0 failed, 0 pending, 5 damaged" in res.stdout, res.stdout + res.stderr

    res = launch(*job, f"output.dir={out}")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    warnings = [ln for ln in res.stderr.splitlines() if "is damaged" in ln]
    named = [f"{state / f'shard-{i:05d}.json'} is damaged" for i in damage] + [f"{state / 'index.json.gz'} is damaged"]
    for name in named:
        assert sum(name in ln for ln in warnings) == 1, f"{name!r} not said once in: {warnings}"
    assert len(warnings) == len(named), warnings
    assert read_rows(out) == read_rows(clean)  # regenerated, the same images
    info = json.loads(status(out, "--json").stdout)
    assert info["done"] == 16 and info["damaged"] == 0
    assert (state / "shard-1.json").exists()  # a stranger's file is left alone


SOUND = b'{"status": "done", "rows": 2}'
DAMAGED_INDEXES = {  # what state/index.json.gz holds -> the reason its warning gives
    "not-gzip": (b"not gzip", "Error -3 while decompressing data: incorrect header check"),
    "list": (gzip.compress(b"[]"), "a JSON list without a mapping of states"),
    "states-list": (gzip.compress(b'{"version": 1, "states": []}'), "a JSON dict without a mapping of states"),
    "no-states": (gzip.compress(b'{"version": 1}'), "a JSON dict without a mapping of states"),
    "no-version": (gzip.compress(b'{"states": {}}'), "version None, where this meshgen reads version 1"),
    "newer": (gzip.compress(b'{"version": 2, "states": {"0": [[1, 2], %s]}}' % SOUND), "version 2, where"),
    "state-int": (gzip.compress(b'{"version": 1, "states": {"0": 5}}'), "the entry of shard 0 is not a state"),
    "state-lists": (gzip.compress(b'{"version": 1, "states": {"0": [[1, 2], []]}}'), "the entry of shard 0 is"),
    "three-numbers": (
        gzip.compress(b'{"version": 1, "states": {"1": [[1, 2, 3], %s]}}' % SOUND),
        "the entry of shard 1",
    ),
    "key-int": (gzip.compress(b'{"version": 1, "states": {"2": [7, %s]}}' % SOUND), "the entry of shard 2 is not"),
    "bad-shard-key": (gzip.compress(b'{"version": 1, "states": {"x": [[1, 2], {}]}}'), "the entry of shard x is not"),
    "rows-str": (
        gzip.compress(b'{"version": 1, "states": {"0": [[1, 2], {"status": "done", "rows": "2"}]}}'),
        "the entry of shard 0 is not a state",
    ),
    "cut": (gzip.compress(b"{")[:-4], "it ends before its gzip stream does"),
}


# gzip stamps the time into its header: ids from the bytes would differ between xdist workers
@pytest.mark.parametrize("case", list(DAMAGED_INDEXES))
def test_a_damaged_index_is_one_warning_and_the_state_files_are_read(tmp_path, caplog, case):
    from launcher.ledger.states import INDEX, Ledger, state_rel

    index, reason = DAMAGED_INDEXES[case]
    store = Store(tmp_path)
    for i in range(3):
        store.write_json(state_rel(i), {"status": "done", "rows": 2})
    store.write_bytes(INDEX, index)
    ledger = Ledger(store)
    assert sorted(ledger.refresh()) == [0, 1, 2] and ledger.reads == 3
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{tmp_path}/state/index.json.gz is damaged ({reason}"), said
    assert said[0].endswith("); reading the state files instead"), said
    ledger.save_index()  # and a sound index replaces it
    again = Ledger(store)
    assert sorted(again.refresh()) == [0, 1, 2] and again.reads == 0


# -- 7. bounds at planning


@pytest.fixture(scope="module")
def rows_out_of_bounds(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bounds")
    pq.write_table(pa.table({"prompt": ["a", "b"], "num_inference_steps": [4, 1_000_000_000]}), d / "steps.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b"], "guidance_scale": [1.0, math.inf]}), d / "inf.parquet")
    (d / "guidance.csv").write_text("prompt,guidance_scale\na,4\nb,100.5\n")
    (d / "long.txt").write_text("a\n" + "x" * (65 * 1024 + 1) + "\n")
    neg = "é" * (TEXT_BYTES // 2 + 1)  # 2 bytes each in UTF-8: over the bound in bytes, under it in characters
    (d / "neg.jsonl").write_text(
        json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "negative_prompt": neg})
    )
    return d


BOUNDS = {
    "row-steps-1e9": ("steps.parquet", [], ["steps.parquet", "row 1", "1000000000", "1 to 1000"]),
    "row-guidance-inf": ("inf.parquet", [], ["inf.parquet", "row 1", "inf", "finite", "0 to 100"]),
    "row-guidance-above-100": ("guidance.csv", [], ["guidance.csv", "line 3", "100.5", "0 to 100"]),
    "row-prompt-over-64KiB": ("long.txt", [], ["long.txt", "line 2", "66561 bytes", "64 KiB", "shorten it"]),
    "row-negative-over-64KiB": ("neg.jsonl", [], ["neg.jsonl", "line 2", "negative_prompt", "65538 bytes", "64 KiB"]),
    "config-steps-1001": (None, ["generate.num_inference_steps=1001"], ["generate.num_inference_steps=1001", "1000"]),
    "config-guidance-inf": (None, ["generate.guidance_scale=inf"], ["generate.guidance_scale=inf", "finite"]),
    "config-guidance-nan": (None, ["generate.guidance_scale=nan"], ["generate.guidance_scale=nan", "finite"]),
    "config-sequence-1e9": (None, ["generate.max_sequence_length=1000000000"], ["max_sequence_length", "4096"]),
}


@pytest.mark.parametrize("case", list(BOUNDS))
def test_values_out_of_bounds_are_refused_at_planning(case, tiny_model, rows_out_of_bounds, tmp_path):
    source, overrides, expected = BOUNDS[case]
    args = [f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}", *overrides]
    if source:
        args.append(f"dataset.path={rows_out_of_bounds / source}")
    refused(launch(*args, timeout=120), *expected)
    assert not (tmp_path / "out").exists()  # nothing reached a worker, nothing was written


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_both_readers_take_values_at_their_bounds_and_refuse_beyond(tmp_path, fmt):
    """The fast reader accepts only what the exact one does: at the bound both give the same rows; beyond it the
    fast one gives up and the exact one names the row."""
    at = [{"prompt": "p" * TEXT_BYTES}]
    if fmt != "txt":
        at += [
            {"prompt": "a", "num_inference_steps": 1000, "guidance_scale": 100.0},
            {"prompt": "b", "num_inference_steps": 1, "guidance_scale": 0.0, "negative_prompt": "n" * TEXT_BYTES},
        ]
    beyond = [{"prompt": "p" * (TEXT_BYTES + 1)}]
    if fmt != "txt":
        beyond += [{"prompt": "a", "num_inference_steps": 1001}, {"prompt": "a", "guidance_scale": 100.01}]
        beyond += [{"prompt": "a", "negative_prompt": "n" * (TEXT_BYTES + 1)}]
        beyond += [{"prompt": "a", "guidance_scale": math.inf}] if fmt == "parquet" else []
    for k, rows in enumerate([at, *([r] for r in beyond)]):
        f = _write(tmp_path / f"{k}.{fmt}", rows)
        src = Source(f)
        if k == 0:
            fast = pa.Table.from_batches(list(fast_batches(f, src, 0)), schema=SCHEMA)
            exact = pa.Table.from_batches(list(_batches(_exact_rows(f, src, 0))), schema=SCHEMA)
            assert fast.to_pylist() == exact.to_pylist() and fast.num_rows == len(rows)
            continue
        with pytest.raises(_GiveUp):
            list(fast_batches(f, src, 0))
        with pytest.raises(ConfigError, match="must be|64 KiB"):
            list(_exact_rows(f, src, 0))


def _write(path: Path, rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    if path.suffix == ".txt":
        path.write_text("".join(r["prompt"] + "\n" for r in rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        import csv

        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    return str(path)


# -- 8. globs and links


def _tree(root: Path) -> None:
    for f in ("top.txt", "a/one.txt", "a/b/deep.txt", "c/two.txt", ".h/hidden.txt", "a/.dot.txt", "a/b/c/d/far.txt"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(f"a prompt from {f}\n")


PATTERNS = ["*/*.txt", "**/*.txt", "a/**/*.txt", "*.txt", "**/b/*.txt", "a/*/*.txt", "[ac]/*.txt", "?/b/**/*.txt"]
PATTERNS += ["*/two.txt"]  # a plain part after a glob: looked up, not listed
PATTERNS += ["a/**", "**", "a/b/**"]  # ending in **: every file below, none hidden (folders are no source)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_globs_mean_what_python_glob_means(tmp_path, pattern):
    _tree(tmp_path)
    want = sorted(f for f in glob.glob(str(tmp_path / pattern), recursive=True) if os.path.isfile(f))
    assert want, pattern
    assert source_files(str(tmp_path / pattern)) == want


def test_a_linked_file_is_read_once_and_a_symlink_loop_is_named(tiny_model, tmp_path):
    _tree(tmp_path / "g")
    (tmp_path / "g" / "a" / "link.txt").symlink_to(tmp_path / "g" / "c" / "two.txt")
    (tmp_path / "g" / "e").symlink_to(tmp_path / "g" / "c")  # a second path to a folder: no loop
    files = source_files(str(tmp_path / "g" / "**" / "*.txt"))
    assert sorted(map(os.path.realpath, files)) == sorted({os.path.realpath(f) for f in files})  # each real file once
    assert len(files) == 5 and str(tmp_path / "g" / "a" / "link.txt") in files
    (tmp_path / "g" / "a" / "b" / "up").symlink_to("../..")  # back to g: ** would go round forever
    res = launch(f"model.path={tiny_model}", f"dataset.path={tmp_path}/g/**/*.txt", f"output.dir={tmp_path / 'out'}")
    refused(res, f"{tmp_path}/g/a/b/up", "symlink loop", f"leads back to {tmp_path / 'g'}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=f"{tmp_path}/g/a/b/up leads back"):  # a ** reached through a *
        source_files(str(tmp_path / "g" / "*" / "**" / "*.txt"))
    assert source_files(str(tmp_path / "g" / "a" / "b" / "up" / "top.txt"))  # no ** through it: no loop


def test_globs_on_s3_match_as_on_disk(s3, tmp_path):
    _tree(tmp_path)
    store = Store("s3://meshgen-test/globs")
    for f in tmp_path.rglob("*"):
        if f.is_file():
            store.write_bytes(str(f.relative_to(tmp_path)), f.read_bytes())
    for pattern in PATTERNS:
        local = [f.removeprefix(str(tmp_path)) for f in source_files(str(tmp_path / pattern))]
        remote = [f.removeprefix("s3://meshgen-test/globs") for f in source_files(f"s3://meshgen-test/globs/{pattern}")]
        assert remote == local, pattern


# -- 9. unreachable and missing sources


def test_an_unreachable_or_missing_s3_source_is_one_line(tiny_model, s3, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"model.path={tiny_model}", "dataset.path=s3://meshgen-test/prompts.txt", f"output.dir={tmp_path / 'o'}"]
    res = launch(*args, env={**s3, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    refused(res, "dataset.path s3://meshgen-test/prompts.txt", "cannot be read", "credentials")
    res = launch(*args, env=s3)  # the store answers, the file is not there
    refused(res, "dataset.path s3://meshgen-test/prompts.txt does not exist")
    assert not (tmp_path / "o").exists()


# -- 10. credentials in addresses


def test_addresses_with_credentials_are_refused_and_never_shown(tiny_model, s3, tmp_path):
    import boto3

    secret = "wJalrXUtnFEMI-K7MDENG"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    job = [f"model.path={tiny_model}", f"dataset.path={prompts}"]
    cases = [
        ([*job, f"output.dir=s3://AKIAKEY:{secret}@meshgen-test/cred"], "output.dir=s3://***@meshgen-test/cred"),
        ([*job, "--dry-run", f"output.dir=s3://AKIAKEY:{secret}@meshgen-test/cred"], "output.dir=s3://***@"),
        ([*job, f"dataset.path=s3://AKIAKEY:{secret}@meshgen-test/p.txt", "output.dir=s3://meshgen-test/cred"], None),
        ([*job, f"model.path=https://user:{secret}@example.com/m", f"output.dir={tmp_path / 'o'}"], "model.path="),
        ([*job, f"output.dir=s3://AKIAKEY:{secret}@meshgen-test/cred]"], "cannot parse"),  # Hydra echoes it
    ]
    for args, shown in cases:
        res = launch(*args, env=s3)
        last = refused(res, *([shown] if shown else ["dataset.path=s3://***@meshgen-test/p.txt"]))
        assert secret not in res.stdout + res.stderr
        if "cannot parse" not in last:
            assert "carries credentials" in last and "AWS_ACCESS_KEY_ID" in last
    listed = boto3.client("s3").list_objects_v2(Bucket="meshgen-test", Prefix="cred")
    assert listed.get("KeyCount", 0) == 0  # no run.json, no record, no log: nothing written
    assert not (tmp_path / "o").exists()
    res = status(f"s3://AKIAKEY:{secret}@meshgen-test/cred")
    assert res.returncode == 2 and secret not in res.stdout + res.stderr and "s3://***@" in res.stderr
    # Whatever else logs an address (an endpoint from the environment, a library), the log line is masked.
    code = "import logging, sys; from launcher.logs import setup_logging; setup_logging(0); "
    code += "logging.getLogger('x').warning('fetching from %s', sys.argv[1])"
    res = subprocess.run(
        [sys.executable, "-c", code, f"https://user:{secret}@hub.example/m"],
        capture_output=True,
        text=True,
        env=TOOL_ENV,
    )
    assert "fetching from https://***@hub.example/m" in res.stderr and secret not in res.stderr, res.stderr


# -- 11. printed paths keep their scheme


def test_an_s3_runs_log_lines_keep_the_scheme(tiny_model, s3, tmp_path):
    """Rank 0 of a run on S3 dies at its start (a sitecustomize on the workers' path, which runs where a worker
    starts as a fresh interpreter); the launcher names its log by its whole address, and that address is where the
    log is."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '0' and os.environ.get('MESHGEN_TEST_DIE'):\n    os._exit(7)\n"
    )
    url = "s3://meshgen-test/logpaths"
    env = {**s3, "PYTHONPATH": f"{site}:{REPO}", "MESHGEN_TEST_DIE": "1", "MESHGEN_WORKER_START": "subprocess"}
    res = launch(f"model.path={tiny_model}", f"output.dir={url}", "mesh.tp=1", env=env)
    assert res.returncode == 7, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if "its log:" in ln]
    log = line.split("its log: ", 1)[1].strip()
    assert log.startswith(f"{url}/logs/") and log.endswith("/rank-0.log"), line
    assert any(f"worker logs: {url}/logs/" in ln for ln in res.stderr.splitlines()), res.stderr[-2000:]
    assert Store(url).exists(log.removeprefix(url + "/"))  # the address printed is the log's


def test_the_whole_source_checks_its_ids_once_read(tmp_path):
    """An empty source is refused naming it; with N images a prompt id that is another prompt's sample id is
    refused naming both (a sweep: its variant ids); with dataset.bad_rows=skip a row set aside for its own reason
    takes no part in the id checks, and the later of two good rows with one id is set aside."""
    from launcher.sources.prompts import read_batches
    from launcher.sources.rejected import Recheck

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(str(empty))))
    assert str(e.value) == f"dataset {empty} holds no prompts; add prompts or point dataset.path elsewhere"

    ids = tmp_path / "ids.jsonl"
    src = lambda **kw: Source(str(ids), id_column="id", **kw)  # noqa: E731
    for clash, kw, said in (
        ("a-1", {"images_per_prompt": 2}, "generate.images_per_prompt=2"),
        ("a@1", {"variants": 2}, "generate.sweep"),
    ):
        ids.write_text(
            f'{{"id": "{clash}", "prompt": "x"}}\n{{"id": "a", "prompt": "y"}}\n{{"id": "b", "prompt": "z"}}\n'
        )
        assert sum(b.num_rows for b in read_batches(src())) == 3  # one image, no sweep: no sample id but the prompt's
        with pytest.raises(ConfigError) as e:
            list(read_batches(src(**kw)))
        assert str(e.value).startswith(f"dataset {ids}: with {said}, prompt 'a' has a sample id {clash!r}"), str(
            e.value
        )

    skip = tmp_path / "skip.jsonl"
    skip.write_text('{"id": "a", "prompt": "x"}\n{"id": "a"}\n{"id": "a-1"}\n')  # the last two have no prompt
    src = Source(str(skip), id_column="id", bad_rows="skip", images_per_prompt=2)
    rows = [r for b in read_batches(src) for r in b.to_pylist()]
    assert [r["rejected"] is None for r in rows] == [True, False, False]
    assert all("prompt" in json.loads(r["rejected"])["reason"] for r in rows[1:]), rows  # not for their ids
    skip.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(Recheck) as e:
        list(read_batches(Source(str(skip), id_column="id", bad_rows="skip")))
    assert [position for position, _ in e.value.late] == [1], e.value.late


def test_the_fast_reader_takes_a_csv_whole_over_several_blocks(tmp_path, monkeypatch):
    """The CSV a user exports (quoted cells with newlines and commas, an id column of text like 007, empty
    cells, every per-row setting) is read by the fast reader without giving up, over blocks of ~200 bytes
    (4 MiB in use), row for row as the exact reader reads it."""
    import csv

    from launcher.sources import prompts_fast

    monkeypatch.setattr(prompts_fast, "_BLOCK", 200)
    rows = [
        {
            "uid": f"{i:03d}",
            "prompt": f"line one, {i}\nline two",
            "negative_prompt": "" if i % 2 else "blurry",
            "seed": i,
            "height": 64,
            "width": 128,
            "num_inference_steps": 4,
            "guidance_scale": 3.5,
        }
        for i in range(40)
    ]
    path = tmp_path / "p.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert path.stat().st_size > 3 * 200
    src = Source(str(path), id_column="uid")
    fast = pa.Table.from_batches(list(fast_batches(str(path), src, 0)), schema=SCHEMA)  # no _GiveUp
    exact = pa.Table.from_batches(list(_batches(_exact_rows(str(path), src, 0))), schema=SCHEMA)
    assert fast.to_pylist() == exact.to_pylist()
    assert fast.column("id").to_pylist() == [f"{i:03d}" for i in range(40)]
    assert fast.column("prompt").to_pylist() == [r["prompt"] for r in rows]
    assert fast.column("negative_prompt").to_pylist() == [None if i % 2 else "blurry" for i in range(40)]
    assert fast.column("seed").to_pylist() == list(range(40)) and set(fast.column("width").to_pylist()) == {128}
