"""Seconds per denoising step and MFU of a real-size FLUX.1 transformer on one CUDA GPU, eager and compiled.

    python -m tools.bench.gpu [--out gpu_mfu.json] [--modes eager,regional,full] [--steps 10]
    python -m tools.bench.gpu --dry-run     # a tiny config on the CPU: checks the script itself, no GPU needed

The transformer is FLUX.1-dev's (`FluxTransformer2DModel.from_config` with its config values: 19 double and 38
single blocks, 24 heads x 128, joint_attention_dim 4096, pooled 768, in_channels 64, guidance embeddings) with
random weights, built directly on the GPU in bf16 (no checkpoint needed). One step is one transformer forward
at 1024x1024, batch 1: 4096 image tokens (a 64x64 grid of 2x2 latent patches) plus 512 text tokens = 4608.
Its FLOP count comes from the config: matmuls 2 x per-token weights x tokens, attention 4 x tokens^2 x width per
block, about 74.4 TFLOP. MFU = FLOPs / step seconds / the GPU's dense bf16 peak (datasheet: 989 TFLOP/s on H100
and H200 SXM); it is also given against an 8192^3 bf16 matmul measured on the same GPU, the practical ceiling.

Modes: `eager`; `regional` (`compile_repeated_blocks`: each block class compiled once, fast to compile);
`full` (`torch.compile` of the whole transformer, fullgraph, static shapes: the runner's compile mode, slower to
compile); `offload`: the transformer's off-and-on round trip, and from it the per-image cost of a 4-step image
under model offload, unstaged (one round trip per image) against staged (one per shard of 256); `taylorseer`: a
20-step loop without and with TaylorSeer (diffusers' defaults), time and relative output difference (random
weights: says nothing of image quality). Inputs are random, never zeros. Timing: device synchronized, median
of `--steps` steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from launcher.models.checkpoints import PUBLISHED

FLUX1_DEV = dict(PUBLISHED["black-forest-labs/FLUX.1-dev"]["transformer"][2])
TINY = {**FLUX1_DEV, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
        "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (8, 12, 12)}  # fmt: skip
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, datasheets (SXM)


def step_flops(cfg: dict, img_tokens: int, txt_tokens: int) -> float:
    """FLOPs of one forward: every token meets 12 d^2 weights per block (double: q, k, v, out and a 4x MLP in its
    own stream; single: q, k, v, a 4x MLP in, and the fused out), joint attention costs 4 L^2 d per block, plus
    the embedders and the output projection. Per-sample work (modulation, time embeddings) is negligible."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    tokens = img_tokens + txt_tokens
    matmul = 2 * blocks * 12 * d * d * tokens
    attention = blocks * 4 * tokens * tokens * d
    edges = 2 * d * (img_tokens * cfg["in_channels"] * 2 + txt_tokens * cfg["joint_attention_dim"])
    return float(matmul + attention + edges)


