"""64-bit hashes of a batch's rows, vectorised: what the id map (launcher/ledger/idmap.py) keeps per source row.

- `id_hashes`: of each id's file stem (launcher/ledger/shards.py's file_stem), so two ids that would write the same
  image file collide like two equal ids do; equal hashes are then compared as strings, so a collision of two
  different stems costs a look, never a refusal.
- `row_hashes`: of everything a row contributes to its images (id, prompt, per-row overrides, reference hashes,
  kept columns), so an edited row is found without keeping its text; a column empty throughout is left out, as the
  shard fingerprint leaves it out (launcher/ledger/shards.py).
A Python loop costs ~1 us a row; pandas' siphash over Arrow strings ~0.1-0.4 us, which a 100M-row source needs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from launcher.ledger.shards import FILE_STEM_UNSAFE, UNHASHED

_SAFE = np.zeros(256, bool)
_SAFE[[ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"]] = True
_MIX = np.uint64(0x9E3779B97F4A7C15)
NOT_HASHED = UNHASHED | {"rejected"}


def _column_hash(col: pa.Array) -> np.ndarray:
    import pandas as pd

    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        values = pd.Series(pd.arrays.ArrowStringArray(pa.chunked_array([col]).cast(pa.large_string())))
    elif pa.types.is_integer(col.type):  # nulls filled (they are masked): the dtype must not depend on them
        values = pd.Series(col.fill_null(0).cast(pa.int64()).to_numpy())
    elif pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
        values = pd.Series(col.fill_null(0).cast(pa.float64()).to_numpy())
    else:  # a kept column of another type (lists, structs): its values as text
        values = pd.Series([str(v) for v in col.to_pylist()], dtype=object)
    return pd.util.hash_pandas_object(values, index=False).to_numpy(np.uint64)


def _salt(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def stems(ids: pa.Array) -> pa.Array:
    """The ids as file stems: a copy only where an id holds a character a file name cannot."""
    data = ids.buffers()[2]
    if data is None or _SAFE[np.frombuffer(data, np.uint8)].all():
        return ids
    return pc.replace_substring_regex(ids, FILE_STEM_UNSAFE, "_")


def id_hashes(ids: pa.Array) -> np.ndarray:
    return _column_hash(stems(ids))


def row_hashes(batch: pa.RecordBatch) -> np.ndarray:
    """One uint64 per row over its hashed columns, each salted by its name (a value moved to another column is a
    change). A null adds nothing, so a row hashes alike whatever the other rows of its batch hold."""
    out = np.zeros(batch.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for name, col in sorted(zip(batch.schema.names, batch.columns, strict=True), key=lambda nc: nc[0]):
            if name in NOT_HASHED or col.null_count == len(col):
                continue
            mixed = (out ^ (_column_hash(col) ^ _salt(name))) * _MIX
            mixed ^= mixed >> np.uint64(31)
            out = np.where(np.asarray(col.is_valid()), mixed, out) if col.null_count else mixed
    return out


def shard_fingerprint(total: int) -> str:
    """A shard's fingerprint in the id map: the sum of its rows' hashes mod 2**64, so one row's edit updates it
    without reading the others (launcher/ledger/idmap.py)."""
    return f"v3-{int(total) & (2**64 - 1):016x}"
