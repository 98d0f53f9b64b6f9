"""The edit job's costs: planning per reference, and generation against a bare edit loop.

    python -m tools.bench.edit [--rows 100000] [--distinct 2000] [--size 1024] [--gen-rows 8] [--gen-size 256]
                               [--out edit.json]

- plan: a Parquet source whose `image` column holds {bytes, path} PNGs of --size x --size (photo-like: smooth
  gradients and noise, ~1.5 MB each at 1024), planned as `job=edit` plans it (pass 1: `make_plan`, which reads,
  hashes and header-checks every reference; pass 2: `write_plan_file`, which does it again for the selected
  shards), each in a fresh process whose peak resident memory is its VmHWM, less that of the same
  process planning a text-to-image job over the same rows (same imports, no references). Two sources:
  --distinct rows, each PNG different (real bytes on disk: 1.5 MB x rows), and --rows rows repeating one PNG
  (Parquet stores it once in its dictionary, but every row's bytes are still read out, hashed and checked), which
  shows how time and memory grow with rows when the disk cannot hold --rows distinct images.
- generate: the tiny FLUX.2 pipeline, one thread, --gen-rows rows with --gen-size references read from PNG files:
  the job's own path (jobs/edit.py batches, which read and check each reference, then the worker's
  `shard_steps`) against a bare loop that opens each reference file and calls
  `pipe(image=[ref], prompt=[p], generator=...)`. The ratio is per image (target <= 1.05); the images must be equal.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def photo_png(size: int, seed: int) -> bytes:
    """A photo-like PNG (smooth gradients and noise), different for each seed: one noise field, rolled."""
    import numpy as np
    from PIL import Image

    base = _BASE.get(size)
    if base is None:
        rng = np.random.default_rng(0)
        y, x = np.mgrid[0:size, 0:size] / size
        grad = np.stack([np.sin(6 * x) * 80 + 128, np.cos(5 * y) * 80 + 128, (x + y) * 60 + 60], -1)
        base = _BASE[size] = np.clip(grad + rng.normal(0, 12, grad.shape), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(np.roll(base, seed * 7, axis=(0, 1))).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


_BASE: dict = {}


def write_source(path: Path, rows: int, size: int, distinct: bool) -> int:
    """A Parquet prompt source with an Image struct column; returns its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("prompt", pa.string()), ("image", struct)])
    one = photo_png(size, 0)
    with pq.ParquetWriter(path, schema, use_dictionary=not distinct) as w:
        for start in range(0, rows, 64):
            n = min(64, rows - start)
            images = [photo_png(size, start + i) if distinct else one for i in range(n)]
            table = pa.table(
                {
                    "prompt": [f"make picture {start + i} brighter" for i in range(n)],
                    "image": [{"bytes": b, "path": f"{start + i}.png"} for i, b in enumerate(images)],
                },
                schema=schema,
            )
            w.write_table(table, row_group_size=64)
    return path.stat().st_size


_PLAN = """
import json, sys, time
from launcher.config import load_config
from launcher.plan.plan import make_plan, write_plan_file
from launcher.sources.prompts import SizeRule
from launcher.ledger.store import Store
src, out, job = sys.argv[1:4]
cfg = load_config("tiny", [f"dataset.path={src}", f"output.dir={out}", f"job={job}", "dataset.prompt_column=prompt"])
sizes = SizeRule(16, 4 * 2**20, 1024, 1024, 10)
t0 = time.perf_counter()
plan = make_plan(cfg, {}, sizes)
t1 = time.perf_counter()
write_plan_file(Store(out), "plans/bench.arrow", cfg, plan, sizes)
t2 = time.perf_counter()
# VmHWM, not getrusage: Linux carries the forking parent's peak into ru_maxrss across exec.
peak = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")) / 1024
n = sum(s.rows for s in plan.shards)
print(json.dumps({"pass1_s": t1 - t0, "pass2_s": t2 - t1, "peak_rss_mb": peak, "rows": n}))
"""


