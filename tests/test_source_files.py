"""Which files `dataset.path` names (launcher/sources/prompts.py), and an earlier run's folder as a source: each
refusal is one line naming the path and how to fix it; an earlier meshgen run is read as its Parquet shards, in
shard order, and its rows' settings columns (how its images were made) override nothing of the job that reads it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_hub_source

from launcher.errors import ConfigError
from launcher.sources.prompts import Source, read_batches, run_folder, source_files

hub_env = test_hub_source.hub_env  # the fake Hub with its repo of prompts: a fixture here too


def _refusal(path) -> str:
    with pytest.raises(ConfigError) as e:
        source_files(str(path))
    return str(e.value)


def test_each_path_that_names_no_prompt_file_is_refused_in_one_line(tmp_path):
    assert _refusal(tmp_path / "none.jsonl") == (
        f"dataset.path {tmp_path}/none.jsonl does not exist; pass an existing file with dataset.path=..."
    )
    assert _refusal(f"{tmp_path}/*.csv") == (
        f"dataset.path {tmp_path}/*.csv does not exist; pass an existing file with dataset.path=..."
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _refusal(f"{tmp_path}/*") == (
        f"dataset.path {tmp_path}/* matches folders only; end the glob with the files' names"
    )
    assert _refusal(tmp_path / "a") == (
        f"dataset.path {tmp_path}/a is a folder but not one written by datasets.save_to_disk; "
        "pass a file (.txt, .jsonl, .csv, .parquet), a glob, or a save_to_disk folder"
    )
    (tmp_path / "v1.2").mkdir()
    for name, shown in (("p.tsv", "'.tsv'"), ("prompts", "'(no extension)'"), ("v1.2/prompts", "'(no extension)'")):
        (tmp_path / name).write_text("a cat\n")
        assert _refusal(tmp_path / name) == (
            f"dataset {tmp_path}/{name}: unknown format {shown}; use one of .txt, .jsonl, .csv, .parquet"
        )


def test_a_glob_keeps_its_files_and_saved_datasets_and_passes_over_plain_folders(tmp_path):
    (tmp_path / "plain").mkdir()
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (tmp_path / "x.txt").write_text("a cat\n")
    assert source_files(f"{tmp_path}/*") == [str(saved), f"{tmp_path}/x.txt"]


def _earlier_run(folder, shards: dict[int, list[str]]) -> None:
    """An earlier meshgen run's output folder: run.json and its Parquet shards, with the columns a run writes."""
    (folder / "data").mkdir(parents=True)
    (folder / "run.json").write_text("{}")
    for index, ids in shards.items():
        n = len(ids)
        pq.write_table(
            pa.table({
                "id": ids, "prompt": [f"prompt of {i}" for i in ids], "seed": pa.array([7] * n, pa.int64()),
                "height": pa.array([512] * n, pa.int64()), "width": pa.array([768] * n, pa.int64()),
                "num_inference_steps": pa.array([28] * n, pa.int64()), "guidance_scale": [3.5] * n,
                "negative_prompt": ["blurry"] * n, "image": [b"png"] * n,
            }),
            folder / "data" / f"shard-{index:05d}.parquet",
        )  # fmt: skip


def test_an_earlier_run_is_read_as_its_shards_in_order_and_its_settings_override_nothing(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, {10: ["k", "l"], 2: ["c"], 0: ["a", "b"]})
    want = [f"{run}/data/shard-{i:05d}.parquet" for i in (0, 2, 10)]
    assert source_files(f"{run}/") == want and source_files(f"{run}/data/*.parquet") == want
    assert source_files(f"{run}/data/shard-00002.parquet") == [want[1]]
    assert run_folder(f"{run}/data/*.parquet") and run_folder(f"{run}/") and run_folder(str(run))
    assert not run_folder(str(tmp_path)) and not run_folder("nowhere://at/all")  # an address no store reads

    def rows(row_settings: bool) -> list[dict]:
        src = Source(f"{run}/", id_column="id", row_settings=row_settings)
        return pa.Table.from_batches(list(read_batches(src))).to_pylist()

    made = rows(row_settings=False)  # as job=edit reads an earlier run: its rows' settings are how it was made
    assert [(r["id"], r["prompt"]) for r in made] == [(i, f"prompt of {i}") for i in "abckl"]
    overrides = ("seed", "height", "width", "negative_prompt", "num_inference_steps", "guidance_scale")
    assert all(r[k] is None for r in made for k in overrides)
    kept = rows(row_settings=True)[0]  # any other source's columns of those names set its rows' settings
    assert (kept["seed"], kept["height"], kept["width"], kept["num_inference_steps"]) == (7, 512, 768, 28)
    assert (kept["guidance_scale"], kept["negative_prompt"]) == (3.5, "blurry")


