"""Read a prompt source as a stream of Arrow batches of (id, prompt, per-row overrides), with one-line errors.

Every error names the file and, where there is one, the line (or Parquet row), so a bad row in a million-line
source is found in seconds, before any chip is reserved. Two readers give the same rows:
- the fast one (launcher/sources/prompts_fast.py): pyarrow's streaming JSON/CSV/Parquet readers and vectorised
  checks, which a 10M-line source needs (a Python loop over rows costs ~10 us each);
- the exact one (launcher/sources/prompts_exact.py): row by row in Python. It runs where the fast one gives up
  (an odd file, a value it cannot judge), and it is what names the bad line: the fast one never words an error.
Nothing holds the whole source: batches stream, and only ids are kept (to refuse duplicates).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from launcher.errors import ConfigError
from launcher.ledger.addresses import check_address
from launcher.ledger.store import open_uri

# Per-row columns that override the config for that sample, where the pipeline accepts them, with their types.
OVERRIDE_COLUMNS = ("seed", "height", "width", "negative_prompt", "num_inference_steps", "guidance_scale")
_INT_COLUMNS = ("seed", "height", "width", "num_inference_steps")
FORMATS = (".txt", ".jsonl", ".csv", ".parquet")
SCHEMA = pa.schema(
    [("id", pa.string()), ("prompt", pa.string())]
    + [
        (k, pa.int64() if k in _INT_COLUMNS else pa.float64() if k == "guidance_scale" else pa.string())
        for k in OVERRIDE_COLUMNS
    ]
)
BATCH_ROWS = 65536


@dataclass(frozen=True)
class Source:
    """What to read: `dataset.path` and its columns, and the size rule of per-row height/width."""

    path: str
    prompt_column: str = "prompt"
    id_column: str | None = None
    sizes: SizeRule | None = None
    images_per_prompt: int = 1  # sample ids <prompt id>-<k> must not repeat another prompt's id
    image_column: str | None = None  # job=edit: each row's references (launcher/sources/references.py)
    size_from_reference: bool = False
    # False for an earlier meshgen run as the source: its seed, size, steps, guidance and negative prompt columns
    # say how its images were made, not how to edit them, so they override nothing.
    row_settings: bool = True
    variants: int = 0  # with generate.sweep: V, and sample ids <base id>@<v> must not either
    bad_rows: str = "refuse"  # dataset.bad_rows: refuse (exit 2 naming the row) | skip (set it aside)
    late: tuple[tuple[int, str], ...] = ()  # skip: (row, why) found after the row was read (a duplicate id)
    keep_columns: tuple[str, ...] | str = ()  # dataset.keep_columns: names, or "all" (launcher/sources/keep.py)


@dataclass(frozen=True)
class SizeRule:
    multiple: int  # the model's size factor (VAE scale x patch)
    max_pixels: int  # what the family allows
    height: int  # the config's, for rows that set only one of the two
    width: int
    max_references: int = 0  # job=edit: references a row may give (the family's), checked at planning
    # (column, why): per-row columns the family's pipeline would not see, refused at planning (launcher/plan/plan.py)
    ignored: tuple[tuple[str, str], ...] = ()

    def problem(self, h: int, w: int) -> str | None:
        for key, v in (("height", h), ("width", w)):
            if v % self.multiple:
                fix = max(self.multiple, v // self.multiple * self.multiple)
                return f"{key} {v} is not a multiple of {self.multiple} (this model's size factor); use e.g. {fix}"
        if h * w > self.max_pixels:
            return (
                f"{w}x{h} is {h * w / 2**20:.1f} megapixels, more than the {self.max_pixels / 2**20:.1f} this model "
                "family allows; use a smaller size"
            )
        return None


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ConfigError(f"dataset.limit={limit} selects no prompts; use 1 or more, or null for all rows")


def read_batches(src: Source) -> Iterator[pa.RecordBatch]:
    """The source's rows in order, as batches with SCHEMA; ids default to the row number across all files.

    With dataset.bad_rows=skip, a row that fails a check stays in its place with a `rejected` column saying why
    (launcher/sources/rejected.py): the plan sets it aside, and no later row moves to another shard."""
    from launcher.sources import rejected

    files, ids, skip, n = source_files(src.path), [], src.bad_rows == "skip", 0
    for _, _, b in file_batches(src, files):
        n += b.num_rows
        if src.id_column:
            ids.append(rejected.good_ids(b) if skip else b.column(0))
        yield b
    if n == 0:
        raise ConfigError(f"dataset {src.path} holds no prompts; add prompts or point dataset.path elsewhere")
    if ids:
        all_ids = pa.chunked_array(ids, pa.string())
        if skip:
            rejected.check_unique(all_ids, src)  # raises Recheck naming the rows to set aside, if any
        else:
            _check_unique(all_ids, src, files)
        if src.images_per_prompt > 1 or src.variants:
            from launcher.plan.shards import check_sample_ids

            where, n = f"dataset {src.path}", src.images_per_prompt
            ok = (i.as_py() for c in ids for i in c if i.is_valid)
            check_sample_ids(ok, n, where, src.variants)


def file_batches(
    src: Source, files: list[str], start: int = 0, offset: int = 0
) -> Iterator[tuple[str, int, pa.RecordBatch]]:
    """(file, the batch's first row number in the whole source, the batch): `files` read in order, their first row
    at `start`. Checks every row as read_batches does, but not the ids across rows (the caller's, by id or row).
    `offset`: bytes of a single text file to pass over, its old end where it only grew (launcher/ids/idplan.py);
    not with references or kept columns, whose readers start at the top."""
    from launcher.sources import rejected
    from launcher.sources.prompts_fast import fast_batches

    refs, keep, skip = None, src.row_settings, src.bad_rows == "skip"
    schema = SCHEMA.append(rejected.FIELD) if skip else SCHEMA
    if src.image_column:
        from launcher.sources.references import References

        refs = References(src, files)
    if src.keep_columns:  # after the references: a second attacher, row for row (launcher/sources/keep.py)
        from launcher.sources.keep import Kept

        refs = _Both(refs, Kept(src, files))

    def out(b: pa.RecordBatch, at: int) -> pa.RecordBatch:
        b = rejected.marked(b, at, src.late) if skip else b
        return _attached(refs, _settings_dropped(b, keep))

    for f in files:
        done = 0
        try:
            for b in fast_batches(f, src, start, offset):
                yield f, start + done, out(b, start + done)
                done += b.num_rows
        except _GiveUp:
            try:
                for b in _batches(_exact_rows(f, src, start, offset), skip=done, schema=schema):
                    yield f, start + done, out(b, start + done)
                    done += b.num_rows
            except OSError as e:  # the store stopped answering mid-file: one line, not a traceback
                raise ConfigError(unreadable(f, e)) from None
        start += done


def _attached(refs, b: pa.RecordBatch) -> pa.RecordBatch:
    return refs.attach(b) if refs else b


@dataclass
class _Both:
    refs: object
    kept: object

    def attach(self, b: pa.RecordBatch) -> pa.RecordBatch:
        return self.kept.attach(_attached(self.refs, b))


def _settings_dropped(b: pa.RecordBatch, keep: bool) -> pa.RecordBatch:
    if keep:
        return b
    cols = [
        pa.nulls(b.num_rows, f.type) if f.name in OVERRIDE_COLUMNS else c
        for f, c in zip(b.schema, b.columns, strict=True)
    ]
    return pa.RecordBatch.from_arrays(cols, schema=b.schema)


def read_prompts(
    path: str,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    limit: int | None = None,
) -> list[dict]:
    """The rows as dicts (id, prompt, overrides present), for tools and tests; runs stream with read_batches."""
    check_limit(limit)
    rows = []
    for b in read_batches(Source(path, prompt_column, id_column)):
        rows += [{k: v for k, v in r.items() if v is not None} for r in b.to_pylist()]
        if limit is not None and len(rows) >= limit:
            break
    return rows[:limit]


class _GiveUp(Exception):
    """The fast reader cannot judge this file; the exact one reads it."""


def _batches(rows: Iterator[dict], skip: int = 0, schema: pa.Schema = SCHEMA) -> Iterator[pa.RecordBatch]:
    chunk = []
    for n, r in enumerate(rows):
        if n >= skip:
            chunk.append(r)
        if len(chunk) == BATCH_ROWS:
            yield pa.RecordBatch.from_pylist(chunk, schema=schema)
            chunk = []
    if chunk:
        yield pa.RecordBatch.from_pylist(chunk, schema=schema)


def _exact_rows(f: str, src: Source, start: int, offset: int = 0) -> Iterator[dict]:
    from launcher.sources.prompts_exact import exact_rows

    return exact_rows(f, src, start, offset)


def _check_unique(ids: pa.ChunkedArray, src: Source, files: list[str]) -> None:
    """Unique ids, and unique file names (two ids that differ only in characters a file name cannot hold would
    overwrite each other's image). Vectorised; the exact reader then names the lines of the first clash."""
    import pyarrow.compute as pc

    from launcher.plan.shards import FILE_STEM_UNSAFE, file_stem

    stems = pc.replace_substring_regex(ids, FILE_STEM_UNSAFE, "_")
    if pc.count_distinct(ids).as_py() == len(ids) and pc.count_distinct(stems).as_py() == len(ids):
        return
    seen: dict[str, str] = {}
    stem_of: dict[str, str] = {}
    for f in files:
        for where, r in _raw_rows(f, src.prompt_column, src.id_column):
            rid = str(r[src.id_column])
            if rid in seen:
                raise ConfigError(f"{where}: duplicate id {rid!r} (first at {seen[rid]}); ids must be unique")
            seen[rid] = where.removeprefix("dataset ")
            other = stem_of.setdefault(file_stem(rid), rid)
            if other != rid:
                raise ConfigError(
                    f"dataset {src.path}: ids {other!r} and {rid!r} both become the file name {file_stem(rid)}.png; "
                    "make them differ in letters, digits, '-' or '_'"
                )


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of a local path, a gs:// / s3:// URL or a Hub dataset (hf://), and the path within it."""
    if "://" in path:
        check_address(path, "dataset.path")
        if path.startswith("hf://"):  # read-only, through huggingface_hub (launcher/sources/hub_source.py)
            from launcher.sources.hub_source import hub_filesystem

            return hub_filesystem(path)
        magic = [path.index(c) for c in "*?[" if c in path]
        if not magic:
            return open_uri(path)
        head = path[: min(magic)].rpartition("/")[0]  # a URI parser refuses '[': give it the part before the glob
        fs, root = open_uri(head)
        return fs, root + path[len(head) :]
    return pafs.LocalFileSystem(), path


def run_folder(path: str) -> bool:
    """Whether `path` is an earlier meshgen run's output folder, or its `data/*.parquet`."""
    folder = path.rstrip("/").removesuffix("/data/*.parquet")
    try:  # an address no store reads is no run folder: the reader names it, in one line
        fs, p = filesystem(folder)
        return fs.get_file_info(f"{p}/run.json").type == pafs.FileType.File
    except (OSError, ValueError):
        return False


def source_files(path: str) -> list[str]:
    """The files of `dataset.path` (a file, a glob, a save_to_disk folder, a meshgen output folder), checked, in
    order."""
    try:
        return _source_files(path)
    except (OSError, pa.ArrowException) as e:  # a store that does not answer, an address pyarrow cannot parse
        raise ConfigError(unreadable(path, e)) from None


def unreadable(f: str, e: Exception) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    if "://" not in f:
        return f"dataset.path {f} cannot be read ({first}); check that it exists and that you may read it"
    if f.startswith("hf://"):
        from launcher.sources import hub_source

        return hub_source.unreadable(f, first)
    return (
        f"dataset.path {f} cannot be read ({first}); check the address, the network and the credentials "
        "(the AWS_* variables for s3://, gcloud application default credentials for gs://)"
    )


def _source_files(path: str) -> list[str]:
    from launcher.sources.globs import expand, has_magic
    from launcher.sources.hub_source import repo_files, whole_repo

    if whole_repo(path):  # hf://datasets/ORG/NAME[@REV]: every data file of the repo, as `datasets` finds them
        return repo_files(path)
    if run_folder(path) and not path.endswith(".parquet"):
        path = path.rstrip("/") + "/data/*.parquet"  # an earlier meshgen run: its Parquet shards, in shard order
    fs, p = filesystem(path)
    if has_magic(p):
        matches = expand(path, fs, p)  # Python's glob semantics: * within a folder, ** only where written
    else:
        matches = [path] if fs.get_file_info(p).type != pafs.FileType.NotFound else []
    if not matches:
        raise ConfigError(f"dataset.path {path} does not exist; pass an existing file with dataset.path=...")
    if has_magic(p):  # a glob's plain folders lead to its files; they are not data themselves
        matches = [f for f in matches if not _is_folder(f) or _is_saved_dataset(f)]
        if not matches:
            raise ConfigError(f"dataset.path {path} matches folders only; end the glob with the files' names")
    for f in matches:
        if _is_folder(f):
            if _is_saved_dataset(f):
                continue
            raise ConfigError(
                f"dataset.path {f} is a folder but not one written by datasets.save_to_disk; "
                f"pass a file ({', '.join(FORMATS)}), a glob, or a save_to_disk folder"
            )
        suffix = _suffix(f)
        if suffix not in FORMATS:
            raise ConfigError(
                f"dataset {f}: unknown format {suffix or '(no extension)'!r}; use one of {', '.join(FORMATS)}"
            )
    return matches


def _suffix(f: str) -> str:
    name = f.rstrip("/").rsplit("/", 1)[-1]
    return "." + name.rsplit(".", 1)[1].lower() if "." in name else ""


def _is_folder(f: str) -> bool:
    fs, p = filesystem(f)
    return fs.get_file_info(p).type == pafs.FileType.Directory


def _is_saved_dataset(f: str) -> bool:
    fs, p = filesystem(f)
    return all(fs.get_file_info(f"{p}/{n}").type == pafs.FileType.File for n in ("state.json", "dataset_info.json"))


def _raw_rows(f: str, col: str, id_col: str | None) -> Iterator[tuple[str, dict]]:
    """(where, the row as the file holds it), row by row."""
    from launcher.sources.prompts_raw import raw_rows

    return raw_rows(f, col, id_col)
