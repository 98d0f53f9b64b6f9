"""job=edit end to end through launch.sh: chained onto a text-to-image run's output folder, references in a path
column, staleness, bad input, and both editing families (tiny FLUX.2, tiny Qwen-Image-Edit-Plus)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import FLUX2_KW, launch, max_diff, pixels, read_rows
from PIL import Image

EDIT = ("job=edit", "run.shard_size=2", "generate.num_inference_steps=3")


def contract_seed(sample_id: str, base: int = 0) -> int:
    """DESIGN.md's seed, computed here from its words rather than by the code under test."""
    return int.from_bytes(hashlib.sha256(f"{base}:{sample_id}".encode()).digest()[:8], "little") & (2**63 - 1)


@pytest.fixture(scope="module")
def source(run_job) -> Path:
    """The text-to-image run the edits start from (tiny FLUX.2, tp=1, 20 prompts)."""
    return run_job("mesh.tp=1")


@pytest.fixture(scope="module")
def edit(tiny_model, tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def run(*overrides: str, model: Path | None = None) -> Path:
        key = (*overrides, str(model))
        if key not in cache:
            out = tmp_path_factory.mktemp("edit")
            res = launch(f"model.path={model or tiny_model}", f"output.dir={out}", *EDIT, *overrides, timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
            cache[key] = out
        return cache[key]

    return run


def bare_edit(model: Path, refs: list[bytes], prompt: str, seeds: list[int] | int, **kw) -> np.ndarray:
    """What a user writes: pipe(image=[refs], prompt=..., generator=...), one thread, as the workers run; one
    image per seed (several: num_images_per_prompt, one generator each)."""
    import torch
    from diffusers import DiffusionPipeline

    import launcher.models._qwen_vl_processor  # noqa: F401  the tiny Qwen-Image-Edit-Plus names it in model_index.json

    torch.set_num_threads(1)
    pipe = _PIPES.get(model) or _PIPES.setdefault(model, DiffusionPipeline.from_pretrained(model))
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in refs]
    seeds = [seeds] if isinstance(seeds, int) else seeds
    if len(seeds) > 1:
        kw["num_images_per_prompt"] = len(seeds)
    out = pipe(
        image=images,
        prompt=[prompt],
        height=64,
        width=64,
        num_inference_steps=3,
        generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
        output_type="np",
        **kw,
    ).images
    out = (out * 255).round().astype(np.int16)
    return out[0] if len(seeds) == 1 else out


_PIPES: dict = {}
# The edits of the source's first 4 rows that several tests share (each run costs a torchrun start): at dp=1
# keeping the references' bytes, and at dp=2 without them.
ONE = ("mesh.tp=1", "output.reference_bytes=true", "dataset.limit=4")
DP2 = ("mesh.tp=1", "mesh.dp=2", "dataset.limit=4")


def test_edit_chained_onto_a_run_keeps_rows_lineage_and_equals_a_bare_loop(source, edit, tiny_model):
    import datasets

    out = edit(f"dataset.path={source}", *ONE)
    before, after = read_rows(source), read_rows(out)
    assert sorted(after, key=int) == ["0", "1", "2", "3"]
    for sid, r in after.items():
        src = before[sid]
        assert r["prompt"] == src["prompt"] and r["seed"] == src["seed"] == contract_seed(sid)
        ref = src["image"]["bytes"]
        [lineage] = r["reference"]
        assert lineage["sha256"] == hashlib.sha256(ref).hexdigest() and lineage["id"] == sid
        assert lineage["path"].startswith(str(source / "data" / "shard-00000.parquet"))
        assert r["reference_image"]["bytes"] == ref
        expected = bare_edit(tiny_model, [ref], r["prompt"], contract_seed(sid), **FLUX2_KW)
        assert (pixels(r["image"]["bytes"]) == expected).all(), sid
        assert (expected != pixels(ref)).any()  # an edit, not a copy
    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert isinstance(ds.features["image"], datasets.Image) and isinstance(
        ds.features["reference_image"], datasets.Image
    )
    assert ds[0]["reference_image"].size == (64, 64)
    card = (out / "README.md").read_text()
    assert "name: reference" in card and "image-to-image" in card


def test_the_contact_sheet_shows_before_and_after(source, edit, monkeypatch):
    import importlib

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    cs = importlib.import_module("contact_sheet")
    # The references are read back from their lineage here: the dp=2 run did not keep their bytes.
    out = edit(f"dataset.path={source}/data/*.parquet", *DP2)
    before, after = read_rows(source), read_rows(out)
    sheet = cs.contact_sheet(out, n=4, cols=2)
    assert sheet.size == (2 * (2 * cs.THUMB + 2 * cs.PAD), 2 * cs.CELL_H)
    for i in range(4):
        x, y = cs.cell_origin(i, 2, 2 * cs.THUMB)
        for half, rows in ((0, before), (1, after)):
            left = x + cs.PAD + half * cs.THUMB
            thumb = sheet.crop((left, y + cs.PAD, left + cs.THUMB, y + cs.PAD + cs.THUMB))
            small = np.asarray(thumb.resize((64, 64), Image.Resampling.NEAREST)).astype(np.int16)
            assert (small == pixels(rows[str(i)]["image"]["bytes"])).all(), (i, half)


def test_edit_dp2_equals_dp1_and_tp2_staged_is_within_2_levels(source, edit):
    one = edit(f"dataset.path={source}", *ONE)
    dp2 = edit(f"dataset.path={source}/data/*.parquet", *DP2)
    a, b = read_rows(one), read_rows(dp2)
    assert {k: r["image"]["bytes"] for k, r in a.items()} == {k: r["image"]["bytes"] for k, r in b.items()}
    assert max_diff(one, edit(f"dataset.path={source}", "execution.staged=true", "dataset.limit=4")) <= 2


def test_edit_compiled_with_static_shapes_writes_webdataset(source, edit):
    import tarfile

    eager = edit(f"dataset.path={source}", *ONE)
    ov = ("execution.mode=compile", "testing.compile_backend=aot_eager", "output.webdataset=true")
    out = edit(f"dataset.path={source}", "mesh.tp=1", "dataset.limit=4", *ov)
    assert max_diff(eager, out) <= 2
    states = [json.loads((out / "state" / f"shard-0000{i}.json").read_text()) for i in (0, 1)]
    # One shape (64x64, one row a call, references resized to it): compiled in the first shard, reused after.
    assert states[0]["compiles"] >= 1 and states[1]["compiles"] == 0
    with tarfile.open(out / "webdataset" / "shard-00001.tar") as tar:
        meta = json.load(tar.extractfile("2.json"))
    assert meta["reference"][0]["sha256"] == hashlib.sha256(read_rows(source)["2"]["image"]["bytes"]).hexdigest()


def _padded(png: bytes, size: int) -> bytes:
    """The same PNG image in a file of more than `size` bytes: a private ancillary chunk (`meSh`, which readers
    skip) of zeros before IEND."""
    data = bytes(size)
    chunk = struct.pack(">I", len(data)) + b"meSh" + data + struct.pack(">I", zlib.crc32(b"meSh" + data))
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunk + png[end:]


def _refs(folder: Path, source: Path) -> list[bytes]:
    """Three of the source run's images as files in `folder`/refs, and a JSONL that names them relatively. The
    second is padded past the 1 MiB that planning hashes a file by (launcher/sources/references.py `_CHUNK`): a
    hash of its first chunk alone would not be its sha256."""
    rows = read_rows(source)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    images = [rows[str(i)]["image"]["bytes"] for i in range(3)]
    images[1] = _padded(images[1], (1 << 20) + 1000)
    for i in range(3):
        (folder / "refs" / f"{i}.png").write_bytes(images[i])
    lines = [
        {"id": "a", "prompt": "put them together", "image": ["refs/0.png", "refs/1.png"]},
        {"id": "b", "prompt": "make it night", "image": "refs/2.png"},
    ]
    (folder / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return images


def test_two_references_from_relative_paths_and_an_edited_reference_is_stale(source, tiny_model, tmp_path):
    refs = _refs(tmp_path, source)
    out = tmp_path / "out"
    job = [f"model.path={tiny_model}", f"dataset.path={tmp_path}/edits.jsonl", "job=edit", "mesh.tp=1"]
    job += ["run.shard_size=1", "generate.num_inference_steps=3", f"output.dir={out}", "generate.images_per_prompt=2"]
    job += ["dataset.id_column=id"]
    res = launch(*job)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_rows(out)
    assert sorted(rows) == ["a-0", "a-1", "b-0", "b-1"]
    a = rows["a-0"]
    assert [x["path"] for x in a["reference"]] == [str(tmp_path / "refs" / f"{i}.png") for i in (0, 1)]
    assert len(refs[1]) > 1 << 20 and pixels(refs[1]).shape == (64, 64, 3)  # over a hashing chunk, still an image
    assert [x["sha256"] for x in a["reference"]] == [hashlib.sha256(r).hexdigest() for r in refs[:2]]
    expected = bare_edit(tiny_model, refs[:2], a["prompt"], [contract_seed(f"a-{k}") for k in (0, 1)], **FLUX2_KW)
    for k in (0, 1):
        assert (pixels(rows[f"a-{k}"]["image"]["bytes"]) == expected[k]).all(), k
    # Edit the reference of row b: its shard (1) is stale, shard 0 is not.
    (tmp_path / "refs" / "2.png").write_bytes(refs[0])
    res = launch(*job)
    assert res.returncode == 2 and "stale" in res.stderr and "[1]" in res.stderr, res.stderr[-2000:]
    shard0 = (out / "data" / "shard-00000.parquet").stat().st_mtime_ns
    res = launch(*job, "run.stale=regenerate")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "data" / "shard-00000.parquet").stat().st_mtime_ns == shard0
    assert read_rows(out)["b-0"]["reference"][0]["sha256"] == hashlib.sha256(refs[0]).hexdigest()


def _png(size=(64, 64)) -> bytes:  # the edit pipelines take 64 px a side at least
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format="PNG")
    return buf.getvalue()


