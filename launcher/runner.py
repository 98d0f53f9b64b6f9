"""The worker's loop: plan the shards, load the pipeline, generate shard by shard, record each outcome.

The ranks of a tp group run every shard in lockstep. After each batch they exchange their local errors over a
CPU group, so when any rank fails, all of them stop that shard at the same point and no rank is left waiting in
a collective that its peer abandoned. (A failure inside a sharded forward pass cannot be caught that way: the
peers block in the collective until `run.timeout_s`, then the job ends with a crash and the shard stays pending.)
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from jobs.text_to_image import generate_shard
from launcher import ledger
from launcher.dist import ParallelDims, build_groups, init_distributed, resolve_device
from launcher.errors import EXIT_OK, EXIT_SHARDS_FAILED
from launcher.pipeline import load_pipeline
from launcher.shards import Shard, replica_shards
from launcher.writer import encode_png, write_shard

logger = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """testing.fail_shards: a failure on purpose, to prove that a shard's ranks agree on its outcome."""


def run_worker(cfg) -> int:
    device_type = resolve_device(cfg.device)
    device = init_distributed(device_type, cfg.run.timeout_s)
    mesh = ParallelDims(cfg.mesh.dp, cfg.mesh.tp, dist.get_world_size()).build_mesh(device_type)
    groups = build_groups(mesh)
    # One rank decides what to run and tells the others: a fast replica may finish a shard before a slow
    # rank would have looked, and every rank must see the same selection.
    box = [ledger.plan(cfg) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.world_control)
    shards, selected = box[0]
    mine = replica_shards(selected, groups.dp_rank, cfg.mesh.dp)
    logger.info("%d shards selected for this worker; dp replica %d runs %s", len(selected), groups.dp_rank, mine)
    if not mine:
        dist.destroy_process_group()
        return EXIT_OK
    pipe = load_pipeline(cfg, device, mesh)
    out = Path(cfg.output.dir)
    code = EXIT_OK
    for i in mine:
        if not run_shard(pipe, shards[i], cfg, groups, out):
            logger.error("shard %d failed", i)
            if cfg.run.on_error == "abort":
                code = EXIT_SHARDS_FAILED
                break
    dist.destroy_process_group()
    return code


def _agree(groups, error: str | None) -> str | None:
    """Exchange local errors within the tp group; every rank gets the first error (or None)."""
    errors = [None] * dist.get_world_size(groups.tp_control)
    dist.all_gather_object(errors, error, group=groups.tp_control)
    return next((e for e in errors if e), None)


def run_shard(pipe, shard: Shard, cfg, groups, out: Path) -> bool:
    """Generate and write one shard; record its outcome in its state file. True when done."""
    start = time.time()
    if groups.is_writer:
        ledger.clean_tmp(out, shard.index)
    inject = shard.index in cfg.testing.fail_shards and groups.tp_rank == cfg.mesh.tp - 1
    samples, error = [], None
    batches = generate_shard(pipe, shard, cfg)
    while True:
        local = None
        try:
            batch = next(batches, None)
            if batch is None:
                break
            samples.extend(batch)
            if inject:
                raise InjectedFailure(f"testing.fail_shards: injected failure in shard {shard.index}")
        except Exception as e:  # any failure fails this shard only; the run goes on
            local = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        error = _agree(groups, local)
        if error:
            break
    if groups.is_writer and not error:
        try:
            order = {r["id"]: n for n, r in enumerate(shard.rows)}
            samples.sort(key=lambda s: order[s["id"]])
            for s in samples:
                s["png"] = encode_png(s.pop("image"))
            write_shard(out, shard.name, samples, png=cfg.output.png, parquet=cfg.output.parquet)
        except Exception as e:
            error = f"{type(e).__name__} while writing: {e}\n{traceback.format_exc()}"
    error = _agree(groups, error if groups.is_writer else None)
    if groups.is_writer:
        seconds = round(time.time() - start, 3)
        state = {
            "status": "failed" if error else "done",
            "rows": len(shard.rows),
            "seconds": seconds,
            "prompts_fingerprint": shard.fingerprint,
            "images_per_s": round(len(shard.rows) / seconds, 3) if not error else None,
        }
        if error:
            state.update(error=error.splitlines()[0], traceback=error)
        ledger.write_json(ledger.state_path(out, shard.index), state)
    return error is None
