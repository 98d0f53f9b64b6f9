"""Text to image: turn one shard's rows into images with a diffusers pipeline.

Batches are formed within same-shape buckets and padded to `generate.batch_size`, so every call has a static
shape (one compile per shape). Each sample gets its own CPU generator seeded from its id, so an image does not
depend on which batch, rank or device produced it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from launcher.ledger.shards import row_seed
from launcher.models import family_of

logger = logging.getLogger(__name__)


SETTINGS = ("height", "width", "num_inference_steps", "guidance_scale")  # what a batch must share
_CASTS = (int, int, int, float)


@dataclass
class Batch:
    rows: list[dict]  # padded to batch_size by repeating the last row
    n_real: int  # how many of `rows` are real samples; the padded outputs are dropped
    shape: tuple  # the values of SETTINGS
    seeds: list[int]  # one per row

    @property
    def settings(self) -> dict:
        return dict(zip(SETTINGS, self.shape, strict=True))


def make_batches(rows, gen) -> list[Batch]:
    """Group rows into same-shape buckets (in order of first appearance), then cut padded batches.

    A row's own columns override the config's settings. The config is read once here, not per row: a config
    node's attribute costs microseconds, which add up to a per-image overhead on small models.
    """
    defaults = (gen.height, gen.width, gen.num_inference_steps, gen.guidance_scale)
    base_seed, size = gen.seed, gen.batch_size
    buckets: dict[tuple, list[dict]] = {}
    for r in rows:
        shape = tuple(cast(r.get(k, d)) for k, d, cast in zip(SETTINGS, defaults, _CASTS, strict=True))
        buckets.setdefault(shape, []).append(r)
    out = []
    for shape, members in buckets.items():
        for i in range(0, len(members), size):
            chunk = members[i : i + size]
            padded = chunk + [chunk[-1]] * (size - len(chunk))
            out.append(Batch(padded, len(chunk), shape, [row_seed(r, base_seed) for r in padded]))
    return out


@functools.cache
def _accepted(pipeline_class) -> frozenset[str]:
    return frozenset(inspect.signature(pipeline_class.__call__).parameters)


@functools.cache
def _family(pipeline_class):
    return family_of(pipeline_class.__name__)


def pipeline_kwargs(pipe, batch: Batch, cfg) -> dict:
    """Keyword arguments of one pipeline call, keeping only those the pipeline accepts."""
    accepted = _accepted(type(pipe))
    kwargs = {
        "prompt": [r["prompt"] for r in batch.rows],
        **batch.settings,
        # Generators live on CPU: initial latents are drawn there, whatever the device.
        "generator": [torch.Generator("cpu").manual_seed(s) for s in batch.seeds],
        "max_sequence_length": cfg.generate.max_sequence_length,
        **cfg.model.call_kwargs,
    }
    if "negative_prompt" in accepted and any(r.get("negative_prompt") for r in batch.rows):
        kwargs["negative_prompt"] = [r.get("negative_prompt") or "" for r in batch.rows]
    kwargs = _family(type(pipe)).call_kwargs(kwargs)
    return {k: v for k, v in kwargs.items() if k in accepted}


def run_batch(pipe, batch: Batch, cfg, num_inference_steps: int | None = None) -> list[dict]:
    """Generate one batch; one sample dict per real row: row fields, settings, seed and `pixels` (uint8 HxWx3).

    `num_inference_steps` overrides the batch's steps (a warm-up needs only enough to trace every graph).
    """
    kwargs = pipeline_kwargs(pipe, batch, cfg)
    if num_inference_steps is not None:
        kwargs["num_inference_steps"] = num_inference_steps
    kwargs["output_type"] = "np"
    images = pipe(**kwargs).images
    common = {"model": cfg.model.path, **batch.settings}
    return [
        {
            "id": row["id"],
            "prompt": row["prompt"],
            "seed": seed,
            "negative_prompt": row.get("negative_prompt"),
            **common,
            # The same rounding as diffusers' numpy_to_pil, without the PIL round trip.
            "pixels": (image * 255).round().astype("uint8"),
        }
        for row, seed, image in zip(batch.rows[: batch.n_real], batch.seeds, images, strict=False)
    ]


def count_truncated(pipe, prompts: list[str], max_sequence_length: int) -> int:
    """How many prompts are longer than `max_sequence_length` tokens, so the text encoder sees them cut.

    Not an error (the pipeline truncates them), but worth a line in the run summary. The prompts are tokenized as
    the pipeline does, which the family knows (FLUX.2 adds a system message that counts towards the limit).
    """
    tokenizers = [t for t in (getattr(pipe, n, None) for n in ("tokenizer", "tokenizer_2", "tokenizer_3")) if t]
    if not tokenizers or not prompts:
        return 0
    saved = [t.model_max_length for t in tokenizers]
    for t in tokenizers:
        t.model_max_length = 2**62  # long on purpose: no warning
    try:
        ids = _family(type(pipe)).token_ids(pipe, prompts) or []
    finally:
        for t, m in zip(tokenizers, saved, strict=True):
            t.model_max_length = m
    return sum(len(i) > max_sequence_length for i in ids)
