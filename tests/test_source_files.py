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


# -- survivors of the sources room's mutation run (docs/survivors/sources.txt)


def _png(size: int = 64, noise: bool = False) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8) if noise else None
    im = Image.fromarray(pixels) if noise else Image.new("RGB", (size, size), (200, 10, 10))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_a_symlink_loop_names_the_link_or_says_a_link_in_the_path_leads_back(tmp_path):
    """globs.py: a folder whose real path is one `**` is already inside is a loop, refused in one line. It names
    the folder where that folder is itself the link (here a link back to the folder a `*` reached, where the `**`
    starts); where the loop comes through a link higher up (a `*` that took the link, then a real folder under
    it), the folder is no link, and the line says "a link in it"."""
    import os

    root = os.path.realpath(tmp_path)
    g = f"{root}/g"
    os.makedirs(f"{g}/a/b")
    os.symlink(f"{g}/a", f"{g}/a/b/up")  # back to a, which `*` reached
    pattern = f"{g}/*/**/*.txt"
    with pytest.raises(ConfigError) as e:
        source_files(pattern)
    assert str(e.value) == (
        f"dataset.path {pattern}: {g}/a/b/up leads back to {g}/a, a folder it is inside, so ** would never end "
        "(a symlink loop); remove the link or write a glob that does not recurse through it"
    )
    h = f"{root}/h"
    os.makedirs(f"{h}/a")
    os.symlink(h, f"{h}/a/x")  # `*` takes x (h itself); under it, h/a/x/a is the real folder h/a again
    pattern = f"{h}/a/*/**/*.txt"
    with pytest.raises(ConfigError) as e:
        source_files(pattern)
    assert str(e.value) == (
        f"dataset.path {pattern}: a link in it leads back to {h}/a, a folder it is inside, so ** would never end "
        "(a symlink loop); remove the link or write a glob that does not recurse through it"
    )


def test_names_that_end_in_a_space_or_an_x_are_read_as_written(tmp_path):
    """Only a trailing '/' is dropped from a path (a folder given as `dir/`): a file or folder name that ends in a
    space or in a letter the code strips elsewhere (the X of `rstrip("XX/XX")`) is that name, whether a glob
    reaches it, it is an earlier run's folder, or it is the folder that relative references start from."""
    from launcher.sources.reach import check_output_outside_source
    from launcher.sources.references import _base_dir

    g = tmp_path / "g"
    for folder in ("a ", "bX"):
        (g / folder).mkdir(parents=True)
        (g / folder / "p.txt").write_text("a cat\n")
    assert source_files(f"{g}/*/p.txt") == [f"{g}/a /p.txt", f"{g}/bX/p.txt"]  # as glob.glob names them
    for name, shown in (("p.txtX", "'.txtx'"), ("p.txt ", "'.txt '")):  # the extension is all after the last '.'
        (tmp_path / name).write_text("a cat\n")
        assert _refusal(tmp_path / name) == (
            f"dataset {tmp_path}/{name}: unknown format {shown}; use one of .txt, .jsonl, .csv, .parquet"
        )
    for name in ("run ", "runX"):
        _earlier_run(tmp_path / name, {0: ["a"]})
        assert source_files(str(tmp_path / name)) == [f"{tmp_path}/{name}/data/shard-00000.parquet"]
        assert _base_dir(str(tmp_path / name)) == str(tmp_path / name)
    # `** ` is no `**`: it matches names ending in a space within x, so x/out is out of its reach
    check_output_outside_source(f"{g}/x/** ", f"{g}/x/out")


def test_only_objects_that_share_a_size_and_a_time_are_asked_for_their_etag(tmp_path, monkeypatch):
    """globs.py once_each: an object store has no inodes, so two objects are one file when their size, time and
    ETag agree. The ETag costs a HEAD request an object: only objects that share a size and a time with another
    are asked (none for most sources), and of those with one ETag the first is kept."""
    import os

    import pyarrow.fs as pafs

    from launcher.sources import globs

    asked = []
    monkeypatch.setattr(globs, "_etag", lambda scheme, f: asked.append((scheme, f)) or '"one-etag"')
    found = []
    for name, data in (("a.txt", b"1\n"), ("b.txt", b"22\n"), ("c.txt", b"22\n")):
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, ns=(10**18, 10**18))
        found.append(str(tmp_path / name))
    fs = pafs.LocalFileSystem()
    infos = {i.path: i for i in fs.get_file_info(found)}
    assert globs.once_each(found, infos, fs, "s3://") == found[:2]  # c.txt repeats b.txt
    assert asked == [("s3://", found[1]), ("s3://", found[2])]  # a.txt has a size of its own: no request


