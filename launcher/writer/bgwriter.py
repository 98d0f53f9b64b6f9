"""Writing off the critical path: each batch's images are encoded and written by a writer process as they are made.

Generation hands each batch over (`add`) and goes on, then the shard's outcome (`submit`); it waits only when
`output.queue_shards` batches or shard ends are already waiting (backpressure), and that wait is measured. So a
worker holds a few batches of images, never a shard's (launcher/writer/stream.py writes them as they come).
The work itself runs in a spawned writer process (launcher/writer/writer_process.py): image
encoding (0.1-0.3 s per 1024x1024 PNG on one core, 4 ms per JPEG, 50 ms per WebP; see launcher/writer/encode.py),
spread over `encode_workers` processes that scale with the host's cores, Parquet and file writes, uploads.
The generating process keeps only a thread that hands each shard over and then writes its state file, so file
I/O never holds that process's GIL while it feeds the chips (done in a thread there, it cost ~11 ms of CPU per
16-image shard plus the GIL hand-offs of every syscall). Every outcome, failures included, reaches the shard's
state file, written last.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from types import SimpleNamespace

from omegaconf import OmegaConf

from launcher.errors import unwritable
from launcher.ledger import states as ledger
from launcher.ledger.store import Store
from launcher.logs import SHARD_EVENTS
from launcher.writer.writer import delete_shard_files
from launcher.writer.writer_process import _abort, _add_batch, _finish, _start_writer, _stop_encoders

logger = logging.getLogger(__name__)
events = logging.getLogger(SHARD_EVENTS)


@dataclass
class ShardJob:
    index: int
    name: str
    samples: list[dict]  # row fields plus "pixels" (uint8 HxWx3) not handed over by `add`; empty when it failed
    state: dict  # status, timings, error: completed by the writer
    order: dict[str, int] = field(default_factory=dict)  # the order of `samples`
    queued: threading.Event = field(default_factory=threading.Event)
    prev: dict | None = None  # the shard's state before this attempt: how many attempts failed alike (`attempts`)


@dataclass
class _Batch:
    index: int
    name: str
    samples: list[dict]  # row fields plus "pixels"


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
        self.held_images: int = 0  # images handed over and not yet written, and the most at once
        self.peak_images: int = 0  # images handed over and not yet written, and the most at once
        self._open: set[int] = set()  # shards with batches handed over and no end yet
        self._broken: dict[int, BaseException] = {}  # shard -> the error that stopped its files being written
        self.out_of_space = False  # a write found the output full: generating more would only fail too
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, output_cfg.queue_shards))
        # spawn, not fork: this process holds threads and process groups that a fork would copy half-alive.
        self._ctx = multiprocessing.get_context("spawn")
        # Plain values, not the config's dataclass: unpickling that would import launcher.config, and Hydra with it,
        # in the writer process (0.1 s of its start).
        is_cfg = OmegaConf.is_config(output_cfg)
        plain = SimpleNamespace(**(OmegaConf.to_container(output_cfg, resolve=True) if is_cfg else vars(output_cfg)))  # ty: ignore[invalid-argument-type]
        self._start = (store.uri, plain, encode_workers, os.getpid())
        # Writer processes are started from one thread that lives until close(): each asks the kernel to kill it
        # when the thread that started it ends (errors.py die_with_parent), and the shard-writer thread, which
        # replaces a process that died, ends before close() stops the process's encoders.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="writer-spawner")
        self._process: ProcessPoolExecutor = self._new_process()  # declared: `pool = self._process` is never None
        self.fatal: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self._thread.start()

    def _new_process(self) -> ProcessPoolExecutor:
        def start() -> ProcessPoolExecutor:
            pool = ProcessPoolExecutor(1, mp_context=self._ctx, initializer=_start_writer, initargs=self._start)
            pool.submit(int)  # started now, while the model loads: it spawns, imports and warms up (~1 s of CPU)
            return pool

        return self._spawner.submit(start).result()

    def _renew(self, broken: ProcessPoolExecutor) -> None:
        """A new writer process in place of `broken`, which died (out of memory?) and is reaped here. Once per
        death: a shard that fails later for that death must not replace the new process too (it would outlive us)."""
        if self._process is broken:
            self._process = self._new_process()
        broken.shutdown(wait=True, cancel_futures=True)

    def add(self, index: int, name: str, samples: list[dict]) -> float:
        """Hand one batch's samples of shard `index` over (written under temporary names until its `submit`);
        the seconds spent waiting for room in the queue."""
        self.held_images += len(samples)
        self.peak_images = max(self.peak_images, self.held_images)
        return self._put(_Batch(index, name, samples))

    def submit(self, job: ShardJob) -> float:
        """Queue a shard's end (and any samples not handed over by `add`); the seconds spent waiting for room."""
        self.held_images += len(job.samples)
        self.peak_images = max(self.peak_images, self.held_images)
        waited = self._put(job)
        stages = job.state.setdefault("stages", {})
        stages["writer_wait"] = round(stages.get("writer_wait", 0.0) + waited, 4)
        job.queued.set()  # the state is complete: the writer may now record it
        return waited

    def _put(self, item) -> float:
        t0 = time.perf_counter()
        while True:  # never wait forever on a writer that died
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=1.0)
                break
            except queue.Full:
                continue
        return time.perf_counter() - t0

    def _raise_if_failed(self) -> None:
        # Until close(), the thread ends only by failing, and it sets `fatal` before it ends.
        if self.fatal is not None:
            raise RuntimeError(f"the shard writer stopped: {self.fatal!r}")

    def _loop(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                self._stream(job) if isinstance(job, _Batch) else self._record(job)
                job = None  # not held while waiting for the next one
        except BaseException as e:  # the state of a shard could not be written: stop, loudly
            self.fatal = e
            logger.exception("the shard writer failed")

    def _begin(self, index: int) -> None:
        # A shard being regenerated stops being done before its files change: a crash in between leaves it
        # pending, never "done" with a mix of old and new files.
        if index not in self._open:
            self._open.add(index)
            self.store.delete(ledger.state_rel(index))

    def _stream(self, b: _Batch) -> None:
        n, samples, b.samples, pool = len(b.samples), b.samples, [], self._process
        try:
            if b.index in self._broken:
                return
            if not self.still_held(b.index):  # a dropped batch: the shard can never be done by us with it
                self._broken[b.index] = RuntimeError(f"our claim on shard {b.index} was taken over mid-shard")
                return
            self._begin(b.index)
            pool.submit(_add_batch, b.name, samples).result()
        except Exception as e:  # said when the shard ends: it fails, and its later batches are dropped
            self._broken[b.index] = e
            if isinstance(e, BrokenProcessPool):
                self._renew(pool)
        finally:
            self.held_images -= n

    def _record(self, job: ShardJob) -> None:
        n = len(job.samples)
        if not self.still_held(job.index):  # taken over (we looked dead): its files are the new holder's
            self._discard(job)
            self._open.discard(job.index), self._broken.pop(job.index, None)
            self.held_images -= n
            return self._lost(job)
        broke, pool = self._broken.get(job.index), self._process
        try:
            self._begin(job.index)
            if broke is not None:
                raise broke
            self._write(job)
        except Exception as e:  # a write error fails that shard, never silently
            job.state.update(
                status="failed",
                error=f"{type(e).__name__} while writing: {e}",
                error_class=type(e).__name__,
                traceback="".join(traceback.format_exception(e)),
            )
            if unwritable(e):
                self.out_of_space = job.state["out_of_space"] = True
                logger.error("shard %d: %s takes no more writes (%s); this worker stops", job.index, self.store, e)
            if isinstance(e, BrokenProcessPool) and e is not broke:  # it died now (an earlier death: renewed)
                self._renew(pool)
        finally:
            self._open.discard(job.index)
            self._broken.pop(job.index, None)
            self.held_images -= n
            job.samples = []
        if job.state["status"] != "done":
            self.failed.append(job.index)
            self._discard(job)
            try:  # no data of a failed shard stays readable
                delete_shard_files(self.store, job.name)
            except OSError as e:  # said in its state; the shard is failed either way
                job.state["error"] += f"; its files could not be removed: {type(e).__name__}: {e}"
        job.queued.wait()
        if not self.still_held(job.index):  # taken over while we wrote: its state is the new holder's to write
            return self._lost(job)
        job.state["finished_at"] = time.time()
        job.state["attempts"] = ledger.attempts_of(job.prev, job.state)
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

    def _discard(self, job: ShardJob) -> None:
        """Drop what the writer process holds of the shard's files (their temporary names go with it)."""
        try:
            self._process.submit(_abort, job.name).result()
        except Exception as e:  # noqa: BLE001 - a writer that died holds nothing any more
            logger.warning("shard %d: its unfinished files could not be dropped: %s", job.index, e)

    def _write(self, job: ShardJob) -> None:
        if job.state["status"] != "done":
            return
        t0 = time.perf_counter()
        if job.samples:
            job.samples.sort(key=lambda s: job.order[s["id"]])
            self._process.submit(_add_batch, job.name, job.samples).result()
        job.state.update(self._process.submit(_finish, job.name).result())  # files, data_bytes
        job.state["write_seconds"] = round(time.perf_counter() - t0, 4)

    def close(self) -> None:
        """Write everything queued, then stop (once: a second call only says again what failed)."""
        if self._closed:
            return self._raise_if_failed()
        self._closed = True
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
        self._spawner.shutdown()
        self._raise_if_failed()


def _log_event(job: ShardJob) -> None:
    st = job.state
    if st["status"] == "done":
        events.info("shard %d done: %d images in %.1f s", job.index, st["rows"], st["seconds"])
    else:
        events.warning("shard %d failed: %s", job.index, st.get("error", "").split("\n")[0])
