"""`dataset.keep_columns`: source columns carried into every output (Parquet, WebDataset's JSON) with their types.

The kept columns are read in a pass of their own over the source, row for row beside the prompt readers (as
launcher/sources/references.py attaches the reference columns), so the readers stay as they are: a rejected row
keeps its place (launcher/sources/rejected.py) and so does its kept value. Types are the source's Arrow types,
fixed by the first file (Parquet and save_to_disk: their schema; JSON lines: pyarrow's inference over that file's
values; CSV has no types: text); a later file whose values do not fit them is refused naming it.
Kept values are part of each shard's prompts fingerprint: they are recorded in its Parquet, so a changed value
makes the shard stale like a changed prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pyarrow as pa

from launcher.errors import ConfigError

# Every column that meshgen writes or carries in its plan (launcher/writer/writer.py's SCHEMA and the optional
# columns, launcher/sources/prompts.py's SCHEMA, the reference, rejected and quality columns): a kept column of the
# same name would clash with it. tests/test_outputs.py checks that the writer's names are all here.
RESERVED = frozenset(
    "id prompt seed height width num_inference_steps guidance_scale negative_prompt model image prompt_id variant "
    "true_cfg_scale lora_scales reference reference_image ref_sha256 ref_loc rejected clip_score nsfw".split()
)
_READ_ROWS = 4096


def kept_names(src, files: list[str]) -> tuple[str, ...]:
    """The kept column names: the listed ones, or with `all` every column of the first file but the ones
    meshgen reads itself (prompt, id, image and per-row setting columns). Refuses a clash with ours."""
    from launcher.sources.prompts import OVERRIDE_COLUMNS

    spec = src.keep_columns
    if not spec:
        return ()
    if spec == "all":
        own = {src.prompt_column, src.id_column, src.image_column, *OVERRIDE_COLUMNS}
        names = tuple(n for n in _first_fields(files[0], src.prompt_column) if n not in own)
    elif isinstance(spec, str):
        raise ConfigError(f"dataset.keep_columns={spec!r}: give a list of column names, or all")
    else:
        names = tuple(dict.fromkeys(str(n) for n in spec))
    clash = [n for n in names if n in RESERVED]
    if clash:
        raise ConfigError(
            f"dataset.keep_columns: {clash[0]!r} is also one of meshgen's own columns ({', '.join(sorted(RESERVED))}); "
            "rename it in the source, or leave it out of the list"
        )
    return names


@functools.cache
def kept_fields(src, files: tuple[str, ...]) -> tuple[pa.Field, ...]:
    """The kept columns with their types (from the first file), each one checked to exist there."""
    names = kept_names(src, list(files))
    if not names:
        return ()
    found = _first_fields(files[0], src.prompt_column)
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(
            f"dataset.keep_columns: {files[0]} has no column {missing[0]!r}; columns found: "
            f"{', '.join(found) or 'none'}"
        )
    return tuple(pa.field(n, found[n]) for n in names)


def _first_fields(f: str, col: str) -> dict[str, pa.DataType]:
    """name -> type of one file's columns."""
    from launcher.sources.prompts import _suffix, filesystem

    fs, p = filesystem(f)
    if fs.get_file_info(p).type.name == "Directory":
        from launcher.sources.prompts_raw import saved_dataset_files

        with fs.open_input_file(saved_dataset_files(f)[0]) as fh:
            schema = pa.ipc.open_stream(fh).schema
        return {x.name: x.type for x in schema}
    if _suffix(f) == ".parquet":
        import pyarrow.parquet as pq

        return {x.name: x.type for x in pq.read_schema(fs.open_input_file(p))}
    if _suffix(f) == ".txt":
        return {}
    values: dict[str, list] = {}  # each column's values, for their type (nulls play no part in it)
    for _, r in _rows(f, col):
        for k, v in r.items() if isinstance(r, dict) else ():
            values.setdefault(k, []).append(v)
    return {k: _inferred(v) for k, v in values.items()}  # CSV's values are all text: kept as text


