"""A shard's work as steps: one per batch, or staged (encode every prompt, then denoise, then decode).

How a shard is run, whatever the job: the job (jobs/<job>.py, handed in) says what a batch's pipeline call is
(`pipeline_kwargs`, `run_batch`); this module decides when each model runs, and parks the idle one.

Unstaged, each step is one pipeline call. Staged (`execution.staged`), the shard's prompts are encoded first
(the family's `encode`, in the same batches), then every batch is denoised from its embeddings
(`prompt_embeds=...`, `output_type="latent"`), then every batch is decoded by the VAE (the family's
`decode_latents`; without one the pipeline decodes each batch itself). The computation is the same, batch for
batch, so the images equal the unstaged ones.

Why: each model then runs as one stretch per shard.
- With `execution.offload=model`, accelerate's hooks move a model to the chip when it runs and the previous one
  off it; between the stages nothing else runs, so each model moves once per shard instead of once per call.
  The pipeline's own "free the models" at the end of each call is held back until the shard's end.
- Without offload (and on tensor-parallel meshes, where offload is refused), `execution.release_text_encoder`
  parks the model a stage does not use in host memory (launcher/worker/residency.py): the transformer while
  the text encoder encodes, the text encoder while the transformer denoises. The chip then holds at most
  max(text encoder, transformer) + VAE of weights instead of their sum, at the cost of moving both across
  once per shard. (Loading still holds both for a moment.)
Embeddings wait in host memory between the stages (FLUX.2: ~15 MB per prompt at 512 tokens).

With `generate.sweep`, the batches of one chunk of prompts (one per variant) share its embeddings: staged or not,
a prompt is encoded once for all its variants, where the family declares its encoding (else every call encodes).
A batch's LoRA scales go to `set_lora_scales` before it runs (a hook for re-fusing; a swept LoRA scale is
refused at preflight until it does something).
"""

from __future__ import annotations

import functools
import logging

import torch

import jobs.text_to_image as text_to_image
from jobs.text_to_image import _family, cache_context, check_finite
from launcher.worker.residency import Parked, park, unpark

logger = logging.getLogger(__name__)


def shard_steps(pipe, batches: list, cfg, job=text_to_image, set_lora_scales=None):
    """Yield (batch or None, step) pairs; `step(num_inference_steps=None)` returns the samples it finished.

    A batch comes with the step that denoises it, for the compile warm-up. Close the generator when stopping
    early: it puts the models back as they were.
    """
    set_lora = set_lora_scales or (lambda scales: None)
    if not cfg.execution.staged:
        if any(b.variant is not None for b in batches) and _family(type(pipe)).encode is not None:
            yield from _shared_encoding(pipe, batches, cfg, job, set_lora)
            return
        for b in batches:
            yield b, functools.partial(_with_scales, set_lora, b, job.run_batch, pipe, b, cfg)
        return
    yield from _staged(pipe, batches, cfg, job, set_lora)


def _with_scales(set_lora, b, fn, *args, **kwargs):
    set_lora(b.lora_scales)
    return fn(*args, **kwargs)


def _key(b) -> tuple:
    """What a batch's embeddings depend on: its prompts, and the LoRA scales (a LoRA may touch the text encoder)."""
    return b.chunk, b.lora_scales


@torch.no_grad()
def _encode(pipe, b, cfg, job) -> dict:
    return _family(type(pipe)).encode(pipe, job.pipeline_kwargs(pipe, b, cfg))


def _denoise(pipe, b, cfg, job, embeds: dict, num_inference_steps, output_type: str):
    """One pipeline call from the batch's embeddings instead of its prompts."""
    kwargs = job.pipeline_kwargs(pipe, b, cfg)
    for k in ("prompt", "negative_prompt"):
        kwargs.pop(k, None)
    device = pipe._execution_device
    kwargs.update({k: v.to(device) for k, v in embeds.items()})
    if num_inference_steps is not None:
        kwargs["num_inference_steps"] = num_inference_steps
    kwargs["output_type"] = output_type
    with cache_context(pipe):
        return pipe(**kwargs).images