def test_a_hub_repo_is_the_one_named_and_its_refusals_say_which_hub_was_asked(hub, hub_env, monkeypatch):
    """hf:// sources (launcher/sources/hub_source.py): a repo whose name ends in X is that repo, read whole, by a
    glob or a file (Parquet through pyarrow's random-access file); a folder in it is no data file; an unknown repo
    names the Hub it asked (HF_ENDPOINT, as set now, without a trailing '/'), and an address that is none says so."""
    from fake_hub import Repo

    from launcher.sources import hub_source

    parquet = test_hub_source._parquet([{"prompt": "from parquet"}])
    hub.repos["datasets/org/othersX"] = Repo({"p.txt": b"a prompt\n", "q.parquet": parquet, "X/r.txt": b"r\n"})
    base = "hf://datasets/org/othersX"  # org/others is no repo of the Hub
    assert source_files(base) == [f"{base}/X/r.txt", f"{base}/p.txt", f"{base}/q.parquet"]
    assert source_files(f"{base}/*.txt") == [f"{base}/p.txt"]
    assert [r["prompt"] for r in pa.Table.from_batches(read_batches(Source(f"{base}/q.parquet"))).to_pylist()] == [
        "from parquet"
    ]
    assert _refusal(f"{base}/X").startswith(f"dataset.path {base}/X is a folder but not one written by datasets")
    endpoint = hub_env["HF_ENDPOINT"].rstrip("/")
    assert f"{endpoint} (HF_ENDPOINT) has no dataset repo org/nothing that" in _refusal(
        "hf://datasets/org/nothing/p.txt"
    )
    bad = "hf://datasets/org/a name/p.txt"
    said = _refusal(bad)
    assert said.startswith(f"dataset.path {bad} is not a Hub address (") and said.endswith(
        "); write hf://datasets/ORG/NAME[@REVISION][/path or glob]"
    )
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example/mirrorX/")
    assert hub_source.unreadable("hf://datasets/o/n/p.txt", "boom").startswith(
        "dataset.path hf://datasets/o/n/p.txt cannot be read from the Hub at https://hub.example/mirrorX (boom); "
    )


def test_the_exact_readers_batches_have_the_sources_schema_and_carry_late_marks_to_their_rows(tmp_path, monkeypatch):
    """A file the fast reader gives up on (a seed written 3.0, which JSON types as a float) is read row by row and
    cut into batches of BATCH_ROWS rows (2 here; 65536 in a run). Each batch has SCHEMA, as the fast reader's
    (with bad_rows=refuse no `rejected` column: one source, one schema), and with bad_rows=skip a row found bad
    only late (a duplicate id: Source.late) is marked in whichever batch it falls, by its source position."""
    from launcher.sources import prompts
    from launcher.sources.prompts import SCHEMA

    monkeypatch.setattr(prompts, "BATCH_ROWS", 2)
    (tmp_path / "a.txt").write_text("t0\nt1\n")
    rows = [{"prompt": "p0", "seed": 3.0}, {"prompt": "p1"}, {"prompt": "p2", "negative_prompt": "dark"}]
    rows += [{"prompt": "p3"}, {"prompt": "p4", "height": 512}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    batches = list(read_batches(Source(f"{tmp_path}/*")))
    assert [b.schema for b in batches] == [SCHEMA] * len(batches)
    t = pa.Table.from_batches(batches)
    assert t["id"].to_pylist() == [str(i) for i in range(7)]
    assert t["prompt"].to_pylist() == ["t0", "t1", "p0", "p1", "p2", "p3", "p4"]
    assert t["seed"].to_pylist() == [None, None, 3, None, None, None, None]
    assert t["negative_prompt"].to_pylist()[4] == "dark" and t["height"].to_pylist()[6] == 512
    src = Source(f"{tmp_path}/*", bad_rows="skip", late=((5, "a duplicate"),))
    marks = pa.Table.from_batches(list(read_batches(src)))["rejected"].to_pylist()
    assert [json.loads(m) if m else None for m in marks] == [None] * 5 + [
        {"where": "row 5 of the source", "reason": "a duplicate"}, None]  # fmt: skip


def test_repeated_ids_and_file_names_are_named_in_every_format_and_unique_ids_are_read_once(tmp_path, monkeypatch):
    """An id column (dataset.id_column) must hold each id once, and ids must make distinct file names: the
    vectorised check finds a clash, and the row-by-row pass then names its rows; in Parquet too, whose rows are
    read with only the columns used (the id among them). Unique ids cost no second pass over the source."""
    from launcher.sources import prompts

    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"key": ["a", "b", "a"], "prompt": ["x", "y", "z"], "extra": [1, 2, 3]}), p)
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(str(p), id_column="key")))
    assert str(e.value) == f"dataset {p}, row 2: duplicate id 'a' (first at {p}, row 0); ids must be unique"
    j = tmp_path / "j.jsonl"
    j.write_text('{"key": "a b", "prompt": "x"}\n{"key": "a_b", "prompt": "y"}\n')
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(str(j), id_column="key")))
    assert str(e.value) == (
        f"dataset {j}: ids 'a b' and 'a_b' both become the file name a_b.png; "
        "make them differ in letters, digits, '-' or '_'"
    )

    def no_second_pass(*_args):
        raise AssertionError("unique ids were read again row by row")

    monkeypatch.setattr(prompts, "_raw_rows", no_second_pass)
    pq.write_table(pa.table({"key": ["a", "b", "c"], "prompt": ["x", "y", "z"]}), p)
    assert pa.Table.from_batches(read_batches(Source(str(p), id_column="key")))["id"].to_pylist() == ["a", "b", "c"]


