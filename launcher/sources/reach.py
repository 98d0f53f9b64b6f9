"""`output.dir` must lie outside what `dataset.path` can read: else the run's own files come back as prompts.

An output folder inside a source glob's reach (`dir/**/*.parquet` with output.dir=dir/out) read its own Parquet
shards as prompts on the next run, and `run.stale=regenerate` then grew the dataset 4 -> 8 -> 12. So it is refused
at the first run, before anything is written (the preflight's `output` step, dry run too).

The reach of `dataset.path`, decided from its words and no listing (the output folder may not exist yet):
- a glob: every folder its folder parts can match (`**` any depth), whose files it lists; a trailing `**`
  reaches everything below;
- a path without a prompt file's suffix (a save_to_disk folder, an earlier run's folder): everything below it;
- a file: only itself.
On local disk both sides are resolved (symlinks, `..`) first. A link inside the source's tree that leads into the
output folder is not followed here.
"""

from __future__ import annotations

import fnmatch
import os

from launcher.errors import ConfigError
from launcher.sources.globs import has_magic

PROMPT_SUFFIXES = (".txt", ".jsonl", ".csv", ".parquet")  # launcher/sources/prompts.py's FORMATS


def check_output_outside_source(source: str, output: str) -> None:
    """Refuse (exit 2) an `output` folder that `source` (dataset.path) could read from."""
    if reaches(source, output):
        raise ConfigError(
            f"output.dir {output} is inside dataset.path {source}'s reach: its files would be read back as prompts; "
            "choose an output.dir outside it"
        )


def reaches(source: str, output: str) -> bool:
    """Whether `source` could read a file inside the folder `output`."""
    src_scheme, src = _split(source)
    out_scheme, out = _split(output)
    if src_scheme != out_scheme:
        return False
    parts = src.split("/")
    first = next((i for i, s in enumerate(parts) if has_magic(s)), len(parts))
    if first == len(parts):  # no glob: a file, or a folder read whole
        if source.lower().endswith(PROMPT_SUFFIXES):
            return _within(parts[:-1], out.split("/"))
        parts = [*parts, "**"]
    elif src_scheme == "":  # the glob's plain base, resolved as the walk sees it ("/" alone: no empty part)
        parts = os.path.realpath("/".join(parts[:first]) or "/").rstrip("/").split("/") + parts[first:]
    folders = parts if parts[-1] == "**" else parts[:-1]
    return _within(folders, out.split("/"))


def _split(address: str) -> tuple[str, str]:
    """(scheme, the path as '/'-separated parts: absolute and resolved on local disk, without a trailing '/')."""
    if "://" in address:
        scheme, _, rest = address.partition("://")
        return scheme, rest.split("?", 1)[0].strip("/")
    if has_magic(address):
        return "", os.path.abspath(address).rstrip("/")  # resolved after its base is known
    return "", os.path.realpath(address)


def _within(pattern: list[str], out: list[str]) -> bool:
    """Whether some folder that `pattern`'s parts match is `out` or below it."""
    if not out:
        return True
    if not pattern:
        return False
    part = pattern[0]
    if part == "**":
        return _within(pattern[1:], out) or (not out[0].startswith(".") and _within(pattern, out[1:]))
    if out[0].startswith(".") and not part.startswith("."):
        return False
    return fnmatch.fnmatchcase(out[0], part) and _within(pattern[1:], out[1:])