def test_an_edit_job_over_an_earlier_run_reads_its_ids_images_and_prompts_but_not_its_settings(tmp_path):
    """DESIGN (job=edit): chained onto an earlier run's output folder, each row keeps its sample id and its image
    is the reference; the settings that run recorded per row are how it was made, not settings of the edit."""
    from launcher.config import load_config
    from launcher.plan.plan import source

    run = tmp_path / "run"
    _earlier_run(run, {0: ["a", "b"], 1: ["c"]})
    src = source(load_config("tiny", ["job=edit", f"dataset.path={run}/"]))
    assert (src.id_column, src.image_column, src.row_settings) == ("id", "image", False)
    assert source(load_config("tiny", [f"dataset.path={run}/"])).image_column is None  # text to image: no references


def test_lines_are_cut_from_one_mib_reads_and_a_line_over_the_bound_is_dropped_as_it_is_read(tmp_path):
    """launcher/sources/prompts_raw.py _byte_lines: a file's lines as bytes, read 1 MiB at a time, between an
    offset and an end; a line over LINE_BYTES (16 x the 64 KiB a prompt may hold: 1 MiB) is None, whichever
    reads it spans. The fixture puts lines at the bound, one byte past it, and across the read boundaries."""
    import pyarrow.fs as pafs

    from launcher.sources.prompts_raw import _byte_lines
    from launcher.sources.row_checks import LINE_BYTES

    mib = 1 << 20
    assert LINE_BYTES == mib  # DESIGN's 64 KiB prompt x 16
    lines = [b"b" * mib, b"a", b"g" * mib, b"c" * (mib + 1), b"", b"d" * (3 * mib + 5), b"e" * 10, b"f" * mib]
    path = tmp_path / "lines.txt"
    path.write_bytes(b"\n".join(lines))  # the last line, at the bound, has no newline and spans two reads
    fs = pafs.LocalFileSystem()
    want = [b"b" * mib, b"a", b"g" * mib, None, b"", None, b"e" * 10, b"f" * mib]
    assert list(_byte_lines(fs, str(path))) == want
    start = 2 * mib + 4  # the offset of the fourth line
    assert list(_byte_lines(fs, str(path), start)) == want[3:]
    end = start + (mib + 2) + 1 + (3 * mib + 6) + 4  # up to 4 bytes into the "e" line
    assert list(_byte_lines(fs, str(path), start, end)) == [None, b"", None, b"eeee"]
    path.write_bytes(b"x\n" + b"y" * (LINE_BYTES + 1))  # an over-long last line without a newline
    assert list(_byte_lines(fs, str(path))) == [b"x", None]


