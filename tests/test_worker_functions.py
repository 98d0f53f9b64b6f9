"""Fast tests of a worker's own functions (launcher/worker/), in this process, no launch and no model: where a
batch's time goes, and weights moved off the chip and back. Expected values are worked out here from the module's
docstring, never from the product's functions. These are the worker room's tests under `make mutants`."""

from __future__ import annotations

import inspect
import json
import threading
import types

import numpy as np
import pytest
import test_host_functions
import test_lora
import test_quality
import torch
from test_lora import FAMILY, SCALES, diffusers_fused

quality_models = test_quality.quality_models  # the tiny CLIP and safety checker, built once
loras = test_lora.loras  # two tiny LoRAs of a family's tiny pipeline, built once


class Clock:
    """time.perf_counter at the instants a test lists, one per call."""

    def __init__(self, *ticks: float):
        self.ticks = list(ticks)

    def perf_counter(self) -> float:
        return self.ticks.pop(0)


class Scheduler:
    def __init__(self):
        self.calls = []

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None):
        self.calls.append((num_inference_steps, sigmas))
        return "set"


def pipe_with_stages():
    vae = types.SimpleNamespace(decode=lambda latents: latents * 2)
    return types.SimpleNamespace(
        text_encoder=torch.nn.Linear(2, 2),
        text_encoder_2=torch.nn.Identity(),
        text_encoder_3=None,
        vae=vae,
        scheduler=Scheduler(),
    )


def test_stage_times_run_from_encoding_to_decoding_and_a_call_from_embeddings_from_set_timesteps(monkeypatch):
    from launcher.worker import timing

    pipe = pipe_with_stages()
    timer = timing.StageTimer(pipe, torch.device("cpu"))
    # the encoders: 1 -> 3 and 3.5 -> 4; set_timesteps reads no clock (denoising already began at 4); decoding
    # 10 -> 14; then a call from embeddings: set_timesteps at 20, decoding 25 -> 26
    monkeypatch.setattr(timing, "time", Clock(1, 3, 3.5, 4, 10, 14, 20, 25, 26))
    pipe.text_encoder(torch.zeros(1, 2))
    pipe.text_encoder_2(torch.zeros(1))
    assert pipe.scheduler.set_timesteps(4, sigmas=[1.0]) == "set" and pipe.scheduler.calls == [(4, [1.0])]
    assert torch.equal(pipe.vae.decode(torch.ones(1)), torch.full((1,), 2.0))
    pipe.scheduler.set_timesteps(4)
    pipe.vae.decode(torch.ones(1))
    timer.add({"denoise": 0.5, "vae_decode": 0.25})
    assert timer.take() == {"text_encoder": 2.5, "denoise": (10 - 4) + (25 - 20) + 0.5, "vae_decode": 4 + 1 + 0.25}
    assert timer.take() == {"text_encoder": 0.0, "denoise": 0.0, "vae_decode": 0.0}
    # the pipeline reads set_timesteps' parameters to know what it may pass
    assert "sigmas" in inspect.signature(pipe.scheduler.set_timesteps).parameters


def test_stage_times_are_rounded_to_a_tenth_of_a_millisecond():
    from launcher.worker.timing import StageTimer

    timer = StageTimer(types.SimpleNamespace(), torch.device("cpu"))
    timer.add({"text_encoder": 0.123449, "denoise": 2.00006})
    timer.add({"text_encoder": 0.0000002})
    assert timer.take() == {"text_encoder": 0.1234, "denoise": 2.0001, "vae_decode": 0.0}


@pytest.mark.parametrize("kind", ["cuda", "tpu"])
def test_a_stage_boundary_waits_for_the_chip_and_a_cpu_never_does(monkeypatch, kind):
    from launcher.worker import timing

    synced = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synced.append("accelerator"))
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(synchronize=lambda: synced.append("tpu")), raising=False)
    monkeypatch.setattr(timing, "time", Clock(*range(10)))
    for device, expected in (
        (torch.device("cpu"), []),
        (types.SimpleNamespace(type=kind), ["accelerator" if kind == "cuda" else "tpu"] * 3),
    ):
        synced.clear()
        pipe = pipe_with_stages()
        timing.StageTimer(pipe, device)
        pipe.text_encoder(torch.zeros(1, 2))  # one at the end of encoding, two around decoding
        pipe.vae.decode(torch.ones(1))
        assert synced == expected


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(3, 4)
        self.b.weight = self.a.weight  # one tensor, two modules: moved once
        self.empty = torch.nn.Parameter(torch.zeros(0))  # holds nothing: nothing to move
        self.register_buffer("table", torch.arange(6, dtype=torch.float16))


def test_parking_moves_each_weight_once_and_unparking_brings_the_same_values_back():
    from launcher.worker import residency

    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tensors_before = {k: v.data_ptr() for k, v in m.named_parameters()}
    # a.weight 48 + a.bias 16 + b.bias 16 (float32) and the table 12 (float16)
    size = 48 + 16 + 16 + 12
    assert residency.resident_bytes(m, None) == size
    moved = residency.MOVED["bytes"]
    parked = residency.park(m)
    assert parked.nbytes == size and len(parked.entries) == 4
    assert residency.resident_bytes(m) == 0 and m.a.weight.numel() == 0 and residency.MOVED["bytes"] == moved + size
    residency.unpark(parked)
    assert residency.MOVED["bytes"] == moved + 2 * size and parked.entries == []
    after = m.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert m.b.weight is m.a.weight and residency.resident_bytes(m) == size
    assert {k: v.data_ptr() for k, v in m.named_parameters()} != tensors_before  # a fresh copy, not the old bytes


def test_each_sample_carries_its_prompt_rows_kept_values_found_by_prompt_id():
    import pyarrow as pa

    from launcher.plan.shards import Shard
    from launcher.writer.columns import carry_kept
    from launcher.writer.writer import KEPT_FIELDS

    kept = (pa.field("source", pa.string()), pa.field("score", pa.float32()))
    rows = ({"id": "a", "prompt": "x", "source": "web", "score": 0.5}, {"id": "b", "prompt": "y", "source": None})
    # two images of prompt a (ids a-0, a-1) and one sample of b whose id is its prompt's
    samples = [{"id": "a-0", "prompt_id": "a"}, {"id": "b"}, {"id": "a-1", "prompt_id": "a"}]
    carry_kept(samples, Shard(3, rows, "fp", kept))
    assert [(s["source"], s["score"]) for s in samples] == [("web", 0.5), (None, None), ("web", 0.5)]
    assert all(s[KEPT_FIELDS] == kept for s in samples)
    plain = [{"id": "a"}]
    carry_kept(plain, Shard(3, rows, "fp"))  # nothing kept: the samples are as they were
    assert plain == [{"id": "a"}]


def test_the_batch_digest_is_the_sha256_of_every_images_bytes_in_order():
    import hashlib

    import numpy as np

    from launcher.worker.cache import digest

    a, b = np.zeros((2, 2, 3), np.uint8), np.full((2, 2, 3), 7, np.uint8)
    assert digest([{"pixels": a}, {"pixels": b}]) == hashlib.sha256(bytes(12) + bytes([7] * 12)).hexdigest()
    assert digest([{"pixels": b}, {"pixels": a}]) != digest([{"pixels": a}, {"pixels": b}])
    assert digest([]) == hashlib.sha256().hexdigest()


def test_magcache_takes_the_job_steps_unless_given_and_flux_names_diffusers_ratios():
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    from launcher.worker.cache import cache_config

    options = {"mag_ratios": "flux"}
    got = cache_config("magcache", options, 28)
    assert got.num_inference_steps == 28 and list(got.mag_ratios) == list(FLUX_MAG_RATIOS)
    assert options == {"mag_ratios": "flux"}  # the config's own options are not changed
    assert cache_config("magcache", {"num_inference_steps": 50, "mag_ratios": "flux"}, 28).num_inference_steps == 50
    assert type(cache_config("taylorseer", {"max_order": 2}, 28)).__name__ == "TaylorSeerCacheConfig"
    assert cache_config("first_block", {"threshold": 0.3}, 28).threshold == 0.3


@pytest.mark.parametrize("library", ["imagecodecs", "pil"])
def test_each_format_encodes_what_it_promises_through_either_library(library):
    import io

    import numpy as np
    from PIL import Image

    from launcher.writer.encode import Encoding, encode

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)

    def back(data: bytes) -> tuple[str, np.ndarray]:
        image = Image.open(io.BytesIO(data))
        return image.format, np.asarray(image.convert("RGB"))

    for enc in (Encoding("png", png_level=9, png_encoder=library), Encoding("webp", lossless=True)):
        fmt, got = back(encode(pixels, enc, library))
        assert fmt == enc.format.upper() and np.array_equal(got, pixels)  # lossless: the same pixels
    for fmt in ("jpeg", "webp"):
        small, large = (encode(pixels, Encoding(fmt, quality=q), library) for q in (10, 95))
        assert back(large)[0] == fmt.upper() and len(small) < len(large)
        assert not np.array_equal(back(large)[1], pixels)  # lossy, as asked: not the lossless encoding


def test_the_card_names_each_encoding_and_files_take_its_extension():
    from launcher.writer.encode import Encoding, default_library

    assert Encoding("png", png_level=3).describe() == "png (lossless, zlib level 3)"
    assert Encoding("webp", lossless=True, quality=50).describe() == "webp (lossless)"
    assert Encoding("webp", quality=80).describe() == "webp (lossy, quality 80)"
    assert Encoding("jpeg", quality=90).describe() == "jpeg (lossy, quality 90)"
    assert [Encoding(f).extension for f in ("png", "jpeg", "webp")] == ["png", "jpg", "webp"]
    # the faster library of each (encode.py's measurements): PNG's is the configured one
    assert default_library(Encoding("png", png_encoder="pil")) == "pil"
    assert default_library(Encoding("jpeg")) == default_library(Encoding("webp")) == "imagecodecs"
    assert default_library(Encoding("webp", lossless=True)) == "pil"


def stream_sample(i: int, pixels) -> dict:
    sample = {"id": f"s{i}", "prompt": f"p{i}", "seed": i, "height": 4, "width": 6, "num_inference_steps": 2}
    return sample | {"guidance_scale": 1.0, "negative_prompt": "", "model": "m", "_pos": i, "pixels": pixels}


def test_the_writer_process_encodes_each_batch_and_commits_a_shard_whole(tmp_path, monkeypatch):
    """launcher/writer/writer_process.py in this process: a batch's images encoded as output.format says (their
    pixels handed over, not kept), added to the shard's files, which appear only at `_finish`."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from launcher.ledger.store import Store
    from launcher.writer import writer_process as wp

    out = types.SimpleNamespace(format="webp", quality=95, lossless=True, png_encoder="imagecodecs", png_level=1)
    out.__dict__.update({"webp_method": 0, "parquet": True, "webdataset": False, "image_files": False})
    out.__dict__.update({"row_group_size": 2, "embed_images": True})
    monkeypatch.setattr(wp, "_OUT", {"store": Store(tmp_path), "cfg": out, "encoders": None})
    monkeypatch.setattr(wp, "_STREAMS", {})
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (4, 6, 3), dtype=np.uint8) for _ in range(3)]
    batch = [stream_sample(i, images[i]) for i in (1, 0)]
    wp._add_batch("shard-00007", batch)
    assert all("pixels" not in s for s in batch) and list(wp._STREAMS) == ["shard-00007"]
    assert not (tmp_path / "data" / "shard-00007.parquet").exists()  # not before _finish
    record = wp._write_files("shard-00007", [stream_sample(2, images[2])])
    assert wp._STREAMS == {} and list(record["files"]) == ["data/shard-00007.parquet"]
    rows = pq.read_table(tmp_path / "data" / "shard-00007.parquet").to_pylist()
    assert [r["id"] for r in rows] == ["s0", "s1", "s2"]
    for r, want in zip(rows, images, strict=True):
        image = Image.open(io.BytesIO(r["image"]["bytes"]))
        assert image.format == "WEBP" and np.array_equal(np.asarray(image.convert("RGB")), want)
    # a shard whose batch fails to be added leaves nothing, and no stream behind
    wp._add_batch("shard-00008", [stream_sample(0, images[0])])
    bad = stream_sample(1, images[1]) | {"seed": "not a seed"}  # fails the row group's write (int64 seeds)
    with pytest.raises(pa.ArrowInvalid):
        wp._add_batch("shard-00008", [bad])
    assert wp._STREAMS == {} and sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["shard-00007.parquet"]
    # no file kind at all (a benchmark's control): states only, nothing encoded or kept
    out.parquet = False
    wp._add_batch("shard-00009", [stream_sample(0, images[0])])
    assert wp._STREAMS == {}


def test_a_lora_delta_is_scale_times_scaling_times_b_a_whatever_the_chunk(monkeypatch):
    from launcher.worker import lora_fuse
    from launcher.worker.lora import Factor

    torch.manual_seed(0)
    A, B = torch.randn(2, 3), torch.randn(5, 2)  # rank 2, 3 in, 5 out
    expected = torch.randn(5, 3)
    weight = expected.clone()
    expected += 0.5 * 3.0 * (B @ A)
    monkeypatch.setattr(lora_fuse, "CHUNK_BYTES", 2 * 3 * 4)  # two rows of the delta at a time: 2 + 2 + 1
    lora_fuse.add_delta(weight, Factor(A, B, scaling=3.0), 0.5)
    assert torch.allclose(weight, expected, atol=1e-6)
    # a layer that stores its weight as in x out (Conv1D) takes the delta transposed
    stored = torch.ones(3, 5)
    lora_fuse.add_delta(stored, Factor(A, B, scaling=1.0, fan_in_fan_out=True), 2.0)
    assert torch.allclose(stored, 1.0 + 2.0 * (B @ A).T, atol=1e-6)
    # half weights on the CPU: the product in float32, then cast (PEFT's arithmetic), not in bfloat16
    half = torch.zeros(5, 3, dtype=torch.bfloat16)
    A16, B16 = A.to(torch.bfloat16), B.to(torch.bfloat16)
    lora_fuse.add_delta(half, Factor(A16, B16, scaling=1.0), 1.0)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, (B16.float() @ A16.float()).to(torch.bfloat16))


def test_fuse_adds_each_lora_in_turn_and_counts_the_layers_it_changed():
    from launcher.worker import lora_fuse
    from launcher.worker.lora import Factor

    torch.manual_seed(1)
    transformer = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = [transformer[0].weight.clone(), transformer[1].weight.clone()]
    pipe = types.SimpleNamespace(transformer=transformer)
    one = Factor(torch.ones(1, 3), torch.ones(4, 1), scaling=1.0)
    two = Factor(torch.ones(1, 4), torch.ones(2, 1), scaling=2.0)
    fused = [({"transformer": {"0": one, "1": two}}, 0.5), ({"transformer": {"0": one}}, -1.5)]
    assert lora_fuse.fuse(pipe, fused) == 3
    assert torch.allclose(transformer[0].weight, before[0] + 0.5 - 1.5)
    assert torch.allclose(transformer[1].weight, before[1] + 2.0 * 0.5)
    assert lora_fuse._packed_slices(transformer) == {} and lora_fuse._tp_degree(transformer) == 1


def test_a_text_encoders_packed_tp_plan_is_refused_and_a_plain_one_splits_evenly():
    from launcher.worker import lora_fuse

    plain = types.SimpleNamespace(tp_plan={"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"})
    assert lora_fuse._refuse_packed(plain) == {} and lora_fuse._refuse_packed(types.SimpleNamespace()) == {}
    packed = types.SimpleNamespace(tp_plan={"layers.*.q_proj": "colwise", "layers.*.gate_up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match=r"^the text encoder's tensor-parallel plan packs layers.\*.gate_up_proj: "):
        lora_fuse._refuse_packed(packed)


class Claims:
    """A claims book whose shards in `held` are a live run's the first time they are tried."""

    def __init__(self, held=(), full=False):
        self.held, self.tried, self.skipped, self.out_of_space = set(held), [], set(), full

    def try_claim(self, i, seen):
        self.tried.append((i, seen))
        if i in self.held:
            self.held.discard(i)
            self.skipped.add(i)
            return False
        return True


