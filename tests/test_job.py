"""The tiny job end to end through launch.sh and torchrun: real processes, real files read back."""

import json
import shutil

import pyarrow.parquet as pq
from conftest import file_snapshot, launch, max_diff, pixels, read_rows

N_PROMPTS = 20  # conf/prompts/tiny.txt, cut into shards of 8


def test_tiny_job_at_tp2_writes_complete_shards(run_job):
    out = run_job()
    rows = read_rows(out)
    assert sorted(rows, key=int) == [str(i) for i in range(N_PROMPTS)]
    assert [pq.read_metadata(f).num_rows for f in sorted((out / "data").glob("*.parquet"))] == [8, 8, 4]
    meta = json.loads(pq.read_schema(out / "data" / "shard-00000.parquet").metadata[b"huggingface"])
    assert meta["info"]["features"]["image"] == {"_type": "Image"}
    for r in rows.values():
        assert (r["height"], r["width"]) == (64, 64)
        assert pixels(r["image"]["bytes"]).shape == (64, 64, 3)
        assert r["image"]["path"] == f"{r['id']}.png"
    assert not (out / "images").exists()  # each image once by default: in the Parquet (output.image_files adds files)
    for i in range(3):
        state = json.loads((out / "state" / f"shard-{i:05d}.json").read_text())
        assert state["status"] == "done" and state["rows"] == (8 if i < 2 else 4)
    run = json.loads((out / "run.json").read_text())
    assert run["shards"] == 3 and run["settings"]["generate"]["seed"] == 0
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_hf_datasets_loads_the_image_feature(run_job):
    import datasets

    out = run_job()
    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds[0]["image"].size == (64, 64) and len(ds) == N_PROMPTS


def test_rerunning_a_finished_job_does_nothing(run_job, tiny_model, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_job(), out)  # with its files' times: the rerun must leave them as they are
    before = file_snapshot(out)
    res = launch(f"model.path={tiny_model}", f"output.dir={out}")
    assert res.returncode == 0, res.stderr
    assert "nothing to do" in res.stderr
    assert file_snapshot(out) == before


def test_tp2_matches_tp1_within_2_levels(run_job):
    assert max_diff(run_job(), run_job("mesh.tp=1")) <= 2


def test_dp2_is_bitwise_equal_to_dp1(run_job):
    a, b = read_rows(run_job("mesh.tp=1")), read_rows(run_job("mesh.tp=1", "mesh.dp=2"))
    assert {k: r["image"]["bytes"] for k, r in a.items()} == {k: r["image"]["bytes"] for k, r in b.items()}


def test_batch_size_3_matches_2_within_2_levels(run_job):
    # conf tiny's batches of 2 (the run above) against batches of 3: 20 prompts, a partial last batch in each
    assert max_diff(run_job("mesh.tp=1"), run_job("mesh.tp=1", "generate.batch_size=3")) <= 2


def test_the_tiny_model_is_deterministic(tiny_model, tmp_path):
    from launcher.models.flux2 import build_tiny as build_tiny_flux2

    again = build_tiny_flux2(tmp_path / "again")
    files = sorted(p.relative_to(tiny_model) for p in tiny_model.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (tiny_model / f).read_bytes() == (again / f).read_bytes(), f
