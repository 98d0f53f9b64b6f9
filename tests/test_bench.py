"""The benchmark scripts run end to end at tiny sizes and report every number. Nothing here judges a timing:
the targets are checked by running tools/bench at the issue's sizes, not by tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tools(monkeypatch):
    """Import the benchmark modules the way `python -m tools.bench` finds them (the checkout on the path)."""
    monkeypatch.syspath_prepend(str(REPO))


def _positive_numbers(node, path=""):
    """Every number under `node` (JSON), with its path, for checking that all are positive."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _positive_numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _positive_numbers(v, f"{path}[{i}]")
    elif isinstance(node, int | float) and not isinstance(node, bool):
        yield path, node


def test_bench_runs_every_part_and_writes_json(tiny_model, tmp_path, tools, capsys):
    from tools.bench import __main__ as bench

    out = tmp_path / "bench.json"
    tiny = ["--images", "4", "--shard-size", "2", "--repeats", "1", "--height", "32", "--width", "32"]
    tiny += ["--steps", "2", "--mem-heads", "2", "--mem-layers", "1", "--mem-single-layers", "1"]
    tiny += ["--writer-size", "64", "--writer-images", "2", "--writer-processes", "1,2", "--writer-repeats", "1"]
    tiny += ["--writer-encoders", "imagecodecs", "--writer-levels", "1", "--writer-formats", "png,jpeg,webp-lossless"]
    tiny += ["--parts", "runner,memory,writer"]  # speed: below, its in-process parts; its N jobs reuse the runner's
    assert bench.main(["--out", str(out), "--model", str(tiny_model), "--workdir", str(tmp_path), *tiny]) == 0
    result = json.loads(out.read_text())

    runner = result["runner"]["summary"]
    for key in ("runner_s_per_image", "bare_s_per_image", "ratio", "nowrite_s_per_image", "writes_ratio"):
        assert runner[key]["min"] > 0, key
        assert runner[key]["min"] <= runner[key]["median"] <= runner[key]["max"], key
    assert runner["same_images"] is True  # the runner and the bare loop did the same work
    assert 0 <= runner["writer_wait_share"]["median"] < 1
    assert runner["runner_first_image_s"]["median"] > 0 and runner["bare_first_image_s"]["median"] > 0
    assert len(result["runner"]["repeats"][0]["shards_s_per_image"]["runner"]) == 2  # 4 images in shards of 2

    memory = result["memory"]
    assert set(memory["ranks"]) == {"tp1", "tp2"} and all(len(r) == 2 for r in memory["ranks"].values())
    tp1, tp2 = (memory["ranks"][k][0]["local"]["transformer"]["bytes"] for k in ("tp1", "tp2"))
    assert tp2 < tp1  # tp=2 holds a shard, whatever the timing
    assert memory["ratio_tp2_over_tp1"]["transformer_local_bytes"] < 1

    rows = result["writer"]["rows"]
    assert [(r["format"], r["encoder"], r["level"], r["processes"]) for r in rows] == [
        (f, "imagecodecs", level, p) for f, level in (("png", 1), ("jpeg", 95), ("webp-lossless", 0)) for p in (1, 2)
    ]
    for path, value in _positive_numbers({"writer": rows, "runner": runner}):
        if "e2e" in path:  # a difference of two whole-run wall times: noise can make it negative at 4 images
            continue
        if "between_shards" in path:  # a gap between times each rounded to 1 ms: it can be -1 ms when nothing waits,
            assert value > (-0.05 if "share" in path else -0.003), path  # a few percent of a 4-image run's shard
            continue
        # a share of waiting can be 0 (the writer kept up), and so can a setting (lossless WebP's level); every
        # time, size and rate is a measured positive
        assert value >= 0 if "share" in path or path.endswith(".level") else value > 0, path
    assert all(r["images_per_s"] > 0 for r in rows)

    printed = capsys.readouterr().out
    assert "ratio runner / bare" in printed and "ratio tp2/tp1" in printed and "png imagecodecs level 1" in printed


def test_photo_like_images_are_not_flat(tools):
    from tools.bench.writer import photo_like

    img = photo_like(128, seed=1)
    assert img.shape == (128, 128, 3) and img.dtype == np.uint8
    # Flat images compress ten times faster than photographs: the benchmark's must have texture everywhere.
    assert np.abs(np.diff(img.astype(int), axis=1)).mean() > 2
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 1000


def test_flux1_step_flops_match_the_issue(tools):
    from tools.bench.gpu import FLUX1_DEV, step_flops

    assert step_flops(FLUX1_DEV, 4096, 512) / 1e12 == pytest.approx(74.4, abs=0.1)