def worker_of(claims=None, writer=None, is_writer=True):
    from launcher.plan.shards import Shard
    from launcher.worker.runner import Worker

    plan = types.SimpleNamespace(seen=lambda i: f"seen-{i}", shard=lambda i: Shard(i, ({"id": str(i)},), "fp"))
    groups = types.SimpleNamespace(is_writer=is_writer, tp_size=1)
    return Worker(None, None, groups, None, writer, plan=plan, claims=claims)


def test_a_worker_claims_shards_in_its_order_and_tries_those_a_live_run_held_once_more_at_the_end():
    from launcher.worker.runner import _next_shard

    claims = Claims(held={4})
    w, order = worker_of(claims), [4, 1, 7]
    assert _next_shard(w, claims, order) == 1 and w.shard.index == 1 and order == [7]
    assert _next_shard(w, claims, order) == 7
    assert _next_shard(w, claims, order) == 4 and w.rescanned and claims.skipped == set()  # held at first: once more
    assert _next_shard(w, claims, order) is None and w.shard is None
    assert claims.tried == [(4, "seen-4"), (1, "seen-1"), (7, "seen-7"), (4, "seen-4")]
    full = Claims(full=True)
    assert _next_shard(worker_of(full), full, [0]) is None and full.tried == []  # a full output: no more claims
    assert _next_shard(worker_of(Claims(), is_writer=False), Claims(), [0]) is None  # only the writer claims


def test_a_failure_names_its_shard_and_up_to_five_real_rows_of_its_batch():
    from launcher.plan.shards import Shard
    from launcher.worker.runner import _out_of_space, _rows_of

    shard = Shard(12, (), "fp")
    rows = [{"id": f"r{i}"} for i in range(8)]
    assert _rows_of(shard, None) == " (shard 12)"
    assert _rows_of(shard, types.SimpleNamespace(rows=rows, n_real=7)) == (
        " (shard 12, rows 'r0', 'r1', 'r2', 'r3', 'r4' and 2 more)"
    )
    assert _rows_of(shard, types.SimpleNamespace(rows=rows, n_real=2)) == " (shard 12, rows 'r0', 'r1')"
    assert _rows_of(shard, types.SimpleNamespace(rows=rows[:5], n_real=5)).endswith("'r4')")
    assert not _out_of_space(worker_of()) and not _out_of_space(worker_of(writer=types.SimpleNamespace(out_of_space=0)))
    assert _out_of_space(worker_of(writer=types.SimpleNamespace(out_of_space=True)))


