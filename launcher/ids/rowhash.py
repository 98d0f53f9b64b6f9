"""64-bit hashes of a batch's rows, vectorised: what the id map (launcher/ids/idmap.py) keeps per source row.

- `id_hashes`: of each id's file stem (launcher/plan/shards.py's file_stem), so two ids that would write the same
  image file collide like two equal ids do; equal hashes are then compared as strings, so a collision of two
  different stems costs a look, never a refusal.
- `row_hashes`: of everything a row contributes to its images (id, prompt, per-row overrides, reference hashes,
  kept columns), so an edited row is found without keeping its text; a column empty throughout is left out, as the
  shard fingerprint leaves it out (launcher/plan/shards.py).
A Python loop costs ~1 us a row, pandas' siphash over Arrow strings 0.3-0.4 us; strings here are hashed from Arrow's
buffer with numpy (`_string_hash`), ~0.02 us an id, which a 100M-row source needs. Not a cryptographic hash: it
finds edits and candidate duplicates, and every candidate duplicate is then compared as text.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from launcher.plan.shards import FILE_STEM_UNSAFE, UNHASHED

_SAFE = np.zeros(256, bool)
_SAFE[[ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"]] = True
_MIX = np.uint64(0x9E3779B97F4A7C15)
NOT_HASHED = UNHASHED | {"rejected"}


def _column_hash(col: pa.Array) -> np.ndarray:
    import pandas as pd

    if pa.types.is_string(col.type):
        return _string_hash(col)
    if pa.types.is_large_string(col.type):
        return _string_hash(col.cast(pa.string()))
    if pa.types.is_integer(col.type):  # nulls filled (they are masked): the dtype must not depend on them
        values = pd.Series(col.cast(pa.int64(), safe=False).fill_null(0).to_numpy())  # a uint64 past 2**63 wraps
    elif pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
        values = pd.Series(col.cast(pa.float64()).fill_null(0).to_numpy())  # a bool column takes no 0 as a null
    else:  # a kept column of another type (lists, structs): its values as text
        values = pd.Series([str(v) for v in col.to_pylist()], dtype=object)
    return pd.util.hash_pandas_object(values, index=False).to_numpy(np.uint64)


_WORD = 8
_CAP = 256  # bytes hashed word by word; a longer string's rest is hashed by pandas (rare: prompts are short)
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def _string_hash(col: pa.Array) -> np.ndarray:
    """Each string's bytes read 8 at a time from Arrow's buffer (a strided view, one copy of at most _CAP bytes a
    row), mixed multiply-xorshift: ~0.02 us an id, ~0.13 us a 40-byte prompt, where pandas takes 0.3-0.4."""
    n = len(col)
    offsets = np.frombuffer(col.buffers()[1], np.int32)[col.offset : col.offset + n + 1].astype(np.int64)
    data = col.buffers()[2]
    data = np.frombuffer(data, np.uint8)[offsets[0] : offsets[-1]] if data is not None else np.zeros(0, np.uint8)
    lens = np.diff(offsets)
    width = min(_CAP, max(_WORD, -(-int(lens.max(initial=0)) // _WORD) * _WORD))
    padded = np.concatenate([data, np.zeros(width, np.uint8)])
    words = np.lib.stride_tricks.sliding_window_view(padded, width)[offsets[:-1] - offsets[0]].view("<u8")
    h, ones = lens.astype(np.uint64) * _M1, np.uint64(2**64 - 1)
    with np.errstate(over="ignore"):
        for j in range(width // _WORD):
            valid = np.clip(lens - _WORD * j, 0, _WORD).astype(np.uint64)
            mask = np.where(valid == _WORD, ones, (np.uint64(1) << (valid * np.uint64(8))) - np.uint64(1))
            mixed = (h ^ (words[:, j] & mask)) * _M2
            mixed ^= mixed >> np.uint64(29)
            h = np.where(valid > 0, mixed, h) if j else mixed  # a row's hash must not depend on its batch's widest
        long = np.flatnonzero(lens > _CAP)
        if len(long):
            import pandas as pd

            rest = pd.arrays.ArrowStringArray(pa.chunked_array([col.take(pa.array(long)).cast(pa.large_string())]))
            h[long] = (h[long] ^ pd.util.hash_pandas_object(pd.Series(rest), index=False).to_numpy(np.uint64)) * _M2
        h ^= h >> np.uint64(31)
        return h * _M1


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


def row_hashes(batch: pa.RecordBatch, ids: np.ndarray | None = None) -> np.ndarray:
    """One uint64 per row over its hashed columns, each salted by its name (a value moved to another column is a
    change). A null adds nothing, so a row hashes alike whatever the other rows of its batch hold."""
    out = np.zeros(batch.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for name, col in sorted(zip(batch.schema.names, batch.columns, strict=True), key=lambda nc: nc[0]):
            if name in NOT_HASHED or col.null_count == len(col):
                continue
            h = ids if name == "id" and ids is not None else _column_hash(col)  # `ids`: id_hashes, computed already
            mixed = (out ^ (h ^ _salt(name))) * _MIX
            mixed ^= mixed >> np.uint64(31)
            out = np.where(np.asarray(col.is_valid()), mixed, out) if col.null_count else mixed
    return out


def shard_fingerprint(total: int) -> str:
    """A shard's fingerprint in the id map: the sum of its rows' hashes mod 2**64, so one row's edit updates it
    without reading the others (launcher/ids/idmap.py)."""
    return f"v3-{int(total) & (2**64 - 1):016x}"
