"""One copy by default (output.image_files, output.embed_images) and source columns carried (dataset.keep_columns)."""

from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from launcher.config import load_config
from launcher.ledger.store import Store


def png(color=(10, 20, 30), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), lines[-5:]
    return lines[-1]


# -- one copy


def test_a_default_run_stores_each_image_once_in_the_parquet(run_job):
    out = run_job("mesh.tp=1")
    assert not (out / "images").exists()  # no image files by default
    for f in sorted((out / "data").glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            assert Image.open(io.BytesIO(r["image"]["bytes"])).format == "PNG"
        state = json.loads((out / "state" / f"{f.stem}.json").read_text())
        assert list(state["files"]) == [f"data/{f.name}"]


def samples():
    return [
        {"id": i, "prompt": f"p {i}", "seed": 1, "height": 6, "width": 8, "model": "m", "encoded": png((k, 0, 0))}
        for k, i in enumerate(["a", "b/c"])
    ]


def write_shard(store: Store, name: str, samples: list[dict], output_cfg) -> dict:
    """A shard's files as the writer process writes them (launcher/writer/stream.py): one batch, then commit."""
    from launcher.writer.stream import ShardStream

    stream = ShardStream(store, name, output_cfg)
    stream.add(samples)
    return stream.commit()


def test_embed_images_false_writes_files_that_parquet_rows_point_at(tmp_path, monkeypatch):
    """Rows hold no bytes and the file's path from the folder's root; `datasets` opens such a path relative to
    the working directory, so it loads from the folder itself; the state records every file."""
    import datasets

    cfg = load_config("tiny", ["output.embed_images=false"])
    assert cfg.output.image_files is True  # rows that point at files need the files
    out = tmp_path / "out"
    got = write_shard(Store(out), "shard-00000", samples(), cfg.output)
    rows = pq.read_table(out / "data" / "shard-00000.parquet").to_pylist()
    assert [r["image"] for r in rows] == [
        {"bytes": None, "path": "images/shard-00000/a.png"},
        {"bytes": None, "path": "images/shard-00000/b_c.png"},
    ]
    assert (out / "images/shard-00000/b_c.png").read_bytes() == samples()[1]["encoded"]
    assert sorted(got["files"]) == [
        "data/shard-00000.parquet",
        "images/shard-00000/a.png",
        "images/shard-00000/b_c.png",
    ]
    monkeypatch.chdir(out)
    ds = datasets.load_dataset("parquet", data_files="data/*.parquet", split="train")
    assert ds[1]["image"].getpixel((0, 0)) == (1, 0, 0)


def test_the_defaults_embed_and_write_no_files(tmp_path):
    cfg = load_config("tiny", [])
    assert (cfg.output.image_files, cfg.output.embed_images) == (False, True)
    out = tmp_path / "out"
    got = write_shard(Store(out), "shard-00000", samples(), cfg.output)
    rows = pq.read_table(out / "data" / "shard-00000.parquet").to_pylist()
    assert [r["image"]["bytes"] for r in rows] == [s["encoded"] for s in samples()]
    assert list(got["files"]) == ["data/shard-00000.parquet"] and not (out / "images").exists()
    cfg = load_config("tiny", ["output.image_files=true"])  # both copies, as before, when asked
    got = write_shard(Store(tmp_path / "both"), "shard-00000", samples(), cfg.output)
    assert len(got["files"]) == 3


@pytest.mark.parametrize(
    "overrides, copies",
    [
        ([], 1),  # the Parquet's
        (["output.image_files=true"], 2),
        (["output.embed_images=false"], 1),  # the files; the Parquet only points at them
        (["output.webdataset=true"], 2),
        (["output.png=true", "output.webdataset=true"], 3),
    ],
)
def test_the_space_estimate_counts_the_copies_written(overrides, copies):
    from launcher.sizing.space import estimate_bytes

    cfg = load_config("tiny", ["generate.height=1024", "generate.width=1024", *overrides])
    assert estimate_bytes(cfg, 10) == int(10 * 1024 * 1024 * 1.8 * copies)


# -- dataset.keep_columns


def planned(path, *overrides):
    """Every planned shard's rows (launcher/plan/plan.py's pass over the source), as one table."""
    from launcher.plan.plan import shard_tables, source

    cfg = load_config("tiny", [f"dataset.path={path}", "run.shard_size=2", *overrides])
    return pa.concat_tables([t for _, t, _ in shard_tables(source(cfg), 2, None)])


def test_kept_columns_keep_their_source_types(tmp_path):
    src = tmp_path / "p.parquet"
    when = pa.array([0, 86400, None], pa.timestamp("ms"))
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "n": pa.array([1, 2, 3], pa.int16()), "t": when}), src)
    t = planned(src, "dataset.keep_columns=[t,n]")
    assert t.schema.field("n").type == pa.int16() and t.schema.field("t").type == pa.timestamp("ms")
    assert t.column("n").to_pylist() == [1, 2, 3] and t.column("t").equals(pa.chunked_array([when]))
    assert planned(src, "dataset.keep_columns=all").schema.names[-2:] == ["n", "t"]  # all: every other column
    lines = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "cat": "x", "k": 1, "tags": ["u"]}, {"prompt": "b", "k": 2.5}, {"prompt": "c", "cat": "z"}]
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = planned(lines, "dataset.keep_columns=[cat,k,tags]")
    assert t.column("cat").to_pylist() == ["x", None, "z"] and t.schema.field("k").type == pa.float64()
    assert t.column("tags").to_pylist() == [["u"], None, None]