def test_encoders_take_half_the_hosts_cores_shared_by_its_writers(monkeypatch):
    import os

    from launcher.writer.bgwriter import default_encode_workers

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [default_encode_workers(n) for n in (0, 1, 2, 3, 8, 9)] == [8, 8, 4, 2, 1, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert default_encode_workers(1) == 1


def test_a_pipelines_components_are_read_from_its_model_index(tmp_path):
    from launcher.worker.pipeline import _cls, component_classes

    index = {"_class_name": "P", "_diffusers_version": "0.1", "vae": ["diffusers", "AutoencoderKL"]}
    index |= {"text_encoder_2": [None, None], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    got = component_classes(str(tmp_path))
    assert got == {"vae": ("diffusers", "AutoencoderKL"), "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
    assert _cls(got["vae"]).__name__ == "AutoencoderKL"


def test_each_sample_gets_the_scores_its_image_has_in_any_batch_size(quality_models):
    import numpy as np
    from omegaconf import OmegaConf
    from test_quality import PROMPTS, images, qcfg

    from launcher.worker.quality import Scorer, enabled, load_scorer

    clip, checker = quality_models
    whole = Scorer(qcfg(clip, checker, batch_size=7)).columns(images(), PROMPTS)
    samples = [{"pixels": x, "prompt": p, "id": str(i)} for i, (x, p) in enumerate(zip(images(), PROMPTS, strict=True))]
    by_two = Scorer(qcfg(clip, checker, batch_size=2))
    by_two.add_columns(samples)
    assert [s["nsfw"] for s in samples] == whole["nsfw"] and len(whole["nsfw"]) == 7
    assert np.allclose([s["clip_score"] for s in samples], whole["clip_score"], atol=1e-4)
    by_two.add_columns([])  # nothing to score
    assert Scorer.names_for(qcfg(clip, checker)) == ["clip_score", "nsfw"] == by_two.names
    assert Scorer.names_for(qcfg(clip, checker, clip_score=False)) == ["nsfw"]
    assert Scorer.names_for(qcfg(clip, checker, safety=False, clip_score=False)) == []
    job = OmegaConf.create({"quality": qcfg(clip, checker, safety=False), "model": {"dtype": "float32"}})
    assert enabled(job) and load_scorer(job, "cpu").names == ["clip_score"]
    job.quality.clip_score = False
    assert not enabled(job) and load_scorer(job, "cpu") is None
    assert not enabled(OmegaConf.create({"quality": None})) and not enabled(OmegaConf.create({}))


class ShardWriter:
    """The background writer as run_shard sees it: what each `add` was handed, and the job `submit` got."""

    def __init__(self):
        self.added, self.jobs = [], []

    def add(self, index, name, samples):
        self.added.append((index, name, [dict(s) for s in samples]))
        return 0.125  # seconds waited for room in its queue

    def submit(self, job):
        self.jobs.append(job)


def shard_worker(monkeypatch, tmp_path, fail_at=None, overrides=()):
    """A writing rank (tp rank 0) whose pipeline makes each batch's images, counting a compile a batch, and fails
    with ValueError at batch `fail_at`; a fake clock: 2.5 s from the shard's start to its end."""
    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.worker import runner
    from launcher.worker.execution import CompileStats

    cfg = load_config("tiny", ["generate.images_per_prompt=2", "generate.batch_size=2", *overrides])
    w = runner.Worker(cfg, "the pipeline", types.SimpleNamespace(is_writer=True, tp_size=1, tp_rank=0), None, None)
    takes = iter([{"before": 9.0}, {"denoise": 1.5}])
    w.timer = types.SimpleNamespace(take=lambda: next(takes))
    w.writer, w.store, w.run_id, w.load_seconds = ShardWriter(), Store(tmp_path), "run-1", 1.23456
    w.claims, w.compile_stats = types.SimpleNamespace(attempt=lambda i: f"attempt-of-{i}"), CompileStats()

    def steps(pipe, batches, cfg, job, set_lora_scales=None):
        for k, b in enumerate(batches):

            def step(b=b, k=k, **_):
                w.compile_stats.compiles += 1
                if k == fail_at:
                    raise ValueError("boom")
                return [{"id": sid, "prompt": "p", "pixels": np.zeros((2, 2, 3), np.uint8)} for sid in b.image_ids()]

            yield b, step

    clock = iter([10.0, 12.5])
    hits = iter([4, 7])
    monkeypatch.setattr(runner, "shard_steps", steps)
    monkeypatch.setattr(
        runner, "time", types.SimpleNamespace(perf_counter=lambda: next(clock), time=lambda: 1e9 + 0.12345)
    )
    monkeypatch.setattr(runner, "cache_hits", lambda: next(hits))
    truncated = []
    job = runner.job_of(cfg.job)
    monkeypatch.setattr(job, "count_truncated", lambda pipe, prompts, n: truncated.append((pipe, prompts, n)) or 1)
    return w, truncated


def test_a_done_shards_state_says_what_it_made_and_where_its_time_went(monkeypatch, tmp_path):
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    (tmp_path / "state").mkdir()
    prev = {"status": "failed", "error_class": "OSError", "attempts": 1}
    (tmp_path / "state" / "shard-00005.json").write_text(json.dumps(prev))
    w, truncated = shard_worker(monkeypatch, tmp_path)
    rows = ({"id": "a", "prompt": "pa"}, {"id": "b", "prompt": "pb"}, {"id": "c", "prompt": "pc"})
    assert runner.run_shard(w, Shard(5, rows, "fp-5"))
    handed = [s for _, _, samples in w.writer.added for s in samples]
    # DESIGN's sample ids with N = 2, each with its place among the shard's rows (the writer keeps that order)
    order = ["a-0", "a-1", "b-0", "b-1", "c-0", "c-1"]
    assert sorted((s["_pos"], s["id"]) for s in handed) == list(enumerate(order))
    assert {(i, n) for i, n, _ in w.writer.added} == {(5, "shard-00005")}
    [job] = w.writer.jobs
    assert (job.index, job.name, job.samples, job.prev) == (5, "shard-00005", [], prev)
    batches = len(w.writer.added)
    assert job.state == {
        "status": "done",
        "rows": 6,
        "prompts": 3,
        "prompts_fingerprint": "fp-5",
        "run_id": "run-1",
        "attempt": "attempt-of-5",
        "seconds": 2.5,
        "images_per_s": 2.4,
        "stages": {"load": 1.2346, "denoise": 1.5, "warmup": 0.0, "writer_wait": 0.125 * batches},
        "started_at": 1e9 + 0.123,
        "compiles": batches,
        "compile_cache_hits": 3,
        "truncated": 1,
    }
    assert truncated == [("the pipeline", ["pa", "pb", "pc"], w.cfg.generate.max_sequence_length)]
    assert w.load_seconds == 0.0  # counted in this shard's stages only


def test_a_swept_shards_state_counts_its_prompts_beside_its_samples(monkeypatch, tmp_path):
    """DESIGN: each prompt makes images_per_prompt x sweep variants samples; a shard's state says both, `rows` its
    samples and `prompts` its prompts, with one image a prompt too once a sweep makes several."""
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    sweep = ["generate.images_per_prompt=1", "generate.sweep={guidance_scale:[2.5,4.0]}"]
    w, _ = shard_worker(monkeypatch, tmp_path, overrides=sweep)
    rows = ({"id": "a", "prompt": "pa"}, {"id": "b", "prompt": "pb"}, {"id": "c", "prompt": "pc"})
    assert runner.run_shard(w, Shard(0, rows, "fp"))
    [job] = w.writer.jobs
    assert (job.state["rows"], job.state["prompts"]) == (6, 3)


def test_a_failed_shards_state_names_the_error_its_class_and_the_batchs_samples(monkeypatch, tmp_path):
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    w, truncated = shard_worker(monkeypatch, tmp_path, fail_at=1, overrides=["generate.images_per_prompt=1"])
    rows = tuple({"id": f"r{i}", "prompt": "p"} for i in range(6))
    assert not runner.run_shard(w, Shard(2, rows, "fp"))
    [job] = w.writer.jobs
    state = job.state
    assert state["status"] == "failed" and state["rows"] == 6 and "prompts" not in state
    assert state["error"] == "ValueError: boom (shard 2, rows 'r2', 'r3')" and state["error_class"] == "ValueError"
    assert state["traceback"].startswith(state["error"] + "\nTraceback (most recent call last):")
    assert state["samples"] == ["r2", "r3"] and state["images_per_s"] is None and state["truncated"] is None
    assert [s["id"] for _, _, b in w.writer.added for s in b] == ["r0", "r1"] and job.prev is None
    assert truncated == []


def test_a_failure_in_a_step_of_no_batch_fails_its_shard_naming_no_samples(monkeypatch, tmp_path):
    """launcher/worker/runner.py: a step that belongs to no batch (execution.staged encodes a shard's prompts before
    any batch) fails its shard like any other, its state naming the error and no samples."""
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    w, _ = shard_worker(monkeypatch, tmp_path, overrides=["generate.images_per_prompt=1"])

    def encode(**_):
        raise RuntimeError("the text encoder is out of memory")

    def steps(*args, **kwargs):
        yield None, encode

    monkeypatch.setattr(runner, "shard_steps", steps)
    assert not runner.run_shard(w, Shard(1, ({"id": "a", "prompt": "p"},), "fp"))
    [job] = w.writer.jobs
    assert job.state["status"] == "failed"
    assert job.state["error"] == "RuntimeError: the text encoder is out of memory (shard 1)"  # no rows named
    assert "samples" not in job.state and w.writer.added == []


def test_an_injected_failure_fails_its_shard_on_the_last_tp_rank_only(monkeypatch, tmp_path):
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    rows = ({"id": "a", "prompt": "p"},)
    for rank, tp, failed in ((1, 2, True), (0, 2, False), (0, 1, True)):
        w, _ = shard_worker(monkeypatch, tmp_path, overrides=["testing.fail_shards=[3]", f"mesh.tp={tp}"])
        w.groups.tp_rank, w.writer = rank, None  # no writer: its result is all it says
        assert runner.run_shard(w, Shard(3, rows, "fp")) is not failed
        w, _ = shard_worker(monkeypatch, tmp_path, overrides=["testing.fail_shards=[3]", f"mesh.tp={tp}"])
        w.groups.tp_rank, w.writer = rank, None
        assert runner.run_shard(w, Shard(4, rows, "fp"))  # another shard


@pytest.mark.parametrize("encode_workers", [1, 2])
def test_the_writer_processs_functions_in_this_process(encode_workers, tmp_path, monkeypatch):
    """launcher/writer/writer_process.py's side, called here as the spawned writer process calls it: set up once
    (its death tied to the given parent, its nice value raised by WRITER_NICENESS, pandas refused, an encoder pool
    only for 2+ encode workers); batches encoded and streamed into a shard's files, committed whole by `_finish`;
    an aborted shard and a batch that cannot be written leave nothing of their files; with no output kind, no file."""
    import importlib
    import sys
    from types import SimpleNamespace

    import pyarrow.parquet as pq
    from conftest import pixels
    from omegaconf import OmegaConf
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.writer import writer_process as wp

    parents, nice = [], []
    monkeypatch.setattr(wp, "die_with_parent", parents.append)
    monkeypatch.setattr(wp.os, "nice", nice.append)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(wp, "_OUT", {})
    monkeypatch.setattr(wp, "_STREAMS", {})
    cfg = load_config("tiny", ["output.row_group_size=2", "output.image_files=true"]).output
    plain = SimpleNamespace(**OmegaConf.to_container(cfg, resolve=True))
    wp._start_writer(str(tmp_path), plain, encode_workers, 4242)
    try:
        assert parents == [4242] and nice == [wp.WRITER_NICENESS]
        with pytest.raises(ModuleNotFoundError, match="the writer process does without pandas"):
            importlib.import_module("pandas.not_yet_imported")
        pool = wp._OUT["encoders"]
        assert (pool._max_workers if pool else 1) == encode_workers and (pool is None) == (encode_workers == 1)
        first, second = samples(["a", "b"], 0, first=0), samples(["c"], 1, first=2)
        made = [s["pixels"].copy() for s in (*first, *second)]
        wp._add_batch("shard-00000", first)
        wp._add_batch("shard-00000", second)
        assert not (tmp_path / "data" / "shard-00000.parquet").exists()  # not before its end
        got = wp._finish("shard-00000")
        rows = pq.read_table(tmp_path / "data" / "shard-00000.parquet").to_pylist()
        assert [r["id"] for r in rows] == ["a", "b", "c"]
        assert [pixels(r["image"]["bytes"]).tolist() for r in rows] == [p.tolist() for p in made]
        assert sorted(got["files"]) == [
            "data/shard-00000.parquet",
            *(f"images/shard-00000/{i}.png" for i in "abc"),
        ]

        wp._add_batch("shard-00001", samples(["d"], 2, first=0))
        wp._abort("shard-00001")
        bad = samples(["e", "g"], 3, first=0)  # a row group's worth: written, and refused, as it is added
        bad[1]["seed"] = "not a seed"
        with pytest.raises(Exception, match="seed"):
            wp._add_batch("shard-00002", bad)
        left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        assert left == sorted(got["files"]) and wp._STREAMS == {}

        none = SimpleNamespace(**{**vars(plain), "parquet": False, "image_files": False, "webdataset": False})
        wp._OUT["cfg"] = none
        wp._add_batch("shard-00003", samples(["f"], 4, first=0))
        assert wp._STREAMS == {} and not list(tmp_path.glob("*/shard-00003*"))
    finally:
        wp._stop_encoders()
    assert "encoders" not in wp._OUT


def test_a_write_that_fails_fails_its_shard_with_the_error_and_leaves_none_of_its_files(tmp_path, caplog):
    """launcher/writer/bgwriter.py: a shard whose batch the writer process could not write is recorded failed (the
    error, its class, its traceback; its attempts counted as DESIGN's state says), with none of its files; a shard
    whose claim another run took over is left to it, state and all; a state the output refuses for want of room
    leaves the shard pending and the writer out of space."""
    import errno

    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    out = load_config("tiny", ["output.row_group_size=1", "output.image_files=true"]).output
    recorded, lost = [], []
    taken = {3, 4}
    writer = BackgroundWriter(Store(tmp_path), out, 1, recorded.append, lambda i: i not in taken, lost.append)
    writer.add(2, "shard-00002", samples(["a", "b"], 0, first=0))
    bad = samples(["c"], 1, first=2)
    bad[0]["seed"] = "not a seed"  # int64 seeds: its write fails
    writer.add(2, "shard-00002", bad)
    prev = {"status": "failed", "error_class": "ArrowInvalid", "attempts": 2}
    writer.submit(ShardJob(2, "shard-00002", [], {"status": "done", "rows": 3, "seconds": 1.0}, prev=prev))
    writer.add(3, "shard-00003", samples(["x"], 0, first=0))
    writer.submit(ShardJob(3, "shard-00003", [], {"status": "done", "rows": 1, "seconds": 1.0}))
    # a taken-over shard whose samples come with its end, not batch by batch: none of them stays held either
    writer.submit(ShardJob(4, "shard-00004", samples(["y", "z"], 0, first=0), {"status": "done", "rows": 2}))
    with caplog.at_level("WARNING"):
        writer.close()
    state = json.loads((tmp_path / "state" / "shard-00002.json").read_text())
    assert state["status"] == "failed" and state["error_class"] == "ArrowInvalid" and state["attempts"] == 3
    assert state["error"].startswith("ArrowInvalid while writing: ") and "Traceback" in state["traceback"]
    assert isinstance(state["finished_at"], float) and writer.failed == [2] and recorded == [2] and lost == [3, 4]
    assert "shard 3: another run took its claim over" in caplog.text and "shard 2 failed: ArrowInvalid" in caplog.text
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "state/shard-00002.json"
    ]
    assert writer.held_images == 0 and not writer.out_of_space

    full = Store(tmp_path / "full")

    def no_room(rel, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    full.write_json = no_room
    writer = BackgroundWriter(full, out, 1, recorded.append)
    writer.add(0, "shard-00000", samples(["a"], 0, first=0))
    writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": 1, "seconds": 1.0}))
    writer.close()
    assert writer.out_of_space and recorded == [2] and not (tmp_path / "full" / "state").exists()


def test_a_shard_taken_over_then_claimed_again_is_written_whole(tmp_path):
    """launcher/writer/bgwriter.py: a shard whose claim another run took over mid-shard is left to it; claimed
    again later (that run gave it up), the same writer writes it whole: the first attempt's dropped batches are
    forgotten, not held against the second."""
    import pyarrow.parquet as pq
    from conftest import until
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    recorded, lost, taken = [], [], {0}
    writer = BackgroundWriter(
        Store(tmp_path), load_config("tiny").output, 1, recorded.append, lambda i: i not in taken, lost.append
    )
    try:
        writer.add(0, "shard-00000", samples(["a", "b"], 0, first=0))
        writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": 2, "seconds": 1.0}))
        until(lambda: lost == [0])
        taken.clear()
        writer.add(0, "shard-00000", samples(["c", "d"], 0, first=0))
        writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": 2, "seconds": 1.0}))
    finally:
        writer.close()
    assert recorded == [0] and writer.failed == []
    assert json.loads((tmp_path / "state" / "shard-00000.json").read_text())["status"] == "done"
    assert pq.read_table(tmp_path / "data" / "shard-00000.parquet")["id"].to_pylist() == ["c", "d"]


def test_a_writer_process_that_died_fails_its_shard_and_a_new_one_writes_the_next(tmp_path, caplog, monkeypatch):
    """launcher/writer/bgwriter.py, a recovery path: the writer process dies (out of memory, say) while a shard's
    batches are handed over: that shard is recorded failed with the error that broke it, and a new writer process
    writes the next shard whole. A failed shard whose files cannot be removed says so in its error. Each shard's
    end is one event line as docs/guide.md shows them (`shard 3 done: 256 images in 412.0 s`, `shard 4 failed: ...`)."""
    import psutil
    import pyarrow.parquet as pq
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer import bgwriter
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    class Stuck(Store):  # removes state files, not a shard's data
        def delete(self, rel: str) -> None:
            if not rel.startswith("state/"):
                raise OSError(f"cannot remove {rel}")
            super().delete(rel)

    started = []  # each writer process started: the first, and one for its death (not one per failed shard)
    new_process = BackgroundWriter._new_process
    monkeypatch.setattr(BackgroundWriter, "_new_process", lambda self: started.append(new_process(self)) or started[-1])
    # ...each from the one thread that lives until close(): a process dies with the thread that started it
    # (launcher/errors.py die_with_parent), and the shard-writer thread that replaces one ends before close() is done.
    starters = []

    class Pool(bgwriter.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            starters.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bgwriter, "ProcessPoolExecutor", Pool)
    out, recorded = load_config("tiny").output, []
    writer = BackgroundWriter(Stuck(tmp_path), out, 1, recorded.append)
    try:

        def writers() -> list:  # the writer process (multiprocessing's resource tracker is a child too)
            return [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]

        first = writers()
        assert len(first) == 1
        first[0].kill()
        first[0].wait(30)
        writer.add(0, "shard-00000", samples(["a", "b"], 0, first=0))
        writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": 2, "seconds": 1.0}))
        writer.add(1, "shard-00001", samples(["c"], 1, first=0))
        end = samples(["e", "d"], 2)  # handed over with its end, out of order: `order` puts them in place
        writer.submit(ShardJob(1, "shard-00001", end, {"status": "done", "rows": 3, "seconds": 1.0}, {"d": 1, "e": 2}))
        with caplog.at_level("INFO", logger="meshgen.shards"):
            writer.close()
    finally:
        writer.close()  # again, after a failed assertion: its process never outlives the test (a no-op once closed)
    failed = json.loads((tmp_path / "state" / "shard-00000.json").read_text())
    assert failed["status"] == "failed" and failed["error_class"] == "BrokenProcessPool", failed
    assert failed["error"].startswith("BrokenProcessPool while writing: ")
    assert failed["error"].endswith("; its files could not be removed: OSError: cannot remove data/shard-00000.parquet")
    done = json.loads((tmp_path / "state" / "shard-00001.json").read_text())
    assert done["status"] == "done" and recorded == [0, 1] and writer.failed == [0] and writer.held_images == 0
    assert isinstance(done["write_seconds"], float) and done["write_seconds"] >= 0  # its files' write, timed
    assert pq.read_table(tmp_path / "data" / "shard-00001.parquet")["id"].to_pylist() == ["c", "d", "e"]
    assert not writers() and len(started) == 2 and len(set(starters)) == 1, starters
    # The new process lived until close() stopped its encoders: it is not tied to the thread that replaced it.
    assert "could not stop the encoder processes" not in caplog.text
    events = [r.getMessage() for r in caplog.records if r.name == "meshgen.shards"]
    assert events == [f"shard 0 failed: {failed['error']}", "shard 1 done: 3 images in 1.0 s"]


def test_a_pipeline_loads_as_diffusers_loads_it_in_the_configured_dtype(tiny_model):
    """At tp=1 nothing is sharded: load_pipeline is diffusers' own from_pretrained, in model.dtype, on the device,
    its progress bars off (the launcher's bar is the terminal's)."""
    from diffusers import DiffusionPipeline

    from launcher.config import load_config
    from launcher.worker.pipeline import load_pipeline

    cfg = load_config("tiny", [f"model.path={tiny_model}", "mesh.tp=1", "mesh.dp=1", "model.dtype=bfloat16"])
    pipe = load_pipeline(cfg, torch.device("cpu"), None)
    bare = DiffusionPipeline.from_pretrained(tiny_model, dtype=torch.bfloat16)
    assert type(pipe) is type(bare) and pipe.transformer.dtype == torch.bfloat16
    assert pipe._progress_bar_config == {"disable": True}
    for name in ("transformer", "vae", "text_encoder"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(bare, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name


@pytest.mark.parametrize("staged, abort", [(False, False), (True, False), (False, True)])
def test_one_rank_in_this_process_generates_the_plans_shards_and_marks_each_done(
    staged, abort, tiny_model, tmp_path, monkeypatch
):
    """A world of one rank (gloo, this process), as torchrun would start it: run_worker reads the plan the launcher
    wrote, claims each shard, loads the pipeline, writes each shard's Parquet and marks it done. DESIGN: one row per
    sample, ids the row number and `<prompt id>-<k>` for N images a prompt, each seed the first 8 bytes of
    sha256("<generate.seed>:<sample id>") little-endian masked to 63 bits, images of the size asked; the same with
    execution.staged (a shard's prompts encoded before it is denoised). With run.on_error=abort, a failed shard
    ends the run: exit 3 (DESIGN: the run ended but some selected shards are not done), no other shard begun."""
    import gc
    import hashlib
    import io
    import socket

    import pyarrow.parquet as pq
    import torch.distributed as dist
    from PIL import Image

    from launcher.checks.preflight import preflight
    from launcher.config import load_config
    from launcher.plan.plan import plan_rel, write_plan_file
    from launcher.worker.main import run

    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    prompts.write_text("a red fox\na blue cat\na green owl\n")
    job = ["mesh.tp=1", "run.shard_size=2", "generate.images_per_prompt=2", "generate.seed=11", "generate.width=48"]
    job += [
        "generate.height=32",
        "generate.num_inference_steps=1",
        "generate.batch_size=3",
        f"execution.staged={staged}",
        *(["testing.fail_shards=[0]", "run.on_error=abort"] if abort else []),
    ]
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}", *job]
    cfg = load_config("tiny", args[1:])
    pf = preflight(cfg)
    write_plan_file(pf.store, plan_rel("run-1"), cfg, pf.plan, pf.sizes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in {**env, "LOCAL_WORLD_SIZE": "1", "MESHGEN_RUN_ID": "run-1"}.items():
        monkeypatch.setenv(k, v)
    try:
        code = run(args)  # the worker's entry, as torchrun's `-m launcher.worker.main conf=tiny ...` runs it
    finally:
        gc.unfreeze()
        if dist.is_initialized():
            dist.destroy_process_group()
    states = {p.name: json.loads(p.read_text()) for p in (out / "state").glob("shard-*.json")}
    if abort:
        assert code == 3 and {k: v["status"] for k, v in states.items()} == {"shard-00000.json": "failed"}
        return
    assert code == 0
    assert sorted(states) == ["shard-00000.json", "shard-00001.json"]
    assert [s["status"] for s in states.values()] == ["done", "done"] and not list((out / "claims").rglob("*.json"))
    rows = [r for i in (0, 1) for r in pq.read_table(out / "data" / f"shard-{i:05d}.parquet").to_pylist()]
    ids = ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert [r["id"] for r in rows] == ids and [r["prompt_id"] for r in rows] == ["0", "0", "1", "1", "2", "2"]
    seeds = [int.from_bytes(hashlib.sha256(f"11:{i}".encode()).digest()[:8], "little") & (2**63 - 1) for i in ids]
    assert [r["seed"] for r in rows] == seeds
    assert all(Image.open(io.BytesIO(r["image"]["bytes"])).size == (48, 32) == (r["width"], r["height"]) for r in rows)


@pytest.mark.parametrize("family", ["flux2", "flux1"])
def test_fused_weights_are_bitwise_diffusers_in_bfloat16(family, loras, monkeypatch):
    """The delta arithmetic is PEFT's (float32 on CPU for half types): every weight equals diffusers' fuse, also
    when the delta is computed a few rows at a time (as it is for real-size layers), with and without alpha keys
    (FLUX.1's LoRA has them). The LoRAs and diffusers' own fuse are tests/test_lora.py's."""
    import torch
    from diffusers import DiffusionPipeline

    from launcher.worker import lora_fuse
    from launcher.worker.lora import factors
    from launcher.worker.lora_fuse import fuse

    monkeypatch.setattr(lora_fuse, "CHUNK_BYTES", 3 * 32 * 4)  # 3 rows of a 32-wide layer per step

    model, files = loras(family)
    ref = diffusers_fused(model, files, dtype=torch.bfloat16)
    ours = DiffusionPipeline.from_pretrained(model, dtype=torch.bfloat16)
    base = {k: v.clone() for k, v in ours.transformer.state_dict().items()}
    pipeline_class = type(ours).__name__
    fuse(ours, [(factors(pipeline_class, f, str(model)), s) for f, s in zip(files, SCALES, strict=True)])
    for part in ("transformer", "text_encoder"):
        a, b = getattr(ours, part).state_dict(), getattr(ref, part).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{part}.{k}"
    changed = [k for k, v in ours.transformer.state_dict().items() if not torch.equal(v, base[k])]
    assert len(changed) == len(FAMILY[family][2]["transformer"])


@pytest.mark.parametrize("family", ["flux2", "flux1", "sd3", "qwenimage", "flux2_klein"])
def test_transformers_has_a_tp_plan_for_the_text_encoder_exactly_where_its_family_says(family, tiny_family, tiny_model):
    """Each family module declares whether its text encoder shards (tp_text_encoder); the worker asks transformers
    (the config's base_model_tp_plan, or the class's _tp_plan) before it shards one: the two must agree."""
    from launcher.models import families
    from launcher.worker.pipeline import _cls, component_classes, text_encoder_has_tp_plan

    path = str(tiny_model if family == "flux2" else tiny_family(family))
    fam = next(f for f in families() if f.name == family)
    assert text_encoder_has_tp_plan(path, _cls(component_classes(path)["text_encoder"])) is fam.tp_text_encoder


def _pipeline_class(model) -> str:
    return json.loads((model / "model_index.json").read_text())["_class_name"]


@pytest.mark.parametrize("family", ["flux2", "flux1"])
def test_factors_are_the_files_a_and_b_per_module_with_peft_scaling(family, loras):
    """launcher/worker/lora.py: each module's factors A (r x in) and B (out x r) as the file holds them, in the
    transformer and the text encoder alike, and PEFT's scaling alpha / r (FLUX.1's tiny LoRA carries alpha 2 over
    rank 4; FLUX.2's none: alpha = r)."""
    from safetensors.torch import load_file

    from launcher.worker.lora import factors

    model, files = loras(family)
    modules, alpha = FAMILY[family][2], FAMILY[family][3]
    got = factors(_pipeline_class(model), files[0], str(model))
    assert {c: sorted(m) for c, m in got.items()} == {c: sorted(names) for c, names in modules.items()}
    sd = load_file(str(files[0]))
    for comp, names in modules.items():
        for n in names:
            f = got[comp][n]
            assert torch.equal(f.A, sd[f"{comp}.{n}.lora_A.weight"]), n
            assert torch.equal(f.B, sd[f"{comp}.{n}.lora_B.weight"]), n
            assert f.scaling == (alpha / 4 if alpha else 1.0) and not f.fan_in_fan_out, n


def test_factors_refuse_what_would_fuse_only_in_part(loras, tmp_path):
    """A key that matches no layer, one of a component the pipeline lacks, a component none of whose keys match
    (the others still judged), DoRA: each a LoraError naming it, never a LoRA fused in part."""
    from safetensors.torch import load_file

    model, files = loras("flux2")
    sd = load_file(str(files[0]))
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)

    def refusal(state: dict) -> str:
        return _lora_refusal(model, tmp_path, state)

    extra = {"transformer.nothing_here.lora_A.weight": a, "transformer.nothing_here.lora_B.weight": b}
    assert refusal(sd | extra) == (
        f"2 of its {len(sd) + 2} keys match no layer of the model (transformer.nothing_here.lora_A.weight, "
        "transformer.nothing_here.lora_B.weight); a misspelt prefix fuses the LoRA only in part"
    )
    other = {"unet.down.lora_A.weight": a, "unet.down.lora_B.weight": b}
    assert refusal(sd | other).startswith(f"2 of its {len(sd) + 2} keys match no layer of the model (unet.down.")
    encoder_only = {k: v for k, v in sd.items() if k.startswith("text_encoder.")}
    assert refusal(extra | encoder_only).startswith(f"2 of its {len(encoder_only) + 2} keys match no layer")
    assert refusal(extra) == "none of its keys matches a module of the model (components it names: transformer)"
    for component in ("transformer", "text_encoder"):  # each library words a shape mismatch its own way
        key = next(k for k in sd if k.startswith(f"{component}.") and k.endswith("lora_A.weight"))
        why = refusal(sd | {key: torch.zeros(4, sd[key].shape[1] + 8)})
        assert why.startswith(f"its {component} factors' shapes do not match the model's layers ("), why
    key = "transformer.transformer_blocks.0.attn.to_q"
    dora = sd | {f"{key}.lora_magnitude_vector": torch.ones(sd[f"{key}.lora_B.weight"].shape[0])}
    why = refusal(dora)  # diffusers turns DoRA on for the whole adapter: the first of its layers is named
    assert (
        why.startswith("transformer.")
        and why.split(" ", 1)[0].removeprefix("transformer.") in FAMILY["flux2"][2]["transformer"]
    )
    assert why.endswith(" is not a plain LoRA on a linear layer (DoRA, lora bias or another layer)")


def test_a_staged_step_sets_its_batchs_lora_scales_and_passes_the_warm_ups_step_count():
    """launcher/worker/staged.py: each staged denoise step first sets its batch's LoRA scales, then calls the job
    with what the runner passes (the compile warm-up passes num_inference_steps as a keyword)."""
    from launcher.worker.staged import _with_scales

    calls = []
    batch = types.SimpleNamespace(lora_scales=(0.5,))
    got = _with_scales(calls.append, batch, lambda *a, **k: (a, k), "pipe", batch, num_inference_steps=1)
    assert calls == [(0.5,)] and got == (("pipe", batch), {"num_inference_steps": 1})


def test_a_shard_made_again_stops_being_done_before_its_first_batch_is_written(tmp_path):
    """launcher/writer/bgwriter.py: a done shard generated again (run.shards=all, run.stale=regenerate) loses its
    done state when its first batch reaches the writer, before any of its files change: a crash in between leaves
    it pending, never "done" over a mix of old and new files. The state comes back with the shard's end."""
    from conftest import until
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    store, state = Store(tmp_path), tmp_path / "state" / "shard-00000.json"
    store.write_json("state/shard-00000.json", {"status": "done", "rows": 2})
    writer = BackgroundWriter(store, load_config("tiny").output, 1, lambda index: None)
    try:
        writer.add(0, "shard-00000", samples(["a"], 0, first=0))
        until(lambda: not state.exists())
        end = samples(["b"], 1)  # the shard's last sample, handed over with its end: its place, 1
        writer.submit(ShardJob(0, "shard-00000", end, {"status": "done", "rows": 2, "seconds": 1.0}, {"b": 1}))
    finally:
        writer.close()
    assert json.loads(state.read_text())["status"] == "done"


# worker room, part run (second): launcher/worker/runner.py (run_worker among fakes, run_shard, the tp exchanges)


class FakeWorld:
    """torch.distributed as one rank of a dp x tp world sees it: control messages go over the gloo groups that
    build_groups makes ("world", "tp"; launcher/worker/dist.py's Groups), never the default (accelerator) group.
    A message this rank does not send is the next one `feed` holds for that group, as its sender would send it."""

    def __init__(self, rank, size, tp_rank, feed):
        self.rank, self.size, self.tp_rank, self.feed = rank, size, tp_rank, feed
        self.destroyed = False

    def get_rank(self):
        return self.rank

    def get_world_size(self, group=None):
        return self.size

    def broadcast_object_list(self, box, src=None, group=None, group_src=None):
        assert group in ("world", "tp"), f"a control message over {group!r}"
        sender = self.rank == (src or 0) if group == "world" else self.tp_rank == group_src
        if not sender:
            box[0] = self.feed[group].pop(0)

    def all_gather_object(self, out, obj, group=None):
        assert group == "world", f"a control message over {group!r}"
        out[:] = [obj] * len(out)

    def destroy_process_group(self):
        self.destroyed = True


class FakeWriter:
    def __init__(self, store, output, n_enc, on_recorded, still_held, on_lost=None, failed=(), full_after=None):
        self.n_enc = n_enc
        self.failed, self.full_after, self.shards, self.closed = list(failed), full_after, [], False

    @property
    def out_of_space(self):
        return self.full_after is not None and len(self.shards) >= self.full_after

    def close(self):
        self.closed = True


def run_worker_in(monkeypatch, tmp_path, *, rank, dp, tp, overrides=(), outcomes=None, writer=None, feed=None):
    """run_worker on one rank of a fake world: its model load, shards and writer faked, its claims and plan order
    real. Returns (exit code, what it did): shards generated with the worker's run id and load time at each."""
    from launcher.config import load_config
    from launcher.worker import runner
    from launcher.worker.dist import Groups

    dp_rank, tp_rank = divmod(rank, tp)
    world = FakeWorld(rank, dp * tp, tp_rank, feed or {})
    cfg = load_config("tiny", [f"output.dir={tmp_path}", f"mesh.dp={dp}", f"mesh.tp={tp}", *overrides])
    did = types.SimpleNamespace(calls=[], shards=[], writer=None)
    record = did.calls.append

    class Dims:
        def __init__(self, *args):
            record(("dims", args))

        def build_mesh(self, device_type):
            return "the mesh"

    def shard(w, s):
        did.shards.append((s.index, w.run_id, w.load_seconds))
        if w.writer is not None:
            w.writer.shards.append(s.index)
        return (outcomes or {}).get(s.index, True)

    def new_writer(*args):
        did.writer = (writer or FakeWriter)(*args)
        return did.writer

    class Plan:
        def __init__(self, store, rel):
            self.selected = [0, 1, 2, 3]

        def seen(self, i):
            return None

        def shard(self, i):
            return types.SimpleNamespace(index=i)

    device = torch.device("cpu")
    monkeypatch.setattr(runner, "dist", world)
    monkeypatch.setenv("MESHGEN_RUN_ID", "run-7")
    monkeypatch.setattr(runner, "resolve_device", lambda d: "cpu")
    monkeypatch.setattr(runner, "init_distributed", lambda kind, timeout: device)
    monkeypatch.setattr(runner, "ParallelDims", Dims)
    monkeypatch.setattr(runner, "build_groups", lambda mesh: Groups(mesh, dp_rank, tp_rank, tp, "tp", "world"))
    monkeypatch.setattr(runner, "PlanFile", Plan)
    monkeypatch.setattr(runner, "BackgroundWriter", new_writer)
    monkeypatch.setattr(runner, "load_pipeline", lambda *a: record(("load", a)) or "the pipeline")
    monkeypatch.setattr(runner, "StageTimer", lambda *a: record(("timer", a)) or "the timer")
    monkeypatch.setattr(runner, "apply_cache", lambda *a: record(("cache", a)))
    monkeypatch.setattr(runner, "apply_compile", lambda *a: record(("compile", a[:3])))
    monkeypatch.setattr(runner, "load_scorer", lambda *a: record(("scorer", a)) or "the scorer")
    monkeypatch.setattr(runner, "run_shard", shard)
    monkeypatch.setattr(runner, "gc", types.SimpleNamespace(freeze=lambda: None))
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=Clock(100.0, 103.5).perf_counter))
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    code = runner.run_worker(cfg)
    assert world.destroyed
    return code, did, cfg


@pytest.mark.parametrize("nodes, encoders", [(1, 4), (2, 8)])
def test_a_dp_replica_claims_its_own_share_first_and_loads_once_on_the_run_id_rank_0_broadcast(
    nodes, encoders, monkeypatch, tmp_path
):
    """A writer (tp rank 0) of dp replica 1 of 2: the run id is rank 0's, sent over the gloo world group; its shards
    in the order launcher/plan/shards.py's preference gives slot 1 of 2 (its own, every second one from 1, then the
    others); the pipeline loaded on the mesh once, the stage timer, step cache and compile given that pipeline, the
    scorer on this rank's device; each claim names the worker and the run; the load time (3.5 s by the clock here)
    counted in the first shard. The encoders take half the host's 16 cores, shared by the host's writers: 2 writers
    (dp=2 on one host), 4 each; 1 writer (dp=2 over 2 hosts), 8 (a count: a process pool takes no float). With
    run.on_error=abort and every shard done, the exit code is 0 after every shard."""
    over = [f"mesh.nodes={nodes}", "run.on_error=abort"]
    feed = {"world": ["run-7"]}
    code, did, cfg = run_worker_in(monkeypatch, tmp_path, rank=1, dp=2, tp=1, overrides=over, feed=feed)
    assert code == 0
    assert [i for i, _, _ in did.shards] == [1, 3, 0, 2]
    assert {r for _, r, _ in did.shards} == {"run-7"}
    for i in range(4):  # what another run reads to tell whether the claim is live: this worker's index and run
        claim = json.loads((tmp_path / "claims" / f"shard-{i:05d}" / "g00000.json").read_text())
        assert (claim["worker"], claim["run_id"]) == (0, "run-7")
    assert did.shards[0][2] == 3.5
    assert did.calls == [
        ("dims", (2, 1, 2)),
        ("load", (cfg, torch.device("cpu"), "the mesh")),
        ("timer", ("the pipeline", torch.device("cpu"))),
        ("cache", ("the pipeline", cfg)),
        ("compile", ("the pipeline", cfg, "cpu")),
        ("scorer", (cfg, torch.device("cpu"))),
    ]
    assert did.writer.n_enc == encoders and type(did.writer.n_enc) is int and did.writer.closed


def test_a_tp_peer_follows_its_writers_shards_and_ends_the_run_at_an_aborted_one(monkeypatch, tmp_path):
    """A tp rank 1 of 2 neither reads the plan nor loads a scorer nor starts a writer: it generates the shards its
    writer sends it; with run.on_error=abort, its failed shard ends its run with exit 3 (DESIGN: the run ended but
    selected shards are not done), the next shard not begun."""
    feed = {"world": ["run-7"], "tp": [types.SimpleNamespace(index=2), types.SimpleNamespace(index=0)]}
    over = ["run.on_error=abort"]
    code, did, _ = run_worker_in(
        monkeypatch, tmp_path, rank=1, dp=1, tp=2, overrides=over, outcomes={2: False}, feed=feed
    )
    assert code == 3 and did.shards == [(2, "run-7", 3.5)] and did.writer is None
    assert [c for c, *_ in did.calls] == ["dims", "load", "timer", "cache", "compile"]


@pytest.mark.parametrize("on_error, code", [("continue", 0), ("abort", 3)])
def test_a_shard_the_writer_failed_ends_the_run_with_3_only_under_abort(on_error, code, monkeypatch, tmp_path):
    """Every shard generated, but the writer failed one: under abort the worker exits 3; under continue it exits 0
    (a worker's nonzero exit is a crash to torchrun; the launcher counts failed shards from the ledger, DESIGN)."""
    writer = lambda *a: FakeWriter(*a, failed=[0])  # noqa: E731
    got, did, _ = run_worker_in(
        monkeypatch, tmp_path, rank=0, dp=1, tp=1, overrides=[f"run.on_error={on_error}"], writer=writer
    )
    assert got == code and len(did.shards) == 4 and did.writer.closed


def test_a_full_output_stops_the_worker_after_its_shard_and_still_closes_its_writer(monkeypatch, tmp_path):
    writer = lambda *a: FakeWriter(*a, full_after=1)  # noqa: E731
    code, did, _ = run_worker_in(monkeypatch, tmp_path, rank=0, dp=1, tp=1, writer=writer)
    assert code == 0 and [i for i, _, _ in did.shards] == [0] and did.writer.closed


class StageClock:
    """A shard's stage timer: each take() hands over the stage times since the last (none here but `denoise`)."""

    def __init__(self):
        self.added = []

    def take(self):
        return {"denoise": 1.5}

    def add(self, stages):
        self.added.append(stages)


def test_a_compiled_shard_counts_each_shapes_warm_up_apart_rounded_like_every_time_in_its_state(monkeypatch, tmp_path):
    """execution.mode=compile: the first batch of a shape runs a warm-up of WARMUP_STEPS (2) first, the next of the
    same shape none, a step of no batch (staged's encode) none; the warm-up's seconds are the state's `warmup`
    stage and left out of its `seconds`; `compiles` counts this shard's compiles only (5 came before it). Times are
    rounded as the stage times are, to 0.1 ms, images per second to 3 decimals. The scorer's columns are on every
    sample the writer gets."""
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    w, _ = shard_worker(monkeypatch, tmp_path, overrides=["execution.mode=compile", "generate.images_per_prompt=1"])
    w.timer, w.compile_stats.compiles, calls = StageClock(), 5, []
    w.writer.add = lambda index, name, samples: (
        w.writer.added.append((index, name, [dict(s) for s in samples])) or 0.0123456
    )
    w.scorer = types.SimpleNamespace(add_columns=lambda samples: [s.update({"quality.score": 0.5}) for s in samples])

    def steps(pipe, batches, cfg, job, set_lora_scales=None):
        for b in batches:

            def step(b=b, **kw):
                calls.append((b.image_ids()[0], kw))
                w.compile_stats.compiles += 1
                return [{"id": sid, "prompt": "p", "pixels": np.zeros((2, 2, 3), np.uint8)} for sid in b.image_ids()]

            yield b, step
        yield None, lambda **kw: calls.append((None, kw)) or []

    clock = iter([10.0, 11.0, 13.123456789, 20.987664321])  # shard start, warm-up start and end, shard end
    monkeypatch.setattr(runner, "shard_steps", steps)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: next(clock), time=lambda: 1e9))
    assert runner.run_shard(w, Shard(0, tuple({"id": i, "prompt": "p"} for i in "abcd"), "fp"))  # 2 batches of 2
    assert calls == [("a", {"num_inference_steps": 2}), ("a", {}), ("c", {}), (None, {})]
    [job] = w.writer.jobs
    state = job.state
    assert state["stages"]["warmup"] == 2.1235 and state["seconds"] == 8.8642  # 20.98766 - 10 - 2.12346
    assert state["images_per_s"] == 0.451 and state["stages"]["writer_wait"] == 0.0247
    assert state["compiles"] == 3  # the warm-up's and the two batches'
    assert [s["quality.score"] for _, _, b in w.writer.added for s in b] == [0.5] * 4


