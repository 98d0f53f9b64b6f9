"""Writer throughput: how many 1024x1024 images per second the encoding pool turns into PNG, JPEG or WebP bytes.

Flat or purely synthetic images compress an order of magnitude faster than photographs and mislead, so the
images are photographic-like: hard-edged objects softened by a lens blur, shading and texture at several
scales, and sensor noise (about 1.9 MB each as PNG at level 1, like a real 1024x1024 photograph). They go
through the runner's own encoding function (`launcher.writer.encode.encode`) in a spawned process pool chunked the
way the writer process (`launcher.writer.writer_process._write_files`) chunks a shard, with 1 and 2 processes, for each
format, library (imagecodecs, Pillow) and PNG level; JPEG and WebP at quality 95, lossless WebP.
The pool is started and warmed before timing: its start-up is paid once per run, while the model loads.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from launcher.writer.encode import Encoding, encode


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


def _encode(item: tuple[np.ndarray, Encoding, str]) -> int:
    return len(encode(*item))


def _warm(_: int) -> int:
    import launcher.writer.encode  # noqa: F401  (the import is what a worker's first task pays)

    return 0


def variants(formats, encoders, levels, quality: int) -> list[tuple[str, Encoding, str, int]]:
    """(format label, encoding, library, level) for each combination: PNG at each zlib level, JPEG and lossy WebP at
    `quality`, lossless WebP; WebP at the runner's default effort (method 0)."""
    out = []
    for fmt in formats:
        for lib in encoders:
            if fmt == "png":
                out += [(fmt, Encoding("png", png_level=lv), lib, lv) for lv in levels]
            elif fmt == "webp-lossless":
                out.append((fmt, Encoding("webp", lossless=True), lib, 0))
            else:
                out.append((fmt, Encoding(fmt, quality=quality), lib, quality))
    return out


def encode_rate(images: list[np.ndarray], enc: Encoding, library: str, processes: int, count: int) -> dict:
    """Encode `count` images (cycling through `images`) with `processes` spawned workers; images/s and sizes."""
    ctx = multiprocessing.get_context("spawn")  # as BackgroundWriter: its process holds threads a fork would copy
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        list(pool.map(_warm, range(processes * 2)))
        list(pool.map(_encode, [(images[0], enc, library)] * processes))  # the codec's own first-call set-up
        items = [(images[i % len(images)], enc, library) for i in range(count)]
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
    formats: tuple[str, ...] = ("png", "jpeg", "webp", "webp-lossless"),
    quality: int = 95,
) -> dict:
    """images/s for every (format, encoder, level, processes): the median of `repeats` runs, with all of them."""
    images = [photo_like(size, seed) for seed in range(distinct)]
    rows = []
    for fmt, enc, lib, level in variants(formats, encoders, levels, quality):
        for p in processes:
            runs = [encode_rate(images, enc, lib, p, count) for _ in range(repeats)]
            rates = [r["images_per_s"] for r in runs]
            rows.append(
                {
                    "format": fmt,
                    "encoder": lib,
                    "level": level,
                    "processes": p,
                    "images_per_s": statistics.median(rates),
                    "images_per_s_per_process": statistics.median(rates) / p,
                    "all_images_per_s": rates,
                    "mb_per_image": runs[0]["mb_per_image"],
                }
            )
    for r in rows:  # scaling against the same variant with the fewest processes
        same = [b for b in rows if (b["format"], b["encoder"], b["level"]) == (r["format"], r["encoder"], r["level"])]
        base = min(same, key=lambda b: b["processes"])
        r["speedup"] = r["images_per_s"] / base["images_per_s"]
    settings = {"size": size, "count": count, "distinct_images": distinct, "repeats": repeats, "quality": quality}
    return {"settings": settings, "rows": rows}
