"""Seconds per image, measured or published, per model and chip kind: what a dry run's expected time comes from.

Each entry is one replica's time per image at the settings it was taken at (steps, height, width, tp: the chips of
that replica) and says where it comes from. A dry run scales it linearly to the job's steps and pixels and to its
chips per replica (tp), and divides by the replicas: coarse on purpose, it says hours or weeks, not minutes. A model
and chip with no entry is "unknown": add a line here when you measure one (the run record's images/s, or
tools/bench/), with its source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Speed:
    seconds: float  # per image, one replica, after warm-up
    steps: int
    height: int
    width: int
    tp: int  # chips in the replica that was timed
    source: str


# (hub id, or a local model folder's name) -> chip kind (mesh.chip) -> Speed
SPEEDS: dict[str, dict[str, Speed]] = {
    "black-forest-labs/FLUX.2-dev": {
        # Baseten, "Sub-second image generation with Flux.2 and Qwen-Image" (baseten.co/blog/sub-second-image-
        # generation-flux2-and-qwen-image): FP4 on a B200 takes 0.98 s, "5.4x faster than the H100 baseline", so
        # the baseline is about 5.3 s on one H100; steps and size not stated there: taken as the model's 28 steps
        # at 1024x1024.
        "h100": Speed(5.3, 28, 1024, 1024, 1, "published: Baseten's H100 baseline (0.98 s x 5.4)"),
    },
    "black-forest-labs/FLUX.2-klein-4B": {
        # InferenceBench, "FLUX.2-klein-4B on H100: Image Generation Benchmark" (inferencebench.io/blog/
        # flux2-klein-4b-image-generation-benchmark): 0.57 s at 1024x1024, 4 steps, one H100, diffusers.
        "h100": Speed(0.57, 4, 1024, 1024, 1, "published: InferenceBench, one H100, diffusers"),
    },
    "tiny-flux2": {
        # Measured here: `./launch.sh` (conf tiny, 64x64, 4 steps, tp=2 on 2 CPU processes) on a 2-core VM shared
        # with other jobs: 8 images in 1.2 s (its second shard; 20 images in 3.4 s of shards), start-up not counted.
        "cpu": Speed(0.15, 4, 64, 64, 2, "measured: conf tiny on a 2-core VM"),
    },
}


def speed(model: str, chip: str) -> Speed | None:
    """The entry for a hub id or a local folder (by its name), on a chip kind; None where there is none."""
    table = SPEEDS.get(model) or SPEEDS.get(model.rstrip("/").rsplit("/", 1)[-1], {})
    return table.get(chip)