def _shared_encoding(pipe, batches: list, cfg, job, set_lora):
    """Unstaged sweep: each chunk's prompts encoded by its first batch, its other variants reuse the embeddings
    (only the current chunk's are kept)."""
    held: dict[tuple, dict] = {}
    try:
        for b in batches:

            def step(b=b, num_inference_steps=None):
                set_lora(b.lora_scales)
                if _key(b) not in held:
                    held.clear()
                    held[_key(b)] = _encode(pipe, b, cfg, job)
                images = _denoise(pipe, b, cfg, job, held[_key(b)], num_inference_steps, "np")
                return [{**s, "model": cfg.model.path} for s in b.samples(images)]

            yield b, step
    finally:
        held.clear()


class _Swap:
    """Which model is parked: none, the text encoder, or the transformer (one per pipeline, kept across shards)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.parked: Parked | None = None
        self.which: str | None = None

    def only(self, name: str) -> None:
        """Keep `name` on the chip and park the other one of text_encoder / transformer."""
        other = "transformer" if name == "text_encoder" else "text_encoder"
        if self.which == other:
            return
        if self.parked is not None:
            unpark(self.parked)
        model = getattr(self.pipe, other, None)
        self.parked, self.which = (park(model), other) if model is not None else (None, None)

    def restore(self) -> None:
        if self.parked is not None:
            unpark(self.parked)
        self.parked = self.which = None


_SWAPS: dict[int, _Swap] = {}  # one pipeline per worker process; its parked model stays parked between shards


def _swap_of(pipe) -> _Swap:
    return _SWAPS.setdefault(id(pipe), _Swap(pipe))


def _staged(pipe, batches: list, cfg, job, set_lora):
    fam = _family(type(pipe))
    offload = cfg.execution.offload == "model"
    swap = _swap_of(pipe) if cfg.execution.release_text_encoder and not offload else None
    free_models = pipe.maybe_free_model_hooks
    # Within the shard, a call's end only resets the step cache's state; the models stay where they are.
    pipe.maybe_free_model_hooks = lambda: [
        c._reset_stateful_cache() for c in pipe.components.values() if hasattr(c, "_reset_stateful_cache")
    ]
    embeds: dict[tuple, dict] = {}
    latents: dict[int, object] = {}
    try:
        if swap:
            swap.only("text_encoder")
        first = {}  # each chunk (and LoRA scales) is encoded once, by its first batch
        for b in batches:
            first.setdefault(_key(b), b)
        for key, b in first.items():

            def encode(key=key, b=b, **_):
                set_lora(b.lora_scales)
                embeds[key] = {k: v.to("cpu") for k, v in _encode(pipe, b, cfg, job).items()}
                return []

            yield None, encode
        if swap:
            swap.only("transformer")
        out_type = "latent" if fam.decode_latents else "np"
        for i, b in enumerate(batches):

            def denoise(i=i, b=b, num_inference_steps=None):
                set_lora(b.lora_scales)
                latents[i] = _denoise(pipe, b, cfg, job, embeds[_key(b)], num_inference_steps, out_type)
                return []

            yield b, denoise
        embeds.clear()
        for i, b in enumerate(batches):

            @torch.no_grad()
            def decode(i=i, b=b, **_):
                out = latents.pop(i)
                if fam.decode_latents:  # the latents are at hand here: name the transformer where they went bad
                    check_finite(b, out, "transformer")
                images = fam.decode_latents(pipe, out, b.shape[0], b.shape[1]) if fam.decode_latents else out
                return [{**s, "model": cfg.model.path} for s in b.samples(images)]

            yield None, decode
    finally:
        del pipe.maybe_free_model_hooks  # the class's own again
        if offload:
            free_models()  # every model off the chip at the shard's end, as after an unstaged call