def _inferred(values: list) -> pa.DataType:
    try:
        t = pa.array(values).type
    except (pa.ArrowException, ValueError, TypeError):
        return pa.string()  # mixed kinds (a number here, text there): kept as text
    return pa.string() if pa.types.is_null(t) else t


def _rows(f: str, col: str):
    from launcher.sources.prompts_raw import raw_rows

    return raw_rows(f, col, None)


class Kept:
    """Attaches the kept columns to the prompt batches of one pass over the source, row for row."""

    def __init__(self, src, files: list[str]):
        self.fields, self.col = kept_fields(src, tuple(files)), src.prompt_column
        self._parts: Iterator[pa.RecordBatch] = (b for f in files for b in self._file_batches(f))
        self._held: list[pa.RecordBatch] = []

    def attach(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        n, got, parts = batch.num_rows, 0, []
        while got < n:
            part = self._held.pop(0) if self._held else next(self._parts)
            if got + part.num_rows > n:
                self._held.insert(0, part.slice(n - got))
                part = part.slice(0, n - got)
            parts.append(part)
            got += part.num_rows
        kept = pa.Table.from_batches(parts, schema=pa.schema(self.fields)).combine_chunks()
        cols = list(batch.columns) + [kept.column(f.name).chunk(0) if n else pa.array([], f.type) for f in self.fields]
        return pa.RecordBatch.from_arrays(cols, schema=pa.schema([*batch.schema, *self.fields]))

    def _file_batches(self, f: str) -> Iterator[pa.RecordBatch]:
        from launcher.sources.prompts import _suffix, filesystem

        fs, p = filesystem(f)
        names = [x.name for x in self.fields]
        schema = pa.schema(self.fields)
        if fs.get_file_info(p).type.name == "Directory" or _suffix(f) == ".parquet":
            for b in _arrow_batches(f, fs, p, names):
                yield _cast(pa.RecordBatch.from_arrays([b.column(n) for n in names], names=names), schema, f)
            return
        if _suffix(f) == ".txt":
            raise ConfigError(f"dataset.keep_columns: {f} is a .txt file: it has no columns to keep")
        chunk: list[dict] = []
        for _, r in _rows(f, self.col):
            chunk.append({n: r.get(n) for n in names} if isinstance(r, dict) else {})
            if len(chunk) == _READ_ROWS:
                yield _from_rows(chunk, schema, f)
                chunk = []
        if chunk:
            yield _from_rows(chunk, schema, f)


def _arrow_batches(f: str, fs, p: str, names: list[str]) -> Iterator[pa.RecordBatch]:
    if fs.get_file_info(p).type.name == "Directory":
        from launcher.sources.prompts_raw import saved_dataset_files

        for part in saved_dataset_files(f):
            with fs.open_input_file(part) as fh:
                reader = pa.ipc.open_stream(fh)
                _check_has(f, reader.schema.names, names)
                yield from reader
        return
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(fs.open_input_file(p))
    _check_has(f, pf.schema_arrow.names, names)
    yield from pf.iter_batches(columns=names, batch_size=_READ_ROWS)


def _check_has(f: str, have: list[str], names: list[str]) -> None:
    missing = [n for n in names if n not in have]
    if missing:
        raise ConfigError(f"dataset.keep_columns: {f} has no column {missing[0]!r}; columns found: {', '.join(have)}")


def _from_rows(rows: list[dict], schema: pa.Schema, f: str) -> pa.RecordBatch:
    try:
        return pa.RecordBatch.from_pylist(rows, schema=schema)
    except (pa.ArrowException, ValueError, TypeError, OverflowError) as e:
        raise ConfigError(_misfit(f, schema, e)) from None


def _cast(b: pa.RecordBatch, schema: pa.Schema, f: str) -> pa.RecordBatch:
    if b.schema.equals(schema):
        return b
    try:
        return b.cast(schema)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise ConfigError(_misfit(f, schema, e)) from None


def _misfit(f: str, schema: pa.Schema, e: Exception) -> str:
    types = ", ".join(f"{x.name}: {x.type}" for x in schema)
    first = str(e).splitlines()[0][:160]
    return f"dataset.keep_columns: {f} holds values that are not of the first file's types ({types}): {first}"