def test_kept_values_stay_with_their_rows_past_read_chunks_across_files_and_in_every_format(tmp_path, monkeypatch):
    """16 JSON lines over two files, read 4 rows at a time by the kept pass and ~100 bytes at a time by the
    prompt pass (4,096 rows and 4 MiB in use: the same kind of boundaries, fewer rows): each row keeps its own
    values, typed by the first file; CSV keeps text; a saved dataset over two files keeps its types; a later
    file that lacks a kept column, or whose values do not fit the first file's types, is refused naming it."""
    import datasets

    from launcher.errors import ConfigError
    from launcher.sources import keep, prompts_fast

    monkeypatch.setattr(keep, "_READ_ROWS", 4)
    monkeypatch.setattr(prompts_fast, "_BLOCK", 100)  # the prompt pass reads JSON lines ~100 bytes at a time
    (tmp_path / "j").mkdir()
    first = [{"prompt": f"p{i}", "k": i, **({"cat": f"c{i}"} if i % 3 else {})} for i in range(11)]
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "j" / "b.jsonl").write_text("".join(json.dumps({"prompt": "q", "k": i}) + "\n" for i in range(5)))
    t = planned(tmp_path / "j" / "*.jsonl", "dataset.keep_columns=[k,cat]")
    assert t.schema.field("k").type == pa.int64() and t.schema.field("cat").type == pa.string()
    assert t.column("k").to_pylist() == [*range(11), *range(5)]
    assert t.column("cat").to_pylist() == [f"c{i}" if i % 3 else None for i in range(11)] + [None] * 5

    nulls = tmp_path / "nulls.jsonl"  # a column of nulls only in the first file is kept as text
    nulls.write_text('{"prompt": "a", "note": null}\n{"prompt": "b"}\n')
    t = planned(nulls, "dataset.keep_columns=[note]")
    assert t.schema.field("note").type == pa.string() and t.column("note").to_pylist() == [None, None]
    with pytest.raises(ConfigError) as e:
        planned(nulls, "dataset.keep_columns=[note,seed,nsfw]")
    assert str(e.value).startswith("dataset.keep_columns: 'seed' is also one of meshgen's own columns (clip_score, ")
    assert str(e.value).endswith(", width); rename it in the source, or leave it out of the list"), str(e.value)

    csv = tmp_path / "p.csv"
    csv.write_text("prompt,n\na,1\nb,2\n")
    t = planned(csv, "dataset.keep_columns=all")
    assert t.schema.field("n").type == pa.string() and t.column("n").to_pylist() == ["1", "2"]

    rows = [{"prompt": f"p{i}", "n": i * 10, "tag": f"t{i}"} for i in range(7)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    t = planned(tmp_path / "saved", "dataset.keep_columns=[tag,n]")
    assert t.schema.field("n").type == pa.int64() and t.column("n").to_pylist() == [i * 10 for i in range(7)]
    assert t.column("tag").to_pylist() == [f"t{i}" for i in range(7)]
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tmp_path / "saved1"))  # one file
    assert planned(tmp_path / "saved1", "dataset.keep_columns=[n]").column("n").to_pylist() == [0, 10]
    with pytest.raises(ConfigError) as e:
        planned(tmp_path / "saved", "dataset.keep_columns=[tag,nope]")
    assert str(e.value).endswith("has no column 'nope'; columns found: prompt, n, tag"), str(e.value)

    pq.write_table(pa.table({"prompt": ["a"], "n": [1]}), tmp_path / "j" / "a.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "n": pa.array([2], pa.int32())}), tmp_path / "j" / "b.parquet")
    t = planned(tmp_path / "j" / "*.parquet", "dataset.keep_columns=[n]")  # int32 fits int64
    assert t.schema.field("n").type == pa.int64() and t.column("n").to_pylist() == [1, 2]
    pq.write_table(pa.table({"prompt": ["c"], "n": ["three"]}), tmp_path / "j" / "c.parquet")
    with pytest.raises(ConfigError) as e:
        planned(tmp_path / "j" / "*.parquet", "dataset.keep_columns=[n]")
    said = f"dataset.keep_columns: {tmp_path / 'j' / 'c.parquet'} holds values that are not of the first file's types "
    assert str(e.value).startswith(said + "(n: int64): ") and "three" in str(e.value), str(e.value)
    pq.write_table(pa.table({"prompt": ["c"], "other": [3]}), tmp_path / "j" / "c.parquet")
    with pytest.raises(ConfigError) as e:
        planned(tmp_path / "j" / "*.parquet", "dataset.keep_columns=[n]")
    said = f"dataset.keep_columns: {tmp_path / 'j' / 'c.parquet'} has no column 'n'; columns found: prompt, other"
    assert str(e.value) == said, str(e.value)

    said = f"dataset.keep_columns: {tmp_path / 'j' / 'b.jsonl'} holds values that are not of the first file's types "
    for at in (0, 5):  # in a full read of 4 rows, and in the last, short one
        bad = [{"prompt": "q", "k": "x" * 300 if i == at else i} for i in range(6)]
        (tmp_path / "j" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
        with pytest.raises(ConfigError) as e:
            planned(tmp_path / "j" / "*.jsonl", "dataset.keep_columns=[k,cat]")
        assert str(e.value).startswith(said + "(k: int64, cat: string): "), str(e.value)
        arrow = str(e.value).split("(k: int64, cat: string): ", 1)[1]
        assert "xxx" in arrow and len(arrow) == 160, arrow  # pyarrow's first line, cut to 160 characters

    # a line that is not an object is set aside by the prompt pass; the kept pass keeps its place
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"prompt": "a", "k": 1}\n"just text"\n{"prompt": "c", "k": 3}\n')
    t = planned(odd, "dataset.keep_columns=[k]", "dataset.bad_rows=skip")
    assert t.column("k").to_pylist() == [1, None, 3]


def test_a_changed_kept_value_changes_the_shard_fingerprint_and_none_kept_changes_nothing(tmp_path):
    from launcher.plan.shards import prompts_fingerprint

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "p", "cat": "x"}\n')
    b.write_text('{"prompt": "p", "cat": "y"}\n')
    fp = lambda path, *o: prompts_fingerprint(planned(path, *o))  # noqa: E731
    assert fp(a) == fp(b)  # not kept: the column plays no part, as before
    assert fp(a, "dataset.keep_columns=[cat]") != fp(b, "dataset.keep_columns=[cat]")
    assert fp(a, "dataset.keep_columns=[cat]") != fp(a)
    a.write_text('{"prompt": "p", "tags": ["x"], "ok": true}\n')  # other types: by their values too
    b.write_text('{"prompt": "p", "tags": ["y"], "ok": true}\n')
    assert fp(a, "dataset.keep_columns=[tags,ok]") != fp(b, "dataset.keep_columns=[tags,ok]")
    assert fp(a, "dataset.keep_columns=[tags,ok]") == fp(a, "dataset.keep_columns=[tags,ok]")