def test_gpu_bench_dry_run_writes_json(tmp_path, tools):
    from tools.bench import gpu as gpu_bench

    out = tmp_path / "mfu.json"
    assert gpu_bench.main(["--dry-run", "--modes", "eager", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["modes"]["eager"]["step_s"] > 0 and result["modes"]["eager"]["finite"]
    assert result["params"] > 0 and result["tokens"] == {"image": 64, "text": 16}  # an 8 x 8 grid, 16 text tokens
    # by hand: d = 2 heads x 32 = 64, 2 blocks, 80 tokens: 2*2*12*64^2*80 + 2*4*80^2*64 + 2*64*(64*64*2 + 16*64)
    assert result["tflop_per_step"] * 1e12 == pytest.approx(20_185_088)


def test_speed_bench_counts_offload_moves_parking_and_cache(tiny_model, tools):
    from tools.bench.speed import bench_cache, bench_offload, bench_release

    o = bench_offload(str(tiny_model), 4, 32, 1)
    # The bare loop moves every model on and off per image; staged once per shard of 4.
    assert o["staged"]["bytes_per_image"] * 4 == pytest.approx(o["bare"]["bytes_per_image"]) and o["bytes_ratio"] < 1
    r = bench_release(str(tiny_model), 1, 32, 1)
    assert 0 < r["released"]["weights"] < r["kept"]["weights"]
    c = bench_cache(str(tiny_model), 1, 32, (8,))["steps_8"]
    assert c["taylorseer"]["s_per_image"] > 0 and c["max_pixel_diff"] > 0  # step caching changes the images


def test_control_bench_runs_at_tiny_sizes(tiny_model, tmp_path, tools):
    from tools.bench.control import bench_control, table

    r = bench_control(str(tiny_model), [40], [], 0, 16, tmp_path)
    run = r["local"][40]
    assert run["shards"] == 3 and run["cold"]["exit"] == run["warm"]["exit"] == 0
    assert run["warm"]["peak_mb"]["launcher"] > 0 and "worker" not in run["warm"]["peak_mb"]  # nothing to do
    pending = r["shard0_pending"]
    assert pending["big"]["exit"] == 0 and pending["big"]["peak_mb"]["worker"] > 0
    assert "| local | 40 | 3 |" in table(r)


def test_nightly_source_has_the_promised_rows_ids_and_edits(tmp_path, tools):
    import pyarrow.parquet as pq

    from tools.bench.nightly import source_table, write_source

    src = write_source(tmp_path / "src", 1000, 3)
    files = sorted(src.glob("*.parquet"))
    table = pq.read_table(files)
    assert len(files) == 3 and table.num_rows == 1000 and table.column_names == ["uid", "prompt"]
    uids = table.column("uid").to_pylist()
    assert len(set(uids)) == 1000 and all(p.strip() for p in table.column("prompt").to_pylist())
    assert write_source(tmp_path / "src", 1000, 3) == src and sorted(src.glob("*.parquet")) == files
    stamp = [f.stat().st_mtime_ns for f in files]
    write_source(tmp_path / "src", 1000, 3)  # the same sizes: kept, not written again
    assert [f.stat().st_mtime_ns for f in files] == stamp
    added = source_table(1000, 10, 3).column("uid").to_pylist()  # the grown scenario's new rows: new ids
    assert len(set(added)) == 10 and not set(added) & set(uids)
    # 1% of the prompts edited, spread over every file; the ids stay
    edited_files = sorted(write_source(tmp_path / "edited", 1000, 3, edit=True).glob("*.parquet"))
    per_file = []
    for before, after in zip(files, edited_files, strict=True):
        a, b = pq.read_table(before).to_pydict(), pq.read_table(after).to_pydict()
        assert a["uid"] == b["uid"]
        per_file.append(sum(x != y for x, y in zip(a["prompt"], b["prompt"], strict=True)))
    assert sum(per_file) == 10 and all(per_file)


def test_nightly_table_marks_a_missed_target(tools):
    from tools.bench.nightly import plan_seconds, stale_shards, table

    def run(wall, peak_gb, plan=5.0, **more):
        return {"wall_s": wall, "plan_s": plan, "peak_gb": peak_gb, "exit": 0, "generated_shards": 0, **more}

    result = {"args": {"ballast_mb": 1024}, "runs": {
        "calibration": run(3, 1.0, peak_bytes=2**30 - 1),  # a 1024 MB worker whose peak does not show it
        "first": run(200, 1.4, plan=119.9),  # first plan: 120 s, 1.5 GB
        "again": run(30.5, 1.5),  # unchanged: 30 s, 1.5 GB
        "grown": run(12, 1.51),  # +1,000 rows: 30 s, 1.5 GB
    }}  # fmt: skip
    lines = {line.split()[0]: line for line in table(result).splitlines()}
    assert "NOT COUNTED" in lines["calibration"]
    assert "plan <= 120: met" in lines["first"] and "peak <= 1.5: met" in lines["first"]
    assert "wall <= 30: MISSED" in lines["again"] and "peak <= 1.5: met" in lines["again"]
    assert "wall <= 30: met" in lines["grown"] and "peak <= 1.5: MISSED" in lines["grown"]

    seen = [
        (1.0, "[launcher] 00:00:01 DEBUG launcher.checks.preflight: preflight: output"),
        (2.5, "[launcher] 00:00:02 DEBUG launcher.checks.preflight: preflight: prompts"),
        (9.0, "[launcher] 00:00:09 DEBUG launcher.checks.preflight: preflight: fetch"),
        (9.5, "error: shards [0, 7] are done but their prompts changed since (samples u1, u2); rerun with ..."),
    ]
    assert plan_seconds(seen)["plan_s"] == 7.0 and plan_seconds(seen)["steps_s"]["prompts"] == 6.5
    assert stale_shards(seen) == 2 and stale_shards(seen[:3]) is None
