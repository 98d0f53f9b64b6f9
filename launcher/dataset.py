"""Read a prompt source into rows of (id, prompt, per-row overrides), with one-line errors for bad input."""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

from launcher.errors import ConfigError

# Per-row columns that override the config for that sample, where the pipeline accepts them.
OVERRIDE_COLUMNS = ("seed", "height", "width", "negative_prompt", "num_inference_steps", "guidance_scale")
FORMATS = (".txt", ".jsonl", ".csv", ".parquet")


def read_prompts(
    path: str, prompt_column: str = "prompt", id_column: str | None = None, limit: int | None = None
) -> list[dict]:
    """Rows as dicts with `id` (str), `prompt` and any override columns, in source order.

    Ids default to the row number across all files in order, so appending rows never renumbers earlier ones.
    """
    if limit is not None and limit < 0:
        raise ConfigError(f"dataset.limit={limit} is below 0; use a positive number, or null for all rows")
    files = _files(path)
    rows: list[dict] = []
    for f in files:
        rows.extend(_read_file(f, prompt_column))
    if not rows:
        raise ConfigError(f"dataset {path} holds no prompts; add prompts or point dataset.path elsewhere")
    out, seen = [], {}
    for n, r in enumerate(rows):
        rid = str(r[id_column]) if id_column else str(n)
        if id_column and (id_column not in r or r[id_column] is None):
            raise ConfigError(
                f"dataset {path}: row {n} has no {id_column!r} (dataset.id_column); "
                f"columns found: {', '.join(sorted(r))}"
            )
        if rid in seen:
            raise ConfigError(f"dataset {path}: duplicate id {rid!r} in rows {seen[rid]} and {n}; ids must be unique")
        seen[rid] = n
        row = {"id": rid, "prompt": str(r[prompt_column])}
        row.update({k: r[k] for k in OVERRIDE_COLUMNS if r.get(k) is not None})
        out.append(row)
    return out[:limit] if limit is not None else out


def _files(path: str) -> list[Path]:
    matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    if not matches or not Path(matches[0]).exists():
        raise ConfigError(f"dataset.path {path} does not exist; pass an existing file with dataset.path=...")
    files = [Path(m) for m in matches]
    for f in files:
        if f.is_dir():
            raise ConfigError(f"dataset.path {f} is a folder; pass a file ({', '.join(FORMATS)}) or a glob")
        if f.suffix.lower() not in FORMATS:
            raise ConfigError(
                f"dataset {f}: unknown format {f.suffix or '(no extension)'!r}; use one of {', '.join(FORMATS)}"
            )
    return files


def _read_file(f: Path, col: str) -> list[dict]:
    suffix = f.suffix.lower()
    if suffix == ".txt":
        with open(f, encoding="utf-8") as fh:
            return [{col: ln.strip()} for ln in fh if ln.strip()]
    if suffix == ".jsonl":
        rows = []
        with open(f, encoding="utf-8") as fh:
            for n, ln in enumerate(fh, 1):
                if not ln.strip():
                    continue
                try:
                    obj = json.loads(ln)
                except json.JSONDecodeError as e:
                    msg = f"dataset {f}, line {n}: malformed JSON ({e.msg}); fix or remove that line"
                    raise ConfigError(msg) from None
                if not isinstance(obj, dict):
                    raise ConfigError(f"dataset {f}, line {n}: expected a JSON object, got {type(obj).__name__}")
                rows.append(obj)
    elif suffix == ".csv":
        with open(f, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            rows = []
            for n, r in enumerate(reader, 2):
                if None in r or any(v is None for v in r.values()):
                    raise ConfigError(
                        f"dataset {f}, line {n}: expected {len(reader.fieldnames)} fields, "
                        f"got {len(r) - (None not in r) + len(r.get(None, []))}"
                    )
                rows.append(_csv_types(r))
    else:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(f).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise ConfigError(f"dataset {f}: not a readable Parquet file ({e})") from None
    if rows and col not in rows[0]:
        raise ConfigError(
            f"dataset {f} has no prompt column {col!r} (dataset.prompt_column); columns found: {', '.join(rows[0])}"
        )
    return rows


def _csv_types(r: dict) -> dict:
    # CSV has no types: numbers in the override columns come in as text.
    out = dict(r)
    for k in ("seed", "height", "width", "num_inference_steps"):
        if out.get(k) not in (None, ""):
            out[k] = int(out[k])
        elif k in out:
            out[k] = None
    if out.get("guidance_scale") not in (None, ""):
        out["guidance_scale"] = float(out["guidance_scale"])
    if out.get("negative_prompt") == "":
        out["negative_prompt"] = None
    return out
