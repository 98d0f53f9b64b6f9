"""What a job will cost, said by its dry run before any chip is booked: how the shards spread over the replicas,
the output's bytes against the room at the target, the download and whether the repo is gated, and the expected
time from measured or published seconds per image (launcher/models/speeds.py; "unknown" where there are none).

Every line starts with `# ` like the dry run's other lines; a line that starts `# warning: ` is a finding the user
should act on before the run (idle replicas, an output that will not fit).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from launcher.sizing.space import estimate_bytes, free_bytes, size_text

SPEEDS_FILE = "launcher/models/speeds.py"


def cost_lines(pf) -> list[str]:
    from launcher.plan.sweep import n_variants
    from launcher.workers import resolve_workers

    cfg, plan = pf.cfg, pf.plan
    prompts = plan.prompts(plan.selected)
    images = prompts * cfg.generate.images_per_prompt * n_variants(cfg.generate)
    _, workers = resolve_workers(cfg)
    replicas = cfg.mesh.dp * workers
    return [
        *replica_lines(len(plan.selected), prompts, replicas, cfg.mesh.dp, workers),
        *output_lines(cfg, pf.store, images),
        download_line(cfg),
        time_line(cfg, pf.mesh.chip.name, images, replicas),
    ]


def replica_lines(shards: int, prompts: int, replicas: int, dp: int, workers: int) -> list[str]:
    who = f"dp={dp} x {workers} worker{'s' if workers > 1 else ''}"
    lines = [f"# replicas: {replicas} ({who}); {_n(shards, 'shard')} to generate, {shards / replicas:.1f} per replica"]
    if 0 < shards < replicas:
        fits = math.ceil(prompts / replicas)
        lines.append(
            f"# warning: {replicas - shards} of {replicas} replicas will sit idle: {_n(shards, 'shard')} for "
            f"{replicas} replicas; run.shard_size={fits} makes {replicas} shards of "
            f"these {prompts} prompts (in a new output folder: the shard size is part of its fingerprint)"
        )
    return lines


def output_lines(cfg, store, images: int) -> list[str]:
    need = estimate_bytes(cfg, images)
    g = cfg.generate
    what = f"about {size_text(need)} for {images} images ({cfg.output.format}, {g.height}x{g.width})"
    free = free_bytes(store) if store is not None else None
    if free is None:
        return [f"# output: {what} at {store}; free space not known there (an object store)"]
    lines = [f"# output: {what} at {store}; {size_text(free)} free there"]
    if free < need:
        lines.append(
            f"# warning: {store} has {size_text(free)} free but the images need about {size_text(need)}: the run "
            "would stop when it is full; free some space or choose another output.dir"
        )
    return lines


def download_line(cfg) -> str:
    from launcher.models.checkpoints import DOWNLOADS
    from launcher.sizing.model_files import cached_root, looks_like_hub_id

    path = str(cfg.model.path)
    if Path(path).is_dir():
        return f"# download: none: model.path is a local folder ({size_text(disk_bytes(Path(path)))} on disk)"
    if cfg.model.get("build"):
        return "# download: none: the project's tiny model, built here on first use"
    if not looks_like_hub_id(path):
        return f"# download: unknown: {path} is neither a folder nor a hub id"
    root = cached_root(path)
    if root is not None:
        return f"# download: none: {path} is in the Hugging Face cache ({size_text(disk_bytes(root))} on disk)"
    size, gated = DOWNLOADS.get(path, (None, None))
    amount = f"about {size:g} GB" if size else "size unknown (not in the published checkpoints' table)"
    if gated is None:
        access = "gated or not: not known here"
    elif not gated:
        access = "not gated"
    else:
        from huggingface_hub import get_token

        token = "a token is set here" if get_token() else "no token here: set HF_TOKEN or run `hf auth login`"
        access = f"gated: the account must accept its license at https://huggingface.co/{path} ({token})"
    return f"# download: {amount} for {path}, once, before the workers start; {access}"


def disk_bytes(root: Path) -> int:
    """Bytes of the files under root, each file once (a hub snapshot's files are links to shared blobs)."""
    seen, total = set(), 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue  # a dangling link: a blob not downloaded
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def time_line(cfg, chip: str, images: int, replicas: int) -> str:
    from launcher.models.speeds import speed

    path = str(cfg.model.path)
    ref = speed(path, chip)
    if ref is None:
        name = Path(path).name if Path(path).is_dir() else path
        return f"# time: unknown: no measured or published seconds per image for {name} on {chip} ({SPEEDS_FILE})"
    g, tp = cfg.generate, cfg.mesh.tp
    per_image = ref.seconds * (g.num_inference_steps / ref.steps) * (g.height * g.width / (ref.height * ref.width))
    per_image *= ref.tp / tp  # a replica of more chips, taken as that much faster
    total = images * per_image / replicas
    return (
        f"# time: about {duration(total)} for {images} images on {_n(replicas, 'replica')} "
        f"({per_image:.3g} s per image per replica: {ref.seconds:g} s at {ref.steps} steps, {ref.height}x{ref.width}, "
        f"tp={ref.tp} on {chip}, scaled linearly to this job's steps, pixels and tp; {ref.source}; start-up and "
        "download not counted)"
    )


def duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
