"""The exact reader's first step: each row of a prompt file as the file holds it, with where it came from.

One generator per format, row by row, so that a bad line is named exactly and nothing holds the whole file. A text
file that only grew is read from `offset`, its old end (a line end; launcher/ids/idplan.py): its lines are
numbered on from those before it, and a CSV's rows take the file's header.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator

import pyarrow.fs as pafs

from launcher.errors import ConfigError
from launcher.sources.prompts import OVERRIDE_COLUMNS, _suffix, filesystem
from launcher.sources.row_checks import LINE_BYTES, Bad, line_problem


def raw_rows(f: str, col: str, id_col: str | None, offset: int = 0, role: str = "prompt") -> Iterator[tuple[str, dict]]:
    """(where, row) of `f` from byte `offset` (0, or the old end of a text file that only grew). `col` is the column
    that must be there: the prompt column, or (`role="image"`) the references' column, named so when missing."""
    fs, p = filesystem(f)
    if fs.get_file_info(p).type == pafs.FileType.Directory:  # source_files let only save_to_disk folders through
        yield from _saved_dataset(f, col, id_col, role)
        return
    suffix = _suffix(f)
    if suffix == ".parquet":
        yield from _parquet(f, col, id_col, role)
        return
    lines = _lines(f, offset)
    if suffix == ".txt":
        for n, ln in lines:
            if isinstance(ln, Bad):
                yield f"dataset {f}, line {n}", ln
            elif ln.strip():
                yield f"dataset {f}, line {n}", {col: ln.strip()}
    elif suffix == ".jsonl":
        for n, ln in lines:
            if isinstance(ln, Bad):
                yield f"dataset {f}, line {n}", ln
                continue
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                yield f"dataset {f}, line {n}", Bad(f"malformed JSON ({e.msg}); fix or remove that line")
                continue
            if not isinstance(obj, dict):
                got = ln.strip()[:40]
                obj = Bad(f"expected a JSON object {{...}}, got {got}; fix that line")
            yield f"dataset {f}, line {n}", obj
    else:
        yield from _csv(f, col, offset, role)


def open_from(fs, p: str, offset: int):
    """The file as a stream from byte `offset`."""
    if not offset:
        return fs.open_input_stream(p)
    fh = fs.open_input_file(p)
    fh.seek(offset)
    return fh


def _lines(f: str, offset: int = 0) -> Iterator[tuple[int, str | Bad]]:
    """Numbered lines without their ends: universal newlines (\\n, \\r\\n, \\r) but not str.splitlines(), which
    also splits at U+2028 and friends, which may stand unescaped inside a JSON string or a quoted CSV field.
    Decoded line by line, so a byte that is not UTF-8 is named by its own line (a Bad in its place), as is a line
    longer than LINE_BYTES, which is never held whole. From `offset` (a line end), numbered on from the lines before."""
    fs, p = filesystem(f)
    n = _lines_before(fs, p, offset) if offset else 0
    for part in _byte_lines(fs, p, offset):
        if part is None:
            n += 1
            yield n, Bad(line_problem(n))
            continue
        try:
            text = part.decode("utf-8")
        except UnicodeDecodeError as e:
            n += 1
            reason = f"not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8"
            yield n, Bad(reason, part.decode("utf-8", "replace").replace("\r", " "))  # one line for csv too
            continue
        if n == 0:
            text = text.removeprefix("\ufeff")  # spreadsheet exports often start with a byte-order mark
        for line in text.removesuffix("\r").split("\r"):
            n += 1
            yield n, line


def _lines_before(fs, p: str, offset: int) -> int:
    """How many lines _lines numbers before byte `offset`, a line end: one per \\n, counted in blocks, unless a
    lone \\r (which _lines also splits at, except in a line it cannot decode) asks to count them as _lines does."""
    n, lone_cr = 0, False
    with fs.open_input_stream(p) as raw:
        left = offset
        while left > 0 and (chunk := raw.read(min(1 << 22, left))):
            left -= len(chunk)
            n += chunk.count(b"\n")
            lone_cr = lone_cr or b"\r" in chunk.replace(b"\r\n", b"")
    if not lone_cr:
        return n
    return sum(1 if part is None else _line_count(part) for part in _byte_lines(fs, p, 0, offset))