def build(cfg: dict, device: str, dtype):
    """The transformer with random weights, created on `device` in `dtype` (no float32 copy of 12B weights)."""
    import torch
    from diffusers import FluxTransformer2DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = FluxTransformer2DModel.from_config(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()  # already in `dtype`: .to() would only warn about modules kept in float32 (there are none)


def inputs(cfg: dict, grid: int, txt_tokens: int, device: str, dtype) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(device, dtype)
    return {
        "hidden_states": randn(1, grid * grid, cfg["in_channels"]),
        "encoder_hidden_states": randn(1, txt_tokens, cfg["joint_attention_dim"]),
        "pooled_projections": randn(1, cfg["pooled_projection_dim"]),
        "timestep": torch.tensor([0.7], device=device, dtype=dtype),  # the model scales t in [0, 1] by 1000
        "guidance": torch.tensor([3.5], device=device, dtype=dtype) if cfg["guidance_embeds"] else None,
        "img_ids": img_ids,
        "txt_ids": torch.zeros(txt_tokens, 3, device=device, dtype=dtype),
        "return_dict": False,
    }


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(model, kwargs: dict, device: str, warmup: int, steps: int) -> dict:
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(warmup):
            out = model(**kwargs)[0]
        _sync(device)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(**kwargs)[0]
            _sync(device)
            times.append(time.perf_counter() - t0)
    return {"warmup_s": warm, "step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "finite": bool(torch.isfinite(out).all())}  # fmt: skip


def matmul_tflops(device: str, n: int = 8192, reps: int = 10) -> float:
    """Measured dense bf16 matmul rate, the practical ceiling (random data: zeros run faster)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def offload_round_trip(model, device: str) -> dict:
    """Seconds to move the transformer off the chip and back: what enable_model_cpu_offload pays per call for it,
    and staged execution once per shard. The weights go to pinned host memory, as accelerate's hooks leave them."""
    import torch

    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _sync(device)
    t0 = time.perf_counter()
    model.to("cpu")
    t1 = time.perf_counter()
    model.to(device)
    _sync(device)
    t2 = time.perf_counter()
    torch.cuda.empty_cache() if device == "cuda" else None
    return {"bytes": nbytes, "to_host_s": t1 - t0, "to_chip_s": t2 - t1, "round_trip_s": t2 - t0}


def staged_vs_unstaged(step_s: float, trip: dict, steps: int = 4, shard: int = 256) -> dict:
    """Per image with model offload: unstaged moves the transformer on and off per image, staged once per shard."""
    unstaged = steps * step_s + trip["round_trip_s"]
    staged = steps * step_s + trip["round_trip_s"] / shard
    return {"steps": steps, "shard": shard, "unstaged_s_per_image": unstaged, "staged_s_per_image": staged,
            "ratio": staged / unstaged}  # fmt: skip


def cache_steps(model, kwargs: dict, device: str, steps: int) -> dict:
    """A denoising-like loop of `steps` forwards (timestep falling), without and with TaylorSeer (defaults):
    seconds per loop and the relative difference of the last output."""
    import torch
    from diffusers import TaylorSeerCacheConfig

    def loop():
        x, outs = kwargs["hidden_states"], None
        with torch.inference_mode(), model.cache_context("cond"):
            _sync(device)
            t0 = time.perf_counter()
            for i in range(steps):
                t = torch.full_like(kwargs["timestep"], 1 - i / steps)
                outs = model(**{**kwargs, "hidden_states": x, "timestep": t})[0]
                x = x - outs / steps
            _sync(device)
        return time.perf_counter() - t0, x.float()

    loop()  # warm-up
    plain_s, plain = loop()
    model.enable_cache(TaylorSeerCacheConfig())
    try:
        loop()
        cached_s, cached = loop()
    finally:
        model.disable_cache()
    rel = float((cached - plain).abs().mean() / plain.abs().mean())
    return {"steps": steps, "none_s": plain_s, "taylorseer_s": cached_s, "ratio": cached_s / plain_s,
            "mean_rel_diff": rel}  # fmt: skip


def peak_tflops(device: str, override: float | None) -> float | None:
    import torch

    if override:
        return override
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def run(args: argparse.Namespace) -> dict:
    import torch

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on the CPU")
    cfg, grid, txt = (TINY, 8, 16) if dry else (FLUX1_DEV, args.grid, args.txt_tokens)
    dtype = torch.bfloat16
    flops = step_flops(cfg, grid * grid, txt)
    peak = peak_tflops(device, args.peak_tflops)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run, tiny config)",
        "torch": torch.__version__,
        "config": cfg,
        "tokens": {"image": grid * grid, "text": txt},
        "tflop_per_step": flops / 1e12,
        "peak_bf16_tflops": peak,
        "matmul_tflops": matmul_tflops(device, 512 if dry else 8192),
        "modes": {},
    }
    t0 = time.perf_counter()
    model = build(cfg, device, dtype)
    result["build_s"] = time.perf_counter() - t0
    result["params"] = sum(p.numel() for p in model.parameters())
    kwargs = inputs(cfg, grid, txt, device, dtype)
    for mode in [m for m in args.modes if m in ("offload", "taylorseer")]:  # eager, before any compile
        if mode == "offload":
            r = time_steps(model, kwargs, device, warmup=1, steps=2 if dry else 3)
            trip = offload_round_trip(model, device)
            result["staged"] = {"step_s": r["step_s"], "offload": trip, **staged_vs_unstaged(r["step_s"], trip)}
            print(f"  offload: transformer {trip['bytes'] / 2**30:.1f} GiB off and on in {trip['round_trip_s']:.2f} s; "
                  f"4-step image with offload: unstaged {result['staged']['unstaged_s_per_image']:.3f} s, "
                  f"staged {result['staged']['staged_s_per_image']:.3f} s", flush=True)  # fmt: skip
        else:
            c = result["cache"] = cache_steps(model, kwargs, device, 4 if dry else 20)
            print(f"  cache: {c['steps']} steps none {c['none_s']:.2f} s, taylorseer {c['taylorseer_s']:.2f} s "
                  f"(x{c['ratio']:.2f}), mean relative difference {c['mean_rel_diff']:.4f}", flush=True)  # fmt: skip
    for mode in [m for m in args.modes if m not in ("offload", "taylorseer")]:
        if mode == "regional":
            model.compile_repeated_blocks(fullgraph=True, dynamic=False)
        elif mode == "full":
            model = torch.compile(model, fullgraph=True, dynamic=False)
        r = time_steps(model, kwargs, device, warmup=1 if dry else args.warmup, steps=2 if dry else args.steps)
        r["mfu"] = flops / r["step_s"] / (peak * 1e12) if peak else None
        r["of_matmul_rate"] = flops / r["step_s"] / (result["matmul_tflops"] * 1e12)
        result["modes"][mode] = r
        print(f"{mode:>9}: {r['step_s'] * 1000:8.1f} ms/step (min {r['min_s'] * 1000:.1f}, max {r['max_s'] * 1000:.1f})"
              f"  MFU {r['mfu'] if r['mfu'] is None else round(r['mfu'], 3)}"
              f"  of matmul rate {r['of_matmul_rate']:.3f}  warm-up {r['warmup_s']:.1f} s  finite {r['finite']}",
              flush=True)  # fmt: skip
        if mode == "regional" and "full" in args.modes:  # full compile needs the uncompiled blocks back
            del model
            torch.cuda.empty_cache() if device == "cuda" else None
            model = build(cfg, device, dtype)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_mfu.json")
    p.add_argument(
        "--modes", default="eager,regional", help="comma-separated: eager, regional, full, offload, taylorseer"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (compiles happen here)")
    p.add_argument("--grid", type=int, default=64, help="image tokens per side (1024 px / 8 / 2 = 64)")
    p.add_argument("--txt-tokens", type=int, default=512)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, if not in the table")
    p.add_argument("--dry-run", action="store_true", help="tiny config on the CPU")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(args.modes) - {"eager", "regional", "full", "offload", "taylorseer"}
    if bad:
        p.error(f"unknown modes {sorted(bad)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}: {result['params'] / 1e9:.2f}B params, {result['tflop_per_step']:.1f} TFLOP/step, "
          f"matmul {result['matmul_tflops']:.0f} TFLOP/s; wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
