"""`dataset.path` globs with the meaning of Python's `glob.glob(pattern, recursive=True)`, on any store.

- `*`, `?` and `[...]` match within one folder's names, never across `/`; names starting with `.` are matched only
  by a pattern part that starts with `.` (as `glob` does);
- `**` as a whole part matches zero or more folders, and only there: `dir/*/*.txt` does not reach `dir/a/b/x.txt`;
- each file is listed once, under the first of its paths in sorted order: on local disk two paths with one
  (st_dev, st_ino) are one file (a symlink beside its target, a hard link, a folder bind-mounted inside itself:
  each once made every prompt twice); on an object store, two objects with one size, time and ETag; on the Hub
  (no times there), two files with one size and content id (LFS sha256, else git blob id);
- a folder link back to a folder it is inside is a loop that `**` would follow forever (a link to a parent under
  `dir/**/*.txt` once made 41 samples from 1 prompt): it is refused, naming the link.

One walker serves local disk and object stores alike through pyarrow.fs listings, one per folder visited.
fnmatch alone is not enough: it lets `*` cross `/`, and a recursive listing follows links into loops.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Iterator

import pyarrow.fs as pafs

from launcher.errors import ConfigError

logger = logging.getLogger(__name__)
MAGIC = "*?["


def has_magic(path: str) -> bool:
    return any(c in path for c in MAGIC)


def expand(path: str, fs: pafs.FileSystem, p: str) -> list[str]:
    """The files and folders that the glob `path` (`p` within `fs`, without the scheme) names, sorted, each once."""
    scheme = path.split("://", 1)[0] + "://" if "://" in path else ""
    local = not scheme
    absolute = p.startswith("/")
    parts = [s for s in p.split("/") if s]
    first = next(i for i, s in enumerate(parts) if has_magic(s))
    base = "/".join(parts[:first])
    base = ("/" + base if absolute else base) or ("/" if absolute else ".")
    walker = _Walker(fs, local, path)
    ancestors = (os.path.realpath(base),) if local else ()
    found = sorted(set(walker.walk(base, parts[first:], ancestors)))
    if not local:
        return [scheme + f for f in once_each(found, walker.infos, fs, scheme)]
    if base == "." and not absolute:
        found = [f.removeprefix("./") for f in found]
    seen: dict[tuple[int, int], str] = {}
    out = []
    for f in found:  # one path per file: a link beside its target, a hard link, a folder mounted inside itself
        st = os.stat(f)
        first_path = seen.setdefault((st.st_dev, st.st_ino), f)
        if first_path == f:
            out.append(f)
        else:
            logger.info("dataset.path: %s is %s under another name: read once", f, first_path)
    return out


def once_each(found: list[str], infos: dict[str, pafs.FileInfo], fs: pafs.FileSystem, scheme: str) -> list[str]:
    """`found` on an object store, less the objects that repeat an earlier one: no inodes there, so the same
    (size, modification time) and then the same ETag (a HEAD request per object, only for those that share a
    size and a time with another: none for most sources). Folders are kept as they are."""
    groups: dict[tuple, list[str]] = {}
    for f in found:
        info = infos.get(f) or fs.get_file_info(f)
        if info.type == pafs.FileType.File:
            groups.setdefault((info.size, info.mtime_ns), []).append(f)
    dropped: set[str] = set()
    for paths in (g for g in groups.values() if len(g) > 1):
        seen: dict[str, str] = {}
        for f in paths:
            tag = _etag(scheme, f)
            if tag is not None and seen.setdefault(tag, f) != f:
                logger.info("dataset.path: %s%s has the content of %s%s: read once", scheme, f, scheme, seen[tag])
                dropped.add(f)
    return [f for f in found if f not in dropped]


def _etag(scheme: str, path: str) -> str | None:
    """The object's ETag (one HEAD request), a Hub file's content id; None where the store's client is not there."""
    if scheme == "hf://":
        from launcher.sources.hub_source import content_id

        return content_id(path)
    bucket, _, key = path.partition("/")
    if scheme == "s3://":
        import boto3  # AWS_ENDPOINT_URL and the AWS_* credentials, as pyarrow reads them

        from launcher.ledger.store import boto_bounds, boto_errors

        with boto_errors():
            return boto3.client("s3", config=boto_bounds()).head_object(Bucket=bucket, Key=key)["ETag"]
    if scheme == "gs://":
        from launcher.ledger.gcs import gcs_client  # the same server as the listing's (STORAGE_EMULATOR_HOST)

        return gcs_client().bucket(bucket).get_blob(key).etag
    return None


class _Walker:
    def __init__(self, fs: pafs.FileSystem, local: bool, pattern: str):
        self.fs, self.local, self.pattern = fs, local, pattern
        self.infos: dict[str, pafs.FileInfo] = {}  # what the listings said of each entry: sizes, times

    def _list(self, folder: str) -> list[pafs.FileInfo]:
        sel = pafs.FileSelector(folder, allow_not_found=True, recursive=False)
        got = [i for i in self.fs.get_file_info(sel) if i.type in (pafs.FileType.File, pafs.FileType.Directory)]
        self.infos.update((i.path, i) for i in got)
        return got

    def _enter(self, folder: str, ancestors: tuple[str, ...]) -> tuple[str, ...]:
        """The real folders above and at `folder`; a ConfigError where `folder` is one of those above (a loop)."""
        if not self.local:
            return ancestors
        real = os.path.realpath(folder)
        if real in ancestors:
            link = folder if os.path.islink(folder) else "a link in it"
            raise ConfigError(
                f"dataset.path {self.pattern}: {link} leads back to {real}, a folder it is inside, so ** would "
                "never end (a symlink loop); remove the link or write a glob that does not recurse through it"
            )
        return (*ancestors, real)

    def walk(self, folder: str, parts: list[str], ancestors: tuple[str, ...]) -> Iterator[str]:
        if not parts:
            yield folder
            return
        part, rest = parts[0], parts[1:]
        if part == "**":
            if self.local and os.path.realpath(folder) not in ancestors:  # reached by `*`: where the ** starts
                ancestors = (*ancestors, os.path.realpath(folder))
            yield from self.walk(folder, rest, ancestors) if rest else iter([folder])
            for info in self._list(folder):
                if info.type == pafs.FileType.Directory and not info.base_name.startswith("."):
                    yield from self.walk(info.path, parts, self._enter(info.path, ancestors))
                elif not rest and not info.base_name.startswith("."):
                    yield info.path
            return
        if not has_magic(part):
            child = f"{folder.rstrip('/')}/{part}"
            if rest:
                yield from self.walk(child, rest, ancestors)
            elif self.fs.get_file_info(child).type != pafs.FileType.NotFound:
                yield child
            return
        for info in self._list(folder):
            name = info.base_name
            if name.startswith(".") and not part.startswith("."):
                continue
            if not fnmatch.fnmatchcase(name, part):
                continue
            if not rest:
                yield info.path
            elif info.type == pafs.FileType.Directory:
                yield from self.walk(info.path, rest, ancestors)
