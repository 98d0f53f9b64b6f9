"""Edit: each row's reference images go to the pipeline's `image=`, its prompt (the instruction) to `prompt=`.

Diffusers' edit pipelines take one set of references per call (FLUX.2 repeats them over the whole batch;
Qwen-Image-Edit-Plus takes one prompt per call), so a call holds one row and its `images_per_prompt` images;
`generate.batch_size` does not apply. A shard's references are read when it is claimed
(launcher/sources/references.py, which checks each one's hash against the plan's), so a reference gone since
planning fails that shard alone, naming its path. Each is decoded to RGB with its full range (a 16-bit image
scaled, not clipped; CMYK through its ICC profile) and brought to the row's size (its bucket) as
`generate.reference_fit` says: `crop` (default: resized to cover the size, keeping its aspect ratio, then
center-cropped), `pad` (resized to fit inside, centered on black) or `stretch` (resized to the size, its aspect
ratio lost). So every call of a bucket has the same shapes: one compile per shape. Seeds, sample ids, sizes and
everything else are text-to-image's.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

from jobs import text_to_image
from jobs.text_to_image import Batch, count_truncated, make_batches
from launcher.sources.reference_reads import load_references

logger = logging.getLogger(__name__)
__all__ = ["EditBatch", "count_truncated", "pipeline_kwargs", "run_batch", "shard_batches"]


@dataclass
class EditBatch(Batch):
    lineage: list = field(default_factory=list)  # one {id, path, sha256} per reference
    data: list = field(default_factory=list)  # the references' bytes, as stored
    keep_bytes: bool = False  # output.reference_bytes
    fit: str = "crop"  # generate.reference_fit

    def references(self) -> list:
        """The references as PIL images, RGB, at the batch's size."""
        from PIL import Image

        h, w = self.shape[0], self.shape[1]
        out = []
        for b in self.data:
            with Image.open(io.BytesIO(b)) as im:
                out.append(fit_image(to_rgb(im), w, h, self.fit))
        return out

    def samples(self, images) -> list[dict]:
        out = super().samples(images)
        for s in out:
            s["reference"] = self.lineage
            if self.keep_bytes:  # a self-contained (before, instruction, after) row
                s["reference_image"] = {"bytes": self.data[0], "path": self.lineage[0]["path"]}
        return out


def to_rgb(im):
    """An 8-bit RGB copy of `im` with its whole range: PIL's convert("RGB") clips 16-bit grey ("I;16", "I") at 255
    (a full ramp comes out 99.6% white), so those are scaled by their top byte; RGB and CMYK go through their
    embedded ICC profile to sRGB where they have one (a Display P3 photo, a print file), else PIL's conversion."""
    import numpy as np
    from PIL import Image, ImageCms

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        grey = (np.clip(np.asarray(im, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=2))
    profile = im.info.get("icc_profile")
    if profile and im.mode in ("RGB", "RGBA", "CMYK"):
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            colour = im.convert("RGB") if im.mode == "RGBA" else im  # alpha dropped, as by the plain conversion
            return ImageCms.profileToProfile(colour, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
        except (ImageCms.PyCMSError, OSError) as e:  # a damaged profile, or one of another colour space: said once
            logger.warning(
                "a reference's ICC profile cannot be used on its %s pixels (%s); converting it without", im.mode, e
            )
    return im.convert("RGB")


def fit_image(im, w: int, h: int, fit: str = "crop"):
    """`im` at w x h: `crop` resizes it to cover w x h (keeping its aspect ratio) and cuts the middle out; `pad`
    resizes it to fit inside and centers it on black; `stretch` resizes it to w x h."""
    from PIL import Image

    lanczos = Image.Resampling.LANCZOS
    if im.size == (w, h):
        return im
    if fit == "stretch":
        return im.resize((w, h), lanczos)
    scale = (max if fit == "crop" else min)(w / im.width, h / im.height)
    size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
    if fit == "crop":
        size = (max(size[0], w), max(size[1], h))  # rounding must not leave a row uncovered
        left, top = (size[0] - w) // 2, (size[1] - h) // 2
        return im.resize(size, lanczos).crop((left, top, left + w, top + h))
    size = (min(size[0], w), min(size[1], h))
    canvas = Image.new("RGB", (w, h))  # black
    canvas.paste(im.resize(size, lanczos), ((w - size[0]) // 2, (h - size[1]) // 2))
    return canvas


def shard_batches(rows, cfg) -> list[EditBatch]:
    """One call per row, its references read now (a missing one raises, naming its path: the shard fails)."""
    from omegaconf import OmegaConf

    # The generation settings as they are (sweeps add keys), with one row a call.
    one = SimpleNamespace(**{**OmegaConf.to_container(cfg.generate, resolve=True), "batch_size": 1})  # ty: ignore[invalid-argument-type]
    out = []
    for b in make_batches(rows, one):
        refs = load_references(b.rows[0])
        out.append(
            EditBatch(
                **vars(b),  # whatever text-to-image's batches carry (sweeps add theirs)
                lineage=[lin for lin, _ in refs],
                data=[d for _, d in refs],
                keep_bytes=bool(cfg.output.reference_bytes),
                fit=cfg.generate.get("reference_fit", "crop"),
            )
        )
    return out


def pipeline_kwargs(pipe, batch: EditBatch, cfg) -> dict:
    kwargs = text_to_image.pipeline_kwargs(pipe, batch, cfg)
    kwargs["image"] = batch.references()
    return kwargs


def run_batch(pipe, batch: EditBatch, cfg, num_inference_steps: int | None = None) -> list[dict]:
    return text_to_image.run_batch(pipe, batch, cfg, num_inference_steps, pipeline_kwargs(pipe, batch, cfg))
