"""The exact reader: each row of a prompt file checked in Python, one by one, so that a bad row is named exactly
(launcher/sources/prompts.py runs it where the fast reader, launcher/sources/prompts_fast.py, gives up)."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.errors import ConfigError
from launcher.sources.bounds import GUIDANCE, STEPS, guidance_problem, steps_problem, text_problem
from launcher.sources.prompts import _INT_COLUMNS, OVERRIDE_COLUMNS, Source
from launcher.sources.prompts_raw import missing_column, raw_rows


def exact_rows(f: str, src: Source, start: int, offset: int = 0) -> Iterator[dict]:
    """Each row from byte `offset` (0, or a grown text file's old end), the first one row `start`, checked. A row
    that fails a check raises (dataset.bad_rows=refuse) or, with skip, stands as a rejected row in its place
    (launcher/sources/rejected.py), so that the rows after it keep their positions."""
    from launcher.sources.rejected import rejected_row

    for n, (where, r) in enumerate(raw_rows(f, src.prompt_column, src.id_column, offset), start):
        try:
            yield _exact_row(where, r, n, src)
        except ConfigError as e:
            if src.bad_rows != "skip":
                raise
            rid = str(n) if not src.id_column else r.get(src.id_column) if isinstance(r, dict) else None
            yield rejected_row(where, rid if isinstance(rid, (str, int)) else None, str(e))


def _exact_row(where: str, r, n: int, src: Source) -> dict:
    from launcher.sources.row_checks import Bad, id_problem

    col, id_col = src.prompt_column, src.id_column
    if isinstance(r, Bad):
        raise ConfigError(f"{where}: {r.reason}")
    prompt = r.get(col)
    if col not in r:
        raise ConfigError(missing_column(where, col, "prompt", r or ["none"]))
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: the prompt ({col!r}) is {_kind(prompt)}, not text; fix that row")
    if too_long := text_problem(f"the prompt ({col!r})", prompt):
        raise ConfigError(f"{where}: {too_long}")
    if id_col and id_col not in r:
        raise ConfigError(f"{missing_column(where, id_col, 'id', r)}; fix the row or set dataset.id_column=null")
    if id_col and r[id_col] is None:
        raise ConfigError(f"{where}: the id ({id_col!r}) is missing (null); give the row an id or remove the row")
    rid = str(r[id_col]) if id_col else str(n)
    if id_col and (problem := id_problem(rid, id_col)):
        raise ConfigError(f"{where}: {problem}")
    row = {"id": rid, "prompt": prompt}
    row.update({k: _override(where, k, r[k]) for k in OVERRIDE_COLUMNS if r.get(k) is not None})
    if src.sizes and ("height" in row or "width" in row):
        problem = src.sizes.problem(row.get("height", src.sizes.height), row.get("width", src.sizes.width))  # ty: ignore[invalid-argument-type]
        if problem:
            raise ConfigError(f"{where}: {problem} (or leave the row's height and width empty)")
    return row


_NEEDS = {
    "seed": "an integer from 0 to 2**63-1",
    "num_inference_steps": f"an integer from {STEPS[0]} to {STEPS[1]}",
    "guidance_scale": f"a finite number from {GUIDANCE[0]:g} to {GUIDANCE[1]:g}",
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
            ok = ok and not (key == "num_inference_steps" and steps_problem(value))
        elif key == "guidance_scale":
            value = float(value)
            ok = not guidance_problem(value)
        else:
            ok = isinstance(value, str)
            if ok and (too_long := text_problem(f"column {key!r}", value)):
                raise ConfigError(f"{where}: {too_long}")
    except (TypeError, ValueError):
        ok = False
    if not ok:
        need = _NEEDS.get(key, "an integer of 1 or more")
        raise ConfigError(f"{where}: column {key!r} is {raw!r}; it must be {need} (or empty, to use the config's)")
    return value


def _kind(value) -> str:
    return "missing (null)" if value is None else f"of type {type(value).__name__}"
