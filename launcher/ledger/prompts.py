"""Read a prompt source into rows of (id, prompt, per-row overrides), with one-line errors for bad input.

Every error names the file and, where there is one, the line (or Parquet row), so a bad row in a million-line
source is found in seconds, before any chip is reserved.
"""

from __future__ import annotations

import csv
import glob
import io
import json
from pathlib import Path

from launcher.errors import ConfigError

# Per-row columns that override the config for that sample, where the pipeline accepts them, with their types.
OVERRIDE_COLUMNS = ("seed", "height", "width", "negative_prompt", "num_inference_steps", "guidance_scale")
_INT_COLUMNS = ("seed", "height", "width", "num_inference_steps")
FORMATS = (".txt", ".jsonl", ".csv", ".parquet")


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ConfigError(f"dataset.limit={limit} selects no prompts; use 1 or more, or null for all rows")


def read_prompts(
    path: str,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    limit: int | None = None,
    images_per_prompt: int = 1,
) -> list[dict]:
    """Rows as dicts with `id` (str), `prompt` and any override columns, in source order.

    Ids default to the row number across all files in order, so appending rows never renumbers earlier ones.
    """
    check_limit(limit)
    rows: list[tuple[str, dict]] = []  # (where it came from, for error messages; the row)
    for f in _files(path):
        rows.extend(_read_file(f, prompt_column, id_column))
    if not rows:
        raise ConfigError(f"dataset {path} holds no prompts; add prompts or point dataset.path elsewhere")
    out, seen = [], {}
    for n, (where, r) in enumerate(rows):
        prompt = r.get(prompt_column)
        if prompt_column not in r:
            raise ConfigError(
                f"{where} has no prompt column {prompt_column!r} (dataset.prompt_column); "
                f"columns found: {', '.join(map(str, r)) or 'none'}"
            )
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: the prompt ({prompt_column!r}) is {_kind(prompt)}, not text; fix that row")
        if id_column:
            if r.get(id_column) is None:
                raise ConfigError(
                    f"{where} has no id column {id_column!r} (dataset.id_column); "
                    f"columns found: {', '.join(map(str, r))}; fix the row or set dataset.id_column=null"
                )
            rid = str(r[id_column])
        else:
            rid = str(n)
        if rid in seen:
            raise ConfigError(f"{where}: duplicate id {rid!r} (first at {seen[rid]}); ids must be unique")
        seen[rid] = where.removeprefix("dataset ")
        row = {"id": rid, "prompt": prompt}
        row.update({k: _override(where, k, r[k]) for k in OVERRIDE_COLUMNS if r.get(k) is not None})
        out.append(row)
    _check_file_names(out, path, images_per_prompt)
    return out[:limit] if limit is not None else out


def _check_file_names(rows: list[dict], path: str, images_per_prompt: int = 1) -> None:
    """Two ids that differ only in characters a file name cannot hold would overwrite each other's PNG."""
    from launcher.ledger.shards import check_sample_ids, file_stem

    check_sample_ids((r["id"] for r in rows), images_per_prompt, f"dataset {path}")
    seen: dict[str, str] = {}
    for r in rows:
        other = seen.setdefault(file_stem(r["id"]), r["id"])
        if other != r["id"]:
            raise ConfigError(
                f"dataset {path}: ids {other!r} and {r['id']!r} both become the file name {file_stem(r['id'])}.png; "
                "make them differ in letters, digits, '-' or '_'"
            )


def _files(path: str) -> list[Path]:
    matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    if not matches or not Path(matches[0]).exists():
        raise ConfigError(f"dataset.path {path} does not exist; pass an existing file with dataset.path=...")
    files = [Path(m) for m in matches]
    for f in files:
        if f.is_dir():
            if (f / "state.json").is_file() and (f / "dataset_info.json").is_file():
                continue  # a folder written by datasets' save_to_disk
            raise ConfigError(
                f"dataset.path {f} is a folder but not one written by datasets.save_to_disk; "
                f"pass a file ({', '.join(FORMATS)}), a glob, or a save_to_disk folder"
            )
        if f.suffix.lower() not in FORMATS:
            raise ConfigError(
                f"dataset {f}: unknown format {f.suffix or '(no extension)'!r}; use one of {', '.join(FORMATS)}"
            )
    return files


