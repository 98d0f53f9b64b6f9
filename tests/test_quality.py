"""quality.*: clip_score and nsfw columns scored as the images are made, and added later by tools.score."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TARGET, launch, load_from_hub, publish, read_rows
from omegaconf import OmegaConf
from PIL import Image


@pytest.fixture(scope="session")
def quality_models(once):
    from launcher.models._tiny_quality import build_tiny_checker, build_tiny_clip

    def make(d):
        build_tiny_clip(d / "clip")
        build_tiny_checker(d / "checker")

    folder = once("tiny quality models", make, unmutated=True)
    return folder / "clip", folder / "checker"


def qcfg(clip, checker, **kw):
    base = dict(clip_score=True, clip_model=str(clip), safety=True, safety_model=str(checker), batch_size=3)
    return OmegaConf.create({**base, **kw})


def images(n=7):
    rng = np.random.default_rng(0)
    out = [rng.integers(0, 256, (48, 40, 3), dtype=np.uint8) for _ in range(n - 2)]
    return out + [
        np.full((40, 40, 3), 200, np.uint8),
        np.linspace(0, 255, 64 * 64 * 3).reshape(64, 64, 3).astype(np.uint8),
    ]


PROMPTS = ["a red cat", "the sea at night", "a small house", "x" * 500, "two dogs", "snow", "a tree"]


def test_clip_score_is_100_cosine_of_transformers_clip(quality_models):
    """Known answer: transformers' own CLIPModel on the same processor inputs; logits_per_image is
    exp(logit_scale) * cosine (the tiny model has the real one's scale, ln 100), and the cosine from
    get_image_features / get_text_features; batching (3 per call) changes nothing."""
    from transformers import CLIPModel, CLIPProcessor

    from launcher.worker.quality import Scorer

    clip, checker = quality_models
    imgs = images()
    got = Scorer(qcfg(clip, checker, safety=False), "cpu", "float32").columns(imgs, PROMPTS)
    assert list(got) == ["clip_score"]
    model, proc = CLIPModel.from_pretrained(clip).eval(), CLIPProcessor.from_pretrained(clip)
    inputs = proc(text=PROMPTS, images=imgs, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diag()
        i = model.get_image_features(pixel_values=inputs["pixel_values"])
        t = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    i, t = (x if isinstance(x, torch.Tensor) else x.pooler_output for x in (i, t))
    cosine = (i / i.norm(dim=-1, keepdim=True) * t / t.norm(dim=-1, keepdim=True)).sum(-1)
    assert model.logit_scale.exp().item() == pytest.approx(100.0)
    np.testing.assert_allclose(got["clip_score"], (100 * cosine).numpy(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got["clip_score"], logits.numpy(), rtol=1e-4, atol=1e-3)
    assert min(got["clip_score"]) < 0 < max(got["clip_score"])  # not clamped: a filter sees every value


def test_nsfw_is_diffusers_safety_checker(quality_models):
    """Known answer: the Stable Diffusion pipelines' own check (feature extractor + checker) flags the same images,
    and our images are never blacked out by it."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPImageProcessor

    from launcher.worker.quality import Scorer

    clip, checker = quality_models
    imgs = images()
    kept = [x.copy() for x in imgs]
    got = Scorer(qcfg(clip, checker, clip_score=False), "cpu", "float32").columns(imgs, PROMPTS)
    model = StableDiffusionSafetyChecker.from_pretrained(checker).eval()
    features = CLIPImageProcessor.from_pretrained(checker)
    pil = [Image.fromarray(x) for x in imgs]
    with torch.no_grad():
        _, want = model(
            images=[x.astype(np.float32) / 255 for x in imgs],
            clip_input=features(pil, return_tensors="pt").pixel_values,
        )
    assert got["nsfw"] == [bool(w) for w in want]
    both = Scorer(qcfg(clip, checker), "cpu", "float32")  # with CLIP on, the checker reuses its preprocessing
    assert both.columns(imgs, PROMPTS)["nsfw"] == got["nsfw"] and both._same_preprocessing
    assert set(got["nsfw"]) == {True, False}  # the tiny checker tells images apart, so the test can fail
    assert all((a == b).all() for a, b in zip(imgs, kept, strict=True))


def test_run_scores_keeps_columns_and_score_tool_adds_them(quality_models, run_job, tmp_path, hub):
    """One launch with quality.* and dataset.keep_columns: the Parquet's clip_score (float32) and nsfw (bool) equal
    the scorer's on the stored (lossless) images; kept source columns keep their types, in the Parquet and in
    WebDataset's JSON; `datasets` loads all of them, from the folder and from the Hub it is pushed to. Then
    tools.score adds the columns to a plain run's copy, rewriting the Parquet and its state's size and sha256
    (status --verify finds nothing damaged)."""
    import datasets
    import pyarrow as pa

    from launcher.worker.quality import Scorer
    from tools import score
    from tools.status import collect

    clip, checker = quality_models
    src = tmp_path / "p.parquet"
    table = pa.table(
        {
            "prompt": ["a red cat", "the blue sea", "a small house"],
            "category": ["animal", "place", None],
            "rank": pa.array([3, 1, 2], pa.int16()),
            "tags": [["a", "b"], [], ["c"]],
            # no JSON type of its own: WebDataset's JSON writes its text (a TypeError failed every shard once)
            "made": pa.array([0, 86_400_000_000, None], pa.timestamp("us")),
        }
    )
    pq.write_table(table, src)
    out = tmp_path / "out"
    res = launch(
        "mesh.tp=1",
        f"dataset.path={src}",
        f"output.dir={out}",
        "dataset.keep_columns=[category,rank,tags,made]",
        "output.webdataset=true",
        "quality.clip_score=true",
        f"quality.clip_model={clip}",
        "quality.safety=true",
        f"quality.safety_model={checker}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = pq.read_table(out / "data" / "shard-00000.parquet")
    assert data.schema.field("clip_score").type == pa.float32() and data.schema.field("nsfw").type == pa.bool_()
    for name in ("category", "rank", "tags", "made"):
        assert data.schema.field(name).type == table.schema.field(name).type
    rows = data.to_pylist()
    assert [r["category"] for r in rows] == ["animal", "place", None] and [r["tags"] for r in rows] == [
        ["a", "b"],
        [],
        ["c"],
    ]
    pixels = [np.asarray(Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB")) for r in rows]
    want = Scorer(qcfg(clip, checker), "cpu", "float32").columns(pixels, [r["prompt"] for r in rows])
    np.testing.assert_allclose([r["clip_score"] for r in rows], want["clip_score"], rtol=1e-4, atol=1e-3)
    assert [r["nsfw"] for r in rows] == want["nsfw"]
    with tarfile.open(out / "webdataset" / "shard-00000.tar") as tar:
        meta = json.loads(tar.extractfile("1.json").read())
    assert (meta["category"], meta["rank"], meta["tags"], meta["made"]) == ("place", 1, [], "1970-01-02 00:00:00")
    assert meta["nsfw"] == rows[1]["nsfw"] and meta["clip_score"] == pytest.approx(rows[1]["clip_score"])
    loaded = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert {"category", "rank", "tags", "clip_score", "nsfw"} <= set(loaded.column_names)
    assert loaded[0]["image"].size == (rows[0]["width"], rows[0]["height"]) and loaded[2]["rank"] == 2
    # Published (the fake Hub on loopback) and loaded back from there: the kept columns and the scores came along.
    assert publish(out, TARGET, env=hub.env).returncode == 0
    shown = "json.dumps([{k: r[k] for k in ('category', 'rank', 'tags', 'clip_score', 'nsfw')} for r in ds])"
    from_hub = json.loads(load_from_hub(hub, tmp_path / "ds", shown))
    assert [(r["category"], r["rank"], r["tags"], r["nsfw"]) for r in from_hub] == [
        (r["category"], r["rank"], r["tags"], r["nsfw"]) for r in rows
    ]
    np.testing.assert_allclose([r["clip_score"] for r in from_hub], [r["clip_score"] for r in rows], rtol=1e-6)

    plain = tmp_path / "plain"
    shutil.copytree(run_job("mesh.tp=1"), plain)
    before = read_rows(plain)
    args = ["--clip-model", str(clip), "--safety-model", str(checker)]
    assert score.main([str(plain), *args]) == 0
    after = read_rows(plain)
    assert set(after) == set(before)
    for k, r in after.items():
        assert {c: v for c, v in r.items() if c not in ("clip_score", "nsfw")} == before[k]
        assert isinstance(r["clip_score"], float) and isinstance(r["nsfw"], bool)
    status = collect(str(plain), verify=True)
    assert set(status["shards"].values()) == {"done"}, status["errors"]
    for f in sorted((plain / "state").glob("shard-*.json")):
        st = json.loads(f.read_text())
        rel = f"data/{f.stem}.parquet"
        assert st["files"][rel][0] == (plain / rel).stat().st_size
    assert score.main([str(plain), *args]) == 0  # scored already: nothing rewritten

    # A damaged shard (a byte flipped, same size) is not scored: that would record its damage as the truth.
    bad = tmp_path / "bad"
    shutil.copytree(run_job("mesh.tp=1"), bad)
    rel = bad / "data" / "shard-00001.parquet"
    data = bytearray(rel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rel.write_bytes(bytes(data))
    state_before = (bad / "state" / "shard-00001.json").read_bytes()
    assert score.main([str(bad), *args]) == 0
    assert (bad / "state" / "shard-00001.json").read_bytes() == state_before and rel.read_bytes() == bytes(data)
    assert collect(str(bad), verify=True)["shards"]["1"] == "damaged"
    assert "clip_score" in pq.read_schema(bad / "data" / "shard-00000.parquet").names


def test_the_memory_plan_counts_the_quality_models_per_rank():
    """CLIP ViT-L/14 has 427,616,513 parameters (its model card's 428M; the checker is its vision tower and
    projection, ~304M); each writing rank holds them whole, in model.dtype, on top of the pipeline's share."""
    from launcher.config import load_config
    from launcher.sizing import memory, mesh_plan

    base = ["model.dtype=bfloat16", "mesh.tp=2"]
    plain, clip = load_config("tiny", base), load_config("tiny", [*base, "quality.clip_score=true"])
    both = load_config("tiny", [*base, "quality.clip_score=true", "quality.safety=true"])
    assert memory.quality_bytes(plain) == 0
    assert memory.quality_bytes(clip) == 427_616_513 * 2
    assert 300e6 * 2 < memory.quality_bytes(both) - memory.quality_bytes(clip) < 310e6 * 2
    per_rank = {"transformer": 10 * memory.GIB, "text_encoder": 0, "vae": 0}
    grown = mesh_plan.need_gib(clip, per_rank) - mesh_plan.need_gib(plain, per_rank)
    assert grown == pytest.approx(427_616_513 * 2 / memory.GIB)


def test_the_launcher_downloads_the_quality_models_once_for_offline_workers(quality_models, tmp_path):
    """A hub id is fetched by the launcher (only configs, tokenizer files and safetensors), and a worker then loads
    it with HF_HUB_OFFLINE=1; a missing repo is one line before any worker starts."""

    from fake_hub import FakeHub, serve

    clip, checker = quality_models
    hub = FakeHub()
    hub.add_folder("org/clip", clip, extra={"pytorch_model.bin": b"\0" * 1024})
    hub.add_folder("org/checker", checker)
    server = serve(hub)
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "PATH": os.environ["PATH"]}
    code = (
        "import os, sys; from launcher.config import load_config; from launcher.errors import ConfigError\n"
        "from launcher.checks.quality_models import fetch_quality_models\n"
        "cfg = load_config('tiny', sys.argv[1:])\n"
        "try:\n    fetch_quality_models(cfg)\nexcept ConfigError as e:\n    print(e); sys.exit(2)\n"
        "os.environ['HF_HUB_OFFLINE'] = '1'\n"
        "from launcher.worker.quality import Scorer; import numpy as np\n"
        "print(Scorer(cfg.quality).columns([np.zeros((8, 8, 3), np.uint8)], ['a']))\n"
    )
    keys = ["quality.clip_score=true", "quality.safety=true", "quality.safety_model=org/checker"]
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, *keys, "quality.clip_model=org/clip"], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert "'clip_score': [" in res.stdout and "'nsfw': [" in res.stdout
        got = [p for p in hub.requested("GET") if "/resolve/" in p]
        assert not any("pytorch_model.bin" in p for p in got) and any("model.safetensors" in p for p in got)
        res = subprocess.run(
            [sys.executable, "-c", code, *keys, "quality.clip_model=org/none"], env=env, capture_output=True, text=True
        )
        assert res.returncode == 2 and res.stdout.startswith("quality.clip_model=org/none cannot be downloaded"), (
            res.stdout + res.stderr[-2000:]
        )
    finally:
        server.shutdown()
