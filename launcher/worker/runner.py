"""The worker's loop: read the run's plan, load the pipeline, generate shard by shard, record each outcome.

The ranks of a tp group run every shard in lockstep. After each batch they exchange their local errors over a
CPU group, so when any rank fails, all of them stop that shard at the same point and no rank is left waiting in
a collective that its peer abandoned. (A failure inside a sharded forward pass cannot be caught that way: the
peers block in the collective until `run.timeout_s`, then the job ends with a crash and the shard stays pending.)
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch.distributed as dist

from jobs import job_of
from launcher.errors import EXIT_OK, EXIT_SHARDS_FAILED
from launcher.ledger import states as ledger
from launcher.ledger.claims import Claims
from launcher.ledger.store import Store
from launcher.logs import STAGE_EVENTS
from launcher.plan.plan import PlanFile, plan_rel
from launcher.plan.shards import Shard, preference, sample_ids
from launcher.plan.sweep import n_variants, raw_sweep
from launcher.testing import hold_until
from launcher.worker.cache import apply_cache, digest
from launcher.worker.dist import Groups, ParallelDims, build_groups, init_distributed, resolve_device
from launcher.worker.execution import CompileStats, apply_compile, cache_hits
from launcher.worker.pipeline import load_pipeline
from launcher.worker.quality import load_scorer
from launcher.worker.staged import shard_steps
from launcher.worker.timing import StageTimer
from launcher.workers import resolve_workers
from launcher.writer.bgwriter import BackgroundWriter, ShardJob, default_encode_workers
from launcher.writer.columns import carry_kept

logger = logging.getLogger(__name__)
stage = logging.getLogger(STAGE_EVENTS)  # what rank 0 is doing before its first image: the launcher's bar shows it
WARMUP_STEPS = 2  # enough to trace every graph of a denoising step; steps are not part of the shape


class InjectedFailure(RuntimeError):
    """testing.fail_shards: a failure on purpose, to prove that a shard's ranks agree on its outcome."""


@dataclass
class Worker:
    cfg: object
    pipe: object
    groups: Groups
    timer: StageTimer | None
    writer: BackgroundWriter | None  # only on each tp group's first rank
    store: Store | None = None
    run_id: str = ""
    plan: PlanFile | None = None  # on each dp group's first rank
    claims: Claims | None = None  # on each dp group's first rank (the one that writes)
    shard: Shard | None = None  # the one being generated, with its rows
    rescanned: bool = False
    compile_stats: CompileStats = field(default_factory=CompileStats)
    warmed: set = field(default_factory=set)  # batch shapes seen (and, in compile mode, compiled)
    load_seconds: float = 0.0  # the model load, until a shard's stages report it
    scorer: object = None  # quality.* columns (launcher/worker/quality.py), on the rank that writes


