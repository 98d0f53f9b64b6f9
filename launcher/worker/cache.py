"""Step caching (`execution.cache`): diffusers' own cache hooks on the transformer, opt in.

A cache reuses or extrapolates transformer outputs across denoising steps, so it changes the images (it is
part of the fingerprint). `execution.cache_options` go to diffusers' config class as they are; MagCache also
needs the step count, which defaults to `generate.num_inference_steps`. Which family supports which cache is
data in launcher/models/ (a cache that raises on a family's transformer is refused at preflight).

Under tensor parallelism each rank holds its own cache state, and every rank must skip the same steps: a rank
that skipped where its peer computed would leave the peer waiting in a collective. The decisions depend only on
the step index (TaylorSeer) or on the transformer's outputs, which the all-reduces make identical on every rank,
so they agree; the runner checks it per batch (same images on every rank, `same_on_every_rank`).
"""

from __future__ import annotations

import hashlib
import logging

logger = logging.getLogger(__name__)

CONFIG_CLASSES = {
    "taylorseer": "TaylorSeerCacheConfig",
    "first_block": "FirstBlockCacheConfig",
    "magcache": "MagCacheConfig",
}


def cache_config(name: str, options: dict, num_inference_steps: int):
    """diffusers' config object for cache `name` with `options` (raises TypeError/ValueError on bad options)."""
    import diffusers

    options = dict(options)
    if name == "magcache":
        options.setdefault("num_inference_steps", num_inference_steps)
        if options.get("mag_ratios") == "flux":  # the ratios diffusers ships, calibrated on FLUX.1
            from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

            options["mag_ratios"] = FLUX_MAG_RATIOS
    return getattr(diffusers, CONFIG_CLASSES[name])(**options)


def apply_cache(pipe, cfg) -> None:
    """Enable `execution.cache` on the transformer; a no-op for `none`."""
    name = cfg.execution.cache
    if name == "none":
        return
    from omegaconf import OmegaConf

    options = (
        OmegaConf.to_container(cfg.execution.cache_options)
        if OmegaConf.is_config(cfg.execution.cache_options)
        else cfg.execution.cache_options
    )
    pipe.transformer.enable_cache(cache_config(name, options, cfg.generate.num_inference_steps))  # ty: ignore[invalid-argument-type]
    logger.info("step cache %s on the transformer, options %s", name, options)


def digest(samples: list[dict]) -> str:
    """A hash of a batch's images: equal on every rank of a tp group when they took the same cache decisions."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s["pixels"].tobytes())
    return h.hexdigest()
