"""Faster than a bare loop? Images per prompt, staged execution with offload, parking, step caching.

Side by side in one run, against what a user writes by hand, on the tiny FLUX.2 (every variant with the same
prompts, seeds, settings and threads):
- `n1`, `n4`: the runner (`./launch.sh`, tp=1, PNG and Parquet written) against tools/bench/bare.py, which calls
  `pipe(num_images_per_prompt=N)` once per prompt. Marginal seconds per image after the first shard, median
  over shards (as the runner part); `ratio` = runner / bare (targets: <= 1.03 at N=1, <= 1.0 at N=4);
  `same_images`: the runner's PNGs equal the bare loop's arrays.
- `offload`: weight bytes moved between host and chip per image, staged (`execution.staged`, one shard of
  `--offload-shard` prompts) against a bare loop with `enable_model_cpu_offload()`; counted in accelerate's
  CpuOffload hooks, where they move modules. On a CPU host nothing really moves (host and chip are one), so the
  counter keeps each model's place as the hooks would on a chip and adds the model's bytes at each change
  (target: staged <= 1/50 of the bare loop's at 256 prompts per shard). Time per image of both is reported too.
- `release`: weight bytes resident on the chip while the transformer denoises, staged without offload, with the
  text encoder parked (`execution.release_text_encoder=true`) and kept (on CUDA also allocated bytes).
- `cache`: TaylorSeer (diffusers' defaults) against no cache at 20 and 50 steps: seconds per image and the
  largest pixel difference (of 255). Target at 20 steps: <= 0.85x the uncached time. Random tiny weights say
  nothing of quality: judging what a cache does to real images needs real checkpoints.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def _pipe(model: str, overrides: list[str]):
    import torch

    from launcher.config import load_config
    from launcher.worker.pipeline import load_pipeline

    cfg = load_config("tiny", [f"model.path={model}", "mesh.tp=1", "mesh.dp=1", *overrides])
    return cfg, load_pipeline(cfg, torch.device("cpu"), None)


def _rows(n: int) -> list[dict]:
    return [{"id": str(i), "prompt": f"a photograph of object number {i} on a wooden table"} for i in range(n)]


class HookCounter:
    """Bytes accelerate's CpuOffload hooks move (or, on a CPU host, would move: places are tracked by hand)."""

    def __init__(self):
        self.bytes, self.place = 0, {}

    def _move(self, module, to: str) -> None:
        if self.place.get(id(module), "host") != to:
            self.bytes += sum(p.numel() * p.element_size() for p in module.parameters())
        self.place[id(module)] = to

    def __enter__(self):
        from accelerate import hooks

        self._saved = (hooks.CpuOffload.init_hook, hooks.CpuOffload.pre_forward)
        init, pre = self._saved
        counter = self

        def init_hook(hook, module):
            counter._move(module, "host")  # installed, or offloaded again
            return init(hook, module)

        def pre_forward(hook, module, *args, **kwargs):
            if hook.prev_module_hook is not None:  # the hook offloads the previous model first
                counter._move(hook.prev_module_hook.model, "host")
            counter._move(module, "chip")
            return pre(hook, module, *args, **kwargs)

        hooks.CpuOffload.init_hook, hooks.CpuOffload.pre_forward = init_hook, pre_forward
        return self

    def __exit__(self, *exc):
        from accelerate import hooks

        hooks.CpuOffload.init_hook, hooks.CpuOffload.pre_forward = self._saved


def _run_shard(pipe, cfg, rows) -> float:
    from jobs.text_to_image import make_batches
    from launcher.worker.staged import shard_steps

    t0 = time.perf_counter()
    for _, step in shard_steps(pipe, make_batches(rows, cfg.generate), cfg):
        step()
    return time.perf_counter() - t0


def bench_offload(model: str, shard: int, size: int, steps: int) -> dict:
    ov = [f"generate.height={size}", f"generate.width={size}", f"generate.num_inference_steps={steps}"]
    ov += ["generate.batch_size=1", "execution.offload=model"]
    out = {"prompts": shard, "size": size, "steps": steps}
    for name, staged in (("bare", False), ("staged", True)):
        cfg, pipe = _pipe(model, [*ov, f"execution.staged={str(staged).lower()}"])
        with HookCounter() as c:
            c.bytes = 0  # installing the hooks at load time moved nothing onto the chip
            if staged:
                seconds = _run_shard(pipe, cfg, _rows(shard))
            else:  # what a user writes: pipe() per prompt, enable_model_cpu_offload() on
                from jobs.text_to_image import make_batches, run_batch

                t0 = time.perf_counter()
                for b in make_batches(_rows(shard), cfg.generate):
                    run_batch(pipe, b, cfg)
                seconds = time.perf_counter() - t0
        out[name] = {"bytes_per_image": c.bytes / shard, "s_per_image": seconds / shard}
    out["bytes_ratio"] = out["staged"]["bytes_per_image"] / out["bare"]["bytes_per_image"]
    out["time_ratio"] = out["staged"]["s_per_image"] / out["bare"]["s_per_image"]
    return out


