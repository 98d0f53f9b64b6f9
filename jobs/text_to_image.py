"""Text to image: turn one shard's rows into images with a diffusers pipeline.

Batches are formed within same-shape buckets and padded to `generate.batch_size`, so every call has a static
shape (one compile per shape). Each sample gets its own CPU generator seeded from its id, so an image does not
depend on which batch, rank or device produced it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from launcher.shards import Shard, row_seed

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    rows: list[dict]  # padded to batch_size by repeating the last row
    n_real: int  # how many of `rows` are real samples; the padded outputs are dropped
    shape: tuple  # (height, width, steps, guidance): what a batch must share


def sample_settings(row: dict, gen) -> dict:
    """The generation settings of one sample: the config's, overridden by the row's own columns."""
    return {
        "height": int(row.get("height", gen.height)),
        "width": int(row.get("width", gen.width)),
        "num_inference_steps": int(row.get("num_inference_steps", gen.num_inference_steps)),
        "guidance_scale": float(row.get("guidance_scale", gen.guidance_scale)),
    }


def make_batches(rows, gen) -> list[Batch]:
    """Group rows into same-shape buckets (in order of first appearance), then cut padded batches."""
    buckets: dict[tuple, list[dict]] = {}
    for r in rows:
        s = sample_settings(r, gen)
        buckets.setdefault(tuple(s.values()), []).append(r)
    out = []
    for shape, members in buckets.items():
        for i in range(0, len(members), gen.batch_size):
            chunk = members[i : i + gen.batch_size]
            out.append(Batch(chunk + [chunk[-1]] * (gen.batch_size - len(chunk)), len(chunk), shape))
    return out


def pipeline_kwargs(pipe, batch: Batch, cfg) -> dict:
    """Keyword arguments of one pipeline call, keeping only those the pipeline accepts."""
    height, width, steps, guidance = batch.shape
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs = {
        "prompt": [r["prompt"] for r in batch.rows],
        "height": height,
        "width": width,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        # Generators live on CPU: initial latents are drawn there, whatever the device.
        "generator": [torch.Generator("cpu").manual_seed(row_seed(r, cfg.generate.seed)) for r in batch.rows],
        "max_sequence_length": cfg.generate.max_sequence_length,
        "output_type": "pil",
        **dict(cfg.model.call_kwargs),
    }
    if "negative_prompt" in accepted and any(r.get("negative_prompt") for r in batch.rows):
        kwargs["negative_prompt"] = [r.get("negative_prompt") or "" for r in batch.rows]
    for key in ("text_encoder_out_layers",):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    return {k: v for k, v in kwargs.items() if k in accepted}


def generate_shard(pipe, shard: Shard, cfg) -> Iterator[list[dict]]:
    """Yield, batch by batch, one sample dict per real row: row fields, settings, seed and a PIL `image`."""
    for batch in make_batches(shard.rows, cfg.generate):
        images = pipe(**pipeline_kwargs(pipe, batch, cfg)).images
        yield [
            {
                "id": row["id"],
                "prompt": row["prompt"],
                "seed": row_seed(row, cfg.generate.seed),
                "negative_prompt": row.get("negative_prompt"),
                "model": cfg.model.path,
                **sample_settings(row, cfg.generate),
                "image": image,
            }
            for row, image in zip(batch.rows[: batch.n_real], images[: batch.n_real], strict=True)
        ]
