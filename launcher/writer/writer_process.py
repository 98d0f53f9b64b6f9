"""The writer process's side of launcher/writer/bgwriter.py: its output settings, store and encoders, set up once
by `_start_writer`, and the shards whose files it is writing (launcher/writer/stream.py)."""

from __future__ import annotations

import importlib.abc
import multiprocessing
import multiprocessing.util
import os
import sys
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from launcher.errors import die_with_parent
from launcher.ledger.store import Store
from launcher.writer.encode import Encoding, encode
from launcher.writer.stream import ShardStream
from launcher.writer.writer import warm_up

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


_STREAMS: dict[str, ShardStream] = {}  # in the writer process: the shards whose files are being written


def _add_batch(name: str, samples: list[dict]) -> None:
    """In the writer process: encode a batch's images and add them to its shard's files (temporary until
    `_finish`). On an error nothing of the shard's new files stays."""
    cfg, encoders = _OUT["cfg"], _OUT["encoders"]
    enc = Encoding.from_config(cfg)
    items = [(s.pop("pixels"), enc) for s in samples]
    if not (cfg.image_files or cfg.parquet or cfg.webdataset):  # none: state files only (a benchmark's control)
        return
    encoded: Iterable[bytes] = map(_encode, items)
    if encoders is not None:
        encoded = encoders.map(_encode, items, chunksize=max(1, len(items) // (4 * encoders._max_workers)))
    for s, data in zip(samples, encoded, strict=True):
        s["encoded"] = data
    del items
    stream = _STREAMS.get(name) or _STREAMS.setdefault(name, ShardStream(_OUT["store"], name, cfg))
    try:
        stream.add(samples)
    except BaseException:
        _abort(name)
        raise


def _finish(name: str) -> dict:
    """In the writer process: commit a shard's files (not its state: the caller writes it after this)."""
    stream = _STREAMS.pop(name, None) or ShardStream(_OUT["store"], name, _OUT["cfg"])
    try:
        return stream.commit()
    except BaseException:
        stream.abort()
        raise


def _abort(name: str) -> None:
    stream = _STREAMS.pop(name, None)
    if stream is not None:
        stream.abort()


def _write_files(name: str, samples: list[dict]) -> dict:
    """In the writer process: a whole shard's images encoded and written (tools/bench/writer.py measures it)."""
    _add_batch(name, samples)
    return _finish(name)


def _encode(item: tuple[np.ndarray, Encoding]) -> bytes:
    return encode(*item)
