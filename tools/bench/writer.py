"""Writer throughput: how many 1024x1024 images per second the PNG encoding pool turns into PNG bytes.

Flat or purely synthetic images compress an order of magnitude faster than photographs and mislead, so the
images are photographic-like: hard-edged objects softened by a lens blur, shading and texture at several
scales, and sensor noise (about 1.9 MB each as PNG at level 1, like a real 1024x1024 photograph). They go
through the runner's own encoding function (`launcher.worker.writer.encode_png`) in a spawned process pool chunked the
way the writer process (`launcher.worker.bgwriter._write_files`) chunks a shard, with 1 and 2 processes, for each
encoder and level.
The pool is started and warmed before timing: its start-up is paid once per run, while the model loads.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def photo_like(size: int = 1024, seed: int = 0) -> np.ndarray:
    """A uint8 size x size x 3 image that compresses like a photograph (not like a flat synthetic one)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    base = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(40, 200, 3)))
    draw = ImageDraw.Draw(base)
    for _ in range(24):
        x0, y0 = (int(v) for v in rng.integers(-size // 4, size, 2))
        w, h = (int(v) for v in rng.integers(size // 16, size // 2, 2))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x0, y0, x0 + w, y0 + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    img = np.asarray(base.filter(ImageFilter.GaussianBlur(1.5)), np.float32)
    mix = (rng.normal(size=(3, 3)) * 0.3 + np.eye(3)).astype(np.float32)  # colour channels move together
    for cells in (4, 16, 64, 256, 512):
        grid = rng.normal(size=(cells + 1, cells + 1, 3)).astype(np.float32) @ mix.T
        up = [np.asarray(Image.fromarray(grid[..., c]).resize((size, size), Image.BICUBIC)) for c in range(3)]
        img += (40.0 / cells**0.5) * np.stack(up, -1)
    img += rng.normal(scale=3.0, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(item: tuple[np.ndarray, str, int]) -> int:
    from launcher.worker.writer import encode_png

    return len(encode_png(*item))


def _warm(_: int) -> int:
    import launcher.worker.writer  # noqa: F401  (the import is what a worker's first task pays)

    return 0


def encode_rate(images: list[np.ndarray], encoder: str, level: int, processes: int, count: int) -> dict:
    """Encode `count` images (cycling through `images`) with `processes` spawned workers; images/s and sizes."""
    ctx = multiprocessing.get_context("spawn")  # as BackgroundWriter: its process holds threads a fork would copy
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        list(pool.map(_warm, range(processes * 2)))
        items = [(images[i % len(images)], encoder, level) for i in range(count)]
        chunk = max(1, count // (4 * processes))
        t0 = time.perf_counter()
        sizes = list(pool.map(_encode, items, chunksize=chunk))
        seconds = time.perf_counter() - t0
    return {"images_per_s": count / seconds, "seconds": seconds, "mb_per_image": statistics.fmean(sizes) / 1e6}


def bench_writer(
    size: int = 1024,
    count: int = 24,
    processes: tuple[int, ...] = (1, 2),
    encoders: tuple[str, ...] = ("imagecodecs", "pil"),
    levels: tuple[int, ...] = (1, 6),
    distinct: int = 6,
    repeats: int = 1,
) -> dict:
    """images/s for every (encoder, level, processes): the median of `repeats` runs, with all of them."""
    images = [photo_like(size, seed) for seed in range(distinct)]
    rows = []
    for encoder in encoders:
        for level in levels:
            for p in processes:
                runs = [encode_rate(images, encoder, level, p, count) for _ in range(repeats)]
                rates = [r["images_per_s"] for r in runs]
                rows.append(
                    {
                        "encoder": encoder,
                        "level": level,
                        "processes": p,
                        "images_per_s": statistics.median(rates),
                        "images_per_s_per_process": statistics.median(rates) / p,
                        "all_images_per_s": rates,
                        "mb_per_image": runs[0]["mb_per_image"],
                    }
                )
    for r in rows:  # scaling against the same encoder and level with the fewest processes
        same = [b for b in rows if (b["encoder"], b["level"]) == (r["encoder"], r["level"])]
        base = min(same, key=lambda b: b["processes"])
        r["speedup"] = r["images_per_s"] / base["images_per_s"]
    return {"settings": {"size": size, "count": count, "distinct_images": distinct, "repeats": repeats}, "rows": rows}