def test_a_shard_starts_by_clearing_its_own_dead_leftovers_only_and_waits_at_the_testing_hold(monkeypatch, tmp_path):
    """launcher/ledger/states.py's clean_tmp for this shard only: its own dead write (this host, a pid that no longer
    runs) goes; another shard's write from another host, quiet for over a minute, stays (that shard is its holder's:
    a batch may take that long); testing.hold_batches_until is waited on (its `.waiting` said) before each batch."""
    import os

    from launcher.ledger.store import HOST
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    hold = tmp_path / "go"
    hold.touch()
    w, _ = shard_worker(
        monkeypatch, tmp_path, overrides=["generate.images_per_prompt=1", f"testing.hold_batches_until={hold}"]
    )
    (tmp_path / "data").mkdir()
    mine = tmp_path / "data" / f".shard-00004.parquet.tmp-{HOST}-999999999"
    theirs = tmp_path / "data" / ".shard-00007.parquet.tmp-another-host-123"
    for p in (mine, theirs):
        p.write_bytes(b"part")
        os.utime(p, (1, 1))
    assert runner.run_shard(w, Shard(4, ({"id": "a", "prompt": "p"},), "fp"))
    assert not mine.exists() and theirs.exists()
    assert (tmp_path / "go.waiting").exists()


