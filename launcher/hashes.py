"""Files' sha256, remembered across runs: the fingerprint names the model's weights and the LoRAs by content, and
a FLUX.2-dev pipeline is ~64 GB that a rerun must not read again.

A file's hash is kept in one small JSON file (`$MESHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/meshgen`, else
`~/.cache/meshgen`, beside the parameter counts of launcher/sizing/memory.py), under its resolved path, with the
stamps that any change of its bytes changes: size, mtime_ns, inode and ctime_ns. ctime as well as the brief's
three: a copy that keeps the source's times (`cp -p`, `rsync -a` in place) of a same-sized retrained checkpoint
changes no size and may set any mtime, but the kernel sets ctime on every write and nobody can set it back. At
most MAX_ENTRIES files, the least recently used dropped; written atomically (a lost race between two launchers
loses an entry, never the file); a damaged cache is ignored and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)
CACHE_NAME = "file_hashes.json"
MAX_ENTRIES = 4096  # a few hundred bytes each: a pipeline has tens of weight files
BLOCK = 8 << 20
MAX_THREADS = 8  # files hashed at once: past that, a disk rather than the cores sets the pace
PROGRESS_FROM = 1 << 30  # bytes to hash before a progress bar is worth its lines
TOUCH_AFTER_S = 86400.0  # a hit rewrites the cache to mark the entry used at most once a day

_MEMO: dict[tuple, str] = {}  # this process's hashes by stamp: run.json is judged several times per launch


def cache_path() -> Path:
    root = os.environ.get("MESHGEN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "meshgen"
    return Path(root).expanduser() / CACHE_NAME


def _stamp(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _read_cache() -> dict[str, dict]:
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, ValueError):  # none yet, or damaged: hash again
        return {}
    if not isinstance(cache, dict):
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}


def _write_cache(cache: dict[str, dict]) -> None:
    if len(cache) > MAX_ENTRIES:
        kept = sorted(cache, key=lambda k: cache[k].get("used", 0), reverse=True)[:MAX_ENTRIES]
        cache = {k: cache[k] for k in kept}
    write_cache_file(cache_path(), cache, "file hashes")


def write_cache_file(path: Path, data: dict, what: str) -> None:
    """A JSON cache in ~/.cache/meshgen, atomically (rename), so that concurrent launchers never read half a file
    (a lost race loses an entry); a read-only home only means computing it again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.debug("cannot cache %s in %s: %s", what, path, e)


def _hit(entry: dict | None, stamp: tuple) -> bool:
    return entry is not None and [entry.get(k) for k in ("size", "mtime_ns", "ino", "ctime_ns")] == list(stamp[1:])


def files_sha256(paths: list[Path], what: str = "files") -> list[str]:
    """Each file's sha256 (hex), in order: from this process's memo, else the cache, else read (with a progress
    bar where that is over PROGRESS_FROM bytes); `what` names them on the bar."""
    stamps = [_stamp(p) for p in paths]
    if all(s in _MEMO for s in stamps):
        return [_MEMO[s] for s in stamps]
    cache, now, dirty = _read_cache(), time.time(), False
    todo = [s for s in stamps if s not in _MEMO and not _hit(cache.get(s[0]), s)]
    total = sum(s[1] for s in todo)
    bar = None
    if total >= PROGRESS_FROM:
        from tqdm import tqdm

        logger.info("hashing %d files of %s (%.1f GB) for the fingerprint, once", len(todo), what, total / 1e9)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"hashing {what}", file=sys.stderr, leave=False)
    # hashlib lets go of the GIL while it hashes a block: a pipeline's shards are hashed side by side.
    digests = []
    if todo:  # no thread otherwise: the launcher forks its workers' server only while it runs none
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, MAX_THREADS)) as pool:
            digests = list(pool.map(lambda s: _read_sha256(Path(s[0]), bar), todo))
    for s, digest in zip(todo, digests, strict=True):
        cache[s[0]] = dict(zip(("size", "mtime_ns", "ino", "ctime_ns"), s[1:], strict=True))
        cache[s[0]].update(sha256=digest, hashed=now, used=now)
        dirty = True
    if bar is not None:
        bar.close()
    for s in (s for s in stamps if s not in _MEMO):
        entry = cache[s[0]]  # a hit, or hashed just now
        if now - entry.get("used", 0) > TOUCH_AFTER_S:
            entry["used"], dirty = now, True
        _MEMO[s] = entry["sha256"]
    if dirty:
        _write_cache(cache)
    return [_MEMO[s] for s in stamps]


def file_sha256(path: Path) -> str:
    return files_sha256([path])[0]


def _read_sha256(path: Path, bar) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            if bar is not None:
                bar.update(n)
    return h.hexdigest()
