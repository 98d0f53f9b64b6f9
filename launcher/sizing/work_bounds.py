"""What the settings make one shard and one worker hold, bounded at planning as the weights are (mesh_plan.py).

A worker hands each batch's images to its writer as they are made (launcher/writer/bgwriter.py), so a shard's
size no longer decides a worker's memory; what still does is one pipeline call: `generate.batch_size` x
`generate.images_per_prompt` images, held as the call's float32 output and then as uint8 in the writer's queue.
A shard's files are still written whole (a temporary file, an object store's spool), so their size is bounded
too: `run.shard_size` x `generate.images_per_prompt` x the sweep's variants images. Both are refused at planning,
exit 2 with the numbers, where they used to be found by an out-of-memory kill or a full disk hours in.
"""

from __future__ import annotations

from launcher.errors import ConfigError

GIB = 1024**3
MAX_SHARD_BYTES = 20 * GIB  # one shard's files, estimated (space.py): one Parquet file a loader and an upload take
HOST_SHARE = 0.5  # of the host's memory, over its worker processes, for the images one call makes
FLOAT_BYTES = 4  # a pipeline's numpy output is float32 per channel


def largest_size(g) -> tuple[int, int]:
    """(height, width) of the largest images the settings ask for (a sweep may ask for larger than the config)."""
    from launcher.plan.sweep import sweep_of

    sweep = sweep_of(g)
    return max([g.height, *sweep.get("height", [])]), max([g.width, *sweep.get("width", [])])


def check_work(cfg, procs_per_host: int, host_bytes: int | None = None) -> None:
    """Refuse a shard whose files, or a call whose images, exceed their bounds (ConfigError naming the numbers)."""
    from launcher.plan.sweep import n_variants
    from launcher.sizing.space import estimate_bytes

    g = cfg.generate
    h, w = largest_size(g)
    variants = n_variants(g)
    per_prompt = g.images_per_prompt * variants
    images = cfg.run.shard_size * per_prompt
    est = estimate_bytes(cfg, images) * (h * w) // (g.height * g.width)
    if est > MAX_SHARD_BYTES:
        one = estimate_bytes(cfg, per_prompt) * (h * w) // (g.height * g.width)
        fix = (
            f"use run.shard_size={MAX_SHARD_BYTES // one} or less"
            if one <= MAX_SHARD_BYTES
            else "use fewer generate.images_per_prompt or sweep values"
        )
        raise ConfigError(
            f"one shard would hold {images} images (run.shard_size={cfg.run.shard_size} x generate.images_per_prompt="
            f"{g.images_per_prompt} x {variants} sweep variants) at up to {h}x{w}: about {est / GIB:.1f} GiB of "
            f"{cfg.output.format} files, above the {MAX_SHARD_BYTES / GIB:.0f} GiB bound of one shard; {fix}"
        )
    per_call = g.batch_size * g.images_per_prompt
    held = per_call * h * w * 3 * (FLOAT_BYTES + cfg.output.queue_shards + 2)
    total = host_bytes if host_bytes is not None else _host_bytes()
    share = total * HOST_SHARE / max(1, procs_per_host)
    if held > share:
        raise ConfigError(
            f"one pipeline call makes {per_call} images (generate.batch_size={g.batch_size} x "
            f"generate.images_per_prompt={g.images_per_prompt}) at up to {h}x{w}: a worker holds about "
            f"{held / GIB:.1f} GiB of them (the call's float32 output, then up to output.queue_shards="
            f"{cfg.output.queue_shards} + 2 batches as uint8), above {share / GIB:.1f} GiB (half of this host's "
            f"{total / GIB:.0f} GiB over its {procs_per_host} processes); use a smaller generate.batch_size or "
            "generate.images_per_prompt"
        )


def _host_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total