@pytest.mark.parametrize("where", ["here", "on a peer"])
def test_a_shard_whose_batches_cannot_be_made_here_or_on_a_peer_fails_naming_the_error_and_runs_no_step(
    where, monkeypatch, tmp_path
):
    """An edit job's reference gone since planning: the shard fails with the error's class and words (the exchange
    with the tp peers gives every rank the first error), and no rank runs a step of it (a peer that had batches
    would wait alone in a collective)."""
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    w, _ = shard_worker(monkeypatch, tmp_path, overrides=["generate.images_per_prompt=1"])
    seen = []
    error = "FileNotFoundError: ref.png is gone"
    if where == "here":
        job = runner.job_of(w.cfg.job)
        monkeypatch.setattr(
            job, "shard_batches", lambda rows, cfg: (_ for _ in ()).throw(FileNotFoundError("ref.png is gone"))
        )
    else:
        monkeypatch.setattr(runner, "_agree", lambda groups, local, mark=None: error if not seen else None)

    def steps(pipe, batches, cfg, job, set_lora_scales=None):
        seen.append(list(batches))
        yield from ()

    monkeypatch.setattr(runner, "shard_steps", steps)
    assert not runner.run_shard(w, Shard(1, ({"id": "a", "prompt": "p"},), "fp"))
    [job] = w.writer.jobs
    assert seen == [[]] and job.state["status"] == "failed"
    assert job.state["error"] == error and job.state["error_class"] == "FileNotFoundError"


def test_an_injected_failure_says_it_is_the_testing_knobs_in_its_shards_state(monkeypatch, tmp_path):
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    w, _ = shard_worker(monkeypatch, tmp_path, overrides=["testing.fail_shards=[3]", "mesh.tp=1"])
    assert not runner.run_shard(w, Shard(3, ({"id": "a", "prompt": "p"},), "fp"))
    want = "InjectedFailure: testing.fail_shards: injected failure in shard 3 (shard 3, rows 'a')"
    assert w.writer.jobs[0].state["error"] == want


def test_compile_mode_warms_up_once_a_height_width_and_batch_length_whatever_its_steps(monkeypatch):
    """runner.py's _warm_up: a batch's compiled graphs depend on its size and length, not on its step count
    (WARMUP_STEPS' comment); each new (height, width, rows) runs the step once with 2 steps, timed apart, the stage
    times it took handed back to the timer's count before it (the warm-up's own are dropped)."""
    from launcher.config import load_config
    from launcher.worker import runner

    cfg = load_config("tiny", ["execution.mode=compile"])
    w = runner.Worker(cfg, None, None, None, None)
    taken = iter(range(100))
    w.timer = types.SimpleNamespace(take=lambda: {"n": next(taken)}, added=[])
    w.timer.add = w.timer.added.append
    monkeypatch.setattr(
        runner, "time", types.SimpleNamespace(perf_counter=Clock(1.0, 1.5, 2.0, 4.0, 5.0, 5.25).perf_counter)
    )
    calls = []
    batches = [((64, 64, 4, 3.5), 2), ((64, 64, 8, 3.5), 2), ((32, 64, 4, 3.5), 2), ((32, 64, 4, 3.5), 1)]
    got = []
    for k, (shape, n) in enumerate(batches):
        batch = types.SimpleNamespace(shape=shape, rows=[{}] * n)
        got.append(runner._warm_up(w, batch, lambda k=k, **kw: calls.append((k, kw))))
    assert got == [0.5, 0.0, 2.0, 0.25]
    assert calls == [(0, {"num_inference_steps": 2}), (2, {"num_inference_steps": 2}), (3, {"num_inference_steps": 2})]
    assert w.timer.added == [{"n": 0}, {"n": 2}, {"n": 4}]


