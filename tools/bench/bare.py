"""The bare diffusers loop that the runner is measured against: `python tools/bench/bare.py OVERRIDE ... --out F`.

It composes the same job config as the runner (conf `tiny` plus the same overrides), loads the pipeline with plain
`DiffusionPipeline.from_pretrained`, and calls `pipe()` once per prompt with a per-sample CPU generator seeded
exactly as the runner seeds it, so both compute the same images. Nothing is written while it runs: the images
stay in memory and only their checksum (for the same-images check) is taken after the timed loop. It writes JSON:
absolute timestamps of its phases (imports done, model loaded, first image) and the seconds of every call.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports, so start-up includes them

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def images_digest(images: list) -> str:
    """sha256 of uint8 images, rounded the way the runner rounds (and diffusers' numpy_to_pil)."""
    h = hashlib.sha256()
    for img in images:
        h.update((img * 255).round().astype("uint8").tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf tiny, as given to ./launch.sh")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)

    import torch
    from diffusers import DiffusionPipeline

    from launcher.config import load_config
    from launcher.plan.shards import image_seeds
    from launcher.sources.prompts import read_prompts
    from launcher.worker.dist import resolve_device
    from launcher.worker.pipeline import DTYPES

    cfg = load_config("tiny", args.overrides)
    gen = cfg.generate
    device = resolve_device(cfg.device)
    rows = read_prompts(cfg.dataset.path, cfg.dataset.prompt_column, cfg.dataset.id_column, cfg.dataset.limit)
    t_imports = time.time()
    pipe = DiffusionPipeline.from_pretrained(cfg.model.path, dtype=DTYPES[cfg.model.dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(cfg.model.call_kwargs).items()}
    t_loaded = time.time()
    seconds, images, t_first = [], [], None
    n = gen.images_per_prompt  # what a user writes by hand: pipe(num_images_per_prompt=N) per prompt
    for row in rows:
        t0 = time.perf_counter()
        out = pipe(
            prompt=[row["prompt"]],
            **({"num_images_per_prompt": n} if n > 1 else {}),
            generator=[torch.Generator("cpu").manual_seed(s) for s in image_seeds(row, gen.seed, n)],
            height=gen.height,
            width=gen.width,
            num_inference_steps=gen.num_inference_steps,
            guidance_scale=gen.guidance_scale,
            max_sequence_length=gen.max_sequence_length,
            output_type="np",
            **extra,
        )
        if device != "cpu":  # the images are numpy, so the device is already synchronized; this is belt and braces
            torch.accelerator.synchronize()
        seconds.append(time.perf_counter() - t0)
        t_first = t_first or time.time()
        images.extend(out.images)
    result = {
        "t_start": T_START,
        "t_imports": t_imports,
        "t_loaded": t_loaded,
        "t_first_image": t_first,
        "t_end": time.time(),
        "seconds": seconds,  # per call, i.e. per prompt: images_per_prompt images each
        "images_per_prompt": n,
        "images_sha256": images_digest(images),
        "threads": torch.get_num_threads(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
