"""What a reference image must be for its row to be generated, checked at planning (launcher/sources/references.py):
an image, not cut short, within the family's pixels and the edit pipelines' own bounds, and read within a size
bound (a device or a growing file is no image). Each failure is one line naming the row and the fix."""

from __future__ import annotations

import hashlib

import pyarrow as pa

from launcher.errors import ConfigError

# The edit pipelines' own bounds on a reference (diffusers' Flux2ImageProcessor.check_image_input, which FLUX.2 and
# FLUX.2 [klein] call on each one): checked at planning, so the row fails there and not its shard at generation.
MIN_SIDE, MAX_ASPECT = 64, 8
MAX_BYTES = 256 << 20  # no reference within a family's pixel limit needs more (4 MP of 16-bit RGBA is 32 MiB)
DECODE_BYTES = 8 << 20  # references up to this size are decoded in full at planning (a cut-short file fails)
_CHUNK = 1 << 20


def check_image(head, where: str, what: str, max_pixels: int, size: int) -> tuple[int, int]:
    """(width, height) from an image's header, or a one-line error: not an image, smaller than the edit pipelines
    take, over the pixel limit, or (decoded in full where that is cheap: `size` bytes up to DECODE_BYTES) cut short."""
    from PIL import Image, UnidentifiedImageError

    w = h = None
    try:
        with Image.open(head) as im:
            w, h = im.size
            if w * h <= max_pixels and size <= DECODE_BYTES:
                im.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        if w is not None:  # the header was read: the data after it is what fails
            raise ConfigError(f"{where}: reference {what} is damaged or cut short ({e}); fix or replace it") from None
        raise ConfigError(f"{where}: reference {what} is not an image ({e}); fix that row") from None
    if w * h > max_pixels:
        raise ConfigError(
            f"{where}: reference {what} is {w}x{h} ({w * h / 2**20:.1f} megapixels), more than the "
            f"{max_pixels / 2**20:.1f} this model family takes; downscale it"
        )
    if min(w, h) < MIN_SIDE or max(w, h) > MAX_ASPECT * min(w, h):
        raise ConfigError(
            f"{where}: reference {what} is {w}x{h}; the edit pipelines take images of at least {MIN_SIDE} px a "
            f"side and at most {MAX_ASPECT}:1; use a larger image or crop it"
        )
    return w, h


def hash_file(path: str, where: str, max_pixels: int) -> tuple[str, tuple[int, int]]:
    from launcher.sources.prompts import filesystem

    try:
        fs, p = filesystem(path)
        with fs.open_input_file(p) as fh:
            h, size = hashlib.sha256(), 0
            while chunk := fh.read(_CHUNK):  # bounded: a device or a growing file is no image (/dev/zero)
                h.update(chunk)
                size += len(chunk)
                if size > MAX_BYTES:
                    raise ConfigError(
                        f"{where}: reference {path} is larger than {MAX_BYTES >> 20} MiB, more than an image within "
                        f"this family's {max_pixels / 2**20:.1f} megapixels needs; use a smaller file"
                    )
            fh.seek(0)
            dims = check_image(fh, where, path, max_pixels, size)
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: reference {path} does not exist; fix the path (relative paths start at the source file's folder)"
        ) from None
    except (OSError, ValueError, pa.ArrowException) as e:
        raise ConfigError(f"{where}: reference {path} cannot be read ({e}); fix the path or its permissions") from None
    return h.hexdigest(), dims


def check_output_size(where: str, h: int | None, w: int | None, sizes) -> None:
    """The pipeline meets each reference at the row's size (jobs/edit.py): below MIN_SIDE it refuses it."""
    h, w = h or (sizes.height if sizes else MIN_SIDE), w or (sizes.width if sizes else MIN_SIDE)
    if min(h, w) < MIN_SIDE or max(h, w) > MAX_ASPECT * min(h, w):
        raise ConfigError(
            f"{where}: the edit pipeline takes references at the output size, {w}x{h} here, which must be at least "
            f"{MIN_SIDE} px a side and at most {MAX_ASPECT}:1; use such a height and width"
        )