def test_a_bad_row_past_the_fast_readers_first_block_keeps_every_row_number_across_files(tmp_path, monkeypatch):
    """The fast reader (pyarrow, in blocks) hands a file to the exact reader at its first row it cannot take (a
    prompt that is no text); the exact one goes on from the rows already read. Row numbers (the default ids) run
    across the glob's files without a gap or a repeat, and with dataset.bad_rows=skip the bad row is set aside
    under its own number and line. Blocks of 64 KiB here (4 MiB in a run): the big file spans 3, its bad row in
    the last."""
    from launcher.sources import prompts_fast
    from launcher.sources.prompts import file_batches, source_files

    monkeypatch.setattr(prompts_fast, "_BLOCK", 1 << 16)

    def write(name, prompts):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    big = [f"a prompt about the number {i:07d} and nothing else" for i in range(3_000)]
    bad = 2_800
    big[bad] = 5
    write("a.jsonl", ["a0", "a1", "a2"])
    write("b.jsonl", big)
    write("c.jsonl", ["c0", "c1"])
    assert (tmp_path / "b.jsonl").stat().st_size > 2 << 16
    src = Source(f"{tmp_path}/*.jsonl", bad_rows="skip")
    starts, tables = [], []
    for f, at, b in file_batches(src, source_files(src.path)):
        starts.append((f.rsplit("/", 1)[1], at, b.num_rows))
        tables.append(pa.Table.from_batches([b]))
    t = pa.concat_tables(tables)
    assert t["id"].to_pylist() == [str(i) for i in range(3 + 3_000 + 2)]
    assert [s[1] for s in starts] == [sum(s[2] for s in starts[:k]) for k in range(len(starts))]  # no gap
    assert len([s for s in starts if s[0] == "b.jsonl"]) >= 2  # the fast reader gave a block before it gave up
    rejected = [(r["id"], json.loads(r["rejected"])) for r in t.select(["id", "rejected"]).to_pylist() if r["rejected"]]
    assert rejected == [
        (str(3 + bad), {
            "where": f"dataset {tmp_path}/b.jsonl, line {bad + 1}",
            "reason": "the prompt ('prompt') is of type int, not text; fix that row",
        })
    ]  # fmt: skip
    assert t["prompt"][3 + bad + 1].as_py() == big[bad + 1] and t["prompt"][-1].as_py() == "c1"


def test_a_hub_file_is_known_by_its_lfs_sha256_or_else_its_git_blob_id(hub_env):
    """What says a Hub file is unchanged without reading it: its LFS object's sha256 (a Parquet file, kept in LFS),
    else its git blob id (sha1 of "blob <size>\\0" and the bytes), as the Hub's tree API lists them."""
    import hashlib

    from test_hub_source import FILES, REPO

    from launcher.sources.globs import expand
    from launcher.sources.hub_source import content_id, hub_filesystem

    fs, p = hub_filesystem(f"hf://datasets/{REPO}")
    expand(f"hf://datasets/{REPO}/data/*", fs, f"{p}/data/*")  # the walker's listing, as a plan makes it
    parquet, jsonl = FILES["data/train-00000.parquet"], FILES["data/train-00001.jsonl"]
    assert content_id(f"datasets/{REPO}/data/train-00000.parquet") == f"sha256:{hashlib.sha256(parquet).hexdigest()}"
    blob = hashlib.sha1(b"blob %d\0" % len(jsonl) + jsonl).hexdigest()
    assert content_id(f"datasets/{REPO}/data/train-00001.jsonl") == f"blob:{blob}"


def test_a_hub_repo_with_no_data_file_is_refused_and_a_gated_one_says_its_http_status(hub, hub_env):
    """A gated repo's files answer 403 to a token that has not accepted its conditions (tests/fake_hub.py, as the
    Hub does): the line carries that status."""
    from fake_hub import Repo

    hub.repos["datasets/org/cards"] = Repo({"README.md": b"# only a card\n", "notes/a.md": b"no data\n"})
    for path in ("hf://datasets/org/cards", "hf://datasets/org/cards/"):
        with pytest.raises(ConfigError) as e:
            source_files(path)
        assert str(e.value).startswith(
            f"dataset.path {path}: the repo holds no .txt, .jsonl, .csv, .parquet files; point dataset.path at its "
            "prompt files ("
        )
    hub.repos["datasets/org/gated"] = Repo({"p.txt": b"a prompt\n"}, gated=True)
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source("hf://datasets/org/gated/p.txt")))
    assert "(HTTP 403: the repo is gated: accept its conditions on the Hub, then set HF_TOKEN)" in str(e.value)


def test_a_hub_error_is_said_by_its_first_line_cut_at_300_characters_or_else_its_kind():
    from launcher.sources.hub_source import _first_line

    assert _first_line(OSError("a refused request\nthe details")) == "a refused request"
    assert _first_line(ValueError("x" * 400)) == "x" * 300
    assert _first_line(TimeoutError("  \n ")) == "TimeoutError" and _first_line(KeyError()) == "KeyError"


