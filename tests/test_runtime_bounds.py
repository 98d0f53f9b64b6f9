"""Issue 34, the runtime half: a failure that will recur is said to recur (run.max_attempts), a worker holds a batch
or two of images, never a shard's, decompression and an unreachable store are bounded in memory and time, the
memory plan bounds a shard's and a call's images, and edit references keep their aspect ratio and their range."""

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import weakref
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
from conftest import launch
from PIL import Image

from launcher.config import load_config
from launcher.ledger.store import Store


# -- run.max_attempts: three cheap launches (1 process each) and one that starts no worker
def test_a_shard_that_fails_alike_max_attempts_times_is_not_retried_until_run_shards_failed(tiny_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(4)))
    out = tmp_path / "out"
    args = [
        f"model.path={tiny_model}",
        f"output.dir={out}",
        f"dataset.path={prompts}",
        "mesh.tp=1",
        "run.shard_size=2",
        "generate.batch_size=1",
        "generate.num_inference_steps=1",
        "run.max_attempts=2",
    ]
    state = out / "state" / "shard-00001.json"
    for attempt in (1, 2):
        res = launch(*args, "testing.fail_shards=[1]")
        assert res.returncode == 3, res.stderr[-2000:]
        st = json.loads(state.read_text())
        assert (st["status"], st["error_class"], st["attempts"]) == ("failed", "InjectedFailure", attempt)
        # ids are the row numbers: shard 1 holds rows 2 and 3; the first batch (row 2) failed, and says so
        assert st["samples"] == ["2"] and "rows '2'" in st["error"], st["error"]
    finished = st["finished_at"]
    dry = launch("--dry-run", *args)
    assert dry.returncode == 0 and "# not retried: shards [1] failed run.max_attempts times" in dry.stdout, dry.stdout
    res = launch(*args, "testing.fail_shards=[1]")  # the same command: shard 1 failed twice alike
    assert res.returncode == 3, res.stderr[-2000:]
    assert json.loads(state.read_text())["finished_at"] == finished  # not retried
    line = next(x for x in res.stderr.splitlines() if "not retried" in x)
    assert "shards [1] failed 2 times" in line and "InjectedFailure" in line and "run.shards=failed" in line, line
    assert json.loads(next((out / "runs").glob("*.json")).read_text()) is not None
    res = launch(*args, "run.shards=failed")  # the row fixed (no injected failure): retried
    assert res.returncode == 0, res.stderr[-2000:]
    st = json.loads(state.read_text())
    assert st["status"] == "done" and st["attempts"] == 3  # three attempts to get it done
    assert pq.read_table(out / "data" / "shard-00001.parquet").column("id").to_pylist() == ["2", "3"]


def test_max_attempts_defaults_to_3_and_a_different_error_starts_the_count_again():
    from launcher.ledger.states import attempts_of, exhausted

    assert load_config("tiny").run.max_attempts == 3
    failed = {"status": "failed", "error_class": "NonFiniteOutput", "attempts": 2}
    assert attempts_of(failed, {"status": "failed", "error_class": "NonFiniteOutput"}) == 3
    assert attempts_of(failed, {"status": "failed", "error_class": "OSError"}) == 1
    states = {0: {**failed, "attempts": 3}, 1: failed}
    assert exhausted(states, {0: "failed", 1: "failed"}, 3) == [0]