def _read_file(f: Path, col: str, id_col: str | None) -> list[tuple[str, dict]]:
    suffix = f.suffix.lower()
    if f.is_dir():
        return _read_saved_dataset(f, col, id_col)
    if suffix == ".parquet":
        return _read_parquet(f, col, id_col)
    text = _text(f)
    # Universal newlines (\n, \r\n, \r) but not str.splitlines(), which also splits at U+2028 and friends: they
    # may stand unescaped inside a JSON string or a quoted CSV field.
    lines = list(io.StringIO(text, newline=None))
    if suffix == ".txt":
        return [(f"dataset {f}, line {n}", {col: ln.strip()}) for n, ln in enumerate(lines, 1) if ln.strip()]
    if suffix == ".jsonl":
        rows = []
        for n, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ConfigError(f"dataset {f}, line {n}: malformed JSON ({e.msg}); fix or remove that line") from None
            if not isinstance(obj, dict):
                got = ln.strip()[:40]
                raise ConfigError(f"dataset {f}, line {n}: expected a JSON object {{...}}, got {got}; fix that line")
            rows.append((f"dataset {f}, line {n}", obj))
        return rows
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        rows = []
        for values in reader:
            if not values:  # a blank line
                continue
            if len(values) != len(header):
                raise ConfigError(
                    f"dataset {f}, line {reader.line_num}: expected {len(header)} fields "
                    f"({', '.join(header)}), got {len(values)}; fix that line (quote fields that hold commas)"
                )
            rows.append((f"dataset {f}, line {reader.line_num}", _csv_types(dict(zip(header, values, strict=True)))))
    except csv.Error as e:
        raise ConfigError(f"dataset {f}, line {reader.line_num}: malformed CSV ({e}); fix that line") from None
    if header and col not in header:  # say so even when the file has a header and no rows
        raise ConfigError(
            f"dataset {f} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(header)}"
        )
    return rows


def _text(f: Path) -> str:
    data = f.read_bytes()
    try:
        return data.decode("utf-8-sig")  # -sig: spreadsheet exports often start with a byte-order mark
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"dataset {f}, line {line}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None


def _read_parquet(f: Path, col: str, id_col: str | None) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(f).names
        if col not in names:
            raise ConfigError(
                f"dataset {f} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(names)}"
            )
        # Only the columns we use: a prompt source may also carry images or embeddings we would never look at.
        wanted = [c for c in dict.fromkeys((col, id_col, *OVERRIDE_COLUMNS)) if c in names]
        table = pq.read_table(f, columns=wanted).to_pylist()
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ConfigError(f"dataset {f}: not a readable Parquet file ({_first_line(e)}); rewrite it") from None
    return [(f"dataset {f}, row {n}", r) for n, r in enumerate(table)]


def _read_saved_dataset(folder: Path, col: str, id_col: str | None) -> list[tuple[str, dict]]:
    """A `datasets.save_to_disk` folder: Arrow stream files listed in its state.json, read with pyarrow alone."""
    import pyarrow as pa

    try:
        files = [folder / d["filename"] for d in json.loads((folder / "state.json").read_text())["_data_files"]]
        tables = [pa.ipc.open_stream(pa.memory_map(str(p))).read_all() for p in files]
    except Exception as e:  # a damaged folder: missing files, bad JSON, bad Arrow
        raise ConfigError(f"dataset {folder}: not a readable save_to_disk folder ({_first_line(e)})") from None
    names = tables[0].schema.names if tables else []
    if col not in names:
        raise ConfigError(
            f"dataset {folder} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(names)}"
        )
    wanted = [c for c in dict.fromkeys((col, id_col, *OVERRIDE_COLUMNS)) if c in names]
    rows = [r for t in tables for r in t.select(wanted).to_pylist()]
    return [(f"dataset {folder}, row {n}", r) for n, r in enumerate(rows)]


def _csv_types(r: dict) -> dict:
    # CSV has no types: empty cells are missing values; numbers are checked and converted by _override.
    return {k: (None if v == "" and k in OVERRIDE_COLUMNS else v) for k, v in r.items()}


_NEEDS = {
    "seed": "an integer from 0 to 2**63-1",
    "guidance_scale": "a number of 0 or more",
    "negative_prompt": "text",
}


def _override(where: str, key: str, value):
    """A per-row override as the pipeline needs it, or a one-line error naming the row and the column."""
    raw = value
    try:
        if key in _INT_COLUMNS:
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise ValueError
            value = int(value)
            ok = 0 <= value < 2**63 if key == "seed" else value >= 1
        elif key == "guidance_scale":
            value = float(value)
            ok = value >= 0
        else:
            ok = isinstance(value, str)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        need = _NEEDS.get(key, "an integer of 1 or more")
        raise ConfigError(f"{where}: column {key!r} is {raw!r}; it must be {need} (or empty, to use the config's)")
    return value


def _kind(value) -> str:
    return "missing (null)" if value is None else f"of type {type(value).__name__}"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
