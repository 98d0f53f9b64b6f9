"""Benchmarks, side by side in one run: `python -m tools.bench [--parts runner,memory,writer] [--out bench.json]`.

Prints a table and writes every number as JSON (default bench.json). Parts (each its own module, importable):

- runner (tools/bench/runner.py): the runner (`./launch.sh`, tp=1, writing PNG and Parquet) against a bare
  diffusers loop (`pipe()` per prompt with per-sample generators, nothing written; tools/bench/bare.py), on the
  tiny FLUX.2 model, same prompts, seeds, settings and threads. `s/image` is the marginal time per image after
  warm-up (the first shard's images); `ratio` is runner over bare (target <= 1.03). `writes ratio` compares the
  runner with writes against the same job with every output off (state files only); `writer wait share` is
  the share of generation time spent waiting for the writer. Time to first image counts from the command's start
  to the first image (the bare loop) or to the first shard's state file (a one-prompt runner job); `runner
  one-image job` is that job's whole wall time, shut-down included. `same images` checks that the runner's PNGs
  equal the bare loop's images bit for bit. Median and min-max over `--repeats` repeats.
- memory (tools/bench/memory.py): private memory per rank at tp=1 and tp=2 (2 CPU processes) on a mid-size
  random-weight FLUX.2 transformer the script builds (~130M parameters, 520 MB float32). `weights private` is
  the rank's private memory (RssAnon plus its local parameters that are file-mapped) less its baseline before
  loading; the ratio tp=2 / tp=1 has a target of <= 0.6.
- speed (tools/bench/speed.py): images per prompt (N=1 and N=4 runner vs a bare loop), staged execution with
  offload (weight bytes moved per image against enable_model_cpu_offload), the text encoder parked while
  denoising (resident weights), TaylorSeer against no cache at 20 and 50 steps (time and pixel difference).
- writer (tools/bench/writer.py): encoding throughput for photographic-like 1024x1024 images through a
  spawned process pool, as the background writer encodes, with 1 and 2 processes, imagecodecs and PIL: PNG at
  levels 1 and 6, JPEG and WebP at quality 95, lossless WebP (targets: >= 6 images/s per process for the
  default imagecodecs PNG level 1, >= 1.8x that with 2).

Timings on a shared machine are noisy: run it when `uptime` shows little load, and read the min-max spread.
On a CUDA host, `--device cuda` runs the runner part on the GPU (memory and writer stay on the CPU);
tools/gpu_bench.sh does that plus the FLUX.1 step-time and MFU measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.memory import bench_memory
from tools.bench.runner import bench_runner
from tools.bench.speed import bench_speed
from tools.bench.table import format_table
from tools.bench.writer import bench_writer

PARTS = ("runner", "memory", "writer", "speed")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS))
    p.add_argument("--out", default="bench.json", help="JSON file to write (default bench.json)")
    p.add_argument("--workdir", default=None, help="where temporary models and outputs go (default: system temp)")
    g = p.add_argument_group("runner")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    g.add_argument("--model", default=None, help="tiny pipeline folder (default: built into the work folder)")
    g.add_argument("--images", type=int, default=96, help="prompts per job")
    g.add_argument("--shard-size", type=int, default=16)
    g.add_argument("--skip-shards", type=int, default=1, help="warm-up shards left out of s/image")
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument("--height", type=int, default=128)
    g.add_argument("--width", type=int, default=128)
    g.add_argument("--steps", type=int, default=8)
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both, on CPU")
    g = p.add_argument_group("speed (also uses --shard-size, --height, --width, --steps, --threads)")
    g.add_argument("--speed-prompts", type=int, default=32, help="prompts of the N=1 / N=4 runner-vs-bare jobs")
    g.add_argument("--offload-shard", type=int, default=256, help="prompts in the staged+offload shard")
    g.add_argument("--cache-images", type=int, default=4, help="images per setting of the cache comparison")
    g.add_argument("--cache-steps", type=_ints, default=(20, 50))
    g = p.add_argument_group("memory")
    g.add_argument("--mem-heads", type=int, default=8, help="attention heads of 128 (width = heads x 128)")
    g.add_argument("--mem-layers", type=int, default=2)
    g.add_argument("--mem-single-layers", type=int, default=4)
    g = p.add_argument_group("writer")
    g.add_argument("--writer-size", type=int, default=1024)
    g.add_argument("--writer-images", type=int, default=24)
    g.add_argument("--writer-processes", type=_ints, default=(1, 2))
    g.add_argument("--writer-repeats", type=int, default=3)
    g.add_argument("--writer-encoders", type=lambda t: tuple(t.split(",")), default=("imagecodecs", "pil"))
    g.add_argument("--writer-levels", type=_ints, default=(1, 6), help="PNG zlib levels")
    g.add_argument(
        "--writer-formats", type=lambda t: tuple(t.split(",")), default=("png", "jpeg", "webp", "webp-lossless")
    )
    g.add_argument("--writer-quality", type=int, default=95, help="JPEG and lossy WebP quality")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def environment() -> dict:
    import torch

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def run(args: argparse.Namespace) -> dict:
    """Run the chosen parts; every number, as written to JSON."""
    result: dict = {"environment": environment(), "args": {k: v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-", dir=args.workdir) as tmp:
        if "runner" in args.parts:
            model = args.model
            if model is None:
                from launcher.models.flux2 import build_tiny as build_tiny_flux2

                model = str(build_tiny_flux2(Path(tmp) / "tiny-flux2"))
            result["runner"] = bench_runner(
                model,
                device=args.device,
                n=args.images,
                shard_size=args.shard_size,
                skip=args.skip_shards,
                repeats=args.repeats,
                height=args.height,
                width=args.width,
                steps=args.steps,
                batch_size=args.batch_size,
                threads=args.threads,
                workdir=tmp,
            )
        if "speed" in args.parts:
            model = args.model
            if model is None:
                from launcher.models.flux2 import build_tiny as build_tiny_flux2

                model = str(build_tiny_flux2(Path(tmp) / "tiny-flux2-speed"))
            result["speed"] = bench_speed(model, args, tmp)
        if "memory" in args.parts:
            result["memory"] = bench_memory(args.mem_heads, args.mem_layers, args.mem_single_layers, tmp)
        if "writer" in args.parts:
            result["writer"] = bench_writer(
                args.writer_size,
                args.writer_images,
                args.writer_processes,
                args.writer_encoders,
                args.writer_levels,
                repeats=args.writer_repeats,
                formats=args.writer_formats,
                quality=args.writer_quality,
            )
    result["environment"]["loadavg_end"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