def _line_count(part: bytes) -> int:
    try:
        return part.decode("utf-8").removesuffix("\r").count("\r") + 1
    except UnicodeDecodeError:
        return 1


def _byte_lines(fs, p: str, offset: int = 0, end: int | None = None) -> Iterator[bytes | None]:
    """The file's lines as bytes, from `offset` to `end`; None for a line over LINE_BYTES, whose bytes are dropped
    as they are read."""
    with open_from(fs, p, offset) as raw:
        head: list[bytes] = []  # a line's pieces so far: joined once, so a long line costs no quadratic copying
        held = 0  # bytes in head; -1 once the line is over the bound (its further pieces are dropped)
        left = end - offset if end is not None else -1
        while left and (chunk := raw.read(1 << 20 if left < 0 else min(1 << 20, left))):
            left = left - len(chunk) if left > 0 else left
            parts = chunk.split(b"\n")
            for k, piece in enumerate(parts):
                if held >= 0:
                    head.append(piece)
                    held += len(piece)
                    if held > LINE_BYTES:
                        head, held = [], -1
                if k < len(parts) - 1:  # a line ends here
                    yield b"".join(head) if held >= 0 else None
                    head, held = [], 0
        if held < 0:
            yield None
        elif rest := b"".join(head):
            yield rest


def _csv(f: str, col: str, offset: int = 0, role: str = "prompt") -> Iterator[tuple[str, dict | Bad]]:
    bad: dict[int, str] = {}  # line -> why it is no text: the csv module sees an empty line in its place

    def texts(lines):
        for n, line in lines:
            if isinstance(line, Bad):  # the record it is in is bad; its quotes still say where that record ends
                bad[n] = line.reason
                line = line.text
            yield line + "\n"

    reader = csv.reader(texts(_lines(f)))
    try:
        header = next(reader, None)
    except csv.Error as e:
        raise ConfigError(f"dataset {f}, line {reader.line_num}: malformed CSV header ({e}); fix that line") from None
    if header and col not in header:  # say so even when the file has a header and no rows
        raise ConfigError(missing_column(f"dataset {f}", col, role, header))
    if bad:
        raise ConfigError(f"dataset {f}, line 1: {next(iter(bad.values()))}")
    last = reader.line_num
    base = 0  # the lines before the reader's first: its line_num counts from there
    if offset:  # a file that only grew: its rows from its old end, under the file's header
        lines = _lines(f, offset)
        first = next(lines, None)
        if first is None:
            return
        base = last = first[0] - 1
        reader = csv.reader(texts(itertools.chain([first], lines)))
    while True:
        try:
            values = next(reader, None)
        except csv.Error as e:
            values = Bad(f"malformed CSV ({e}); fix that line")
        if values is None:
            return
        line = base + reader.line_num  # the record's last line: a quoted field may span lines
        where = f"dataset {f}, line {last + 1}"  # named by its first
        span = [n for n in bad if last < n <= line]  # the record's lines, one of them no text
        last = line
        if span:
            yield f"dataset {f}, line {span[0]}", Bad(bad[span[0]])
        elif isinstance(values, Bad):
            yield where, values
        elif not values:  # a blank line
            continue
        elif len(values) != len(header):  # ty: ignore[invalid-argument-type]
            yield (
                where,
                Bad(
                    f"expected {len(header)} fields ({', '.join(header)}), got {len(values)}; "  # ty: ignore[invalid-argument-type]
                    "fix that line (quote fields that hold commas)"
                ),
            )
        else:
            # CSV has no types: empty cells are missing values; numbers are checked and converted later.
            cells = zip(header, values, strict=True)  # ty: ignore[invalid-argument-type]
            yield where, {k: (None if v == "" and k in OVERRIDE_COLUMNS else v) for k, v in cells}
        for n in span:
            del bad[n]


