"""Writing off the critical path: finished shards are encoded and written by a background thread.

Generation hands a shard over and goes on; it waits only when `output.queue_shards` shards are already
waiting (backpressure), and that wait is measured. PNG encoding, the expensive part (0.1-0.3 s per
1024x1024 image on one core), runs in a pool of processes that scales with the host's cores. Every outcome,
failures included, reaches the shard's state file, written last by this thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

from launcher import ledger
from launcher.store import Store
from launcher.writer import delete_shard_files, encode_png, warm_up, write_shard

logger = logging.getLogger(__name__)


@dataclass
class ShardJob:
    index: int
    name: str
    samples: list[dict]  # row fields plus "pixels" (uint8 HxWx3); empty when generation failed
    state: dict  # status, timings, error: completed by the writer
    order: dict[str, int] = field(default_factory=dict)
    queued: threading.Event = field(default_factory=threading.Event)


def default_encode_workers(writers_on_host: int) -> int:
    """Half the host's cores, shared by the writer ranks on it (the other half feeds the chips)."""
    return max(1, (os.cpu_count() or 1) // (2 * max(1, writers_on_host)))


class BackgroundWriter:
    def __init__(self, store: Store, output_cfg, encode_workers: int, on_recorded: Callable[[int], None]):
        self.store, self.cfg, self.on_recorded = store, output_cfg, on_recorded
        self.failed: list[int] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, output_cfg.queue_shards))
        # spawn, not fork: this process holds threads and process groups that a fork would copy half-alive.
        self._ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(encode_workers, mp_context=self._ctx)
        # Start the encoders now, while the model loads, not at the first shard: each spawns a Python and imports
        # this module and its encoder (~0.3 s of CPU) that would otherwise compete with the second shard's work.
        warm = (np.zeros((1, 1, 3), np.uint8), output_cfg.png_encoder, output_cfg.png_level)
        for _ in range(encode_workers):
            self._pool.submit(_encode, warm)
        self.fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self._thread.start()

    def submit(self, job: ShardJob) -> float:
        """Queue a shard for writing; the seconds spent waiting for room in the queue."""
        t0 = time.perf_counter()
        while True:  # never wait forever on a writer that died
            self._check_alive()
            try:
                self._queue.put(job, timeout=1.0)
                break
            except queue.Full:
                continue
        waited = time.perf_counter() - t0
        job.state.setdefault("stages", {})["writer_wait"] = round(waited, 4)
        job.queued.set()  # the state is complete: the writer may now record it
        return waited

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"the shard writer stopped: {self.fatal!r}")

    def _loop(self) -> None:
        try:
            if self.cfg.parquet:
                warm_up()
            while (job := self._queue.get()) is not None:
                self._record(job)
        except BaseException as e:  # the state of a shard could not be written: stop, loudly
            self.fatal = e
            logger.exception("the shard writer failed")

    def _record(self, job: ShardJob) -> None:
        # A shard being regenerated stops being done before its files change: a crash in between leaves it
        # pending, never "done" with a mix of old and new files.
        _retry(lambda: self.store.delete(ledger.state_rel(job.index)))
        try:
            self._write(job)
        except Exception as e:  # a write error fails that shard, never silently
            job.state.update(
                status="failed", error=f"{type(e).__name__} while writing: {e}", traceback=traceback.format_exc()
            )
            if isinstance(e, BrokenProcessPool):  # an encoder died (out of memory?): start new ones
                self._pool = ProcessPoolExecutor(self._pool._max_workers, mp_context=self._ctx)
        if job.state["status"] != "done":
            self.failed.append(job.index)
            _retry(lambda: delete_shard_files(self.store, job.name))  # no data of a failed shard stays readable
        job.queued.wait()
        job.state["finished_at"] = time.time()
        _retry(lambda: self.store.write_json(ledger.state_rel(job.index), job.state))
        _retry(lambda: self.on_recorded(job.index))

    def _write(self, job: ShardJob) -> None:
        if job.state["status"] != "done":
            return
        t0 = time.perf_counter()
        job.samples.sort(key=lambda s: job.order[s["id"]])
        encode = [(s.pop("pixels"), self.cfg.png_encoder, self.cfg.png_level) for s in job.samples]
        if self.cfg.png or self.cfg.parquet or self.cfg.webdataset:  # none: state files only (a benchmark's control)
            chunk = max(1, len(encode) // (4 * (self._pool._max_workers or 1)))
            for s, png in zip(job.samples, self._pool.map(_encode, encode, chunksize=chunk), strict=True):
                s["png"] = png
        write_shard(self.store, job.name, job.samples, self.cfg)
        job.state["write_seconds"] = round(time.perf_counter() - t0, 4)

    def close(self) -> None:
        """Write everything queued, then stop."""
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=1.0)
                break
            except queue.Full:
                continue
        self._thread.join()
        self._pool.shutdown()
        self._check_alive_or_done()

    def _check_alive_or_done(self) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"the shard writer stopped: {self.fatal!r}")


def _retry(action: Callable[[], object], attempts: int = 4) -> None:
    """Object stores fail transiently now and then: try again, 1 s, 2 s, 4 s later."""
    for n in range(attempts):
        try:
            action()
            return
        except Exception:
            if n == attempts - 1:
                raise
            time.sleep(2**n)


def _encode(item: tuple[np.ndarray, str, int]) -> bytes:
    pixels, encoder, level = item
    return encode_png(pixels, encoder, level)