def test_a_limit_below_one_is_refused_and_reading_stops_at_the_limit(tmp_path):
    """read_prompts (tools/bench/bare.py and tests): dataset.limit selects the first rows; 0 selects none and is
    refused; rows past the limit are not read, so a bad file after them is no error."""
    from launcher.sources.prompts import read_prompts

    (tmp_path / "1.txt").write_text("a\nb\n")
    (tmp_path / "2.jsonl").write_text("not json\n")
    assert read_prompts(f"{tmp_path}/*", limit=2) == [{"id": "0", "prompt": "a"}, {"id": "1", "prompt": "b"}]
    with pytest.raises(ConfigError, match=r"^dataset.limit=0 selects no prompts; use 1 or more"):
        read_prompts(str(tmp_path / "1.txt"), limit=0)


def test_an_address_with_credentials_or_one_no_store_reads_is_refused_in_one_line(tmp_path, monkeypatch):
    """DESIGN: an address is printed and recorded everywhere, so one carrying a secret is refused before any
    store is asked; an address pyarrow cannot parse is one line naming it. A glob with two character classes
    on a store gives pyarrow's URI parser only its part before the first one (which the parser would refuse)."""
    from launcher.sources.prompts import filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing is asked of it
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    said = _refusal("s3://AKIAEXAMPLE:hunter2@bucket/p.txt")
    assert said.startswith("dataset.path=s3://") and " carries credentials in its address" in said
    assert "hunter2" not in said
    assert _refusal("s3:///x.txt") == (
        "dataset.path s3:///x.txt cannot be read (Missing bucket name in S3 URI); check the address, the network "
        "and the credentials (the AWS_* variables for s3://, gcloud application default credentials for gs://)"
    )
    assert filesystem("s3://bucket/[ab]/[cd].txt")[1] == "bucket/[ab]/[cd].txt"


def test_a_glob_over_a_saved_dataset_still_refuses_a_file_of_unknown_format_after_it(tmp_path):
    saved = tmp_path / "a-saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (tmp_path / "z.tsv").write_text("prompt\ta cat\n")
    assert _refusal(f"{tmp_path}/*") == (
        f"dataset {tmp_path}/z.tsv: unknown format '.tsv'; use one of .txt, .jsonl, .csv, .parquet"
    )


def test_an_edit_source_with_kept_columns_gets_both_its_references_and_its_kept_values(tmp_path):
    """job=edit with dataset.keep_columns: two attachers, row for row (prompts.py _Both); neither replaces the
    other."""
    import hashlib

    from launcher.sources.prompts import SizeRule

    png = _png()
    p = tmp_path / "e.parquet"
    image = [{"bytes": png, "path": None}] * 2
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": image, "tag": ["t0", "t1"]}), p)
    sizes = SizeRule(16, 1 << 22, 64, 64, max_references=1)
    src = Source(str(p), sizes=sizes, image_column="image", keep_columns=("tag",))
    t = pa.Table.from_batches(read_batches(src))
    assert t["ref_sha256"].to_pylist() == [hashlib.sha256(png).hexdigest()] * 2
    assert [json.loads(v)[0]["src"] for v in t["ref_loc"].to_pylist()] == [
        [str(p), "image", 0, 0],
        [str(p), "image", 1, 0],
    ]
    assert t["tag"].to_pylist() == ["t0", "t1"]


