"""`dataset.path` globs with the meaning of Python's `glob.glob(pattern, recursive=True)`, on any store.

- `*`, `?` and `[...]` match within one folder's names, never across `/`; names starting with `.` are matched only
  by a pattern part that starts with `.` (as `glob` does);
- `**` as a whole part matches zero or more folders, and only there: `dir/*/*.txt` does not reach `dir/a/b/x.txt`;
- each real file is listed once: on local disk two paths to one file (a link beside its target) give the first
  path in sorted order only;
- a folder link back to a folder it is inside is a loop that `**` would follow forever (a link to a parent under
  `dir/**/*.txt` once made 41 samples from 1 prompt): it is refused, naming the link.

One walker serves local disk and object stores alike through pyarrow.fs listings, one per folder visited.
fnmatch alone is not enough: it lets `*` cross `/`, and a recursive listing follows links into loops.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator

import pyarrow.fs as pafs

from launcher.errors import ConfigError

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
    if base == "." and not absolute:
        found = [f.removeprefix("./") for f in found]
    if not local:
        return [scheme + f for f in found]
    seen: set[str] = set()
    out = []
    for f in found:  # one path per real file: a link beside its target, or two links to one folder
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


class _Walker:
    def __init__(self, fs: pafs.FileSystem, local: bool, pattern: str):
        self.fs, self.local, self.pattern = fs, local, pattern

    def _list(self, folder: str) -> list[pafs.FileInfo]:
        sel = pafs.FileSelector(folder, allow_not_found=True, recursive=False)
        return [i for i in self.fs.get_file_info(sel) if i.type in (pafs.FileType.File, pafs.FileType.Directory)]

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
