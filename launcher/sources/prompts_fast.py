"""The fast reader: pyarrow's streaming readers and vectorised checks, batch by batch.

It yields exactly the rows the exact reader (launcher/sources/prompts.py) would, or gives up (`_GiveUp`) the
moment it meets anything it cannot judge the same way: a parse error, a type it would have to coerce, a value
out of range. The exact reader then reads that file and names the bad line, or finds it valid and goes on
where this one stopped. So the fast path never decides what is an error, only what is certainly fine.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from launcher.sources.bounds import GUIDANCE, STEPS, TEXT_BYTES
from launcher.sources.prompts import (
    _INT_COLUMNS,
    BATCH_ROWS,
    OVERRIDE_COLUMNS,
    SCHEMA,
    Source,
    _GiveUp,
    _suffix,
    filesystem,
)
from launcher.sources.prompts_raw import csv_header, open_from
from launcher.sources.row_checks import CONTROL, ID_BYTES, LINE_BYTES

_TYPES = {f.name: f.type for f in SCHEMA}
_BLOCK = 1 << 22  # bytes per parsed block: large enough to amortise, small enough to stream


def fast_batches(f: str, src: Source, start: int, offset: int = 0) -> Iterator[pa.RecordBatch]:
    """`f`'s rows from byte `offset` (0, or a grown text file's old end), the first one row `start`."""
    try:
        for raw in _raw_batches(f, src, offset):
            if raw.num_rows:
                yield normalize(raw, src, start)
                start += raw.num_rows
    except (pa.ArrowException, UnicodeDecodeError, ValueError, OSError, KeyError):
        raise _GiveUp from None


def _raw_batches(f: str, src: Source, offset: int) -> Iterator[pa.RecordBatch]:
    fs, p = filesystem(f)
    if fs.get_file_info(p).type.name == "Directory":
        from launcher.sources.prompts_raw import saved_dataset_files

        for part in saved_dataset_files(f):
            with fs.open_input_file(part) as fh:
                yield from pa.ipc.open_stream(fh)
        return
    suffix = _suffix(f)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(fs.open_input_file(p))
        names = pf.schema_arrow.names
        wanted = [c for c in dict.fromkeys((src.prompt_column, src.id_column, *OVERRIDE_COLUMNS)) if c in names]
        yield from pf.iter_batches(columns=wanted, batch_size=BATCH_ROWS)
    elif suffix == ".txt":  # from an offset, a U+FEFF is no byte-order mark but text, as in the whole file
        yield from _txt(open_from(fs, p, offset), src.prompt_column, "utf-8" if offset else "utf-8-sig")
    elif suffix == ".jsonl":
        yield from _jsonl(fs, p, src, offset)
    else:
        header = csv_header(f) if offset else None
        yield from _csv(open_from(fs, p, offset), src, header)


def _txt(raw, col: str, encoding: str) -> Iterator[pa.RecordBatch]:
    with raw:
        chunk = []
        text = io.TextIOWrapper(raw, encoding=encoding, newline=None)
        # At most LINE_BYTES characters a read (no more bytes than 4x that): a longer line is never held whole.
        for ln in iter(lambda: text.readline(LINE_BYTES + 1), ""):
            if len(ln) > LINE_BYTES:
                raise _GiveUp  # a line over LINE_BYTES
            s = ln.strip()
            if s:
                chunk.append(s)
                if len(chunk) == BATCH_ROWS:
                    yield pa.record_batch([_strings(chunk)], names=[col])
                    chunk = []
        if chunk:
            yield pa.record_batch([_strings(chunk)], names=[col])


def _strings(values: list[str]) -> pa.Array:
    """A string array built from the values' bytes: pa.array() of a list imports pandas (0.4 s of every launch)
    only to ask whether the list is one of its types."""
    data = [v.encode() for v in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # beyond one string array's 32-bit offsets: the exact reader's
        raise _GiveUp  # a batch of prompts over 2 GiB
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data)))


def _jsonl(fs, p: str, src: Source, offset: int) -> Iterator[pa.RecordBatch]:
    import pyarrow.json as pj

    fields = {src.prompt_column: pa.string(), **{k: _TYPES[k] for k in OVERRIDE_COLUMNS}}
    if src.id_column:  # its type, from the first row: ids may be numbers or text (mixed ones go the exact way)
        with fs.open_input_stream(p) as s:
            text = io.TextIOWrapper(s, encoding="utf-8-sig")
            lines = iter(lambda: text.readline(LINE_BYTES + 1), "")
            first = next((ln for ln in lines if ln.strip()), "{}")
            if len(first) > LINE_BYTES:
                raise _GiveUp  # a line over LINE_BYTES
        value = json.loads(first).get(src.id_column) if first.strip().startswith("{") else None
        fields[src.id_column] = pa.int64() if isinstance(value, int) and not isinstance(value, bool) else pa.string()
    options = pj.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore")
    with open_from(fs, p, offset) as s:  # pyarrow's JSON reader skips a leading byte-order mark itself
        yield from pj.open_json(s, read_options=pj.ReadOptions(block_size=_BLOCK), parse_options=options)


def _csv(raw, src: Source, header: list[str] | None) -> Iterator[pa.RecordBatch]:
    """`header`: the file's, for its rows read from an offset (which have none); None where it has its own."""
    import pyarrow.csv as pcsv

    types = {src.prompt_column: pa.string(), **{k: _TYPES[k] for k in OVERRIDE_COLUMNS}}
    if src.id_column:
        types[src.id_column] = pa.string()  # CSV has no types: an id is the text of its cell
    convert = pcsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False)
    parse = pcsv.ParseOptions(newlines_in_values=True)
    with raw:
        read = pcsv.ReadOptions(block_size=_BLOCK, column_names=header)
        reader = pcsv.open_csv(raw, read_options=read, parse_options=parse, convert_options=convert)
        if src.prompt_column not in reader.schema.names:
            raise _GiveUp  # no prompt column
        for b in reader:
            if "negative_prompt" in b.schema.names:  # an empty cell is no override, as in the exact reader
                i = b.schema.get_field_index("negative_prompt")
                col = b.column(i)
                b = b.set_column(i, "negative_prompt", pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col))
            yield b