@pytest.mark.parametrize(
    "keep, source, said",
    [
        ("[seed]", "jsonl", "dataset.keep_columns: 'seed' is also one of meshgen's own columns"),
        ("[clip_score]", "jsonl", "dataset.keep_columns: 'clip_score' is also one of meshgen's own columns"),
        ("all", "jsonl_model", "dataset.keep_columns: 'model' is also one of meshgen's own columns"),
        ("[nope]", "jsonl", "has no column 'nope'; columns found: prompt, cat"),
        ("[cat]", "txt", "has no column 'cat'; columns found: none"),
    ],
)
def test_a_kept_column_that_clashes_or_is_missing_is_refused_at_planning(
    keep, source, said, tiny_model, tmp_path, launcher_main, capsys
):
    path = tmp_path / f"p.{source[:5].rstrip('_')}"
    if source == "txt":
        path.write_text("a prompt\n")
    else:
        extra = {"model": "m"} if source == "jsonl_model" else {"cat": "x"}
        path.write_text(json.dumps({"prompt": "a", **extra}) + "\n")
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", f"dataset.path={path}", f"output.dir={out}", f"dataset.keep_columns={keep}"]
    assert launcher_main(["--dry-run", *args]) == 2
    line = last_error(capsys)
    assert said in line and "\n" not in line
    assert not os.path.lexists(out)


def test_every_column_the_writer_makes_is_reserved():
    from launcher.sources.keep import RESERVED
    from launcher.sources.prompts import SCHEMA
    from launcher.writer.writer import QUALITY_COLUMNS, schema_of

    sample = {"prompt_id": "p", "variant": 0, "true_cfg_scale": 1.0, "lora_scales": [1.0], "reference": []}
    sample |= {"reference_image": None, **dict.fromkeys(QUALITY_COLUMNS)}
    names = set(schema_of([sample]).names) | set(SCHEMA.names) | {"ref_sha256", "ref_loc", "rejected"}
    assert names <= RESERVED, names - RESERVED


@pytest.mark.parametrize(
    "output, says",
    [
        ({}, "stored as the `image` column's bytes"),  # the default: one copy, in the Parquet
        ({"image_files": True}, "stored as the `image` column's bytes and `images/shard-NNNNN/<id>.png` files"),
        ({"png": True}, "stored as the `image` column's bytes and `images/shard-NNNNN/<id>.png` files"),  # old name
        ({"embed_images": False}, "stored as `images/shard-NNNNN/<id>.png` files; the `image` column's `path`"),
    ],
)
def test_the_card_says_where_the_images_are(output, says):
    from launcher.publish.card import files_section

    assert f"- images: png (lossless, zlib level 1), {says}" in files_section({"format": "png", **output})