def plan_cost(src: Path, rows: int) -> dict:
    out = {}
    for job in ("text_to_image", "edit"):
        with tempfile.TemporaryDirectory() as d:
            res = subprocess.run(
                [sys.executable, "-c", _PLAN, str(src), d, job], cwd=REPO, capture_output=True, text=True, check=True
            )
            out[job] = json.loads(res.stdout.strip().splitlines()[-1])
    e, t = out["edit"], out["text_to_image"]
    return {
        "rows": rows,
        "pass1_ms_per_reference": 1000 * (e["pass1_s"] - t["pass1_s"]) / rows,
        "pass2_ms_per_reference": 1000 * (e["pass2_s"] - t["pass2_s"]) / rows,
        "peak_rss_mb_edit": e["peak_rss_mb"],
        "peak_rss_mb_text_to_image": t["peak_rss_mb"],
        "peak_rss_mb_over_text_to_image": e["peak_rss_mb"] - t["peak_rss_mb"],
    }


def generation(rows: int, size: int, folder: Path) -> dict:
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from jobs import edit as job
    from launcher.config import load_config
    from launcher.models.flux2 import build_tiny
    from launcher.plan.shards import image_seeds
    from launcher.sources.prompts import Source, read_batches
    from launcher.worker.staged import shard_steps

    torch.set_num_threads(1)
    model = build_tiny(folder / "model")
    lines = []
    for i in range(rows):
        (folder / f"{i}.png").write_bytes(photo_png(size, i))
        lines.append(json.dumps({"prompt": f"make picture {i} brighter", "image": f"{i}.png"}))
    (folder / "src.jsonl").write_text("\n".join(lines) + "\n")
    ov = [f"model.path={model}", f"generate.height={size}", f"generate.width={size}", "job=edit"]
    ov += ["generate.num_inference_steps=4", "mesh.tp=1"]
    cfg = load_config("tiny", ov)
    src = Source(str(folder / "src.jsonl"), image_column="image")
    plan_rows = [{k: v for k, v in r.items() if v is not None} for b in read_batches(src) for r in b.to_pylist()]
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def bare():  # what a user writes: open each row's reference, call the pipeline
        out = []
        for i, r in enumerate(plan_rows):
            ref = Image.open(folder / f"{i}.png").convert("RGB")
            g = [torch.Generator("cpu").manual_seed(s) for s in image_seeds(r, 0, 1)]
            kw = dict(guidance_scale=4.0, max_sequence_length=256, text_encoder_out_layers=(1, 2))
            out.append(
                pipe(
                    image=[ref],
                    prompt=[r["prompt"]],
                    height=size,
                    width=size,
                    num_inference_steps=4,
                    generator=g,
                    output_type="np",
                    **kw,
                ).images[0]
            )
        return [(o * 255).round().astype("uint8") for o in out]

    def meshgen():
        samples = []
        for _, step in shard_steps(pipe, job.shard_batches(plan_rows, cfg), cfg, job):
            samples += step()
        return [s["pixels"] for s in samples]

    bare()  # warm-up: first-call costs out of both timings
    times = {}
    for name, fn in (("bare", bare), ("meshgen", meshgen), ("bare2", bare), ("meshgen2", meshgen)):
        t0 = time.perf_counter()
        images = fn()
        times[name] = time.perf_counter() - t0
        times[name + "_images"] = images
    same = all(np.array_equal(a, b) for a, b in zip(times["bare_images"], times["meshgen_images"], strict=True))
    b, m = min(times["bare"], times["bare2"]) / rows, min(times["meshgen"], times["meshgen2"]) / rows
    return {"rows": rows, "size": size, "bare_s_per_image": b, "meshgen_s_per_image": m, "ratio": m / b, "same": same}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--distinct", type=int, default=2000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--gen-rows", type=int, default=8)
    p.add_argument("--gen-size", type=int, default=256)
    p.add_argument("--parts", default="plan,generate")
    p.add_argument("--out", default="edit.json")
    args = p.parse_args(argv)
    result = {}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        if "plan" in args.parts:
            for name, rows, distinct in (("distinct", args.distinct, True), ("repeated", args.rows, False)):
                src = d / f"{name}.parquet"
                mb = write_source(src, rows, args.size, distinct) / 2**20
                result[f"plan_{name}"] = {**plan_cost(src, rows), "source_mb": mb, "size": args.size}
                src.unlink()
                print(name, json.dumps(result[f"plan_{name}"]), flush=True)
        if "generate" in args.parts:
            result["generate"] = generation(args.gen_rows, args.gen_size, d)
            print("generate", json.dumps(result["generate"]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