def test_tp_peers_hear_their_writers_shard_and_full_output_and_share_errors_over_their_gloo_group(monkeypatch):
    """A tp rank 1 of dp replica 1 (world ranks 2, 3): the shard and the output's fullness come from its group's
    rank 0 (group rank: global rank 0 is not in this group), over the gloo tp group; errors are gathered over that
    group, one slot a tp rank, and every rank gets the first; different images with no error fail the batch as a
    RuntimeError (its state's error class)."""
    from launcher.worker import runner
    from launcher.worker.dist import Groups

    class TpWorld(FakeWorld):
        def get_world_size(self, group=None):
            return 2 if group == "tp" else 4

        def broadcast_object_list(self, box, src=None, group=None, group_src=None):
            if group == "tp" and group_src is None and src is None:  # torch then takes global rank 0, not here
                raise ValueError("global rank 0 is not part of group")
            super().broadcast_object_list(box, src, group, group_src)

        def all_gather_object(self, out, obj, group=None):
            assert group == "tp" and len(out) == 2, (group, len(out))
            out[:] = [self.feed["gather"].pop(0), obj]

    shard = types.SimpleNamespace(index=6)
    feed = {"tp": [shard, True], "gather": [("ValueError: boom", None), (None, "a"), (None, "b")]}
    world = TpWorld(3, 4, 1, feed)
    groups = Groups("mesh", 1, 1, 2, "tp", "world")
    w = runner.Worker(None, None, groups, None, None)
    monkeypatch.setattr(runner, "dist", world)
    assert runner._next_shard(w, None, []) == 6 and w.shard is shard
    assert runner._out_of_space(w) is True
    assert runner._agree(groups, None) == "ValueError: boom"
    assert runner._agree(groups, None, "a") is None
    differ = runner._agree(groups, None, "a")
    assert differ.startswith("RuntimeError: the ranks of a tp group computed different images")


def test_a_failed_batch_of_six_real_rows_names_five_and_says_one_more():
    from launcher.plan.shards import Shard
    from launcher.worker.runner import _rows_of

    batch = types.SimpleNamespace(rows=[{"id": i} for i in "abcdefg"], n_real=6)  # g: padding
    assert _rows_of(Shard(2, (), "fp"), batch) == " (shard 2, rows 'a', 'b', 'c', 'd', 'e' and 1 more)"


# worker room, part run: launcher/worker/{dist,execution,main,pipeline,quality}.py (runner.py: part run (second), above)

model_hub, empty_cache = test_host_functions.model_hub, test_host_functions.empty_cache  # the fake Hub's tiny model


class FakeGroup:
    """A process group as torch.distributed.new_group makes it: its ranks in group-rank order, and its backend."""

    def __init__(self, ranks, backend, sort_ranks):
        from torch.distributed import Backend

        self.ranks = "world" if ranks is None else (sorted(ranks) if sort_ranks else list(ranks))
        self.backend = None if backend is None else str(Backend(backend))


def test_each_tp_group_is_a_gloo_group_led_by_its_first_listed_rank_and_the_world_has_one_too(monkeypatch):
    """launcher/worker/dist.py: every rank creates every tp group (a collective), keeps its own as tp_control, and a
    gloo group of all ranks; a tp group's rank 0 is the first rank its layout row lists (a topology-aware TPU layout
    need not list them in increasing order), the one that claims and writes."""
    import torch.distributed as dist

    from launcher.worker.dist import build_groups

    made = []

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, sort_ranks=True, **kw):
        made.append(FakeGroup(ranks, backend, sort_ranks))
        return made[-1]

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    mesh = types.SimpleNamespace(mesh=torch.tensor([[1, 0], [3, 2]]), get_local_rank={"dp": 1, "tp": 1}.get)
    groups = build_groups(mesh)
    assert [(g.ranks, g.backend) for g in made] == [([1, 0], "gloo"), ([3, 2], "gloo"), ("world", "gloo")]
    assert groups.tp_control is made[1] and groups.world_control is made[2] and groups.mesh is mesh
    assert (groups.dp_rank, groups.tp_rank, groups.tp_size, groups.is_writer) == (1, 1, 2, False)


def test_a_tpu_mesh_takes_topology_aware_mesh_from_torch_tpu_distributed_or_from_torch_tpu(monkeypatch):
    """TorchTPU releases put topology_aware_mesh in torch.tpu.distributed or in torch.tpu itself: either serves."""
    from launcher.worker import dist as mdist

    monkeypatch.setattr(
        torch.distributed.device_mesh, "DeviceMesh", lambda dev, mesh, mesh_dim_names: (dev, mesh.tolist())
    )
    layout = lambda shape: torch.tensor([[1, 0]])  # noqa: E731
    for tpu in (
        types.SimpleNamespace(topology_aware_mesh=layout),  # no torch.tpu.distributed
        types.SimpleNamespace(distributed=types.SimpleNamespace(), topology_aware_mesh=layout),  # one without it
    ):
        monkeypatch.setattr(torch, "tpu", tpu, raising=False)
        assert mdist.ParallelDims(1, 2, 2).build_mesh("tpu") == ("tpu", [[1, 0]])