def _refused_row(tmp_path, name: str, data: bytes, **source) -> str:
    f = tmp_path / name
    f.write_bytes(data)
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(str(f), **source)))
    return str(e.value)


def test_each_bad_row_or_file_the_exact_reader_meets_is_worded_in_its_one_line(tmp_path):
    """DESIGN: an error names what is wrong, where, and the fix. The exact reader words each refusal; these are
    the ones a file can only meet there (the fast reader gives up on them first)."""
    f = tmp_path / "n.jsonl"
    assert _refused_row(tmp_path, "n.jsonl", b'{"prompt": null}\n') == (
        f"dataset {f}, line 1: the prompt ('prompt') is missing (null), not text; fix that row"
    )
    line = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]"  # 47 characters: shown up to 40
    assert _refused_row(tmp_path, "n.jsonl", line.encode() + b"\n") == (
        f"dataset {f}, line 1: expected a JSON object {{...}}, got {line[:40]}; fix that line"
    )
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a"], "n": [1]}), p)
    assert _refused_row(tmp_path, "t.parquet", p.read_bytes()) == (
        f"dataset {p} has no prompt column 'prompt' (dataset.prompt_column); columns found: text, n"
    )
    c = tmp_path / "c.parquet"
    c.write_bytes(b"no parquet here")
    with pytest.raises(pa.ArrowInvalid) as e:  # pyarrow's own words for a file that is no Parquet
        pq.ParquetFile(str(c))
    first = str(e.value).strip().splitlines()[0]
    assert _refused_row(tmp_path, "c.parquet", b"no parquet here") == (
        f"dataset {c}: not a readable Parquet file ({first}); rewrite it"
    )
    c = tmp_path / "s.csv"
    assert _refused_row(tmp_path, "s.csv", b"prompt,seed\na,1\nb,NA\n") == (  # no "NA" is a null in a CSV
        f"dataset {c}, line 3: column 'seed' is 'NA'; it must be an integer from 0 to 2**63-1 (or empty, to use "
        "the config's)"
    )
    assert _refused_row(tmp_path, "s.csv", b"prompt\na\n", id_column="key") == (
        f"dataset {c}, line 2 has no id column 'key' (dataset.id_column); columns found: prompt; fix the row or set "
        "dataset.id_column=null"
    )


def test_integer_ids_are_read_as_text_by_the_fast_reader(tmp_path):
    f = tmp_path / "i.jsonl"
    f.write_text('{"key": 7, "prompt": "a"}\n{"key": 12, "prompt": "b"}\n')
    assert pa.Table.from_batches(read_batches(Source(str(f), id_column="key")))["id"].to_pylist() == ["7", "12"]


def test_rows_set_aside_keep_an_id_only_where_they_have_one_and_the_rows_after_them_are_read(tmp_path):
    """dataset.bad_rows=skip (launcher/sources/rejected.py): a row that cannot be read (malformed JSON), a row with
    an id that is no text or number, or none at all, stands in its place with a null id (the rejected file's `id`
    is null where the row has none that could be read); the rows after a bad line or a blank one are read on."""
    f = tmp_path / "s.jsonl"
    lines = ['{"key": "a", "prompt": "p0"}', "{bad json", '{"key": [1], "prompt": null}', '{"prompt": "p3"}', ""]
    f.write_text("\n".join([*lines, '{"key": "e", "prompt": "p5"}']) + "\n")
    t = pa.Table.from_batches(read_batches(Source(str(f), id_column="key", bad_rows="skip")))
    assert t["id"].to_pylist() == ["a", None, None, None, "e"]
    where = [json.loads(m)["where"] if m else None for m in t["rejected"].to_pylist()]
    assert where == [None, f"dataset {f}, line 2", f"dataset {f}, line 3", f"dataset {f}, line 4", None]