BAD = {  # case: (the row's image value, what the one-line error says)
    "missing": ("refs/none.png", "refs/none.png does not exist"),
    "folder": ("refs", "cannot be read"),
    "not_an_image": ("refs/text.png", "is not an image"),
    "too_many": (["refs/ok.png"] * 11, "11 reference images, more than the 10"),
    "too_large": ("refs/big.png", "more than the 4.0 this model family takes"),
    "no_column": (None, "has no image column 'image'"),
}


def _bad_source(tmp_path: Path, case: str) -> Path:
    (tmp_path / "refs").mkdir(exist_ok=True)
    (tmp_path / "refs" / "ok.png").write_bytes(_png())
    (tmp_path / "refs" / "text.png").write_text("not a png")
    (tmp_path / "refs" / "big.png").write_bytes(_png((2049, 2049)))
    value = BAD[case][0]
    bad = {"prompt": "bad"} if value is None else {"prompt": "bad", "image": value}
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "fine", "image": "refs/ok.png"}) + "\n" + json.dumps(bad) + "\n")
    return src


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_references_are_refused_at_planning_naming_file_and_line(case, tmp_path):
    from launcher.errors import ConfigError
    from launcher.sources.prompts import SizeRule, Source, read_batches

    src = _bad_source(tmp_path, case)
    rule = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10)  # FLUX.2's: 4 megapixels, 10 references
    with pytest.raises(ConfigError) as e:
        list(read_batches(Source(str(src), image_column="image", sizes=rule)))
    assert f"{src}, line 2" in str(e.value) and BAD[case][1] in str(e.value), str(e.value)


