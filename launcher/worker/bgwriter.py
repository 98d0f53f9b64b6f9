"""Writing off the critical path: finished shards are encoded and written by a writer process.

Generation hands a shard over and goes on; it waits only when `output.queue_shards` shards are already
waiting (backpressure), and that wait is measured. The work itself runs in a spawned writer process: image
encoding (0.1-0.3 s per 1024x1024 PNG on one core, 4 ms per JPEG, 50 ms per WebP; see launcher/worker/encode.py),
spread over `encode_workers` processes that scale with the host's cores, Parquet and file writes, uploads.
The generating process keeps only a thread that hands each shard over and then writes its state file, so file
I/O never holds that process's GIL while it feeds the chips (done in a thread there, it cost ~11 ms of CPU per
16-image shard plus the GIL hand-offs of every syscall). Every outcome, failures included, reaches the shard's
state file, written last.
"""

from __future__ import annotations

import importlib.abc
import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from omegaconf import OmegaConf

from launcher.errors import die_with_parent, unwritable
from launcher.ledger import states as ledger
from launcher.ledger.store import Store
from launcher.logs import SHARD_EVENTS
from launcher.worker.encode import Encoding, encode
from launcher.worker.writer import delete_shard_files, warm_up, write_shard

logger = logging.getLogger(__name__)
events = logging.getLogger(SHARD_EVENTS)


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
    def __init__(
        self,
        store: Store,
        output_cfg,
        encode_workers: int,
        on_recorded: Callable[[int], None],
        still_held: Callable[[int], bool] = lambda i: True,
        on_lost: Callable[[int], None] = lambda i: None,
    ):
        """on_recorded(shard): its state is written; still_held(shard): our claim on it is still the newest;
        on_lost(shard): it was taken over, and this writer left it alone."""
        self.store, self.on_recorded, self.still_held, self.on_lost = store, on_recorded, still_held, on_lost
        self.failed: list[int] = []
        self.out_of_space = False  # a write found the output full: generating more would only fail too
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, output_cfg.queue_shards))
        # spawn, not fork: this process holds threads and process groups that a fork would copy half-alive.
        self._ctx = multiprocessing.get_context("spawn")
        # Plain values, not the config's dataclass: unpickling that would import launcher.config, and Hydra with it,
        # in the writer process (0.1 s of its start).
        is_cfg = OmegaConf.is_config(output_cfg)
        plain = SimpleNamespace(**(OmegaConf.to_container(output_cfg, resolve=True) if is_cfg else vars(output_cfg)))
        self._start = (store.uri, plain, encode_workers, os.getpid())
        self._process = self._new_process()
        self.fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self._thread.start()

    def _new_process(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(1, mp_context=self._ctx, initializer=_start_writer, initargs=self._start)
        pool.submit(int)  # start it now, while the model loads: it spawns, imports and warms up (~1 s of CPU)
        return pool

    def submit(self, job: ShardJob) -> float:
        """Queue a shard for writing; the seconds spent waiting for room in the queue."""
        t0 = time.perf_counter()
        while True:  # never wait forever on a writer that died
            self._raise_if_failed()
            try:
                self._queue.put(job, timeout=1.0)
                break
            except queue.Full:
                continue
        waited = time.perf_counter() - t0
        job.state.setdefault("stages", {})["writer_wait"] = round(waited, 4)
        job.queued.set()  # the state is complete: the writer may now record it
        return waited

    def _raise_if_failed(self) -> None:
        # Until close(), the thread ends only by failing, and it sets `fatal` before it ends.
        if self.fatal is not None:
            raise RuntimeError(f"the shard writer stopped: {self.fatal!r}")

    def _loop(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                self._record(job)
        except BaseException as e:  # the state of a shard could not be written: stop, loudly
            self.fatal = e
            logger.exception("the shard writer failed")

    def _record(self, job: ShardJob) -> None:
        if not self.still_held(job.index):  # taken over (we looked dead): its files are the new holder's
            return self._lost(job)
        try:
            # A shard being regenerated stops being done before its files change: a crash in between leaves it
            # pending, never "done" with a mix of old and new files.
            self.store.delete(ledger.state_rel(job.index))
            self._write(job)
        except Exception as e:  # a write error fails that shard, never silently
            job.state.update(
                status="failed", error=f"{type(e).__name__} while writing: {e}", traceback=traceback.format_exc()
            )
            if unwritable(e):
                self.out_of_space = job.state["out_of_space"] = True
                logger.error("shard %d: %s takes no more writes (%s); this worker stops", job.index, self.store, e)
            if isinstance(e, BrokenProcessPool):  # the writer process or an encoder died (out of memory?)
                self._process = self._new_process()
        if job.state["status"] != "done":
            self.failed.append(job.index)
            try:  # no data of a failed shard stays readable
                delete_shard_files(self.store, job.name)
            except OSError as e:  # said in its state; the shard is failed either way
                job.state["error"] += f"; its files could not be removed: {type(e).__name__}: {e}"
        job.queued.wait()
        if not self.still_held(job.index):  # taken over while we wrote: its state is the new holder's to write
            return self._lost(job)
        job.state["finished_at"] = time.time()
        try:
            self.store.write_json(ledger.state_rel(job.index), job.state)  # the store retries transient errors
        except OSError as e:
            if not unwritable(e):
                raise
            # Not even the state fits: the shard stays pending (never wrongly done), and the launcher says why.
            self.out_of_space = True
            logger.error("shard %d: %s takes no more writes; its state could not be written either", job.index, e)
            return
        self.on_recorded(job.index)
        _log_event(job)

    def _lost(self, job: ShardJob) -> None:
        logger.warning(
            "shard %d: another run took its claim over (this run looked dead to it); leaving the shard to it",
            job.index,
        )
        self.on_lost(job.index)

    def _write(self, job: ShardJob) -> None:
        if job.state["status"] != "done":
            return
        t0 = time.perf_counter()
        job.samples.sort(key=lambda s: job.order[s["id"]])
        job.state.update(self._process.submit(_write_files, job.name, job.samples).result())  # files, data_bytes
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
        try:  # the encoders first, from inside their parent: a nested pool left to the writer's exit deadlocks it
            self._process.submit(_stop_encoders).result(timeout=120)
        except Exception as e:  # noqa: BLE001 - a writer that died has no encoders left to stop
            logger.warning("could not stop the encoder processes: %s", e)
        self._process.shutdown()
        self._raise_if_failed()


def _log_event(job: ShardJob) -> None:
    st = job.state
    if st["status"] == "done":
        events.info("shard %d done: %d images in %.1f s", job.index, st["rows"], st["seconds"])
    else:
        events.warning("shard %d failed: %s", job.index, st.get("error", "").split("\n")[0])


WRITER_NICENESS = 10  # added to the writer process's nice value (0 is the default, 19 the lowest priority)

# The writer process's side: its output settings, store and encoders, set up once by _start_writer.
_OUT: dict = {}


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """pyarrow imports pandas, where installed, the first time it converts a Python list (Table.from_pylist), only
    to check that the values are no pandas objects: 0.4 s of a writer process's start. The writer is given none."""

    def find_spec(self, name: str, path=None, target=None) -> None:
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError("the writer process does without pandas", name=name)
        return None


def _start_writer(uri: str, output_cfg, encode_workers: int, parent: int) -> None:
    """Initializer of the writer process: open the store, start the encoders, and pay every first-use cost now
    (imports, pyarrow's first Parquet write) rather than while the second shard generates."""
    die_with_parent(parent)
    sys.meta_path.insert(0, _WithoutPandas())
    # Below the generating process, and its encoders inherit it: where cores are short, a shard written a moment
    # later costs nothing, while a denoising step delayed is throughput lost (the queue's backpressure bounds it).
    os.nice(WRITER_NICENESS)
    warm = (np.zeros((8, 8, 3), np.uint8), Encoding.from_config(output_cfg))
    encoders = None
    if encode_workers > 1:  # one encoder needs no pool: the writer process encodes itself
        ctx = multiprocessing.get_context("spawn")
        encoders = ProcessPoolExecutor(
            encode_workers, mp_context=ctx, initializer=die_with_parent, initargs=(os.getpid(),)
        )
        # Stopped before this process exits: multiprocessing joins children before the executor's own exit hook
        # would tell them to stop, so without this a nested pool hangs the exit.
        multiprocessing.util.Finalize(encoders, encoders.shutdown, exitpriority=10)
        for _ in range(encode_workers):
            encoders.submit(_encode, warm)
    _encode(warm)
    if output_cfg.parquet:
        warm_up()
    _OUT.update(store=Store(uri), cfg=output_cfg, encoders=encoders)


def _stop_encoders() -> None:
    """In the writer process, before it exits: stop its encoder pool and wait for it."""
    encoders = _OUT.pop("encoders", None)
    if encoders is not None:
        encoders.shutdown(wait=True)


def _write_files(name: str, samples: list[dict]) -> dict:
    """In the writer process: encode a shard's images, then write its files (not its state: the caller does)."""
    cfg, encoders = _OUT["cfg"], _OUT["encoders"]
    enc = Encoding.from_config(cfg)
    items = [(s.pop("pixels"), enc) for s in samples]
    if cfg.image_files or cfg.parquet or cfg.webdataset:  # none: state files only (a benchmark's control)
        encoded: Iterable[bytes] = map(_encode, items)
        if encoders is not None:
            encoded = encoders.map(_encode, items, chunksize=max(1, len(items) // (4 * encoders._max_workers)))
        for s, data in zip(samples, encoded, strict=True):
            s["encoded"] = data
    return write_shard(_OUT["store"], name, samples, cfg)


def _encode(item: tuple[np.ndarray, Encoding]) -> bytes:
    return encode(*item)
