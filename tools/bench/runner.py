"""The runner against a bare diffusers loop, and the runner with writes against without, on the same job.

Every variant runs as its own process, as a user runs it, with the same model, prompts, seeds, settings and
thread count (OMP_NUM_THREADS is set explicitly for all of them on CPU). One repeat runs them back to back; the
runner runs right next to the two it is compared with (the bare loop, and itself without writes), and the order
reverses every other repeat, so the machine's slow and quiet spells (minutes long on a shared host) fall on both
sides of each ratio:
- `runner`: `./launch.sh` with PNG and Parquet outputs, N prompts, shards of `shard_size`;
- `runner_nowrite`: the same with no output (`output.png/parquet/webdataset=false`: state files only);
- `runner_first`: the same job with one prompt, for the time to the first image on disk;
- `bare`: tools/bench/bare.py, `pipe()` per prompt with per-sample generators, nothing written.

Marginal seconds per image, after warm-up: for the runner, each shard's generation time (the state file's
`seconds` plus `writer_wait`, the time generation waited for the writer) over its images; for the bare loop, the
mean call time over the same images; then the median over the shards after the first `skip` (and the mean, as
`ratio_mean`). Start-up and warm-up are reported apart: the first shard holds the first call's one-off costs.
The images are checked to be identical (the runner's PNGs against the bare loop's arrays), which proves both did
the same work.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("runner_first", "runner_nowrite", "runner", "bare")


def job_overrides(
    model: str, prompts: Path, device: str, height: int, width: int, steps: int, batch_size: int
) -> list[str]:
    """The job every variant runs: conf `tiny` (the tiny model's call settings) at the issue's sizes, tp=1."""
    return [
        f"model.path={model}",
        f"dataset.path={prompts}",
        f"device={device}",
        "mesh.tp=1",
        "mesh.dp=1",
        f"generate.height={height}",
        f"generate.width={width}",
        f"generate.num_inference_steps={steps}",
        f"generate.batch_size={batch_size}",
    ]


def write_prompts(path: Path, n: int) -> Path:
    # Distinct prompts of similar length: the text encoder pads to max_sequence_length anyway.
    path.write_text("".join(f"a photograph of object number {i} on a wooden table, soft light\n" for i in range(n)))
    return path


def _env(device: str, threads: int) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if device == "cpu":  # both the runner and the bare loop, explicitly: the runner would default to 1 anyway
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_runner(overrides: list[str], out: Path, shard_size: int, env: dict, writes: bool = True) -> dict:
    """Launch the real job; wall time, when shard 0's state file appeared, and every shard's state."""
    args = [*overrides, f"output.dir={out}", f"run.shard_size={shard_size}", "run.overwrite=true"]
    if not writes:
        args += ["output.png=false", "output.parquet=false", "output.webdataset=false"]
    shutil.rmtree(out, ignore_errors=True)  # the previous repeat's state file would read as this run's first
    first_state = out / "state" / "shard-00000.json"
    t0 = time.time()
    log = out.with_name(f"{out.name}.log")
    with open(log, "wb") as f:  # a file, not a pipe: nobody reads a pipe while this loop polls
        proc = subprocess.Popen([str(REPO / "launch.sh"), *args], cwd=REPO, env=env, stdout=f, stderr=f)
        t_first = None
        while proc.poll() is None:  # poll for the first shard's state file: the first output a user can see
            if t_first is None and first_state.exists():
                t_first = time.time()
            time.sleep(0.01)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"runner exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
    states = [json.loads(p.read_text()) for p in sorted((out / "state").glob("shard-*.json"))]
    return {"wall": wall, "first_state": (t_first or time.time()) - t0, "states": states}


def run_bare(overrides: list[str], out_json: Path, env: dict) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "tools.bench.bare", *overrides, "--out", str(out_json)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"bare loop exited {res.returncode}:\n{res.stderr[-3000:]}")
    return {**json.loads(out_json.read_text()), "wall": time.time() - t0, "t_launch": t0}


def runner_digest(out: Path) -> str:
    """sha256 of the runner's images in id order, decoded from its Parquet files (as the bare loop hashes its own)."""
    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    rows = [r for f in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    h = hashlib.sha256()
    for r in sorted(rows, key=lambda r: tuple(int(x) for x in r["id"].split("-"))):  # "<prompt>-<k>" with N > 1
        h.update(np.asarray(Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB")).tobytes())
    return h.hexdigest()


def runner_shards(states: list[dict]) -> list[float]:
    """Seconds per image of each shard's generation loop, the time it waited for the writer included."""
    return [(s["seconds"] + s["stages"].get("writer_wait", 0.0)) / s["rows"] for s in states]


def between_shards(states: list[dict]) -> list[float]:
    """Seconds from the end of one shard's generation to the start of the next one's, on the one worker: the
    per-shard bookkeeping that the marginal s/image leaves out (counting truncated prompts, handing the shard to
    the writer, claiming the next shard and reading its rows from the plan, clearing its leftovers)."""
    s = sorted(states, key=lambda st: st["started_at"])
    ends = [a["started_at"] + a["seconds"] + a["stages"].get("warmup", 0.0) + a["stages"]["writer_wait"] for a in s]
    return [b["started_at"] - end for end, b in zip(ends, s[1:], strict=False)]


def bare_shards(seconds: list[float], shard_size: int) -> list[float]:
    """The bare loop's call times cut into the runner's shards: seconds per image of each."""
    return [statistics.fmean(seconds[i : i + shard_size]) for i in range(0, len(seconds), shard_size)]


def one_repeat(overrides: list[str], work: Path, n: int, shard_size: int, skip: int, env: dict, order: list) -> dict:
    """Run every variant once, in `order`; the numbers of this repeat.

    s/image is the median over the shards after the first `skip` of each shard's seconds per image: a one-off
    stall (another process's burst, the encoding pool's start) moves one shard, not the marginal cost. The mean
    over the same shards is kept too (`*_mean`)."""
    many, one = write_prompts(work / "prompts.txt", n), write_prompts(work / "one.txt", 1)
    raw = {}
    for v in order:
        if v == "bare":
            raw[v] = run_bare(overrides, work / "bare.json", env)
        else:
            prompts = one if v == "runner_first" else many
            ov = [o if not o.startswith("dataset.path=") else f"dataset.path={prompts}" for o in overrides]
            raw[v] = run_runner(ov, work / v, shard_size, env, writes=v != "runner_nowrite")
    r, nw, first, bare = raw["runner"], raw["runner_nowrite"], raw["runner_first"], raw["bare"]
    shards = {
        "runner": runner_shards(r["states"]),
        "nowrite": runner_shards(nw["states"]),
        "bare": bare_shards(bare["seconds"], shard_size),
    }
    med = {k: statistics.median(v[skip:]) for k, v in shards.items()}
    mean = {k: statistics.fmean(v[skip:]) for k, v in shards.items()}
    busy = sum(s["seconds"] + s["stages"]["writer_wait"] for s in r["states"])
    gap = statistics.median(between_shards(r["states"]))
    return {
        "images": n,
        "images_measured": n - skip * shard_size,
        "runner_s_per_image": med["runner"],
        "bare_s_per_image": med["bare"],
        "ratio": med["runner"] / med["bare"],
        "ratio_mean": mean["runner"] / mean["bare"],
        "nowrite_s_per_image": med["nowrite"],
        "writes_ratio": med["runner"] / med["nowrite"],
        "writer_wait_share": sum(s["stages"]["writer_wait"] for s in r["states"]) / busy,
        "between_shards_s": gap,
        "between_shards_share": gap / statistics.median(s["seconds"] for s in r["states"][skip:]),
        "write_seconds_per_image": statistics.fmean(s.get("write_seconds", 0.0) / s["rows"] for s in r["states"][1:]),
        "first_write_seconds": r["states"][0].get("write_seconds", 0.0),
        "runner_warmup_s_per_image": statistics.fmean(shards["runner"][:skip]),
        "bare_warmup_s_per_image": statistics.fmean(shards["bare"][:skip]),
        "runner_first_image_s": first["first_state"],
        "runner_first_wall_s": first["wall"],
        "runner_wall_s": r["wall"],
        "runner_e2e_s_per_image": (r["wall"] - first["wall"]) / (n - 1),
        "bare_first_image_s": bare["t_first_image"] - bare["t_launch"],
        "bare_startup_s": {
            "imports": bare["t_imports"] - bare["t_launch"],
            "load": bare["t_loaded"] - bare["t_imports"],
            "first_call": bare["seconds"][0],
        },
        "bare_wall_s": bare["wall"],
        "bare_e2e_s_per_image": (bare["wall"] - (bare["t_first_image"] - bare["t_launch"])) / (n - 1),
        "same_images": runner_digest(work / "runner") == bare["images_sha256"],
        "bare_threads": bare["threads"],
        "shards_s_per_image": shards,
    }


def summarize(repeats: list[dict]) -> dict:
    """Median, min and max over repeats of every number."""
    out = {}
    for key, first in repeats[0].items():
        if isinstance(first, bool):
            out[key] = all(r[key] for r in repeats)
        elif isinstance(first, int | float):
            vals = [r[key] for r in repeats]
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        elif isinstance(first, dict):
            out[key] = summarize([r[key] for r in repeats])
    return out


def bench_runner(
    model: str,
    device: str = "cpu",
    n: int = 96,
    shard_size: int = 16,
    skip: int = 1,
    repeats: int = 5,
    height: int = 128,
    width: int = 128,
    steps: int = 8,
    batch_size: int = 1,
    threads: int = 1,
    workdir: str | None = None,
) -> dict:
    """Runner vs bare loop and writes vs no writes, `repeats` times; the summary and every repeat's numbers."""
    if n < 2 or n <= skip * shard_size:
        raise ValueError(f"n={n} leaves no images after the first {skip} shard(s) of {shard_size}")
    settings = dict(height=height, width=width, steps=steps, batch_size=batch_size)
    with tempfile.TemporaryDirectory(prefix="bench-runner-", dir=workdir) as tmp:
        work = Path(tmp)
        overrides = job_overrides(model, work / "prompts.txt", device, **settings)
        env = _env(device, threads)
        runs = []
        for i in range(repeats):
            order = list(VARIANTS if i % 2 == 0 else reversed(VARIANTS))
            runs.append({**one_repeat(overrides, work, n, shard_size, skip, env, order), "order": order})
    # Every post-warm-up shard of every repeat in one pool: steadier than a median of per-repeat ratios when
    # other processes come and go, since a burst that hits one variant of a repeat counts once, not as a ratio.
    pooled = {
        k: statistics.median(x for r in runs for x in r["shards_s_per_image"][k][skip:])
        for k in ("runner", "nowrite", "bare")
    }
    summary = summarize(runs)
    summary["pooled"] = {
        **{f"{k}_s_per_image": v for k, v in pooled.items()},
        "ratio": pooled["runner"] / pooled["bare"],
        "writes_ratio": pooled["runner"] / pooled["nowrite"],
    }
    return {
        "settings": {
            **settings,
            "device": device,
            "n": n,
            "shard_size": shard_size,
            "skip_shards": skip,
            "threads": threads if device == "cpu" else None,
            "repeats": repeats,
        },
        "summary": summary,
        "repeats": runs,
    }