def test_a_bad_reference_exits_2_and_writes_nothing(tiny_model, tmp_path):
    src, out = _bad_source(tmp_path, "too_many"), tmp_path / "out"
    res = launch(f"model.path={tiny_model}", f"dataset.path={src}", "job=edit", f"output.dir={out}", "mesh.tp=1")
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{src}, line 2" in res.stderr and BAD["too_many"][1] in res.stderr, res.stderr[-2000:]
    assert not (out / "data").exists()


def test_a_family_that_does_not_edit_exits_2(tiny_family, tmp_path):
    src = tmp_path / "p.jsonl"
    (tmp_path / "a.png").write_bytes(_png())
    src.write_text(json.dumps({"prompt": "x", "image": "a.png"}) + "\n")
    res = launch(
        f"model.path={tiny_family('flux1')}", f"dataset.path={src}", "job=edit", f"output.dir={tmp_path / 'o'}"
    )
    assert res.returncode == 2 and "does not take reference images" in res.stderr, res.stderr[-2000:]


def test_a_reference_gone_after_planning_fails_its_shard_only(source, tiny_model, tmp_path):
    _refs(tmp_path, source)
    out = tmp_path / "out"
    job = [f"model.path={tiny_model}", f"dataset.path={tmp_path}/edits.jsonl", "job=edit", "mesh.tp=1"]
    job += ["run.shard_size=1", "generate.num_inference_steps=20", f"output.dir={out}"]
    gone = tmp_path / "refs" / "2.png"

    def remove_once_planned():  # the plan file appears once planning is over, before any worker claims shard 1
        deadline = time.time() + 120
        while time.time() < deadline and not list((out / "plans").glob("*.arrow")):
            time.sleep(0.05)
        gone.unlink()

    t = threading.Thread(target=remove_once_planned)
    t.start()
    res = launch(*job)
    t.join()
    assert res.returncode == 3, res.stderr[-2000:]
    states = [json.loads((out / "state" / f"shard-0000{i}.json").read_text()) for i in (0, 1)]
    assert states[0]["status"] == "done" and states[1]["status"] == "failed"
    assert str(gone) in states[1]["error"] and "missing" in states[1]["error"]


def test_qwen_image_edit_plus_end_to_end_equals_a_bare_loop(source, edit, tiny_family):
    model = tiny_family("qwenimage_edit")
    few = ("dataset.limit=1", "generate.guidance_scale=1.0")  # its VAE encodes each reference at 1024x1024
    out = edit(f"dataset.path={source}", "mesh.tp=1", *few, model=model)
    before, after = read_rows(source), read_rows(out)
    assert sorted(after) == ["0"]
    for sid, r in after.items():
        ref = before[sid]["image"]["bytes"]
        expected = bare_edit(model, [ref], r["prompt"], contract_seed(sid), true_cfg_scale=1.0, max_sequence_length=256)
        assert (pixels(r["image"]["bytes"]) == expected).all(), sid


def test_the_edit_bench_runs_at_tiny_sizes(tmp_path, monkeypatch):
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO))
    from tools.bench import edit as bench

    out = tmp_path / "edit.json"
    bench.main(
        ["--rows", "40", "--distinct", "4", "--size", "64", "--gen-rows", "2", "--gen-size", "64", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert result["generate"]["same"] is True and result["generate"]["ratio"] > 0
    for part, rows in (("plan_distinct", 4), ("plan_repeated", 40)):
        assert result[part]["rows"] == rows and result[part]["peak_rss_mb_edit"] > 0
