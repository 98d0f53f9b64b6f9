"""Reading an edit job's references back: by workers when they claim a shard, by tools from an output's lineage.

The plan (launcher/sources/references.py) says where each reference is and its sha256; a reference that is gone
or changed since planning raises here, naming its path, and fails its shard alone.
"""

from __future__ import annotations

import hashlib
import json

from launcher.sources.references import _entries, column_rows


def read_lineage(path: str, column: str = "image") -> bytes:
    """A reference's bytes from its lineage path (a file, or `<source file>#row=N[&ref=K]`), for tools."""
    from launcher.sources.prompts import filesystem

    if "#row=" in path:
        f, _, rest = path.rpartition("#row=")
        n, _, k = rest.partition("&ref=")
        return _stored_bytes(f, column, int(n), int(k or 0))
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as fh:
        return fh.read()


def load_references(row: dict) -> list[tuple[dict, bytes]]:
    """A plan row's references as (lineage {path, sha256}, bytes), read now and checked against their hashes.

    Raises FileNotFoundError / ValueError naming the path: the shard fails, the others go on."""
    from launcher.sources.prompts import filesystem

    out = []
    for loc, sha in zip(json.loads(row["ref_loc"]), row["ref_sha256"].split(), strict=True):
        where = loc["src"]
        if isinstance(where, list):
            data = _stored_bytes(*where)
            name = f"{where[0]} row {where[2]}"  # where: [file, column, row, k]
        else:
            fs, p = filesystem(where)
            try:
                with fs.open_input_stream(p) as fh:
                    data = fh.read()
            except FileNotFoundError:
                raise FileNotFoundError(f"reference {where} (row {row['id']}) is missing since planning") from None
            name = where
        if hashlib.sha256(data).hexdigest() != sha:
            raise ValueError(f"reference {name} (row {row['id']}) changed since planning; run the same command again")
        out.append(({"id": row["id"], "path": loc["path"], "sha256": sha}, data))
    return out


def _stored_bytes(f: str, col: str, n: int, k: int) -> bytes:
    """The k-th reference of row n of a Parquet file or save_to_disk folder (reading only its row group)."""
    import pyarrow.parquet as pq

    from launcher.sources.prompts import filesystem

    fs, p = filesystem(f)
    if fs.get_file_info(p).type.name == "Directory":
        value = next(v for w, i, v in column_rows(f, col) if i == n)
    else:
        pf = pq.ParquetFile(fs.open_input_file(p))
        start = 0
        for g in range(pf.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            if n < start + rows:
                value = pf.read_row_group(g, columns=[col]).column(0)[n - start].as_py()
                break
            start += rows
        else:
            raise FileNotFoundError(f"reference row {n} of {f} is missing since planning")
    return _entries(value)[k]["bytes"]
