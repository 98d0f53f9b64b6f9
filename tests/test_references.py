"""job=edit's planning without a model: reference sizes, what the shard fingerprint covers, Parquet sources."""

from __future__ import annotations

import io
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from launcher.plan.shards import prompts_fingerprint
from launcher.sources.prompts import SizeRule, Source, read_batches
from launcher.sources.reference_reads import load_references, read_lineage

RULE = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10)


def png(w: int, h: int, color=(0, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def plan_table(path, **kw) -> pa.Table:
    return pa.Table.from_batches(list(read_batches(Source(str(path), image_column="image", sizes=RULE, **kw))))


def test_size_from_reference_rounds_down_to_the_model_factor(tmp_path):
    (tmp_path / "small.png").write_bytes(png(100, 70))
    (tmp_path / "large.png").write_bytes(png(2000, 1500))
    rows = [{"prompt": "a", "image": "small.png"}, {"prompt": "b", "image": "large.png"}]
    rows.append({"prompt": "c", "image": "small.png", "height": 80, "width": 80})  # a row's own size wins
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = plan_table(tmp_path / "p.jsonl", size_from_reference=True).to_pylist()
    assert (t[0]["height"], t[0]["width"]) == (64, 96)
    assert (t[1]["height"], t[1]["width"]) == (1488, 2000)
    assert (t[2]["height"], t[2]["width"]) == (80, 80)
    plain = plan_table(tmp_path / "p.jsonl").to_pylist()  # without it, the config's size applies (empty here)
    assert plain[0]["height"] is None and plain[2]["height"] == 80


def test_the_fingerprint_covers_reference_content_not_location(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "r.png").write_bytes(png(64, 64))
    (a / "p.jsonl").write_text(json.dumps({"prompt": "x", "image": "r.png"}) + "\n")
    first = prompts_fingerprint(plan_table(a / "p.jsonl"))
    shutil.copytree(a, b)  # the same source elsewhere: the same images, the same fingerprint
    assert prompts_fingerprint(plan_table(b / "p.jsonl")) == first
    (b / "r.png").write_bytes(png(64, 64, (255, 0, 0)))  # an edited reference: another fingerprint
    assert prompts_fingerprint(plan_table(b / "p.jsonl")) != first
    text_only = pa.Table.from_batches(list(read_batches(Source(str(a / "p.jsonl")))))
    assert text_only.column_names == plan_table(a / "p.jsonl").column_names[:-2]


def test_parquet_image_structs_and_lists_are_read_back_by_row(tmp_path):
    refs = [png(64, 64, (i * 20, 0, 0)) for i in range(5)]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = [[{"bytes": r, "path": f"{i}.png"}] for i, r in enumerate(refs[:3])]
    images.append([{"bytes": refs[3], "path": None}, {"bytes": refs[4], "path": None}])  # two references
    table = pa.table({"prompt": [f"p{i}" for i in range(4)], "image": pa.array(images, pa.list_(struct))})
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=2)
    rows = plan_table(tmp_path / "s.parquet").to_pylist()
    got = [[data for _, data in load_references(r)] for r in rows]
    assert got == [[refs[0]], [refs[1]], [refs[2]], [refs[3], refs[4]]]
    assert json.loads(rows[3]["ref_loc"])[1]["path"] == f"{tmp_path / 's.parquet'}#row=3&ref=1"
    # tools read a reference back by its lineage path (tools/contact_sheet.py), past the first row group
    paths = [loc["path"] for r in rows for loc in json.loads(r["ref_loc"])]
    assert [read_lineage(p) for p in paths] == refs
    pq.write_table(table.rename_columns(["prompt", "picture"]), tmp_path / "p.parquet", row_group_size=2)
    assert read_lineage(f"{tmp_path / 'p.parquet'}#row=3&ref=1", "picture") == refs[4]
    (tmp_path / "a.png").write_bytes(refs[2])
    assert read_lineage(str(tmp_path / "a.png")) == refs[2]


def test_references_past_the_read_batches_of_parquet_and_saved_datasets_keep_their_rows(tmp_path):
    """19 rows: past two of Parquet's 8-row reads and over a saved dataset's two files, each row plans its own
    reference and names its row; a source without the image column is refused naming the columns it has."""
    import datasets
    import pytest

    from launcher.errors import ConfigError

    refs = [png(64, 64, (i * 12, 255 - i * 12, 7)) for i in range(19)]
    rows = [{"prompt": f"p{i}", "image": {"bytes": r, "path": None}} for i, r in enumerate(refs)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet", row_group_size=5)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(json.loads((tmp_path / "saved" / "state.json").read_text())["_data_files"]) == 2
    for source in (tmp_path / "s.parquet", tmp_path / "saved"):
        planned = plan_table(source).to_pylist()
        assert [[data for _, data in load_references(r)] for r in planned] == [[r] for r in refs], source
        assert [json.loads(r["ref_loc"])[0]["path"] for r in planned] == [f"{source}#row={i}" for i in range(19)]
        assert [read_lineage(f"{source}#row={i}") for i in (0, 9, 10, 18)] == [refs[i] for i in (0, 9, 10, 18)]

    pq.write_table(pa.table({"prompt": ["a"], "picture": [refs[0]]}), tmp_path / "other.parquet")
    datasets.Dataset.from_list([{"prompt": "a", "picture": "x.png"}]).save_to_disk(str(tmp_path / "other"))
    for source in (tmp_path / "other.parquet", tmp_path / "other"):
        with pytest.raises(ConfigError) as e:
            plan_table(source)
        assert str(e.value) == (
            f"dataset {source} has no image column 'image' (dataset.image_column); columns found: prompt, picture"
        ), str(e.value)


def test_a_csv_cell_may_list_several_references_and_a_text_source_without_the_column_is_refused(tmp_path):
    """A CSV cell holds one path, or a JSON list of paths (its references in order); a cell that only starts like
    one is a path. A JSON lines or CSV source without the image column is refused naming the columns it has."""
    refs = {name: png(64, 64, (i * 60, 0, 0)) for i, name in enumerate(("a.png", "b.png", "[c].png"))}
    for name, data in refs.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "p.csv").write_text('prompt,image\none,a.png\ntwo,"[""b.png"", ""a.png""]"\nthree,[c].png\n')
    rows = plan_table(tmp_path / "p.csv").to_pylist()
    got = [[data for _, data in load_references(r)] for r in rows]
    assert got == [[refs["a.png"]], [refs["b.png"], refs["a.png"]], [refs["[c].png"]]]
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "x", "picture": "a.png"}) + "\n")
    (tmp_path / "q.csv").write_text("prompt,picture\nx,a.png\n")
    for source, where in ((tmp_path / "q.jsonl", ", line 1"), (tmp_path / "q.csv", "")):  # a CSV: by its header
        try:
            plan_table(source)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            assert str(e) == (
                f"dataset {source}{where} has no image column 'image' (dataset.image_column); columns found: "
                "prompt, picture"
            ), str(e)
        else:
            raise AssertionError(f"{source} was not refused")


