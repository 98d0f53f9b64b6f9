"""Fast tests of a worker's own functions (launcher/worker/), in this process, no launch and no model: where a
batch's time goes, and weights moved off the chip and back. Expected values are worked out here from the module's
docstring, never from the product's functions. These are the worker room's tests under `make mutants`."""

from __future__ import annotations

import inspect
import types

import pytest
import torch


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
    from launcher.worker.columns import carry_kept
    from launcher.worker.writer import KEPT_FIELDS

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

    from launcher.worker.encode import Encoding, encode

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
    from launcher.worker.encode import Encoding, default_library

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
    """launcher/worker/writer_process.py in this process: a batch's images encoded as output.format says (their
    pixels handed over, not kept), added to the shard's files, which appear only at `_finish`."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from launcher.ledger.store import Store
    from launcher.worker import writer_process as wp

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
