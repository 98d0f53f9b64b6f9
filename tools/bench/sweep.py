"""A sweep against the plain runs it replaces: `python -m tools.bench.sweep [--prompts 8] [--size 64] [--steps 8]
[--repeats 3] [--staged] [--out bench-sweep.json]`.

On the tiny FLUX.2 (built in a temporary folder unless --model), tp=1 on CPU, one thread, through the worker's own
code path (jobs/text_to_image.make_batches and jobs/staged.shard_steps, nothing written):
- `sweep`: one shard of --prompts prompts with `generate.sweep={guidance_scale: [2.5, 3.0, 3.5, 4.0]}`;
- `plain`: the same shard four times, once per guidance scale (`generate.guidance_scale=g`): what a user runs
  without sweeps.
Each repeat times the sweep and the four plain runs back to back (the order reversed every other repeat, so a
slow spell of a shared machine falls on both sides); `ratio` = sweep / (sum of the four plain runs), median over
repeats (target <= 1.03). A first, untimed shard warms every path up. `encoded prompts` counts the prompts the
text encoder saw (a forward pre-hook): the sweep encodes each prompt once, the plain runs four times.
`same_images`: every variant's images equal the matching plain run's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

GUIDANCE = (2.5, 3.0, 3.5, 4.0)


def _pipe(model: str, overrides: list[str]):
    import torch

    from launcher.config import load_config
    from launcher.worker.pipeline import load_pipeline

    cfg = load_config("tiny", [f"model.path={model}", "mesh.tp=1", "mesh.dp=1", *overrides])
    return cfg, load_pipeline(cfg, torch.device("cpu"), None)


def _shard(pipe, cfg, rows) -> tuple[float, list[dict]]:
    from jobs.text_to_image import make_batches
    from launcher.worker.staged import shard_steps

    samples, t0 = [], time.perf_counter()
    for _, step in shard_steps(pipe, make_batches(rows, cfg.generate), cfg):
        samples += step()
    return time.perf_counter() - t0, samples


def bench_sweep(model: str, prompts: int, size: int, steps: int, batch_size: int, repeats: int, staged: bool) -> dict:
    import numpy as np
    from omegaconf import OmegaConf

    base = [
        f"generate.height={size}",
        f"generate.width={size}",
        f"generate.num_inference_steps={steps}",
        f"generate.batch_size={batch_size}",
        f"execution.staged={str(staged).lower()}",
    ]
    cfg, pipe = _pipe(model, base)
    encoded = [0]

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        encoded[0] += ids.shape[0]

    pipe.text_encoder.register_forward_pre_hook(count, with_kwargs=True)
    sweep_cfg = OmegaConf.merge(cfg, {"generate": {"sweep": {"guidance_scale": list(GUIDANCE)}}})
    plain_cfgs = [OmegaConf.merge(cfg, {"generate": {"guidance_scale": g}}) for g in GUIDANCE]
    rows = [{"id": str(i), "prompt": f"a photograph of object number {i} on a wooden table"} for i in range(prompts)]
    _shard(pipe, sweep_cfg, rows[:batch_size])  # warm-up, untimed
    times: dict[str, list[float]] = {"sweep": [], "plain": []}
    counts, same = {}, True
    for r in range(repeats):
        order = ("sweep", "plain") if r % 2 == 0 else ("plain", "sweep")
        for name in order:
            encoded[0] = 0
            if name == "sweep":
                seconds, swept = _shard(pipe, sweep_cfg, rows)
            else:
                runs = [_shard(pipe, c, rows) for c in plain_cfgs]
                seconds = sum(s for s, _ in runs)
                plain = {f"{s['id']}@{v}": s["pixels"] for v, (_, out) in enumerate(runs) for s in out}
            times[name].append(seconds)
            counts[name] = encoded[0]
        same &= all(np.array_equal(s["pixels"], plain[s["id"]]) for s in swept) and len(swept) == len(plain)
    ratios = [s / p for s, p in zip(times["sweep"], times["plain"], strict=True)]
    return {
        "prompts": prompts,
        "variants": len(GUIDANCE),
        "size": size,
        "steps": steps,
        "batch_size": batch_size,
        "staged": staged,
        "sweep_s": statistics.median(times["sweep"]),
        "plain_4_runs_s": statistics.median(times["plain"]),
        "ratio": statistics.median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)],
        "encoded_prompts": {"sweep": counts["sweep"], "plain_4_runs": counts["plain"]},
        "same_images": same,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a FLUX.2 pipeline folder (default: the tiny one, built in a temporary folder)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staged", action="store_true", help="execution.staged=true for both")
    p.add_argument("--out", default="bench-sweep.json")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the workers run on CPU (OMP_NUM_THREADS=1)
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        model = args.model
        if model is None:
            from launcher.models.flux2 import build_tiny

            model = str(build_tiny(Path(tmp) / "tiny-flux2"))
        result = bench_sweep(model, args.prompts, args.size, args.steps, args.batch_size, args.repeats, args.staged)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in result.items():
        print(f"{k:>16}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