def csv_header(f: str) -> list[str]:
    """A CSV file's header as _csv reads it, for its rows read from an offset; a ValueError where it has none."""
    lines = (("" if isinstance(line, Bad) else line) + "\n" for _, line in _lines(f))
    try:
        header = next(csv.reader(lines), None)
    except csv.Error as e:
        raise ValueError(str(e)) from None
    finally:
        lines.close()
    if not header:
        raise ValueError("no CSV header")
    return header


def missing_column(where: str, col: str, role: str, names) -> str:
    """The one wording of a source (or row) without the column `dataset.<role>_column` names."""
    return f"{where} has no {role} column {col!r} (dataset.{role}_column); columns found: {', '.join(map(str, names))}"


def _wanted(names: list[str], col: str, id_col: str | None, f: str, role: str = "prompt") -> list[str]:
    if col not in names:
        raise ConfigError(missing_column(f"dataset {f}", col, role, names))
    # Only the columns we use: a prompt source may also carry images or embeddings we would never look at.
    return [c for c in dict.fromkeys((col, id_col, *OVERRIDE_COLUMNS)) if c in names]


def _parquet(f: str, col: str, id_col: str | None, role: str = "prompt") -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    fs, p = filesystem(f)
    try:
        pf = pq.ParquetFile(fs.open_input_file(p))
        wanted = _wanted(pf.schema_arrow.names, col, id_col, f, role)
        n = 0
        for batch in pf.iter_batches(columns=wanted, batch_size=65536):
            for r in rows_of(batch):
                yield f"dataset {f}, row {n}", r
                n += 1
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ConfigError(f"dataset {f}: not a readable Parquet file ({first_line(e)}); rewrite it") from None


def rows_of(batch) -> list[dict | Bad]:
    """A batch's rows as dicts. Parquet and Arrow files do not guarantee that their text is UTF-8: a value that is
    not makes its row a Bad one, not the whole file unreadable."""
    import pyarrow as pa

    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        pass
    text = [i for i, t in enumerate(batch.schema.types) if pa.types.is_string(t) or pa.types.is_large_string(t)]
    for i in text:
        batch = batch.set_column(i, batch.schema.names[i], batch.column(i).cast(pa.binary()))
    out = []
    for r in batch.to_pylist():
        try:
            out.append({k: v.decode() if i in text and v is not None else v for i, (k, v) in enumerate(r.items())})
        except UnicodeDecodeError as e:
            out.append(Bad(f"a text column holds bytes that are not UTF-8 ({e.reason}); rewrite that row as UTF-8"))
    return out


def saved_dataset_files(folder: str) -> list[str]:
    fs, p = filesystem(folder)
    with fs.open_input_stream(f"{p}/state.json") as s:
        return [f"{p}/{d['filename']}" for d in json.loads(s.read())["_data_files"]]


def _saved_dataset(folder: str, col: str, id_col: str | None, role: str = "prompt") -> Iterator[tuple[str, dict]]:
    """A `datasets.save_to_disk` folder: Arrow stream files listed in its state.json, read with pyarrow alone."""
    import pyarrow as pa

    fs, _ = filesystem(folder)
    n = 0
    try:
        for p in saved_dataset_files(folder):
            with fs.open_input_file(p) as fh:
                reader = pa.ipc.open_stream(fh)
                wanted = _wanted(reader.schema.names, col, id_col, folder, role)
                for batch in reader:
                    for r in rows_of(batch.select(wanted)):
                        yield f"dataset {folder}, row {n}", r
                        n += 1
    except ConfigError:
        raise
    except Exception as e:  # a damaged folder: missing files, bad JSON, bad Arrow
        raise ConfigError(f"dataset {folder}: not a readable save_to_disk folder ({first_line(e)})") from None


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
