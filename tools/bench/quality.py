"""What the quality columns cost per image: `python -m tools.bench.quality [--images 64] [--size 64] [--json]`.

- measured: the tiny random-weight CLIP and safety checker (launcher/models/_tiny_quality.py) scoring `--images`
  images of `--size` pixels on this machine's CPU, seconds per image (min of `--repeats`), each column alone, as
  launcher/worker/quality.py runs them (preprocessing included);
- computed: the forward FLOPs of the real models per image from their configs (launcher/sizing/memory.py's
  PUBLISHED_QUALITY: CLIP ViT-L/14 at 224 pixels, 257 image tokens and 77 text tokens; the checker's ViT-L/14),
  against FLUX.2-dev's per image at 1024x1024 and 28 steps (its transformer over 4096 image + 512 text tokens per
  step, one pass a step as its guidance is distilled, and its text encoder once; the VAE decode left out).
  Matmuls count 2 FLOPs per multiply-add; attention adds 4 * tokens^2 * width per layer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def vit_flops(c: dict, tokens: int, patch_pixels: int = 0) -> float:
    """Forward FLOPs of a CLIP-style transformer tower: per layer q, k, v, o (4 d^2) and the MLP (2 d m) per
    token, plus attention scores and their weighted sum (4 T^2 d), and the patch embedding."""
    d, m, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    per_layer = 2 * tokens * (4 * d * d + 2 * d * m) + 4 * tokens * tokens * d
    return layers * per_layer + 2 * tokens * patch_pixels * d


def quality_flops() -> dict[str, float]:
    from launcher.sizing.memory import PUBLISHED_QUALITY

    clip = PUBLISHED_QUALITY["openai/clip-vit-large-patch14"]
    v, t = clip["vision_config"], clip["text_config"]
    image_tokens = (v["image_size"] // v["patch_size"]) ** 2 + 1
    vision = vit_flops(v, image_tokens, 3 * v["patch_size"] ** 2) + 2 * v["hidden_size"] * clip["projection_dim"]
    text = vit_flops(t, t["max_position_embeddings"]) + 2 * t["hidden_size"] * clip["projection_dim"]
    return {"clip_score": vision + text, "nsfw": vision}


def flux2_dev_flops(height: int = 1024, width: int = 1024, steps: int = 28, text_tokens: int = 512) -> float:
    from launcher.models.checkpoints import published
    from launcher.sizing import memory

    comps = published("black-forest-labs/FLUX.2-dev")
    lib, cls, cfg = comps["transformer"]
    params = memory.counts(comps["transformer"]).total
    tokens = (height // 16) * (width // 16) + text_tokens  # VAE /8, then 2x2 patches packed into channels
    width_ = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    layers = cfg["num_layers"] + cfg["num_single_layers"]
    per_step = 2 * params * tokens + 4 * layers * tokens * tokens * width_
    encoder = 2 * memory.counts(comps["text_encoder"]).total * text_tokens
    return steps * per_step + encoder


def measure(images: int, size: int, repeats: int) -> dict[str, float]:
    from omegaconf import OmegaConf

    from launcher.models._tiny_quality import build_tiny_checker, build_tiny_clip
    from launcher.worker.quality import Scorer

    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(images)]
    prompts = [f"a photo of thing number {i}" for i in range(images)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        clip, checker = build_tiny_clip(Path(tmp) / "clip"), build_tiny_checker(Path(tmp) / "checker")
        for column, (c, s) in {"clip_score": (True, False), "nsfw": (False, True)}.items():
            q = OmegaConf.create(
                dict(clip_score=c, clip_model=str(clip), safety=s, safety_model=str(checker), batch_size=16)
            )
            scorer = Scorer(q, "cpu", "float32")
            scorer.columns(pixels[:2], prompts[:2])  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                scorer.columns(pixels, prompts)
                times.append(time.perf_counter() - t0)
            out[column] = min(times) / images
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--size", type=int, default=64, help="image side in pixels (the tiny job's: 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    flux = flux2_dev_flops()
    real = quality_flops()
    result = {
        "tiny_seconds_per_image": measure(args.images, args.size, args.repeats),
        "real_gflops_per_image": {k: v / 1e9 for k, v in real.items()},
        "flux2_dev_tflops_per_image": flux / 1e12,
        "share_of_flux2_dev": {k: v / flux for k, v in real.items()},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for k, s in result["tiny_seconds_per_image"].items():
        g, share = result["real_gflops_per_image"][k], result["share_of_flux2_dev"][k]
        print(f"{k}: tiny {s * 1e3:.2f} ms/image on CPU; real {g:.0f} GFLOPs/image = {share:.2e} of FLUX.2-dev's")
    print(f"FLUX.2-dev at 1024x1024, 28 steps: {result['flux2_dev_tflops_per_image']:.0f} TFLOPs/image")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
