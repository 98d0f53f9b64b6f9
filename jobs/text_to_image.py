"""Text to image: turn one shard's rows into images with a diffusers pipeline.

Batches are formed within same-shape buckets and padded to `generate.batch_size` prompts, so every call has a
static shape (one compile per shape). With `generate.images_per_prompt=N` a call takes its prompts once and
denoises N images of each (`num_images_per_prompt`): the text encoder runs once per prompt. Each sample gets its
own CPU generator seeded from its id, so an image does not depend on which batch, rank or device produced it.
With `generate.sweep`, each batch of prompts (a "chunk") is followed by one batch per variant: the same rows and
seeds, the variant's settings (launcher/worker/staged.py encodes the chunk once for all of them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch

from launcher.models import family_of
from launcher.plan.shards import image_seeds, sample_ids
from launcher.plan.sweep import LORA_PREFIX, variants

logger = logging.getLogger(__name__)


SETTINGS = ("height", "width", "num_inference_steps", "guidance_scale")  # what a batch must share
_CASTS = (int, int, int, float)


@dataclass
class Batch:
    rows: list[dict]  # prompt rows, padded to batch_size by repeating the last row
    n_real: int  # how many of `rows` are real prompts; the padded outputs are dropped
    shape: tuple  # the values of SETTINGS
    seeds: list[int]  # one per image: images_per_prompt per row, prompt-major (the pipeline's order)
    images_per_prompt: int = 1
    chunk: int = 0  # the batch of prompts it denoises: batches of one chunk share their rows and embeddings
    variant: int | None = None  # with generate.sweep: v
    extra: dict = field(default_factory=dict)  # swept call settings beyond SETTINGS (true_cfg_scale)
    lora_scales: tuple | None = None  # with a swept LoRA scale: every LoRA's scale for this batch

    @property
    def settings(self) -> dict:
        return {**dict(zip(SETTINGS, self.shape, strict=True)), **self.extra}

    def image_ids(self) -> list[str]:
        """The sample id of each real image, in the pipeline's order (prompt-major)."""
        ids = [sid for row in self.rows[: self.n_real] for sid in sample_ids(row["id"], self.images_per_prompt)]
        return ids if self.variant is None else [f"{sid}@{self.variant}" for sid in ids]

    def samples(self, images) -> list[dict]:
        """One sample dict per real image: row fields, settings, seed and `pixels` (uint8 HxWx3)."""
        check_finite(self, images, "vae")  # the pipeline's images: what its VAE decoded
        n, v, out = self.images_per_prompt, self.variant, []
        for i, row in enumerate(self.rows[: self.n_real]):
            for k, sid in enumerate(sample_ids(row["id"], n)):
                sample = {"id": sid, "prompt": row["prompt"], "seed": self.seeds[i * n + k]}
                if n > 1 or v is not None:  # the column exists only then, so N = 1 writes what it always wrote
                    sample["prompt_id"] = row["id"]
                if v is not None:
                    sample.update(id=f"{sid}@{v}", variant=v)
                    if self.lora_scales is not None:
                        sample["lora_scales"] = list(self.lora_scales)
                sample["negative_prompt"] = row.get("negative_prompt")
                # The same rounding as diffusers' numpy_to_pil, without the PIL round trip.
                pixels = sample["pixels"] = (images[i * n + k] * 255).round().astype("uint8")
                # The size the image really has, whatever was asked for (a pipeline may round it).
                out.append({**sample, **self.settings, "height": pixels.shape[0], "width": pixels.shape[1]})
        return out


class NonFiniteOutput(ValueError):
    """A model gave NaN or infinite values for some samples: their images would be black or noise."""


def check_finite(batch: Batch, values, component: str) -> None:
    """Raise NonFiniteOutput naming the samples whose `values` (one per image, the pipeline's order; a torch tensor
    on the chip or a numpy array) are not all finite, and `component`, the model that produced them.

    Once cast to uint8 a NaN is a black pixel and nothing downstream can tell, so a shard of them would be `done`.
    """
    real = len(batch.image_ids())
    if isinstance(values, torch.Tensor):  # one reduction on the chip; only the per-sample flags cross
        ok = torch.isfinite(values[:real].reshape(real, -1)).all(1).tolist()
    else:
        import numpy as np

        ok = np.isfinite(np.asarray(values[:real]).reshape(real, -1)).all(1).tolist()
    bad = [sid for sid, fine in zip(batch.image_ids(), ok, strict=True) if not fine]  # ty: ignore[invalid-argument-type]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteOutput(
            f"the {component} gave non-finite values (NaN or inf) for sample {', '.join(map(repr, bad[:5]))}{more} "
            f"({len(bad)} of {real} in the batch), which would be saved as black images; an overflow in float16 is "
            "the usual cause (model.dtype=bfloat16 or float32 avoids it), else the model's weights"
        )