def test_a_cuda_group_is_bound_to_its_device_and_tpu_without_torch_tpu_or_a_bad_device_is_one_line(
    monkeypatch, tmp_path
):
    """DESIGN: errors name what is wrong. A CUDA process group is created for the rank's own device (device_id), so
    NCCL never guesses it; device=tpu without TorchTPU is refused with the install hint before any group exists."""
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.errors import ConfigError
    from launcher.worker import dist as mdist

    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.append(kw))
    monkeypatch.setattr(mdist, "local_device", lambda device_type: torch.device("cuda", 1))
    assert mdist.init_distributed("cuda", 5) == torch.device("cuda", 1)
    assert seen == [{"backend": "nccl", "timeout": timedelta(seconds=5), "device_id": torch.device("cuda", 1)}]
    monkeypatch.setattr(mdist, "torch_tpu_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"torch_tpu is not installed; on a TPU VM run: pip install"):
        mdist.init_distributed("tpu", 5)
    assert len(seen) == 1
    with pytest.raises(ConfigError, match=r"device='gpu' is not one of auto, tpu, cuda, cpu"):
        mdist.resolve_device("gpu")
    monkeypatch.undo()
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # an installed torch_tpu, found without importing it
    assert mdist.torch_tpu_installed() is True


def test_compile_takes_the_testing_backend_counts_every_compile_and_reads_inductors_cache_hits(monkeypatch):
    """launcher/worker/execution.py: testing.compile_backend replaces the device's backend (the CPU tests' aot_eager);
    the wrapped backend counts each compilation; cache_hits is inductor's fxgraph_cache_hit counter, 0 where none."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from launcher.config import load_config
    from launcher.worker.execution import CompileStats, apply_compile, cache_hits

    looked_up, compiled = [], []
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: looked_up.append(name) or (lambda gm, ex: gm))
    pipe = types.SimpleNamespace(transformer=types.SimpleNamespace(compile=lambda **kw: compiled.append(kw)))
    cfg = load_config("tiny", ["execution.mode=compile", "testing.compile_backend=aot_eager"])
    stats = CompileStats()
    apply_compile(pipe, cfg, "cpu", stats)
    [kw] = compiled
    assert looked_up == ["aot_eager"] and (kw["fullgraph"], kw["dynamic"]) == (True, False)
    assert [kw["backend"]("graph", []) for _ in range(3)] == ["graph"] * 3 and stats.compiles == 3
    saved = {k: dict(v) for k, v in counters.items()}
    try:
        counters.clear()
        assert cache_hits() == 0
        counters["inductor"]["fxgraph_cache_hit"] += 3
        counters["inductor"]["fxgraph_cache_miss"] += 5
        assert cache_hits() == 3
    finally:
        counters.clear()
        for k, v in saved.items():
            counters[k].update(v)


def test_the_torchrun_entry_runs_its_arguments_and_exits_with_the_runs_code(monkeypatch, capsys):
    """`python -m launcher.worker.main conf=NAME ...`: the worker dies with the launcher named in its environment,
    runs its own arguments (conf= first) and exits with run's code; a refusal is one line on stderr, exit 2."""
    import sys

    import launcher.errors
    from launcher.worker import main as wmain

    died, ran, exited = [], [], []
    monkeypatch.setattr(wmain, "die_with_parent", died.append)
    monkeypatch.setattr(wmain, "setup_logging", lambda: None)
    monkeypatch.setattr(wmain, "run", lambda argv: ran.append(argv) or 3)
    monkeypatch.setattr(launcher.errors, "exit_with", exited.append)
    monkeypatch.setenv("MESHGEN_LAUNCHER_PID", "4321")
    monkeypatch.setattr(sys, "argv", ["main.py", "conf=flux2", "mesh.tp=2"])
    wmain.main()
    assert (died, ran, exited) == ([4321], [["conf=flux2", "mesh.tp=2"]], [3])
    monkeypatch.undo()
    assert wmain.run(["conf=tiny", "device=gpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: device='gpu' is not one of auto, tpu, cuda, cpu\n"


def test_a_checkers_preprocessing_is_its_repos_own_else_its_pipelines_else_clips_standard(tmp_path):
    """launcher/worker/quality.py: preprocessor_config.json beside the weights, or a pipeline's feature_extractor/,
    else CLIP's standard preprocessing (transformers' CLIPImageProcessor defaults: shortest edge 224, crop 224)."""
    from transformers import CLIPImageProcessor

    from launcher.worker.quality import _checker_processor

    own, pipeline, bare = tmp_path / "own", tmp_path / "pipeline", tmp_path / "bare"
    CLIPImageProcessor(size={"shortest_edge": 48}, crop_size=48).save_pretrained(own)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(pipeline / "feature_extractor")
    bare.mkdir()
    assert _checker_processor(str(own), CLIPImageProcessor).crop_size == {"height": 48, "width": 48}
    assert _checker_processor(str(pipeline), CLIPImageProcessor).crop_size == {"height": 32, "width": 32}
    image = np.random.default_rng(0).integers(0, 256, (300, 260, 3), dtype=np.uint8)
    got = _checker_processor(str(bare), CLIPImageProcessor)(image, return_tensors="pt").pixel_values
    assert torch.equal(got, CLIPImageProcessor()(image, return_tensors="pt").pixel_values)


def test_the_scorer_runs_its_models_in_the_runs_dtype(quality_models):
    """Both quality models run in model.dtype (the module docstring), their inputs cast to it."""
    from test_quality import PROMPTS, images

    from launcher.config import load_config
    from launcher.worker.quality import load_scorer

    clip, checker = quality_models
    q = [f"quality.clip_model={clip}", f"quality.safety_model={checker}", "quality.batch_size=2"]
    cfg = load_config("tiny", ["quality.clip_score=true", "quality.safety=true", "model.dtype=bfloat16", *q])
    scorer = load_scorer(cfg, "cpu")
    assert scorer.clip.dtype == scorer.checker.dtype == torch.bfloat16
    cols = scorer.columns(images(3), PROMPTS[:3])
    assert len(cols["clip_score"]) == len(cols["nsfw"]) == 3
    assert len(scorer.nsfw(images(2))) == 2  # the checker's own preprocessing, cast too


class Loaded:
    """A component class whose from_pretrained records how it was asked to load."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def from_pretrained(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return f"sharded {self.name}"


@pytest.mark.parametrize(
    "overrides, sharded",
    [
        (["mesh.tp=2", "mesh.dp=3"], {"transformer", "text_encoder"}),
        (["mesh.tp=2", "mesh.dp=3", "model.shard_text_encoder=false"], {"transformer"}),
        (["mesh.tp=2", "mesh.dp=3", "model.shard_transformer=false"], {"text_encoder"}),
        (["mesh.tp=1", "mesh.dp=3"], set()),
    ],
)
def test_at_tp_above_1_each_rank_loads_its_slices_of_what_the_config_shards_and_the_rest_whole(
    overrides, sharded, monkeypatch
):
    """launcher/worker/pipeline.py: at tp > 1 the transformer is read sharded over the mesh's tp axis (diffusers'
    TensorParallelConfig) and the text encoder, where transformers has a plan for its class, with transformers'
    DistributedConfig (tp and dp sizes), each in model.dtype from its subfolder; model.shard_* false keeps that one
    whole; the pipeline is built around the sharded parts, and the heap they freed is given back."""
    import diffusers

    from launcher.config import LoraEntry, load_config
    from launcher.worker import pipeline

    calls, freed, fused = [], [], []
    classes = {"transformer": Loaded("transformer", calls), "text_encoder": Loaded("text_encoder", calls)}
    index = {"transformer": ("diffusers", "T"), "text_encoder": ("transformers", "TE"), "vae": ("diffusers", "V")}
    planned = []
    monkeypatch.setattr(pipeline, "component_classes", lambda path: index)
    monkeypatch.setattr(
        pipeline, "_cls", lambda lib_and_name: classes[{"T": "transformer", "TE": "text_encoder"}[lib_and_name[1]]]
    )
    monkeypatch.setattr(pipeline, "text_encoder_has_tp_plan", lambda path, cls: planned.append((path, cls)) or True)
    monkeypatch.setattr(diffusers, "TensorParallelConfig", lambda mesh: ("tp config", mesh))
    built = lambda *a, **kw: calls.append(("pipe", a, kw)) or "the pipeline"  # noqa: E731
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", built)
    monkeypatch.setattr(pipeline, "place", lambda pipe, cfg, device: None)
    monkeypatch.setattr(pipeline, "release_freed_heap", lambda: freed.append(1))
    import launcher.worker.lora_fuse

    monkeypatch.setattr(launcher.worker.lora_fuse, "fuse_configured", lambda pipe, cfg: fused.append((pipe, cfg)))
    cfg = load_config("tiny", ["model.path=/m", "model.dtype=float16", *overrides])
    cfg.model.loras = [LoraEntry(path="/l.safetensors", scale=0.5)]
    assert pipeline.load_pipeline(cfg, torch.device("cpu"), {"tp": "the tp mesh"}) == "the pipeline"
    want = []
    if "transformer" in sharded:
        parallel = {"parallel_config": ("tp config", "the tp mesh")}
        want.append(("transformer", ("/m",), {"subfolder": "transformer", "dtype": torch.float16, **parallel}))
    if "text_encoder" in sharded:
        dist_config = next(kw.pop("distributed_config") for name, _, kw in calls if name == "text_encoder")
        assert (dist_config.tp_size, dist_config.dp_replicate_size) == (2, 3)
        want.append(("text_encoder", ("/m",), {"subfolder": "text_encoder", "dtype": torch.float16}))
        assert planned == [("/m", classes["text_encoder"])]
    parts = {name: f"sharded {name}" for name in sorted(sharded)}
    assert calls == [*want, ("pipe", ("/m",), {"dtype": torch.float16, **parts})]
    assert fused == [("the pipeline", cfg)] and len(freed) == (1 if sharded else 0)


def test_a_text_encoder_shards_where_its_text_config_or_its_class_has_a_tp_plan():
    """pipeline.py: transformers shards a model by its config's base_model_tp_plan (a composite model's: that of
    its text config, get_text_config()) or its class's _tp_plan; neither: no plan, the encoder is replicated."""
    from launcher.worker.pipeline import text_encoder_has_tp_plan

    def config(plan=None, text=None):  # as transformers' configs: every one has both, None where unset
        c = types.SimpleNamespace(base_model_tp_plan=plan)
        c.get_text_config = lambda: text or c
        return c

    def encoder(cfg, plan=None):
        def from_pretrained(path, subfolder=None):
            assert (path, subfolder) == ("/m", "text_encoder")
            return cfg

        return types.SimpleNamespace(config_class=types.SimpleNamespace(from_pretrained=from_pretrained), _tp_plan=plan)

    colwise = {"layers.*.q_proj": "colwise"}
    assert text_encoder_has_tp_plan("/m", encoder(config(text=config(colwise)))) is True  # composite (Mistral3)
    assert text_encoder_has_tp_plan("/m", encoder(config(colwise))) is True
    assert text_encoder_has_tp_plan("/m", encoder(config(), plan=colwise)) is True
    assert text_encoder_has_tp_plan("/m", encoder(config())) is False


def test_a_pipelines_components_are_read_from_the_hub_by_its_id(tiny_model, model_hub):
    """model.path may be a Hub id: its model_index.json comes through diffusers' loader (the cache, or the Hub),
    not from a folder of that name. The fake Hub of tests/test_host_functions.py serves the tiny pipeline."""
    from launcher.worker.pipeline import component_classes

    index = json.loads((tiny_model / "model_index.json").read_text())
    want = {k: tuple(v) for k, v in index.items() if not k.startswith("_")}
    assert component_classes(test_host_functions.REPO) == want


# worker room, part lora (launcher/worker/lora.py, lora_fuse.py, staged.py, cache.py, residency.py, timing.py)


def test_a_third_text_encoder_counts_as_encoding_and_a_first_call_from_embeddings_as_denoising(monkeypatch):
    """launcher/worker/timing.py: SD3's pipeline has three text encoders (text_encoder_3 its T5): all three are
    encoding time. A timer whose first call comes from embeddings (nothing encoded yet) starts denoising at
    set_timesteps. The timed decode passes the pipeline's keywords on (pipelines call
    `vae.decode(latents, return_dict=False)`)."""
    from launcher.worker import timing

    pipe = pipe_with_stages()
    pipe.text_encoder_3 = torch.nn.Identity()
    pipe.vae = types.SimpleNamespace(decode=lambda latents, return_dict=True: (latents,) if not return_dict else "dict")
    timer = timing.StageTimer(pipe, torch.device("cpu"))
    # a call from embeddings first: set_timesteps at 1, decoding 5 -> 6; then a call that encodes: the encoders
    # 10 -> 11, 11 -> 12 and 12 -> 14 (the third), decoding 20 -> 21
    monkeypatch.setattr(timing, "time", Clock(1, 5, 6, 10, 11, 11, 12, 12, 14, 20, 21))
    pipe.scheduler.set_timesteps(4)
    assert pipe.vae.decode(torch.ones(1), return_dict=False) == (torch.ones(1),)
    pipe.text_encoder(torch.zeros(1, 2))
    pipe.text_encoder_2(torch.zeros(1))
    pipe.text_encoder_3(torch.zeros(1))
    pipe.scheduler.set_timesteps(4)
    pipe.vae.decode(torch.ones(1), return_dict=False)
    assert timer.take() == {"text_encoder": 1 + 1 + 2, "denoise": (5 - 1) + (20 - 14), "vae_decode": 1 + 1}


CACHED = ["execution.cache=taylorseer", "+execution.cache_options.cache_interval=2"]
CACHED += ["+execution.cache_options.disable_cache_before_step=1"]


def _tiny_pipe(tiny_model, cfg):
    from diffusers import Flux2Pipeline

    from launcher.worker.cache import apply_cache

    pipe = Flux2Pipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    apply_cache(pipe, cfg)
    return pipe


def _same_samples(got: list, want: list) -> None:
    assert [s["id"] for s in got] == [s["id"] for s in want]
    for s, w in zip(got, want, strict=True):
        assert s.keys() == w.keys() and s["model"] == w["model"], s["id"]
        assert np.array_equal(s["pixels"], w["pixels"]), s["id"]


def test_an_unstaged_sweep_encodes_each_prompt_once_for_all_its_variants_and_makes_a_plain_calls_images(
    tiny_model, monkeypatch
):
    """launcher/worker/staged.py: with generate.sweep, the variants of one chunk of prompts share its embeddings
    (FLUX.2 declares its encoding): one encoding per chunk, and each variant's images equal bitwise those of a plain
    pipeline call of its batch (jobs/text_to_image.run_batch), with the step cache on, the batch's LoRA scales set
    first, and the warm-up's step count reaching the call."""
    import jobs.text_to_image as job
    from launcher.config import load_config
    from launcher.worker import staged

    sweep = "generate.sweep={guidance_scale:[2.5,4.0]}"
    cfg = load_config("tiny", [f"model.path={tiny_model}", "generate.batch_size=1", sweep, *CACHED])
    pipe = _tiny_pipe(tiny_model, cfg)
    batches = job.make_batches([{"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog"}], cfg.generate)
    assert [(b.chunk, b.variant) for b in batches] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    for b in batches:
        b.lora_scales = (0.5 + b.chunk,)
    encoded, scales, got = [], [], []
    encode = staged._encode
    monkeypatch.setattr(staged, "_encode", lambda *a: encoded.append(a[1].chunk) or encode(*a))
    for i, (b, step) in enumerate(staged.shard_steps(pipe, batches, cfg, set_lora_scales=scales.append)):
        assert b is batches[i]
        got.append(step(num_inference_steps=1) if i == 3 else step())
    assert encoded == [0, 2] and scales == [(0.5,), (0.5,), (2.5,), (2.5,)]
    for i, b in enumerate(batches):
        _same_samples(got[i], job.run_batch(pipe, b, cfg, num_inference_steps=1 if i == 3 else None))
    assert got[0][0]["model"] == str(tiny_model)


def test_staged_with_a_step_cache_makes_a_plain_calls_images_and_parks_nothing_unless_asked(tiny_model):
    """launcher/worker/staged.py: staged steps (encode all, denoise all, decode all) make bitwise the images of a
    plain call per batch also with the step cache on (its state reset after each call, as a pipeline call's end
    resets it), each denoise step setting its batch's LoRA scales and taking the warm-up's step count; with
    execution.release_text_encoder=false no model leaves the chip."""
    import jobs.text_to_image as job
    from launcher.config import load_config
    from launcher.worker import staged

    args = [f"model.path={tiny_model}", "generate.batch_size=1", "execution.staged=true", *CACHED]
    cfg = load_config("tiny", [*args, "execution.release_text_encoder=false"])
    pipe = _tiny_pipe(tiny_model, cfg)
    full = {m: sum(p.numel() for p in getattr(pipe, m).parameters()) for m in ("text_encoder", "transformer")}
    batches = job.make_batches([{"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog"}], cfg.generate)
    for b in batches:
        b.lora_scales = (0.5 + b.chunk,)
    scales, got, kinds = [], [], []
    steps = staged.shard_steps(pipe, batches, cfg, set_lora_scales=scales.append)
    for b, step in steps:
        kinds.append(step.__name__)
        got += step(num_inference_steps=1) if step.__name__ == "denoise" and b is batches[1] else step()
        assert {m: sum(p.numel() for p in getattr(pipe, m).parameters()) for m in full} == full
    steps.close()
    assert kinds == ["encode", "encode", "denoise", "denoise", "decode", "decode"]
    assert scales == [(0.5,), (1.5,)] * 2
    want = job.run_batch(pipe, batches[0], cfg) + job.run_batch(pipe, batches[1], cfg, num_inference_steps=1)
    _same_samples(got, want)


def test_factors_read_the_older_key_layouts_diffusers_reads(loras, tmp_path):
    """launcher/worker/lora.py: layouts of LoRA files diffusers' loaders take, each read whole, every module's
    factors the file's own: CLIP text-encoder keys under `text_model.` (transformers 4's CLIPTextModel, which
    transformers 5 flattened) with transformer keys in diffusers' old `lora.down` / `lora.up` naming (FLUX.1), and
    kohya-style `alpha` keys beside PEFT's (FLUX.2, whose loader keeps them in the state dict)."""
    from safetensors.torch import load_file, save_file

    from launcher.worker.lora import factors

    def read(family: str, rename, extra=None) -> tuple[dict, dict]:
        model, files = loras(family)
        sd = {k: v for k, v in load_file(str(files[0])).items() if not k.endswith(".alpha")}
        path = tmp_path / f"{family}.safetensors"
        save_file({rename(k): v for k, v in sd.items()} | (extra or {}), str(path))
        return factors(_pipeline_class(model), path, str(model)), sd

    def older(key: str) -> str:
        if key.startswith("text_encoder."):
            return key.replace("text_encoder.", "text_encoder.text_model.", 1)
        return key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.")

    alphas = {f"{c}.{n}.alpha": torch.tensor(4.0) for c, names in FAMILY["flux2"][2].items() for n in names}
    for family, got, sd in (("flux1", *read("flux1", older)), ("flux2", *read("flux2", str, alphas))):
        modules = FAMILY[family][2]
        assert {c: sorted(m) for c, m in got.items()} == {c: sorted(names) for c, names in modules.items()}, family
        for comp, names in modules.items():
            for n in names:
                assert torch.equal(got[comp][n].A, sd[f"{comp}.{n}.lora_A.weight"]), (family, n)
                assert torch.equal(got[comp][n].B, sd[f"{comp}.{n}.lora_B.weight"]), (family, n)


def test_factors_refuse_a_file_they_cannot_read_whole_naming_what_is_wrong(loras, tmp_path):
    """launcher/worker/lora.py: what diffusers cannot load is one LoraError in the library's first words; a module
    with one factor only (in either component), a lora_B bias, keys of two components none of which matches (one
    the pipeline lacks) and keys of no component are refused, never fused in part; unmatched keys are listed up to
    five."""
    from safetensors.torch import load_file

    from launcher.worker.lora import loader_class

    model, files = loras("flux2")
    sd = {k: v for k, v in load_file(str(files[0])).items()}

    def refusal(state: dict) -> str:
        return _lora_refusal(model, tmp_path, state)

    key = "transformer.transformer_blocks.0.attn.to_q"
    assert refusal(sd | {f"{key}.lora_A.weight": sd[f"{key}.lora_A.weight"].to(torch.int64)}) == (
        "diffusers cannot read its transformer keys (Error(s) in loading state_dict for Flux2Transformer2DModel:)"
    )
    for component in ("transformer", "text_encoder"):
        b = next(k for k in sd if k.startswith(f"{component}.") and k.endswith(".lora_B.weight"))
        why = refusal({k: v for k, v in sd.items() if k != b})
        assert why == f"no factors were read for {b.removesuffix('.lora_B.weight')}", why
    bias = sd | {f"{key}.lora_B.bias": torch.zeros(sd[f"{key}.lora_B.weight"].shape[0])}
    assert refusal(bias).endswith(" is not a plain LoRA on a linear layer (DoRA, lora bias or another layer)")
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    pair = (("A", a), ("B", b))
    nowhere = {f"{c}.nothing_here.lora_{x}.weight": t for c in ("transformer", "unet") for x, t in pair}
    nowhere = {k: v.clone() for k, v in nowhere.items()}  # safetensors saves no shared tensor
    assert refusal(nowhere) == (
        "none of its keys matches a module of the model (components it names: transformer, unet)"
    )
    assert (
        refusal({"weights": a.clone()}) == "none of its keys matches a module of the model (components it names: none)"
    )
    # text-encoder keys that name no layer (a LoRA made for a deeper model): diffusers' loader finds no rank and
    # raised an IndexError (a traceback at preflight); they are refused as unmatched, the transformer's judged too
    ghost = "text_encoder.model.language_model.layers.9.self_attn.q_proj"  # the tiny encoder has 2 layers
    transformer = {k: v for k, v in sd.items() if k.startswith("transformer.")}
    real = "text_encoder.model.language_model.layers.0.self_attn.q_proj"
    ghosts = {f"{ghost}.lora_{x}.weight": sd[f"{real}.lora_{x}.weight"].clone() for x in ("A", "B")}
    why = refusal(transformer | ghosts)
    assert why.startswith(f"2 of its {len(transformer) + 2} keys match no layer of the model ({ghost}.lora_A"), why
    assert loader_class("NoSuchPipeline") is None  # a custom pipeline's class, which diffusers lacks: no loader
    for n, listed in ((5, "{}"), (6, "{}, ...")):
        extra = {f"transformer.nothing_{i}.lora_A.weight": a.clone() for i in range(n)}
        names = ", ".join(f"transformer.nothing_{i}.lora_A.weight" for i in range(5))
        assert refusal(sd | extra) == (
            f"{n} of its {len(sd) + n} keys match no layer of the model ({listed.format(names)}); a misspelt prefix "
            "fuses the LoRA only in part"
        )


def test_staged_latents_gone_bad_in_the_transformer_name_it_not_the_vae(tiny_model):
    """launcher/worker/staged.py: staged, the family's decode_latents decodes (FLUX.2), so the latents are at hand
    and checked before the VAE: a transformer that gives NaN is named as the model that went bad."""
    import jobs.text_to_image as job
    from launcher.config import load_config
    from launcher.worker import staged

    cfg = load_config("tiny", [f"model.path={tiny_model}", "generate.batch_size=1", "execution.staged=true"])
    pipe = _tiny_pipe(tiny_model, cfg)
    pipe.transformer.register_forward_hook(lambda m, i, out: (torch.full_like(out[0], float("nan")), *out[1:]))
    steps = staged.shard_steps(pipe, job.make_batches([{"id": "a", "prompt": "a cat"}], cfg.generate), cfg)
    with pytest.raises(job.NonFiniteOutput, match=r"^the transformer gave non-finite values"):
        for _, step in steps:
            step()
    steps.close()


def test_a_lora_on_a_sharded_text_encoder_whose_plan_packs_layers_is_refused():
    """launcher/worker/lora_fuse.py: at tp > 1 (the mesh read from a weight's device_mesh), a transformers text
    encoder whose tensor-parallel plan packs layers is refused rather than cut evenly; at tp=1 nothing is cut."""
    from launcher.worker import lora_fuse

    class Encoder(torch.nn.Module):  # a transformers model: a class plan, no load_lora_adapter
        _tp_plan = {"layers.*.gate_up_proj": "packed_colwise"}

        def __init__(self, chips: int):
            super().__init__()
            self.tp_plan = dict(self._tp_plan)
            self.gate_up_proj = torch.nn.Linear(2, 4)
            self.gate_up_proj.weight.device_mesh = types.SimpleNamespace(size=lambda: chips)

    with pytest.raises(ValueError, match=r"^the text encoder's tensor-parallel plan packs layers.\*.gate_up_proj: "):
        lora_fuse._packed_slices(Encoder(2))
    assert lora_fuse._packed_slices(Encoder(1)) == {}


def test_a_loras_non_finite_values_are_counted_in_its_float_tensors_only(tmp_path):
    """launcher/worker/lora.py non_finite: (the first tensor with NaN or inf, its count, the file's count); integer
    tensors (a step counter some trainers save) hold no such values."""
    from safetensors.torch import save_file

    from launcher.worker.lora import non_finite

    clean = {"a.lora_A.weight": torch.ones(2, 3), "step": torch.tensor([7, 8], dtype=torch.int64)}
    save_file(clean, str(tmp_path / "clean.safetensors"))
    assert non_finite(tmp_path / "clean.safetensors") is None
    bad = clean | {"b.lora_B.weight": torch.tensor([[float("nan"), float("inf")], [0.0, 1.0]])}
    bad["c.lora_A.weight"] = torch.tensor([float("-inf")])
    save_file(bad, str(tmp_path / "bad.safetensors"))
    assert non_finite(tmp_path / "bad.safetensors") == ("b.lora_B.weight", 2, 3)


# worker room, part lora (second)


def _sweep_batches():
    """Two chunks of prompts, each denoised at two variants (launcher/plan/sweep.py's order: a chunk's variants
    follow it); chunk 1's second variant sweeps a LoRA scale, so its embeddings are its own."""
    from jobs.text_to_image import Batch

    two, one = (
        [{"id": "0", "prompt": "a red fox"}, {"id": "1", "prompt": "a blue cat"}],
        [{"id": "2", "prompt": "an owl"}],
    )
    return [
        Batch(two, 2, (32, 32, 2, 2.5), [5, 6], chunk=0, variant=0, lora_scales=(0.5,)),
        Batch(two, 2, (32, 32, 3, 4.0), [5, 6], chunk=0, variant=1, lora_scales=(0.5,)),
        Batch(one * 2, 1, (32, 32, 2, 2.5), [7, 7], chunk=1, variant=0, lora_scales=(1.0,)),
        Batch(one * 2, 1, (32, 32, 2, 2.5), [7, 7], chunk=1, variant=1, lora_scales=(0.25,)),
    ]


@pytest.mark.parametrize("staged", [False, True])
def test_staged_and_swept_steps_make_each_batchs_own_images_encoding_each_chunk_once(staged, tiny_model):
    """launcher/worker/staged.py: a sweep's batches of one chunk (and LoRA scales) share its embeddings, staged or
    not, and "the images equal the unstaged ones": each batch's samples are exactly those of its own pipeline call
    (the job's run_batch), also for the compile warm-up's step count. The text encoder runs once per chunk and
    scales; each call is preceded by its batch's LoRA scales. Staged, the transformer is parked while the text
    encoder encodes and the text encoder while the transformer denoises (and stays parked after the shard); within
    the shard a call's end only resets the step cache's state."""
    from diffusers import DiffusionPipeline

    import jobs.text_to_image as job
    from launcher.config import load_config
    from launcher.worker import staged as module
    from launcher.worker.residency import resident_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs (bitwise equal images)
    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    cfg = load_config("tiny", [f"model.path={tiny_model}", f"execution.staged={str(staged).lower()}"])
    warm = 1  # batch 1 is run as the warm-up runs it, with one step
    want = [job.run_batch(pipe, b, cfg, warm if i == 1 else None) for i, b in enumerate(_sweep_batches())]
    encoded, scales, resets, where = [], [], [], []
    pipe.text_encoder.register_forward_hook(lambda *a: encoded.append(1))
    pipe.transformer._reset_stateful_cache = lambda: resets.append(1)
    try:
        got = []
        for b, step in module.shard_steps(pipe, _sweep_batches(), cfg, job, scales.append):
            warm_up = b is not None and b.variant == 1 and b.chunk == 0
            got += step(num_inference_steps=warm) if warm_up else step()
            where.append((resident_bytes(pipe.text_encoder) > 0, resident_bytes(pipe.transformer) > 0))
    finally:
        swap = module._SWAPS.pop(id(pipe), None)
        if swap is not None and swap.parked is not None:
            from launcher.worker.residency import unpark

            unpark(swap.parked)
        torch.set_num_threads(threads)
    assert [s["id"] for s in got] == [s["id"] for w in want for s in w]
    for ours, theirs in zip(got, [s for w in want for s in w], strict=True):
        assert ours["model"] == str(tiny_model) == theirs["model"], ours["id"]
        assert np.array_equal(ours["pixels"], theirs["pixels"]), ours["id"]
    assert len(encoded) == 3
    if not staged:
        assert scales == [(0.5,), (0.5,), (1.0,), (0.25,)] and where == [(True, True)] * 4
        return
    assert scales == [(0.5,), (1.0,), (0.25,)] + [(0.5,), (0.5,), (1.0,), (0.25,)]
    assert where == [(True, False)] * 3 + [(False, True)] * 8  # 3 encodes, 4 denoise steps, 4 decodes
    assert len(resets) == 4


class _Transformer(torch.nn.Linear):
    is_cache_enabled = True  # a step cache on: FLUX.2's calls run in its "cond" cache context

    def __init__(self, log):
        super().__init__(2, 2)
        self.log = log

    def cache_context(self, name):
        import contextlib

        @contextlib.contextmanager
        def inside():
            self.log.append(f"enter {name}")
            yield
            self.log.append(f"exit {name}")

        return inside()


class _Embeds:
    """An embedding tensor that says where it is sent."""

    def __init__(self, log):
        self.log = log

    def to(self, device):
        self.log.append(f"to {device}")
        return self


class Flux2Pipeline:
    """Named as diffusers' FLUX.2 pipeline (the name finds the family: its own encoding, its cache context), with
    an execution device that is not this CPU; it logs what each call is given."""

    def __init__(self):
        self.log, self.freed = [], []
        self.text_encoder, self.transformer = torch.nn.Linear(2, 2), _Transformer(self.log)
        self._execution_device = torch.device("meta")
        self.components = {"transformer": self.transformer}

    def encode_prompt(self, prompt, device, max_sequence_length=512):
        self.log.append(f"encode {prompt} on {device}")
        return _Embeds(self.log), None

    def maybe_free_model_hooks(self):
        self.freed.append(1)

    def __call__(self, prompt=None, negative_prompt=None, prompt_embeds=None, height=None, width=None,
                 num_inference_steps=None, guidance_scale=None, generator=None, max_sequence_length=None,
                 output_type="pil"):  # fmt: skip
        args = {k: v for k, v in locals().items() if k not in ("self", "generator") and v is not None}
        self.log.append({k: (v if k != "prompt_embeds" else "embeds") for k, v in args.items()})
        return types.SimpleNamespace(images="latents")


@pytest.mark.parametrize("offload", [False, True])
def test_a_staged_call_gets_the_embeddings_on_the_chip_in_the_cache_context_and_offload_frees_at_the_end(offload):
    """launcher/worker/staged.py: embeddings wait in host memory between the stages and go to the pipeline's
    execution device for its call, which gets them instead of the prompts (negative ones too), the warm-up's step
    count, latents as its output (FLUX.2 decodes them itself later), inside the family's step-cache context. With
    execution.offload=model nothing is parked (accelerate moves the models) and the pipeline's own "free the
    models" runs once, at the shard's end (closing the steps early, as a stop does)."""
    import jobs.text_to_image as job
    from jobs.text_to_image import Batch
    from launcher.config import load_config
    from launcher.worker import staged as module
    from launcher.worker.residency import resident_bytes

    cfg = load_config("tiny", ["execution.staged=true", f"execution.offload={'model' if offload else 'none'}"])
    rows = [{"id": "0", "prompt": "a fox", "negative_prompt": "blur"}]
    # Another pipeline in this process (tools/bench/speed.py loads two) keeps its own parked model.
    other = Flux2Pipeline()
    first = module.shard_steps(other, [Batch(rows, 1, (32, 32, 4, 2.5), [5])], cfg, job)
    next(first)[1]()
    first.close()
    pipe = Flux2Pipeline()
    steps = module.shard_steps(pipe, [Batch(rows, 1, (32, 32, 4, 2.5), [5])], cfg, job)
    try:
        (none, encode), (batch, denoise) = next(steps), next(steps)
        assert none is None and encode() == [] and batch is not None
        resident = (resident_bytes(pipe.text_encoder) > 0, resident_bytes(pipe.transformer) > 0)
        assert denoise(num_inference_steps=1) == [] and pipe.freed == []
        call = {"prompt_embeds": "embeds", "height": 32, "width": 32}
        call.update(num_inference_steps=1, guidance_scale=2.5, max_sequence_length=256, output_type="latent")
        assert pipe.log == ["encode ['a fox'] on meta", "to cpu", "to meta", "enter cond", call, "exit cond"]
    finally:
        steps.close()
        swap = module._SWAPS.pop(id(pipe), None)
        module._SWAPS.pop(id(other), None)
    assert pipe.freed == ([1] if offload else []) and other.freed == pipe.freed
    assert resident_bytes(other.transformer) == (0 if not offload else 24)  # 2 x 2 weights and 2 biases, float32
    assert resident == (True, True) if offload else resident == (False, True)
    assert (swap is None) == offload


def test_the_configured_loras_are_fused_at_their_scales_as_diffusers_fuses_them(loras):
    """launcher/worker/lora_fuse.py fuse_configured: the load fuses `model.loras`, each file at its own scale, and
    hands back what it fused (each LoRA's factors with its scale), for a later move to other scales. Every weight
    then equals diffusers' load_lora_weights + fuse_lora of the same files and scales (tests/test_lora.py's)."""
    from diffusers import DiffusionPipeline
    from test_lora import lora_override

    from launcher.config import load_config
    from launcher.worker.lora_fuse import fuse_configured

    model, files = loras("flux2")
    cfg = load_config("tiny", [f"model.path={model}", lora_override(files)])
    ours = DiffusionPipeline.from_pretrained(model)
    fused = fuse_configured(ours, cfg)
    assert [scale for _, scale in fused] == list(SCALES)
    modules = FAMILY["flux2"][2]
    assert all({c: sorted(m) for c, m in f.items()} == {c: sorted(n) for c, n in modules.items()} for f, _ in fused)
    ref = diffusers_fused(model, files)
    for part in ("transformer", "text_encoder"):
        a, b = getattr(ours, part).state_dict(), getattr(ref, part).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), part