# -- a worker hands each batch to the writer as it is made
def test_the_runner_holds_at_most_two_batches_of_images(tmp_path, monkeypatch):
    from launcher.plan.shards import Shard
    from launcher.worker import runner
    from launcher.worker.execution import CompileStats

    cfg = load_config("tiny", ["generate.batch_size=2"])
    alive: list[weakref.ref] = []
    peak = [0]

    def held() -> int:
        return sum(r() is not None for r in alive)

    def fake_steps(pipe, batches, cfg, job, set_lora_scales=None):
        for b in batches:

            def step(b=b, **_):
                peak[0] = max(peak[0], held())  # what the runner still holds when the next batch is made
                out = []
                for sid in b.image_ids():
                    px = np.zeros((64, 64, 3), np.uint8)
                    alive.append(weakref.ref(px))
                    out.append({"id": sid, "prompt": "p", "seed": 0, "pixels": px})
                return out

            yield b, step

    class Writer:
        added, jobs = 0, []

        def add(self, index, name, samples):
            self.added += len(samples)
            return 0.0  # written at once: it keeps none of them

        def submit(self, job):
            peak[0] = max(peak[0], held())
            self.jobs.append(job)

    monkeypatch.setattr(runner, "shard_steps", fake_steps)
    rows = tuple({"id": str(i), "prompt": f"p {i}"} for i in range(16))  # 8 batches of 2
    w = runner.Worker(
        cfg,
        object(),
        SimpleNamespace(is_writer=True, tp_size=1, tp_rank=0),
        SimpleNamespace(take=dict, add=lambda s: None),
        Writer(),
        Store(tmp_path),
        "run",
        claims=SimpleNamespace(attempt=lambda i: "a"),
        compile_stats=CompileStats(),
    )
    assert runner.run_shard(w, Shard(0, rows, "fp"))
    assert peak[0] <= 2 * 2, f"the runner held {peak[0]} images at once; a batch is 2"
    assert w.writer.added == 16 and w.writer.jobs[0].state["status"] == "done"


def _samples(ids: list[str], seed: int, first: int | None = None) -> list[dict]:
    """Samples of `ids`; `first`: the shard position of the first (the next ones follow it)."""
    rng = np.random.default_rng(seed)
    return [
        {"id": i, "prompt": "p", "seed": 0, "height": 16, "width": 24}
        | {"pixels": rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)}
        | ({} if first is None else {"_pos": first + k})
        for k, i in enumerate(ids)
    ]


def test_the_writer_streams_batches_into_row_groups_and_commits_at_the_end(tmp_path):
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    out = load_config(
        "tiny",
        ["output.row_group_size=3", "output.queue_shards=1", "output.webdataset=true", "output.image_files=true"],
    ).output
    recorded = threading.Event()
    writer = BackgroundWriter(Store(tmp_path), out, 1, on_recorded=lambda i: recorded.set())
    ids = [f"s{k}" for k in range(10)]
    for b in (2, 0, 1, 4, 3):  # 5 batches of 2, made shape bucket by shape bucket: not in the rows' order
        writer.add(0, "shard-00000", _samples(ids[2 * b : 2 * b + 2], b, 2 * b))
    writer.add(1, "shard-00001", _samples(["x0", "x1"], 9))  # a shard that then fails: nothing of it stays
    writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": 10, "seconds": 0.1}))
    writer.submit(ShardJob(1, "shard-00001", [], {"status": "failed", "error": "E: x", "error_class": "E"}))
    writer.close()
    # queue_shards=1: one batch being written, one waiting in the queue, one waiting for room (batches of 2)
    assert writer.peak_images <= 3 * 2
    table = pq.ParquetFile(tmp_path / "data" / "shard-00000.parquet")
    assert table.read().column("id").to_pylist() == ids  # in the rows' order
    with tarfile.open(tmp_path / "webdataset" / "shard-00000.tar") as tar:
        assert tar.getnames() == [f"{i}.{ext}" for i in ids for ext in ("png", "json")]
    assert [table.metadata.row_group(g).num_rows for g in range(table.metadata.num_row_groups)] == [3, 3, 3, 1]
    state = json.loads((tmp_path / "state" / "shard-00000.json").read_text())
    import hashlib

    for rel, (size, sha) in state["files"].items():
        data = (tmp_path / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha), rel
    assert len([r for r in state["files"] if r.startswith("images/")]) == 10
    assert json.loads((tmp_path / "state" / "shard-00001.json").read_text())["status"] == "failed"
    assert not (tmp_path / "data" / "shard-00001.parquet").exists()
    assert not (tmp_path / "images" / "shard-00001").exists()
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


