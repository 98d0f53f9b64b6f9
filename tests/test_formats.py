"""Prompt sources in every format, per-row overrides, WebDataset output, and what a run reports."""

import csv
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import launch, read_rows
from PIL import Image

from launcher.sources.prompts import read_prompts

ROWS = [
    {"prompt": "a red fox", "seed": 7},
    {"prompt": "a tall tower", "height": 96},
    {"prompt": "a quick sketch", "num_inference_steps": 2, "guidance_scale": 1.5},
    {"prompt": "a plain field", "negative_prompt": "blurry"},
]


def write_source(tmp_path, fmt: str, rows: list[dict]):
    path = tmp_path / f"p.{fmt}" if fmt != "saved" else tmp_path / "saved"
    keys = sorted({k for r in rows for k in r})
    if fmt == "txt":
        path.write_text("".join(r["prompt"] + "\n" for r in rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    else:
        import datasets

        datasets.Dataset.from_list([{k: r.get(k) for k in keys} for r in rows]).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "saved"])
def test_each_format_with_overrides(tmp_path, fmt):
    got = read_prompts(str(write_source(tmp_path, fmt, ROWS)))
    assert [r["id"] for r in got] == ["0", "1", "2", "3"]
    assert got[0]["seed"] == 7 and got[1]["height"] == 96 and got[3]["negative_prompt"] == "blurry"
    assert got[2]["num_inference_steps"] == 2 and got[2]["guidance_scale"] == 1.5
    assert "seed" not in got[1]  # an empty cell is no override


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "parquet", "saved"])
def test_each_format_without_overrides(tmp_path, fmt):
    rows = [{"prompt": f"prompt {i}"} for i in range(3)]
    got = read_prompts(str(write_source(tmp_path, fmt, rows)))
    assert got == [{"id": str(i), "prompt": f"prompt {i}"} for i in range(3)]


def test_globs_number_rows_across_files_and_limit(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("three\n")
    got = read_prompts(str(tmp_path / "*.txt"), limit=2)
    assert [(r["id"], r["prompt"]) for r in got] == [("0", "one"), ("1", "two")]
    assert [r["id"] for r in read_prompts(str(tmp_path / "*.txt"))] == ["0", "1", "2"]


def test_a_run_with_overrides_and_webdataset(tiny_model, tmp_path):
    plain = [*ROWS[:3], {"prompt": "a plain field"}]  # FLUX.2 takes no negative prompt: such a column is refused
    src, out = write_source(tmp_path, "jsonl", plain), tmp_path / "out"
    # FLUX.2's chat template adds 5 tokens and a 168-byte system message; the tiny tokenizer counts bytes, so a
    # limit of 185 cuts the prompts over 12 bytes: "a quick sketch" and "a plain field".
    res = launch(
        f"model.path={tiny_model}",
        f"dataset.path={src}",
        f"output.dir={out}",
        "output.webdataset=true",
        "generate.max_sequence_length=185",
        "mesh.tp=1",  # one worker: the formats are the mesh's business nowhere
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(out)
    assert rows["0"]["seed"] == 7
    assert Image.open(io.BytesIO(rows["1"]["image"]["bytes"])).size == (64, 96)
    for r in rows.values():  # the Parquet row and the WebDataset metadata record the size the image has
        assert Image.open(io.BytesIO(r["image"]["bytes"])).size == (r["width"], r["height"])
    assert (rows["2"]["num_inference_steps"], rows["2"]["guidance_scale"]) == (2, 1.5)
    assert rows["3"].get("negative_prompt") is None
    with tarfile.open(out / "webdataset" / "shard-00000.tar") as tar:
        names = tar.getnames()
        assert names == [f"{i}.{ext}" for i in range(4) for ext in ("png", "json")]
        assert tar.extractfile("1.png").read() == rows["1"]["image"]["bytes"]
        assert json.loads(tar.extractfile("0.json").read())["seed"] == 7
        assert json.loads(tar.extractfile("1.json").read())["height"] == 96
    import webdataset as wds

    samples = list(wds.WebDataset(str(out / "webdataset" / "shard-00000.tar"), shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["0", "1", "2", "3"]
    # The end-of-run summary, and the run's own record in runs/.
    assert "shards: 1 done, 0 failed, 0 pending" in res.stderr and "this run: 4 images" in res.stderr
    [record] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert (record["done"], record["images"], record["exit_code"]) == (1, 4, 0)
    assert record["truncated_prompts"] == 2
    assert "2 prompts were longer than generate.max_sequence_length and were truncated" in res.stderr
    assert set(record["stages"]) >= {"text_encoder", "denoise", "vae_decode", "writer_wait"}