def bench_release(model: str, n: int, size: int, steps: int) -> dict:
    import torch

    from launcher.worker.residency import resident_bytes

    ov = [f"generate.height={size}", f"generate.width={size}", f"generate.num_inference_steps={steps}"]
    out = {}
    for name, release in (("kept", False), ("released", True)):
        cfg, pipe = _pipe(
            model, [*ov, "execution.staged=true", f"execution.release_text_encoder={str(release).lower()}"]
        )
        seen = {}

        def probe(module, args, pipe=pipe, seen=seen):
            if not seen:
                seen["weights"] = resident_bytes(pipe.text_encoder, pipe.transformer, pipe.vae)
                seen["cuda_allocated"] = torch.cuda.memory_allocated() if torch.cuda.is_available() else None

        handle = pipe.transformer.register_forward_pre_hook(probe)
        seconds = _run_shard(pipe, cfg, _rows(n))
        handle.remove()
        out[name] = {**seen, "s_per_image": seconds / n}
    out["ratio"] = out["released"]["weights"] / out["kept"]["weights"]
    return out


def bench_cache(model: str, n: int, size: int, step_counts: tuple[int, ...]) -> dict:
    import numpy as np
    from diffusers import TaylorSeerCacheConfig

    from jobs.text_to_image import make_batches, run_batch

    out = {}
    for steps in step_counts:
        ov = [f"generate.height={size}", f"generate.width={size}", f"generate.num_inference_steps={steps}"]
        cfg, pipe = _pipe(model, [*ov, "generate.batch_size=1"])
        batches = make_batches(_rows(n + 1), cfg.generate)
        row = {}
        for name in ("none", "taylorseer"):
            if name == "taylorseer":
                pipe.transformer.enable_cache(TaylorSeerCacheConfig())
            run_batch(pipe, batches[0], cfg)  # warm-up, left out
            times, images = [], []
            for b in batches[1:]:
                t0 = time.perf_counter()
                images += [s["pixels"] for s in run_batch(pipe, b, cfg)]
                times.append(time.perf_counter() - t0)
            row[name] = {"s_per_image": statistics.median(times), "images": images}
        diff = max(
            int(np.abs(a.astype(int) - b.astype(int)).max())
            for a, b in zip(*(row[k]["images"] for k in row), strict=True)
        )
        out[f"steps_{steps}"] = {
            **{k: {"s_per_image": v["s_per_image"]} for k, v in row.items()},
            "time_ratio": row["taylorseer"]["s_per_image"] / row["none"]["s_per_image"],
            "max_pixel_diff": diff,
        }
    return out


def bench_n(model: str, n: int, shard_size: int, size: int, steps: int, threads: int, workdir: str) -> dict:
    """The runner against the bare loop at N = 1 and N = 4 (same prompts: N = 4 makes 4x the images)."""
    from tools.bench.runner import (
        _env,
        job_overrides,
        run_bare,
        run_runner,
        runner_digest,
        runner_shards,
        write_prompts,
    )

    work = Path(workdir)
    prompts = write_prompts(work / "speed-prompts.txt", n)
    env = _env("cpu", threads)
    out = {}
    for k in (1, 4):
        ov = [*job_overrides(model, prompts, "cpu", size, size, steps, 1), f"generate.images_per_prompt={k}"]
        r = run_runner(ov, work / f"speed-n{k}", shard_size, env)
        b = run_bare(ov, work / f"speed-bare-n{k}.json", env)
        runner = runner_shards(r["states"])[1:]
        per = shard_size  # calls per shard (one per prompt)
        bare = [statistics.fmean(b["seconds"][i : i + per]) / k for i in range(0, len(b["seconds"]), per)][1:]
        out[f"n{k}"] = {
            "runner_s_per_image": statistics.median(runner),
            "bare_s_per_image": statistics.median(bare),
            "ratio": statistics.median(runner) / statistics.median(bare),
            "same_images": runner_digest(work / f"speed-n{k}") == b["images_sha256"],
        }
    return out


def bench_speed(model: str, args, workdir: str) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return {
        "n": bench_n(model, args.speed_prompts, args.shard_size, args.height, args.steps, args.threads, workdir),
        "offload": bench_offload(model, args.offload_shard, 32, 2),
        "release": bench_release(model, 4, args.height, args.steps),
        "cache": bench_cache(model, args.cache_images, args.height, args.cache_steps),
    }