# -- decompression of our own index is bounded
def _gzip_bomb(path: Path, inflated: int) -> None:
    """A one-member gzip file of `inflated` zero bytes, made without holding them: after a full flush the
    compressor starts afresh, so the compressed form of each further 64 MiB of zeros is the same bytes."""
    chunk = bytes(64 * 2**20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: the gzip header and trailer are written here
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH))
        block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
        crc = zlib.crc32(chunk)
        for _ in range(inflated // len(chunk) - 1):
            f.write(block)
            crc = zlib.crc32(chunk, crc)
        f.write(c.flush() + crc.to_bytes(4, "little") + (inflated % 2**32).to_bytes(4, "little"))


# The peak of this process's own memory (VmHWM), not ru_maxrss: Linux carries a parent's peak across fork and
# exec into the child's ru_maxrss, and a pytest worker that has loaded models is past 1 GB itself.
BOMB_READER = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from launcher.ledger.states import Ledger
from launcher.ledger.store import Store
states = Ledger(Store(sys.argv[1])).refresh()
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps({"states": sorted(states), "maxrss_mb": hwm // 1024}))
"""


def test_a_gzip_bomb_as_the_index_is_damaged_not_inflated(tmp_path):
    (tmp_path / "state").mkdir()
    _gzip_bomb(tmp_path / "state" / "index.json.gz", 4 * 2**30)
    assert (tmp_path / "state" / "index.json.gz").stat().st_size < 8 * 2**20  # ~4 MB inflating to 4 GiB
    (tmp_path / "state" / "shard-00000.json").write_text(json.dumps({"status": "done", "rows": 1}))
    res = subprocess.run(
        [sys.executable, "-c", BOMB_READER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    found = json.loads(res.stdout)
    assert found["states"] == [0]  # read from the state file instead
    assert found["maxrss_mb"] < 1024, found  # the old reader inflated all 4 GiB
    assert res.stderr.count("is damaged") == 1 and "inflates past" in res.stderr, res.stderr


def test_a_sound_index_is_still_read(tmp_path):
    from launcher.ledger.states import INDEX, Ledger

    store = Store(tmp_path)
    store.write_json("state/shard-00000.json", {"status": "done", "rows": 1})
    ledger = Ledger(store)
    ledger.refresh()
    ledger.save_index()
    assert json.loads(gzip.decompress((tmp_path / INDEX).read_bytes()))["states"]["0"][1]["rows"] == 1
    again = Ledger(store)
    again.refresh()
    assert again.states == {0: {"status": "done", "rows": 1}} and again.reads == 0  # from the index


# -- an unreachable store is exit 2 within 30 s
def test_an_s3_endpoint_that_never_answers_is_exit_2_within_30_s(silent_s3, tiny_model, launcher_main, capsys):
    t0 = time.monotonic()
    code = launcher_main([f"model.path={tiny_model}", "output.dir=s3://meshgen-test/out", "mesh.tp=1"])
    took = time.monotonic() - t0
    assert code == 2, capsys.readouterr().err[-2000:]
    assert took <= 30, f"{took:.1f} s"


# -- the memory plan bounds a shard's and a call's images; the dry run counts every variant
def test_images_per_shard_and_sweep_variants_are_bounded_at_planning(tiny_model, launcher_main, tmp_path, capsys):
    base = ["--dry-run", f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}", "mesh.tp=1"]
    big = ["generate.images_per_prompt=10000", "generate.height=1024", "generate.width=1024"]
    assert launcher_main([*base, *big]) == 2
    err = capsys.readouterr().err
    # 8 prompts a shard (conf tiny) x 10000 images, 1024x1024 PNG at ~1.8 bytes a pixel: ~150 GB
    assert "one shard would hold 80000 images" in err and "GiB bound of one shard" in err, err[-1500:]
    steps = ",".join(str(i) for i in range(1, 1001))
    scales = ",".join(f"{i / 10:.1f}" for i in range(1000))
    assert launcher_main([*base, f"generate.sweep={{guidance_scale:[{scales}],num_inference_steps:[{steps}]}}"]) == 2
    err = capsys.readouterr().err
    assert "x 1000000 sweep variants" in err, err[-1500:]
    call = ["generate.images_per_prompt=2000", "run.shard_size=1", "generate.height=1024", "generate.width=1024"]
    assert launcher_main([*base, *call, "generate.batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "one pipeline call makes 8000 images" in err or "does not fit" in err, err[-1500:]


def test_the_dry_run_counts_each_sweep_variant(tiny_model, launcher_main, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(5)))
    args = ["--dry-run", f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}", f"dataset.path={prompts}"]
    assert launcher_main([*args, "generate.sweep={guidance_scale:[2.5,4.0]}", "generate.images_per_prompt=3"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("# plan:"))
    assert "(5 prompts, 30 images)" in line, line  # 5 prompts x 3 images x 2 variants


# -- edit references: aspect ratio and full range
def _reference_96x32() -> Image.Image:
    """Thirds: red, green, blue (left to right)."""
    px = np.zeros((32, 96, 3), np.uint8)
    px[:, :32, 0] = px[:, 32:64, 1] = px[:, 64:, 2] = 255
    return Image.fromarray(px)


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _references(data: bytes, fit: str, h: int = 64, w: int = 64) -> np.ndarray:
    from jobs.edit import EditBatch

    batch = EditBatch([{"id": "a", "prompt": "p"}], 1, (h, w, 4, 4.0), [0], data=[data], fit=fit)
    return np.asarray(batch.references()[0])


def test_reference_fit_crop_pad_stretch_on_a_96x32_reference():
    ref = _reference_96x32()
    lanczos = Image.Resampling.LANCZOS
    # crop: resized to cover 64x64 (192x64, the aspect ratio kept), the middle 64 columns cut out
    crop = np.asarray(ref.resize((192, 64), lanczos).crop((64, 0, 128, 64)))
    # pad: resized to fit inside (64x21), centered on black: 21 rows of black above, 22 below
    pad = Image.new("RGB", (64, 64))
    pad.paste(ref.resize((64, 21), lanczos), (0, 21))
    stretch = np.asarray(ref.resize((64, 64), lanczos))
    got = {fit: _references(_png(ref), fit) for fit in ("crop", "pad", "stretch")}
    assert np.array_equal(got["crop"], crop) and np.array_equal(got["pad"], np.asarray(pad))
    assert np.array_equal(got["stretch"], stretch)
    assert (got["crop"][:, 8:56] == [0, 255, 0]).all()  # the green middle third, not squashed thirds
    assert not got["pad"][:21].any() and not got["pad"][43:].any()


def test_reference_fit_is_fingerprinted_for_edit_only_and_only_off_its_default():
    from launcher.plan.shards import settings

    def fit_of(*overrides):
        cfg = load_config("tiny", list(overrides))
        return settings(cfg).get("generate", {}).get("reference_fit")

    assert fit_of("generate.reference_fit=pad") is None  # text to image: no references
    # older edit runs stretched: at that value the key is left out and their fingerprint holds; the new default
    # (crop) is another image, so it is fingerprinted and a resumed older folder is refused, never mixed
    assert fit_of("job=edit", "generate.reference_fit=stretch") is None
    assert fit_of("job=edit") == "crop"
    assert fit_of("job=edit", "generate.reference_fit=pad") == "pad"


def test_a_16_bit_reference_keeps_its_range():
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (16, 1))  # a full-range grey ramp
    data = _png(Image.fromarray(ramp))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # 16-bit as PIL reads it
    got = _references(data, "stretch", 16, 256)
    assert (got[..., 0] == got[..., 1]).all() and (got[..., 0] == got[..., 2]).all()
    assert np.array_equal(got[0, :, 0], (ramp[0] >> 8).astype(np.uint8))  # the top byte of each 16-bit value
    assert (got == 255).mean() < 0.01  # PIL's convert("RGB") made 99.6% of it white


# -- inode exhaustion is said as such
def test_inode_exhaustion_is_not_called_out_of_space(tmp_path, monkeypatch):
    from launcher.sizing.space import stopped_by_space

    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: _no_inodes(real(p)))
    line = stopped_by_space(load_config("tiny"), Store(tmp_path), {}, "run", True)
    assert "out of inodes (0 free" in line and "out of space" not in line, line


def _no_inodes(st):
    """`st` (os.statvfs's answer) with every file slot taken: blocks free, no inode free."""
    fields = {k: getattr(st, k) for k in dir(st) if k.startswith("f_")}
    return SimpleNamespace(**{**fields, "f_files": 1000, "f_ffree": 0, "f_favail": 0})
