"""Room on the output: a warning at start when the selected shards clearly will not fit, and the last line of a
run that the disk (or a quota) stopped.

The estimate is coarse on purpose: bytes per pixel of each image format on photographic content (PNG at zlib
level 1 ~1.8, measured by tools/bench/writer.py; JPEG q95 ~0.35; WebP ~0.25), times the copies written (image
files, the Parquet's embedded images, WebDataset; one by default). It only has to catch a run that needs ten
times the room there is.
"""

from __future__ import annotations

import logging
import shutil

from launcher.errors import refused_write, unwritable
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)
BYTES_PER_PIXEL = {"png": 1.8, "jpeg": 0.35, "webp": 0.25}


def estimate_bytes(cfg, images: int) -> int:
    out = cfg.output
    # each copy of the images: files, the Parquet's embedded bytes (not with output.embed_images=false, whose rows
    # only point at the files), WebDataset
    files = out.get("image_files", out.get("png"))
    copies = bool(files) + bool(out.get("parquet") and out.get("embed_images", True)) + bool(out.get("webdataset"))
    per_pixel = BYTES_PER_PIXEL.get(out.get("format", "png"), 1.8)
    return int(images * cfg.generate.height * cfg.generate.width * per_pixel * max(copies, 1))


def free_bytes(store: Store) -> int | None:
    """Free bytes where the output lives (None on an object store: it has no such number)."""
    probe = _nearest_folder(store)
    return None if probe is None else shutil.disk_usage(probe).free


def _nearest_folder(store: Store):
    """The output folder, or the nearest folder above it that exists (it may not be made yet); None off disk."""
    if not store.is_local:
        return None
    probe = store.local()
    while not probe.exists():
        probe = probe.parent
    return probe


def warn_if_short(cfg, store: Store, images: int) -> None:
    free, need = free_bytes(store), estimate_bytes(cfg, images)
    if free is not None and free < need:
        logger.warning(
            "%s has %s free, but the %d images to generate need about %s; the run will stop when it is full",
            store,
            _size(free),
            images,
            _size(need),
        )


def stopped_by_space(cfg, store: Store, states: dict[int, dict], run_id: str, launcher_failed: bool) -> str | None:
    """The last line of a run that the output stopped (out of room, or read-only), or None. A worker that could
    not even write a claim or a state leaves no word of it, so a probe write and less room than one shard needs
    count too."""
    refused = probe_write(store)
    if refused is not None and refused_write(refused):
        why = str(refused).splitlines()[0][:200]
        return f"error: {store} refuses writes ({why}); make it writable again and run the same command to finish"
    said = any(st.get("out_of_space") for st in states.values() if st.get("run_id") == run_id)
    free = free_bytes(store)
    short = free is not None and free < estimate_bytes(cfg, cfg.run.shard_size)
    if not (said or launcher_failed or refused or short):
        return None
    if free_inodes(store) == 0:  # ENOSPC too, with bytes to spare: a file per image used up the file system's inodes
        space = _size(free) if free is not None else "unknown"
        return (
            f"error: {store} is out of inodes (0 free, {space} of space free); remove files (or move the output "
            "to a file system with more inodes, or use output.image_files=false) and run the same command again"
        )
    room = f"{_size(free)} free" if free is not None else "the store refused writes: a quota?"
    return f"error: {store} is out of space ({room}); free some space and run the same command again to finish"


def free_inodes(store: Store) -> int | None:
    """Files that may still be created where the output lives (None on an object store, or where unknown)."""
    import os

    probe = _nearest_folder(store)
    if probe is None:
        return None
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_favail if st.f_files else None  # 0 files in all: a file system without inodes (btrfs reports 0)


def probe_write(store: Store) -> OSError | None:
    """Whether the output takes a write now: the error of a small probe write, or None."""
    import os
    import socket

    rel = f"state/.probe-{socket.gethostname()}-{os.getpid()}"  # where the shards' states must go
    try:
        store.write_bytes(rel, b"")
        store.delete(rel)
    except OSError as e:
        return e
    return None


def best_effort(what: str, fn, *args) -> bool:
    """Run fn(*args), a write of the launcher's own bookkeeping; True if the output refused it (no room, or no
    permission): the run then says so in its last line instead of crashing."""
    try:
        fn(*args)
    except OSError as e:
        if not unwritable(e):
            raise
        logger.warning("could not write %s: %s", what, str(e).splitlines()[0][:200])
        return True
    return False


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


size_text = _size  # the dry run's cost lines (launcher/sizing/cost.py) say sizes the same way