def test_a_grown_file_is_read_from_its_old_end_with_its_lines_numbered_on(tmp_path):
    """A text source that only grew is read from its old end (a line end; launcher/ids/idplan.py): a U+FEFF there
    is text, not a byte-order mark (the exact reader keeps it too); lines are numbered on from the old part, one
    byte of it too; a CSV's new rows are all read, under the file's header."""
    from launcher.sources.prompts import file_batches
    from launcher.sources.prompts_raw import raw_rows

    f = tmp_path / "g.txt"
    f.write_bytes(b"old\n" + "\ufeffnew\n".encode())
    got = [b.column("prompt").to_pylist() for _, _, b in file_batches(Source(str(f)), [str(f)], 1, 4)]
    assert got == [["\ufeffnew"]]
    for old in (b"\n", b"\r"):  # one line before the new part either way
        j = tmp_path / "g.jsonl"
        j.write_bytes(old + b"{bad\n")
        assert [w for w, _ in raw_rows(str(j), "prompt", None, 1)] == [f"dataset {j}, line 2"], old
    c = tmp_path / "g.csv"
    c.write_text("prompt\na\nb\nc\n")
    assert list(raw_rows(str(c), "prompt", None, len("prompt\na\n"))) == [
        (f"dataset {c}, line 3", {"prompt": "b"}), (f"dataset {c}, line 4", {"prompt": "c"})]  # fmt: skip


def test_a_parquet_column_the_source_does_not_use_is_not_read_row_by_row(tmp_path):
    """The exact reader reads a Parquet file's prompt, id and setting columns only: a column it does not use
    (images, embeddings, notes) is neither held nor checked, so text in it that is not UTF-8 fails no row."""
    notes = pa.array([b"fine", b"\xff not text"], pa.binary()).view(pa.string())
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "seed": [1.0, 2.0], "note": notes}), p)  # float seeds: exact
    t = pa.Table.from_batches(read_batches(Source(str(p))))
    assert t["prompt"].to_pylist() == ["a", "b"] and t["seed"].to_pylist() == [1, 2]


def test_reference_images_are_checked_against_the_familys_pixels_and_the_size_bounds(tmp_path, monkeypatch):
    """launcher/sources/reference_checks.py: a reference over the family's pixels is refused as such (not decoded:
    a truncated one says so too); one at the limit is decoded, so a truncated one is refused as cut short; a file
    is hashed whole and read from its start; a file over MAX_BYTES (monkeypatched to 2 MiB) is refused by its
    size, one of exactly MAX_BYTES is read; the output size a row leaves to the config is the config's."""
    import hashlib
    import io

    from launcher.sources import reference_checks
    from launcher.sources.prompts import SizeRule
    from launcher.sources.reference_checks import check_image, check_output_size, hash_file
    from launcher.sources.references import plan_row

    cut = _png(128, noise=True)
    cut = cut[: len(cut) // 2]
    with pytest.raises(ConfigError) as e:
        check_image(io.BytesIO(cut), "row 0", "#0", 64 * 64, len(cut))
    assert str(e.value) == (
        "row 0: reference #0 is 128x128 (0.0 megapixels), more than the 0.0 this model family takes; downscale it"
    )
    with pytest.raises(ConfigError, match=r"^row 0: reference #0 is damaged or cut short \("):
        check_image(io.BytesIO(cut), "row 0", "#0", 128 * 128, len(cut))
    src = Source("x.parquet", image_column="image", sizes=SizeRule(16, 64 * 64, 64, 64, 1))
    with pytest.raises(ConfigError, match=r"reference #0 is 128x128 .* more than the 0\.0 this model family takes"):
        plan_row("row 0", "x.parquet", 0, {"bytes": _png(128), "path": None}, ".", src)
    png = tmp_path / "r.png"
    png.write_bytes(_png())
    assert hash_file(str(png), "row 0", 1 << 22) == (hashlib.sha256(png.read_bytes()).hexdigest(), (64, 64))
    monkeypatch.setattr(reference_checks, "MAX_BYTES", 2 << 20)
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * (2 << 20))
    with pytest.raises(ConfigError, match=f"^row 0: reference {big} is not an image "):
        hash_file(str(big), "row 0", 1 << 22)
    big.write_bytes(b"\0" * ((2 << 20) + 1))
    with pytest.raises(ConfigError) as e:
        hash_file(str(big), "row 0", 1 << 22)
    assert str(e.value) == (
        f"row 0: reference {big} is larger than 2 MiB, more than an image within this family's 4.0 megapixels "
        "needs; use a smaller file"
    )
    with pytest.raises(ConfigError) as e:
        hash_file(str(tmp_path), "row 0", 1 << 22)  # a folder
    assert str(e.value).startswith(f"row 0: reference {tmp_path} cannot be read (")
    assert str(e.value).endswith("); fix the path or its permissions")
    check_output_size("row 0", None, None, SizeRule(16, 1 << 22, 1024, 1024))  # 1024x1024: within 8:1