def test_relative_reference_paths_are_relative_to_the_source_file_or_the_saved_dataset_folder(tmp_path, monkeypatch):
    """A reference path that is not absolute is relative to the folder of the file that names it; a save_to_disk
    folder names them from inside itself (given with or without a trailing slash); a source named by a bare file
    name, from the working directory. A file of the same name one folder up is another image."""
    import datasets

    ds = tmp_path / "saved" / "ds"
    datasets.Dataset.from_list([{"prompt": "a", "image": "r.png"}]).save_to_disk(str(ds))
    for color, where in enumerate((ds, ds.parent, tmp_path)):
        (where / "r.png").write_bytes(png(64, 64, (color * 100, 0, 0)))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "b", "image": "r.png"}) + "\n")
    monkeypatch.chdir(tmp_path)
    for source, ref in ((str(ds), ds / "r.png"), (f"{ds}/", ds / "r.png"), ("p.jsonl", tmp_path / "r.png")):
        [row] = plan_table(source).to_pylist()
        [(lineage, data)] = load_references(row)
        assert data == ref.read_bytes(), source
        assert lineage["path"] == str(ref), (source, lineage)


def test_references_of_a_source_on_an_object_store_are_relative_to_its_folder_there_and_a_txt_source_has_none(
    s3, tmp_path
):
    """A reference path in a source on S3 is relative to that source file's folder there (a URL in the source is
    read as it is); a .txt source has no column at all, so an edit job over one is refused naming it."""
    import pytest

    from launcher.errors import ConfigError
    from launcher.ledger.store import Store

    refs = [png(64, 64, (i * 90, 10, 10)) for i in range(3)]
    store = Store("s3://meshgen-test/refs-job")
    store.write_bytes("in/pics/a.png", refs[0])
    store.write_bytes("in/b.png", refs[1])
    store.write_bytes("elsewhere/c.png", refs[2])
    rows = [{"prompt": "one", "image": "pics/a.png"}, {"prompt": "two", "image": "b.png"}]
    rows.append({"prompt": "three", "image": "s3://meshgen-test/refs-job/elsewhere/c.png"})
    store.write_bytes("in/p.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    planned = plan_table("s3://meshgen-test/refs-job/in/p.jsonl").to_pylist()
    got = [load_references(r)[0] for r in planned]
    assert [data for _, data in got] == refs
    assert [lineage["path"] for lineage, _ in got] == [
        "s3://meshgen-test/refs-job/in/pics/a.png",
        "s3://meshgen-test/refs-job/in/b.png",
        "s3://meshgen-test/refs-job/elsewhere/c.png",
    ]
    (tmp_path / "p.txt").write_text("a prompt\n")
    with pytest.raises(ConfigError) as e:
        plan_table(tmp_path / "p.txt")
    assert (
        str(e.value)
        == f"dataset {tmp_path / 'p.txt'}: job=edit needs an image column ('image'); a .txt source has none"
    )