def test_an_unstaged_unswept_batch_is_one_call_of_the_jobs_run_batch():
    """launcher/worker/staged.py: unstaged and with no sweep, each step is the job's own call of its batch (with the
    warm-up's step count), whatever the family declares about its encoding; no LoRA scales are set."""
    from jobs.text_to_image import Batch
    from launcher.config import load_config
    from launcher.worker.staged import shard_steps

    def run_batch(pipe, b, cfg, num_inference_steps=None):
        return [(b.chunk, num_inference_steps)]

    pipe, rows = Flux2Pipeline(), [{"id": "0", "prompt": "a fox"}]
    batches = [Batch(rows, 1, (32, 32, 4, 2.5), [5], chunk=c) for c in (0, 1)]
    scales, job = [], types.SimpleNamespace(run_batch=run_batch)
    got = [
        (b, step(num_inference_steps=2))
        for b, step in shard_steps(pipe, batches, load_config("tiny"), job, scales.append)
    ]
    assert got == [(batches[0], [(0, 2)]), (batches[1], [(1, 2)])] and scales == [None, None] and pipe.log == []


def _lora_refusal(model, tmp_path, state: dict) -> str:
    """The one line factors() refuses a LoRA file holding `state` with, for the tiny `model`."""
    from safetensors.torch import save_file

    from launcher.worker.lora import LoraError, factors

    path = tmp_path / "l.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError) as e:
        factors(_pipeline_class(model), path, str(model))
    return str(e.value)