def run_worker(cfg) -> int:
    device_type = resolve_device(cfg.device)
    device = init_distributed(device_type, cfg.run.timeout_s)
    mesh = ParallelDims(cfg.mesh.dp, cfg.mesh.tp, dist.get_world_size()).build_mesh(device_type)
    groups = build_groups(mesh)
    # Rank 0 is on the host whose launcher holds the lock and wrote the plan: its run id is the whole job's, and
    # names the plan file every host reads.
    box = [None]
    if dist.get_rank() == 0:
        box = [os.environ.get("MESHGEN_RUN_ID") or f"{socket.gethostname()}-{os.getppid()}"]
    dist.broadcast_object_list(box, src=0, group=groups.world_control)
    run_id = box[0]
    store = Store(cfg.output.dir)
    # Only the first rank of each dp group claims shards and reads their rows; it tells its tp peers.
    plan = PlanFile(store, plan_rel(run_id)) if groups.is_writer else None  # ty: ignore[invalid-argument-type]
    selected = plan.selected if plan else []
    index, count = resolve_workers(cfg)
    slot, slots = index * cfg.mesh.dp + groups.dp_rank, count * cfg.mesh.dp
    order = preference(selected, slot, slots)
    if plan:
        logger.info(
            "%d shards to generate by %d workers; dp replica %d tries %s first",
            len(selected),
            count,
            groups.dp_rank,
            selected[slot::slots],
        )
    claims = Claims(store, index, run_id)  # ty: ignore[invalid-argument-type]
    # Claim a first shard before the (long) model load, so workers starting together split the work at once.
    w = Worker(cfg, None, groups, None, None, store, run_id, plan=plan, claims=claims)  # ty: ignore[invalid-argument-type]
    first = _next_shard(w, claims, order)
    # Loading is collective across the whole world (transformers builds its mesh over every rank), so the
    # ranks skip it only all together, when no dp group got a shard.
    anyone = [None] * dist.get_world_size()
    dist.all_gather_object(anyone, first is not None, group=groups.world_control)
    if not any(anyone):  # other workers hold every shard
        dist.destroy_process_group()
        return EXIT_OK
    writer = None
    if groups.is_writer:  # before the model load, so that its encoder processes start meanwhile
        writers_here = max(1, cfg.mesh.dp // cfg.mesh.nodes)
        n_enc = cfg.output.encode_workers or default_encode_workers(writers_here)
        writer = BackgroundWriter(store, cfg.output, n_enc, claims.release, claims.still_held, claims.drop)
    t0 = time.perf_counter()
    w.pipe = pipe = load_pipeline(cfg, device, mesh)
    w.timer, w.writer = StageTimer(pipe, device), writer
    apply_cache(pipe, cfg)
    apply_compile(pipe, cfg, device_type, w.compile_stats)
    w.scorer = load_scorer(cfg, device) if groups.is_writer else None
    w.load_seconds = time.perf_counter() - t0  # counted in this worker's first shard's stages
    # The libraries and the model live as long as the worker: out of the collector's reach from here on, so that
    # no full collection walks them between batches (a pause in the loop that feeds the chip).
    gc.freeze()
    stage.info("compile warm-up" if cfg.execution.mode == "compile" else "generating")
    code = EXIT_OK
    i = first
    while i is not None:
        if not run_shard(w, w.shard) and cfg.run.on_error == "abort":  # ty: ignore[invalid-argument-type]
            code = EXIT_SHARDS_FAILED
            break
        if _out_of_space(w):  # the rest would only fail to be written; the launcher says so once
            break
        i = _next_shard(w, claims, order)
    if writer is not None:
        writer.close()
        if writer.failed and cfg.run.on_error == "abort":
            code = EXIT_SHARDS_FAILED
    logger.info("%d distinct batch shapes, %d compiles", len(w.warmed), w.compile_stats.compiles)
    dist.destroy_process_group()
    return code


def _next_shard(w: Worker, claims: Claims, order: list[int]) -> int | None:
    """The next shard this dp group generates: claimed by its first rank, told to the others."""
    box = [None]
    if w.groups.is_writer:
        while box[0] is None and not claims.out_of_space:
            if not order:  # once: shards that a live run held when we tried them, in case it died since
                if w.rescanned or not claims.skipped:
                    break
                w.rescanned = True
                order.extend(sorted(claims.skipped))
                claims.skipped.clear()
            i = order.pop(0)
            if claims.try_claim(i, w.plan.seen(i)):
                box[0] = w.plan.shard(i)
    if w.groups.tp_size > 1:
        dist.broadcast_object_list(box, group=w.groups.tp_control, group_src=0)
    w.shard = box[0]
    return None if box[0] is None else box[0].index


def _out_of_space(w: Worker) -> bool:
    """Whether the dp group's writer found the output full, told to its tp peers so that they stop together."""
    box = [bool(w.writer and w.writer.out_of_space)]
    if w.groups.tp_size > 1:
        dist.broadcast_object_list(box, group=w.groups.tp_control, group_src=0)
    return box[0]


def _agree(groups: Groups, error: str | None, mark: str | None = None) -> str | None:
    """Exchange local errors within the tp group; every rank gets the first error (or None).

    `mark`, when given, must be the same on every rank (a hash of the batch's images under step caching)."""
    if groups.tp_size == 1:  # alone: nobody to wait for
        return error
    errors = [None] * dist.get_world_size(groups.tp_control)
    dist.all_gather_object(errors, (error, mark), group=groups.tp_control)
    first = next((e for e, _ in errors if e), None)
    if first is None and len({m for _, m in errors}) > 1:
        first = "RuntimeError: the ranks of a tp group computed different images (different step-cache decisions)"
    return first


def _warm_up(w: Worker, batch, step) -> float:
    """Compile mode: run each new batch shape once before timing it, so compile time is reported apart."""
    key = (*batch.shape[:2], len(batch.rows))
    if key in w.warmed:
        return 0.0
    w.warmed.add(key)
    if w.cfg.execution.mode != "compile":
        return 0.0
    t0, stages = time.perf_counter(), w.timer.take()
    step(num_inference_steps=WARMUP_STEPS)
    w.timer.take()  # the warm-up's own stage times are not generation time
    w.timer.add(stages)
    seconds = time.perf_counter() - t0
    logger.info("warmed up shape %s in %.2f s (%d compiles so far)", key, seconds, w.compile_stats.compiles)
    stage.info("generating")
    return seconds


def run_shard(w: Worker, shard: Shard) -> bool:
    """Generate one shard and hand it to the writer, which records its outcome. True when generated."""
    cfg, groups = w.cfg, w.groups
    inject = shard.index in cfg.testing.fail_shards and groups.tp_rank == cfg.mesh.tp - 1
    prev = None
    if groups.is_writer:
        logger.info("shard %d: generating %d prompts", shard.index, len(shard.rows))
        ledger.clean_tmp(w.store, shard.index)  # ty: ignore[invalid-argument-type]
        prev = ledger.read_state(w.store, shard.index) if w.writer else None  # how many attempts failed alike  # ty: ignore[invalid-argument-type]
    started_at = time.time()
    start, warmup, compiles, hits = time.perf_counter(), 0.0, w.compile_stats.compiles, cache_hits()
    w.timer.take()
    error, job, waited, involved = None, job_of(cfg.job), 0.0, None
    n, v = cfg.generate.images_per_prompt, n_variants(cfg.generate) if raw_sweep(cfg.generate) else 0
    ids = [sid for r in shard.rows for sid in sample_ids(r["id"], n, v)]
    order = {sid: k for k, sid in enumerate(ids)}  # the rows' order, which the writer keeps (batches go by shape)
    try:  # an edit job reads the shard's references here: one gone since planning fails this shard only
        batches, local = job.shard_batches(shard.rows, cfg), None
    except Exception as e:
        batches, local = [], f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    error = _agree(groups, local)
    # set_lora_scales: the hook that re-fuses LoRAs per swept scale, once that exists (launcher/checks/sweep_checks.py)
    steps = shard_steps(w.pipe, [] if error else batches, cfg, job, set_lora_scales=None)  # tp ranks skip together
    for batch, step in steps:
        local = mark = new = None
        try:
            warmup += _warm_up(w, batch, step) if batch is not None else 0.0
            new = step()
            if cfg.testing.batch_sleep_s:  # not even a sleep(0)'s yield on the real path
                time.sleep(cfg.testing.batch_sleep_s)
            hold_until(cfg.testing.hold_batches_until)
            carry_kept(new, shard)  # dataset.keep_columns
            if w.scorer is not None:  # before the writer takes them: its columns are the shard's
                w.scorer.add_columns(new)
            mark = digest(new) if new and cfg.execution.cache != "none" else None
            if inject:
                raise InjectedFailure(f"testing.fail_shards: injected failure in shard {shard.index}")
        except Exception as e:  # any failure fails this shard only; the run goes on
            local = f"{type(e).__name__}: {e}{_rows_of(shard, batch)}\n{traceback.format_exc()}"
        error = _agree(groups, local, mark)
        if error:
            involved = batch.image_ids() if batch is not None else None
            break
        if new and w.writer is not None:  # handed over now: a worker holds a batch or two, never a shard
            for sample in new:
                sample["_pos"] = order[sample["id"]]
            waited += w.writer.add(shard.index, shard.name, new)
        new = None  # not held while the next batch generates
    steps.close()  # staged: the models back where the next shard expects them
    seconds = time.perf_counter() - start - warmup
    if w.writer is None:
        return error is None
    # Counted here, where the tokenizer is loaded anyway, not by the launcher after the run.
    prompts = [r["prompt"] for r in shard.rows]
    truncated = None if error else job.count_truncated(w.pipe, prompts, cfg.generate.max_sequence_length)
    state = {
        "status": "failed" if error else "done",
        "rows": len(ids),  # images
        **({"prompts": len(shard.rows)} if n > 1 or v else {}),
        "prompts_fingerprint": shard.fingerprint,
        "run_id": w.run_id,
        "attempt": w.claims.attempt(shard.index),  # which claim wrote it: see launcher/ledger/claims.py
        "seconds": round(seconds, 4),
        "images_per_s": None if error else round(len(ids) / seconds, 3),
        "stages": {"load": round(w.load_seconds, 4), **w.timer.take(), "warmup": round(warmup, 4)},
        "started_at": round(started_at, 3),
        "compiles": w.compile_stats.compiles - compiles,
        "compile_cache_hits": cache_hits() - hits,
        "truncated": truncated,
    }
    state["stages"]["writer_wait"] = round(waited, 4)
    if error:
        state.update(error=error.splitlines()[0], error_class=error.split(":", 1)[0], traceback=error)
        if involved:
            state["samples"] = involved[: ledger.SAMPLES_KEPT]
    w.load_seconds = 0.0
    w.writer.submit(ShardJob(shard.index, shard.name, [], state, prev=prev))
    return error is None


def _rows_of(shard: Shard, batch) -> str:
    """Where a failure happened, for its message: the shard and the ids of the batch's rows."""
    if batch is None:  # a stage over the whole shard (execution.staged): no one batch
        return f" (shard {shard.index})"
    ids = [r["id"] for r in batch.rows[: batch.n_real]]
    more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
    return f" (shard {shard.index}, rows {', '.join(map(repr, ids[:5]))}{more})"