def normalize(raw: pa.RecordBatch, src: Source, start: int) -> pa.RecordBatch:
    """One raw batch as SCHEMA, if every value is certainly what the exact reader makes of it."""
    n, names = raw.num_rows, raw.schema.names
    if src.prompt_column not in names:
        raise _GiveUp  # no prompt column
    prompt = raw.column(src.prompt_column)
    if not (pa.types.is_string(prompt.type) or pa.types.is_large_string(prompt.type)) or prompt.null_count:
        raise _GiveUp  # a prompt that is no text, or missing
    _check_length("prompt", prompt)
    for col in raw.columns:  # pyarrow's JSON and Parquet readers do not check that text is UTF-8
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col.validate(full=True)  # ArrowInvalid: the exact reader names the line
    if src.id_column:
        ids = raw.column(src.id_column) if src.id_column in names else pa.nulls(n)
        ok = pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type) or pa.types.is_integer(ids.type)
        if not ok or ids.null_count:
            raise _GiveUp  # an id that is no text or number, or missing
        ids = ids.cast(pa.string())
        _check_ids(ids)
    else:
        rows = np.arange(start, start + n, dtype=np.int64)  # from its buffer: pa.array() would import pandas
        ids = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(rows)]).cast(pa.string())
    columns = [ids, prompt.cast(pa.string())]
    for k in OVERRIDE_COLUMNS:
        col = raw.column(k) if k in names else pa.nulls(n, _TYPES[k])
        columns.append(_override(k, col) if col.null_count < n else pa.nulls(n, _TYPES[k]))
    batch = pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
    if src.sizes and (columns[3].null_count < n or columns[4].null_count < n):
        r = src.sizes
        h = pc.fill_null(batch.column("height"), r.height)
        w = pc.fill_null(batch.column("width"), r.width)
        bad = pc.or_(_not_multiple(h, r.multiple), _not_multiple(w, r.multiple))
        if pc.any(pc.or_(bad, pc.greater(pc.multiply(h, w), r.max_pixels))).as_py():
            raise _GiveUp  # a size the exact reader refuses or sets aside
    return batch


def _check_ids(ids: pa.Array) -> None:
    """Give up on an id that cannot name a file (launcher/sources/row_checks.py id_problem words why)."""
    size = pc.binary_length(ids)
    low, high = pc.min_max(size).values()
    if len(ids) and (low.as_py() == 0 or high.as_py() > ID_BYTES):
        raise _GiveUp  # an empty id, or one too long for a file name
    if pc.any(pc.match_substring_regex(ids, CONTROL)).as_py():
        raise _GiveUp  # an id with a control character


def _not_multiple(a: pa.Array, m: int) -> pa.Array:
    return pc.not_equal(pc.subtract(a, pc.multiply(pc.divide(a, m), m)), 0)


def _override(key: str, col: pa.Array) -> pa.Array:
    t = col.type
    if key in _INT_COLUMNS:
        if not pa.types.is_integer(t):
            raise _GiveUp
        col = col.cast(pa.int64())  # a uint64 beyond int64 fails here, and goes the exact way
        low, high = pc.min_max(col).values()
        if low.as_py() is not None and low.as_py() < (0 if key == "seed" else 1):
            raise _GiveUp
        if key == "num_inference_steps" and high.as_py() is not None and high.as_py() > STEPS[1]:
            raise _GiveUp
        return col
    if key == "guidance_scale":
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise _GiveUp
        col = col.cast(pa.float64())
        out = pc.or_(pc.invert(pc.is_finite(col)), pc.or_(pc.less(col, GUIDANCE[0]), pc.greater(col, GUIDANCE[1])))
        if pc.any(out).as_py():
            raise _GiveUp
        return col
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise _GiveUp
    _check_length(key, col)
    return col.cast(pa.string())


def _check_length(key: str, col: pa.Array) -> None:
    """Give up on text longer than TEXT_BYTES (the exact reader names the line); binary_length counts bytes."""
    if len(col) and (pc.max(pc.binary_length(col)).as_py() or 0) > TEXT_BYTES:
        raise _GiveUp