def test_lines_are_numbered_past_a_line_too_long_or_not_utf8_and_on_from_an_offset(tmp_path):
    """The exact reader's lines (prompts_raw._lines): universal newlines; a line over LINE_BYTES or not UTF-8 is a
    Bad in its place, named by its own number, and the lines after it keep theirs; read from an offset (a grown
    file's old end) the numbers go on from the lines before it, lone carriage returns counted as lines too."""
    from launcher.sources.prompts_raw import _lines
    from launcher.sources.row_checks import LINE_BYTES, Bad

    head = b"p0\np1\n" + b"x" * (LINE_BYTES + 1) + b"\np3\n\xff\xfe not text\np5\r\np6\rp7\n"
    path = tmp_path / "p.txt"
    path.write_bytes(head + b"p9\n")

    def shown(lines):
        return [(n, f"Bad: {v.reason}" if isinstance(v, Bad) else v) for n, v in lines]

    got = shown(_lines(str(path)))
    assert [n for n, _ in got] == list(range(1, 10))
    assert [v for _, v in got if not v.startswith("Bad")] == ["p0", "p1", "p3", "p5", "p6", "p7", "p9"]
    assert got[2][1] == "Bad: the line is longer than 1024 KiB (a prompt may hold 64 KiB); fix or remove that line"
    assert got[4][1] == "Bad: not UTF-8 text (invalid start byte at byte 0); save the file as UTF-8"
    assert shown(_lines(str(path), len(head))) == [(9, "p9")]  # 8 lines before it, one of them ended by a lone \r
    plain = tmp_path / "q.txt"
    plain.write_bytes(b"a\nb\r\nc\n" + b"d\n")
    assert shown(_lines(str(plain), 7)) == [(4, "d")]


def test_an_edit_sources_reference_column_is_read_from_a_saved_dataset_and_from_parquet_alike(tmp_path):
    """launcher/sources/references.py: a `save_to_disk` folder's reference column is read row by row as a Parquet
    file's is, each value with its row; a folder without the column is refused naming the column and those found."""
    import datasets

    from launcher.sources.references import column_rows

    rows = {"prompt": ["a", "b", "c"], "image": ["r0.png", ["r1.png", "r2.png"], "r3.png"]}
    rows["image"] = [json.dumps(v) if isinstance(v, list) else v for v in rows["image"]]
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.table(rows), tmp_path / "p.parquet")
    for f in (tmp_path / "saved", tmp_path / "p.parquet"):
        got = [(n, v) for _, n, v in column_rows(str(f), "image")]
        assert got == list(enumerate(rows["image"])), f
    with pytest.raises(ConfigError, match=r"has no image column 'picture' \(dataset\.image_column\); columns found: "):
        list(column_rows(str(tmp_path / "saved"), "picture"))


def test_large_string_columns_and_a_file_whose_column_is_all_empty_read_as_one_source(tmp_path):
    """A Parquet source may hold its text as large_string (as pandas and polars write it); a file whose
    negative_prompt is empty throughout reads beside one that sets it, each row its own value (DESIGN: per-row
    settings); kept columns (dataset.keep_columns) keep their type through a file with no rows."""
    big = pa.large_string()
    pq.write_table(pa.table({"prompt": pa.array(["a", "b"], big), "tag": ["x", "y"]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], big), "tag": pa.array([], pa.string())}), tmp_path / "2.parquet")
    both = {"prompt": pa.array(["c"], big), "negative_prompt": pa.array(["blurry"], big), "tag": ["z"]}
    pq.write_table(pa.table(both), tmp_path / "3.parquet")
    src = Source(f"{tmp_path}/*.parquet", keep_columns=("tag",))
    rows = pa.Table.from_batches(list(read_batches(src))).to_pylist()
    assert [(r["prompt"], r["negative_prompt"], r["tag"]) for r in rows] == [
        ("a", None, "x"), ("b", None, "y"), ("c", "blurry", "z")]  # fmt: skip
