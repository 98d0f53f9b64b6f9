"""Reference images of an edit job (`job=edit`): found, checked and hashed at planning; read back by workers.

`dataset.image_column` holds, per row, a `datasets` Image struct `{bytes, path}` (meshgen's own Parquet and
`save_to_disk` write it so), a path (relative to the source file's folder, absolute, `s3://`, `gs://`), or a list
of those. Planning reads the column apart from the prompts, a few rows at a time, hashes each reference's bytes
(streaming for files) and reads only its header for the size: no image is decoded or kept. Each row gains two
plan columns:
- `ref_sha256`: the references' sha256, space-separated. The shard fingerprint hashes it like any column, so an
  edited reference makes its shard stale; text-to-image rows leave it empty, which the fingerprint leaves out.
- `ref_loc`: JSON, one `{"path": lineage, "src": where to read it}` per reference; `src` is a path or URL, or
  `[file, column, row, k]` for bytes stored in the source (row within that file, k-th of the row's references). Not
  fingerprinted: moving a source folder is no change of its images.
Workers read a shard's references when they claim it (launcher/sources/reference_reads.py) and check their hashes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
from collections.abc import Iterator

import pyarrow as pa

from launcher.errors import ConfigError
from launcher.sources.reference_checks import check_image, check_output_size, hash_file

REF_FIELDS = [pa.field("ref_sha256", pa.string()), pa.field("ref_loc", pa.string())]

_READ_ROWS = 8  # Parquet rows read at a time: bounds planning memory by a few images, whatever the file holds
_CHUNK = 1 << 20


def _base_dir(f: str) -> str:
    """The folder that relative reference paths are relative to: the source file's (a save_to_disk folder's own)."""
    from launcher.sources.prompts import filesystem

    fs, p = filesystem(f)
    if fs.get_file_info(p).type.name == "Directory":
        return f.rstrip("/")
    return f.rsplit("/", 1)[0] if "/" in f else "."


def resolve(path: str, base: str) -> str:
    """A reference's location: a URL as is; a local path made absolute (lineage and workers need no cwd)."""
    if "://" in path:
        return path
    if "://" in base:
        return base + "/" + path
    return os.path.abspath(posixpath.join(base, path))


def column_rows(f: str, col: str) -> Iterator[tuple[str, int, object]]:
    """(where, row within the file, the column's value) for each row of one source file, a few rows at a time."""
    from launcher.sources.prompts import _suffix, filesystem

    fs, p = filesystem(f)
    if fs.get_file_info(p).type.name == "Directory" or _suffix(f) == ".parquet":
        yield from _arrow_rows(f, col, fs, p)
        return
    if _suffix(f) == ".txt":
        raise ConfigError(f"dataset {f}: job=edit needs an image column ({col!r}); a .txt source has none")
    for n, (where, r) in enumerate(_text_rows(f, col)):
        yield where, n, r


def _text_rows(f: str, col: str) -> Iterator[tuple[str, object]]:
    from launcher.sources.prompts_raw import missing_column, raw_rows

    for where, r in raw_rows(f, col, None, role="image"):
        if col not in r:  # a JSON line without it (a CSV's header says so before its first row)
            raise ConfigError(missing_column(where, col, "image", r))
        value = r[col]
        if isinstance(value, str) and value.startswith("["):  # a CSV cell can hold a JSON list of paths
            try:
                value = json.loads(value)
            except ValueError:
                pass
        yield where, value


def _arrow_rows(f: str, col: str, fs, p: str) -> Iterator[tuple[str, int, object]]:
    import pyarrow.parquet as pq

    from launcher.sources.prompts_raw import missing_column, saved_dataset_files

    def missing(names):
        return ConfigError(missing_column(f"dataset {f}", col, "image", names))

    n = 0
    if fs.get_file_info(p).type.name == "Directory":
        for part in saved_dataset_files(f):
            with fs.open_input_file(part) as fh:
                reader = pa.ipc.open_stream(fh)
                if col not in reader.schema.names:
                    raise missing(reader.schema.names)
                for batch in reader:
                    for v in batch.column(col).to_pylist():
                        yield f"dataset {f}, row {n}", n, v
                        n += 1
        return
    # Buffered column reads: the plan holds a few rows' images, not a whole row group's.
    pf = pq.ParquetFile(fs.open_input_file(p), buffer_size=_CHUNK, pre_buffer=False)
    if col not in pf.schema_arrow.names:
        raise missing(pf.schema_arrow.names)
    for batch in pf.iter_batches(columns=[col], batch_size=_READ_ROWS):
        for v in batch.column(0).to_pylist():
            yield f"dataset {f}, row {n}", n, v
            n += 1


