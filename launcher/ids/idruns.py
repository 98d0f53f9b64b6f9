"""Sorted runs of id hashes: which ids the id map has seen, and duplicate ids found with bounded memory.

Every id the map ever gave a shard has its hash (launcher/ids/rowhash.py) in one of the runs
(`sources/hashes-*.u64`, sorted unique little-endian uint64, read memory-mapped), so a rerun asks "is this id new?"
with a binary search instead of reading the source's other files. New ids' hashes are spilled to disk in 16 buckets by
their top bits while the source streams; each bucket is then sorted alone (1/16 of the hashes in memory at once),
equal neighbours are the candidate duplicates, and the concatenated buckets are the new run. A 100M-id source
needs 800 MB of run on disk and ~60 MB of memory for it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

BUCKET_BITS = 4
MAX_RUNS = 8  # more than this, and a plan merges them into one


class Spill:
    """New ids' hashes as they stream, bucketed on disk; `finish` sorts them into one run and names the doubles."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: list[BinaryIO] = [open(self.folder / f"bucket-{b:02d}.u64", "ab") for b in range(1 << BUCKET_BITS)]  # noqa: SIM115
        self.count = 0

    def add(self, hashes: np.ndarray) -> None:
        hashes = np.asarray(hashes, np.uint64)
        buckets = (hashes >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)
        order = np.argsort(buckets, kind="stable")
        edges = np.searchsorted(buckets[order], np.arange((1 << BUCKET_BITS) + 1))
        for b, f in enumerate(self._files):
            if edges[b + 1] > edges[b]:
                f.write(hashes[order[edges[b] : edges[b + 1]]].astype("<u8").tobytes())
        self.count += len(hashes)

    def finish(self, out: Path) -> np.ndarray:
        """Write the sorted unique hashes to `out`; return those that occur more than once (sorted, unique)."""
        for f in self._files:
            f.close()
        doubles = []
        with open(out, "wb") as run:
            for b in range(1 << BUCKET_BITS):
                path = self.folder / f"bucket-{b:02d}.u64"
                part = np.fromfile(path, dtype="<u8")
                part.sort()
                if len(part) > 1:
                    same = part[1:] == part[:-1]
                    if same.any():
                        doubles.append(np.unique(part[1:][same]))
                        part = np.unique(part)
                run.write(part.tobytes())
                path.unlink()
        return np.concatenate(doubles) if doubles else np.zeros(0, np.uint64)


def open_runs(paths: list[Path]) -> list[np.ndarray]:
    return [np.memmap(p, dtype="<u8", mode="r") if p.stat().st_size else np.zeros(0, np.uint64) for p in paths]


def seen(runs: list[np.ndarray], hashes: np.ndarray) -> np.ndarray:
    """Whether each hash is in any run (binary search in each; the runs stay on disk)."""
    found = np.zeros(len(hashes), bool)
    for run in runs:
        if len(run) == 0:
            continue
        at = np.searchsorted(run, hashes)
        at[at == len(run)] = len(run) - 1
        found |= np.asarray(run[at]) == hashes
    return found


def merged(runs: list[Path], out: Path) -> None:
    """One sorted run of all of `runs`, with bounded memory (through a Spill of their contents, bucket by bucket)."""
    with tempfile.TemporaryDirectory(prefix="meshgen-runs-") as tmp:
        spill = Spill(Path(tmp) / "spill")
        for run in open_runs(runs):
            for at in range(0, len(run), 1 << 22):
                spill.add(np.asarray(run[at : at + (1 << 22)]))
        spill.finish(out)
