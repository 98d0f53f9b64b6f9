"""Image encoding in the writer's processes: PNG, JPEG or WebP bytes of a uint8 HxWx3 array.

Measured on a 2-core developer machine, photographic-like 1024x1024 images, one process (min of 5 interleaved
repeats of 3 images; the machine was shared, load 3-6, so the absolute times are high):
- PNG: imagecodecs (libpng) at level 1 is ~1.6x faster than Pillow at the same level and ~3x faster than Pillow's
  default level 6, for files about 10% larger than level 6 (about 1.9 MB).
- JPEG quality 95: imagecodecs (libjpeg-turbo) 7.8 ms, Pillow 9.6 ms, the same size (0.30 MB).
- lossy WebP quality 95: imagecodecs 95 ms, Pillow 107 ms at method 0 (0.28 MB). Method 0 against libwebp's
  default 4: ~3x faster for 0.2 dB of PSNR and the same size (43 against 135 ms on an idle core).
- lossless WebP, method 0: Pillow 93 ms, imagecodecs 105 ms (1.83 MB, below PNG level 1's size); method 1 is
  3x slower for 1.54 MB.
So each format goes through the faster library (`default_library`); PNG's stays a choice (`output.png_encoder`).
`python -m tools.bench --parts writer` measures every one of them through the writer's process pool.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

FORMATS = ("png", "jpeg", "webp")
EXTENSIONS = {"png": "png", "jpeg": "jpg", "webp": "webp"}  # the file suffix and the WebDataset key
LIBRARIES = ("imagecodecs", "pil")


@dataclass(frozen=True)
class Encoding:
    format: str = "png"
    quality: int = 95  # jpeg and lossy webp
    lossless: bool = False  # webp
    png_encoder: str = "imagecodecs"
    png_level: int = 1
    webp_method: int = 0  # libwebp's effort, 0 (fast) .. 6 (small)

    @property
    def extension(self) -> str:
        return EXTENSIONS[self.format]

    @classmethod
    def from_config(cls, output_cfg) -> Encoding:
        return cls(
            format=output_cfg.format,
            quality=int(output_cfg.quality),
            lossless=bool(output_cfg.lossless),
            png_encoder=output_cfg.png_encoder,
            png_level=int(output_cfg.png_level),
            webp_method=int(output_cfg.webp_method),
        )

    def describe(self) -> str:
        """How the card names it: `webp (lossy, quality 95)`."""
        if self.format == "png":
            return f"png (lossless, zlib level {self.png_level})"
        if self.format == "webp" and self.lossless:
            return "webp (lossless)"
        return f"{self.format} (lossy, quality {self.quality})"


def default_library(enc: Encoding) -> str:
    if enc.format == "png":
        return enc.png_encoder
    return "pil" if enc.format == "webp" and enc.lossless else "imagecodecs"


def encode(pixels: np.ndarray, enc: Encoding, library: str | None = None) -> bytes:
    """The encoded image; `library` overrides the measured choice (the benchmark compares both)."""
    library = library or default_library(enc)
    if library == "imagecodecs":
        import imagecodecs

        if enc.format == "png":
            return bytes(imagecodecs.png_encode(pixels, level=enc.png_level))
        if enc.format == "jpeg":
            return bytes(imagecodecs.jpeg8_encode(pixels, level=enc.quality))
        # Pass lossless explicitly: imagecodecs' own default is lossless. The level of lossless webp is effort.
        level = 0 if enc.lossless else enc.quality
        return bytes(imagecodecs.webp_encode(pixels, level=level, lossless=enc.lossless, method=enc.webp_method))
    from PIL import Image

    buf, image = io.BytesIO(), Image.fromarray(pixels)
    if enc.format == "png":
        image.save(buf, format="PNG", compress_level=enc.png_level)
    elif enc.format == "jpeg":
        image.save(buf, format="JPEG", quality=enc.quality)
    else:
        quality = 0 if enc.lossless else enc.quality
        image.save(buf, format="WEBP", quality=quality, lossless=enc.lossless, method=enc.webp_method)
    return buf.getvalue()