def make_batches(rows, gen, lora_scales: tuple = ()) -> list[Batch]:
    """Group rows into same-shape buckets (in order of first appearance), then cut padded batches.

    A row's own columns override the config's settings. The config is read once here, not per row: a config
    node's attribute costs microseconds, which add up to a per-image overhead on small models. With a sweep,
    each such batch of prompts is repeated once per variant, with the variant's values over the row's (a swept
    key is never a row's column) and the same seeds; `lora_scales` are the loaded LoRAs' scales.
    """
    sweep = variants(gen)
    defaults = (gen.height, gen.width, gen.num_inference_steps, gen.guidance_scale)
    base_seed, size, n = gen.seed, gen.batch_size, gen.images_per_prompt
    buckets: dict[tuple, list[dict]] = {}
    for r in rows:
        shape = tuple(cast(r.get(k, d)) for k, d, cast in zip(SETTINGS, defaults, _CASTS, strict=True))
        buckets.setdefault(shape, []).append(r)
    out = []
    for shape, members in buckets.items():
        for i in range(0, len(members), size):
            chunk = members[i : i + size]
            padded = chunk + [chunk[-1]] * (size - len(chunk))
            seeds = [s for r in padded for s in image_seeds(r, base_seed, n)]
            c = len(out)
            if sweep == [{}]:
                out.append(Batch(padded, len(chunk), shape, seeds, n, chunk=c))
                continue
            for v, values in enumerate(sweep):
                out.append(_variant(Batch(padded, len(chunk), shape, seeds, n, chunk=c), v, values, lora_scales))
    return out


def shard_batches(rows, cfg) -> list[Batch]:
    """The job's entry: a shard's rows as the batches of its pipeline calls (each variant's, with a sweep)."""
    return make_batches(rows, cfg.generate, loaded_lora_scales(cfg))


def loaded_lora_scales(cfg) -> tuple:
    """The scales the model's LoRAs were fused at (model.loras)."""
    return tuple(float(lo.get("scale", 1.0)) for lo in cfg.model.get("loras") or [])


def _variant(batch: Batch, v: int, values: dict, lora_scales: tuple) -> Batch:
    batch.variant = v
    batch.shape = tuple(cast(values.get(k, s)) for k, s, cast in zip(SETTINGS, batch.shape, _CASTS, strict=True))
    batch.extra = {k: float(values[k]) for k in ("true_cfg_scale",) if k in values}
    if any(k.startswith(LORA_PREFIX) for k in values):
        scales = list(lora_scales)
        for k, s in values.items():
            if k.startswith(LORA_PREFIX):
                scales[int(k.removeprefix(LORA_PREFIX))] = float(s)
        batch.lora_scales = tuple(scales)
    return batch


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
    if batch.images_per_prompt > 1:
        kwargs["num_images_per_prompt"] = batch.images_per_prompt
    kwargs = _family(type(pipe)).call_kwargs(kwargs)
    return {k: v for k, v in kwargs.items() if k in accepted}


def run_batch(
    pipe, batch: Batch, cfg, num_inference_steps: int | None = None, kwargs: dict | None = None
) -> list[dict]:
    """Generate one batch; one sample dict per real row: row fields, settings, seed and `pixels` (uint8 HxWx3).

    `num_inference_steps` overrides the batch's steps (a warm-up needs only enough to trace every graph);
    `kwargs`, the call's arguments where another job builds them (jobs/edit.py), else this job's.
    """
    kwargs = pipeline_kwargs(pipe, batch, cfg) if kwargs is None else kwargs
    if num_inference_steps is not None:
        kwargs["num_inference_steps"] = num_inference_steps
    kwargs["output_type"] = "np"
    with cache_context(pipe):
        images = pipe(**kwargs).images
    return [{**s, "model": cfg.model.path} for s in batch.samples(images)]


def cache_context(pipe):
    """The step cache's context around one call, where the pipeline does not open one itself (FLUX.2)."""
    name = _family(type(pipe)).cache_context
    if name and getattr(pipe.transformer, "is_cache_enabled", False):
        return pipe.transformer.cache_context(name)
    return contextlib.nullcontext()


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
