"""Where a batch's time goes: text encoding, denoising, VAE decoding (hooks on the pipeline's components).

On TPU and CUDA work is queued asynchronously, so a stage boundary synchronizes the device; there are three
such points per batch (end of text encoding, start and end of decoding), which costs little next to a batch.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch

STAGES = ("text_encoder", "denoise", "vae_decode")


class StageTimer:
    def __init__(self, pipe, device: torch.device):
        self.totals: dict[str, float] = defaultdict(float)
        self._device = device
        self._te_start = None
        self._denoise_start = None
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                module.register_forward_pre_hook(self._te_begin)
                module.register_forward_hook(self._te_end)
        # Denoising runs from the end of text encoding to the start of decoding. (No hook on the transformer:
        # in compile mode its hooks would be traced into the graph.)
        vae = getattr(pipe, "vae", None)
        if vae is not None:
            decode = vae.decode

            def timed_decode(*args, **kwargs):
                self._sync()
                t0 = time.perf_counter()
                if self._denoise_start is not None:
                    self.totals["denoise"] += t0 - self._denoise_start
                    self._denoise_start = None
                out = decode(*args, **kwargs)
                self._sync()
                self.totals["vae_decode"] += time.perf_counter() - t0
                return out

            vae.decode = timed_decode
        # A call from embeddings (a sweep's later variants) encodes nothing: its denoising starts when the
        # pipeline sets the scheduler's timesteps.
        scheduler = getattr(pipe, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "set_timesteps"):
            set_timesteps = scheduler.set_timesteps

            @functools.wraps(set_timesteps)  # the pipeline inspects its signature (sigmas, timesteps)
            def timed_set_timesteps(*args, **kwargs):
                if self._denoise_start is None:
                    self._denoise_start = time.perf_counter()
                return set_timesteps(*args, **kwargs)

            scheduler.set_timesteps = timed_set_timesteps

    def _sync(self) -> None:
        if self._device.type != "cpu":
            torch.accelerator.synchronize() if self._device.type != "tpu" else torch.tpu.synchronize()

    def _te_begin(self, module, args):
        self._te_start = time.perf_counter()

    def _te_end(self, module, args, output):
        self._sync()
        self._denoise_start = time.perf_counter()
        self.totals["text_encoder"] += self._denoise_start - self._te_start

    def add(self, stages: dict[str, float]) -> None:
        for k, v in stages.items():
            self.totals[k] += v

    def take(self) -> dict[str, float]:
        """The stage totals since the last call, rounded, and reset."""
        out = {k: round(self.totals.get(k, 0.0), 4) for k in STAGES}
        self.totals.clear()
        return out