def test_a_reference_is_read_back_from_its_lineage_in_a_file_whose_name_holds_the_marker(tmp_path):
    """A stored reference's lineage is `<source file>#row=N[&ref=K]`: the marker is the last one in it."""
    from launcher.sources.reference_reads import read_lineage

    f = tmp_path / "x#row=9.parquet"
    image = [{"bytes": b"one", "path": None}, {"bytes": b"two", "path": None}]
    pq.write_table(pa.table({"prompt": ["a", "b"], "image": image}), f)
    assert read_lineage(f"{f}#row=1") == b"two"


def test_a_json_lines_reference_column_holds_a_list_or_nothing(tmp_path):
    from launcher.sources.references import column_rows

    f = tmp_path / "r.jsonl"
    f.write_text('{"prompt": "a", "image": ["r1.png", "r2.png"]}\n{"prompt": "b", "image": null}\n')
    assert [v for _, _, v in column_rows(str(f), "image")] == [["r1.png", "r2.png"], None]


def test_a_source_whose_rows_were_all_set_aside_names_the_file_of_the_first(tmp_path):
    from launcher.sources.rejected import refuse_all

    rows = [{"file": f"{tmp_path}/b.jsonl", "line": 3, "reason": "the prompt is missing"}]
    with pytest.raises(ConfigError) as e:
        refuse_all(f"{tmp_path}/*.jsonl", rows)
    assert str(e.value) == (
        f"dataset {tmp_path}/*.jsonl: every row was set aside (dataset.bad_rows=skip), e.g. {tmp_path}/b.jsonl, "
        "line 3: the prompt is missing"
    )


def test_the_rejected_rows_file_has_its_schema_whatever_its_rows_lack(tmp_path):
    """rejected/<run id>.parquet: its columns keep their types (FILE_SCHEMA) where every row leaves one empty, as a
    row that could not be read leaves its file, line and id."""
    from launcher.ledger.store import Store
    from launcher.sources.rejected import FILE_SCHEMA, write

    rows = [{"file": None, "line": None, "position": 4, "shard": 0, "id": None, "reason": "unreadable"}]
    write(Store(str(tmp_path)), "r1", rows)
    assert pq.read_schema(tmp_path / "rejected" / "r1.parquet").remove_metadata().equals(FILE_SCHEMA)


def test_a_relative_glob_names_its_files_as_python_glob_does(tmp_path, monkeypatch):
    """`./d/*.txt` names `./d/a.txt`, as glob.glob does; `d/*.txt` names `d/a.txt`. The names are those of the
    source's files in every error, in the rejected rows' file and in a reference's lineage."""
    import glob

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("a cat\n")
    monkeypatch.chdir(tmp_path)
    for pattern in ("./d/*.txt", "d/*.txt"):
        assert source_files(pattern) == glob.glob(pattern), pattern


def test_the_fast_reader_gives_up_on_a_batch_of_text_past_32_bit_string_offsets(monkeypatch):
    """prompts_fast._strings builds a string array, whose offsets are int32: a batch of prompts over 2 GiB in all
    would wrap them, so it goes to the exact reader. The bound is numpy's int32 max, stood in for by 12 here (a
    2 GiB batch takes too long to build): 12 bytes in all fit, 13 do not, whichever string holds them."""
    import types

    import numpy as np

    from launcher.sources import prompts_fast
    from launcher.sources.prompts import _GiveUp

    small = types.SimpleNamespace(max=12)
    fake = types.SimpleNamespace(zeros=np.zeros, cumsum=np.cumsum, int64=np.int64, int32=np.int32)
    fake.iinfo = lambda t: small if t is np.int32 else np.iinfo(t)
    monkeypatch.setattr(prompts_fast, "np", fake)
    assert prompts_fast._strings(["abcd", "efghijkl"]).to_pylist() == ["abcd", "efghijkl"]
    with pytest.raises(_GiveUp):
        prompts_fast._strings(["abcd", "efghijklm"])