def _entries(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def plan_row(where: str, f: str, n: int, value, base: str, src) -> tuple[list[str], list[dict], tuple[int, int]]:
    """One row's references: their hashes, locations and the first one's (width, height); checked."""
    entries = [e for e in _entries(value) if e is not None]
    if not entries:
        raise ConfigError(f"{where}: no reference image in column {src.image_column!r}; give one or drop the row")
    limit = src.sizes.max_references if src.sizes else 0
    if limit and len(entries) > limit:
        raise ConfigError(
            f"{where}: {len(entries)} reference images, more than the {limit} this model family takes; "
            f"give at most {limit}"
        )
    max_pixels = src.sizes.max_pixels if src.sizes else 2**62
    shas, locs, first = [], [], None
    for k, e in enumerate(entries):
        if isinstance(e, dict) and e.get("bytes") is not None:
            data = e["bytes"]
            sha = hashlib.sha256(data).hexdigest()
            size = check_image(io.BytesIO(data), where, f"#{k}", max_pixels, len(data))
            # Lineage names the source row (its file and row): a stored image's own `path` is only a file name.
            locs.append({"path": stored_name(f, n, k), "src": [f, src.image_column, n, k]})
        else:
            rel = e.get("path") if isinstance(e, dict) else e
            if not isinstance(rel, str) or not rel:
                raise ConfigError(f"{where}: reference #{k} is {rel!r}, not an image struct or a path; fix that row")
            path = resolve(rel, base)
            sha, size = hash_file(path, where, max_pixels)
            locs.append({"path": path, "src": path})
        shas.append(sha)
        first = first or size
    return shas, locs, first


class References:
    """Attaches the reference columns to the prompt batches of one pass over the source, row for row."""

    def __init__(self, src, files: list[str]):
        self.src = src
        self._rows: Iterator[tuple[str, str, tuple[str, int, object]]] = (
            (f, _base_dir(f), row) for f in files for row in column_rows(f, src.image_column)
        )

    def attach(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """With dataset.bad_rows=skip, a row whose references fail a check is rejected (launcher/sources/rejected.py)
        rather than refused; a row rejected already reads none."""
        from launcher.sources.rejected import FIELD, rejection

        shas, locs, heights, widths = [], [], [], []
        names = batch.schema.names
        h_in, w_in = batch.column(names.index("height")).to_pylist(), batch.column(names.index("width")).to_pylist()
        marks = batch.column(names.index(FIELD.name)).to_pylist() if FIELD.name in names else None
        for i in range(batch.num_rows):
            f, base, (where, n, value) = next(self._rows)
            h, w = h_in[i], w_in[i]
            s, loc = [], []
            if marks is None or marks[i] is None:
                try:
                    s, loc, (w_ref, h_ref) = plan_row(where, f, n, value, base, self.src)
                    if self.src.size_from_reference and h is None and w is None:
                        h, w = fit_size(h_ref, w_ref, self.src.sizes)
                    check_output_size(where, h, w, self.src.sizes)
                except ConfigError as e:
                    if marks is None:
                        raise
                    marks[i], s, loc = rejection(where, str(e)), [], []
            shas.append(" ".join(s))
            locs.append(json.dumps(loc))
            heights.append(h)
            widths.append(w)
        cols = {n: batch.column(n) for n in names}
        cols["height"], cols["width"] = pa.array(heights), pa.array(widths)
        if marks is not None:
            cols[FIELD.name] = pa.array(marks)
        arrays = [cols[n] for n in names] + [pa.array(shas), pa.array(locs)]
        # each column takes its type from the schema, a column of nulls too
        return pa.RecordBatch.from_arrays(arrays, schema=batch.schema.append(REF_FIELDS[0]).append(REF_FIELDS[1]))


def fit_size(h: int, w: int, sizes) -> tuple[int, int]:
    """A reference's size as an output size, rounded down to the model's factor (a reference over the family's
    pixel limit was refused already, so the size is within it)."""
    m = sizes.multiple if sizes else 1
    return max(m, h // m * m), max(m, w // m * m)


def stored_name(f: str, n: int, k: int) -> str:
    return f"{f}#row={n}" + (f"&ref={k}" if k else "")
