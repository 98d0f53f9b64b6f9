"""The exact reader's first step: each row of a prompt file as the file holds it, with where it came from.

One generator per format, row by row, so that a bad line is named exactly and nothing holds the whole file.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator

import pyarrow.fs as pafs

from launcher.errors import ConfigError
from launcher.ledger.prompts import OVERRIDE_COLUMNS, _suffix, filesystem


def raw_rows(f: str, col: str, id_col: str | None) -> Iterator[tuple[str, dict]]:
    fs, p = filesystem(f)
    if fs.get_file_info(p).type == pafs.FileType.Directory:  # source_files let only save_to_disk folders through
        yield from _saved_dataset(f, col, id_col)
        return
    suffix = _suffix(f)
    if suffix == ".parquet":
        yield from _parquet(f, col, id_col)
        return
    lines = _lines(f)
    if suffix == ".txt":
        for n, ln in lines:
            if ln.strip():
                yield f"dataset {f}, line {n}", {col: ln.strip()}
    elif suffix == ".jsonl":
        for n, ln in lines:
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ConfigError(f"dataset {f}, line {n}: malformed JSON ({e.msg}); fix or remove that line") from None
            if not isinstance(obj, dict):
                got = ln.strip()[:40]
                raise ConfigError(f"dataset {f}, line {n}: expected a JSON object {{...}}, got {got}; fix that line")
            yield f"dataset {f}, line {n}", obj
    else:
        yield from _csv(f, col)


def _lines(f: str) -> Iterator[tuple[int, str]]:
    """Numbered lines without their ends: universal newlines (\\n, \\r\\n, \\r) but not str.splitlines(), which
    also splits at U+2028 and friends, which may stand unescaped inside a JSON string or a quoted CSV field.
    Decoded line by line, so a byte that is not UTF-8 is named by its own line."""
    fs, p = filesystem(f)
    n = 0
    for part in _byte_lines(fs, p):
        try:
            text = part.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"dataset {f}, line {n + 1}: not UTF-8 text ({e.reason}); save the file as UTF-8"
            ) from None
        if n == 0:
            text = text.removeprefix("\ufeff")  # spreadsheet exports often start with a byte-order mark
        for line in text.removesuffix("\r").split("\r"):
            n += 1
            yield n, line


def _byte_lines(fs, p: str) -> Iterator[bytes]:
    with fs.open_input_stream(p) as raw:
        head: list[bytes] = []  # a line's pieces so far: joined once, so a 100 MB line costs no quadratic copying
        while chunk := raw.read(1 << 20):
            parts = chunk.split(b"\n")
            if len(parts) > 1:
                yield b"".join([*head, parts[0]])
                yield from parts[1:-1]
                head = []
            head.append(parts[-1])
        if rest := b"".join(head):
            yield rest


def _csv(f: str, col: str) -> Iterator[tuple[str, dict]]:
    reader = csv.reader(line + "\n" for _, line in _lines(f))
    try:
        header = next(reader, None)
        if header and col not in header:  # say so even when the file has a header and no rows
            raise ConfigError(
                f"dataset {f} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(header)}"
            )
        for values in reader:
            if not values:  # a blank line
                continue
            if len(values) != len(header):
                raise ConfigError(
                    f"dataset {f}, line {reader.line_num}: expected {len(header)} fields "
                    f"({', '.join(header)}), got {len(values)}; fix that line (quote fields that hold commas)"
                )
            # CSV has no types: empty cells are missing values; numbers are checked and converted later.
            row = {k: (None if v == "" and k in OVERRIDE_COLUMNS else v) for k, v in zip(header, values, strict=True)}
            yield f"dataset {f}, line {reader.line_num}", row
    except csv.Error as e:
        raise ConfigError(f"dataset {f}, line {reader.line_num}: malformed CSV ({e}); fix that line") from None


def _wanted(names: list[str], col: str, id_col: str | None, f: str) -> list[str]:
    if col not in names:
        raise ConfigError(
            f"dataset {f} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(names)}"
        )
    # Only the columns we use: a prompt source may also carry images or embeddings we would never look at.
    return [c for c in dict.fromkeys((col, id_col, *OVERRIDE_COLUMNS)) if c in names]


def _parquet(f: str, col: str, id_col: str | None) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    fs, p = filesystem(f)
    try:
        pf = pq.ParquetFile(fs.open_input_file(p))
        wanted = _wanted(pf.schema_arrow.names, col, id_col, f)
        n = 0
        for batch in pf.iter_batches(columns=wanted, batch_size=65536):
            for r in batch.to_pylist():
                yield f"dataset {f}, row {n}", r
                n += 1
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ConfigError(f"dataset {f}: not a readable Parquet file ({first_line(e)}); rewrite it") from None


def saved_dataset_files(folder: str) -> list[str]:
    fs, p = filesystem(folder)
    with fs.open_input_stream(f"{p}/state.json") as s:
        return [f"{p}/{d['filename']}" for d in json.loads(s.read())["_data_files"]]


def _saved_dataset(folder: str, col: str, id_col: str | None) -> Iterator[tuple[str, dict]]:
    """A `datasets.save_to_disk` folder: Arrow stream files listed in its state.json, read with pyarrow alone."""
    import pyarrow as pa

    fs, _ = filesystem(folder)
    n = 0
    try:
        for p in saved_dataset_files(folder):
            with fs.open_input_file(p) as fh:
                reader = pa.ipc.open_stream(fh)
                wanted = _wanted(reader.schema.names, col, id_col, folder)
                for batch in reader:
                    for r in batch.select(wanted).to_pylist():
                        yield f"dataset {folder}, row {n}", r
                        n += 1
    except ConfigError:
        raise
    except Exception as e:  # a damaged folder: missing files, bad JSON, bad Arrow
        raise ConfigError(f"dataset {folder}: not a readable save_to_disk folder ({first_line(e)})") from None


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
