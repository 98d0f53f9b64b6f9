"""Edit: each row's reference images go to the pipeline's `image=`, its prompt (the instruction) to `prompt=`.

Diffusers' edit pipelines take one set of references per call (FLUX.2 repeats them over the whole batch;
Qwen-Image-Edit-Plus takes one prompt per call), so a call holds one row and its `images_per_prompt` images;
`generate.batch_size` does not apply. A shard's references are read when it is claimed
(launcher/ledger/references.py, which checks each one's hash against the plan's), so a reference gone since
planning fails that shard alone, naming its path. Each is decoded to RGB and resized to the row's size (its
bucket), so every call of a bucket has the same shapes: one compile per shape. Seeds, sample ids, sizes and
everything else are text-to-image's.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

from jobs import text_to_image
from jobs.text_to_image import Batch, count_truncated, make_batches
from launcher.ledger.reference_reads import load_references

logger = logging.getLogger(__name__)
__all__ = ["EditBatch", "count_truncated", "pipeline_kwargs", "run_batch", "shard_batches"]


@dataclass
class EditBatch(Batch):
    lineage: list = field(default_factory=list)  # one {id, path, sha256} per reference
    data: list = field(default_factory=list)  # the references' bytes, as stored
    keep_bytes: bool = False  # output.reference_bytes

    def references(self) -> list:
        """The references as PIL images, RGB, at the batch's size."""
        from PIL import Image

        h, w = self.shape[0], self.shape[1]
        out = []
        for b in self.data:
            with Image.open(io.BytesIO(b)) as im:
                im = im.convert("RGB")
            out.append(im if im.size == (w, h) else im.resize((w, h), Image.Resampling.LANCZOS))
        return out

    def samples(self, images) -> list[dict]:
        out = super().samples(images)
        for s in out:
            s["reference"] = self.lineage
            if self.keep_bytes:  # a self-contained (before, instruction, after) row
                s["reference_image"] = {"bytes": self.data[0], "path": self.lineage[0]["path"]}
        return out


def shard_batches(rows, cfg) -> list[EditBatch]:
    """One call per row, its references read now (a missing one raises, naming its path: the shard fails)."""
    from omegaconf import OmegaConf

    # The generation settings as they are (sweeps add keys), with one row a call.
    one = SimpleNamespace(**{**OmegaConf.to_container(cfg.generate, resolve=True), "batch_size": 1})
    out = []
    for b in make_batches(rows, one):
        refs = load_references(b.rows[0])
        out.append(
            EditBatch(
                **vars(b),  # whatever text-to-image's batches carry (sweeps add theirs)
                lineage=[lin for lin, _ in refs],
                data=[d for _, d in refs],
                keep_bytes=bool(cfg.output.reference_bytes),
            )
        )
    return out


def pipeline_kwargs(pipe, batch: EditBatch, cfg) -> dict:
    kwargs = text_to_image.pipeline_kwargs(pipe, batch, cfg)
    kwargs["image"] = batch.references()
    return kwargs


def run_batch(pipe, batch: EditBatch, cfg, num_inference_steps: int | None = None) -> list[dict]:
    return text_to_image.run_batch(pipe, batch, cfg, num_inference_steps, pipeline_kwargs(pipe, batch, cfg))
