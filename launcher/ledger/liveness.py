"""Whether the holder of a lock object (an object store has no flock) is alive, with no two clocks compared.

A holder rewrites its lock every few seconds (launcher/ledger/lock.py). A watcher remembers, per lock, the bytes it
last read and when it first read them, on its own monotonic clock: a lock whose bytes have not changed for STALE_S
of that clock is dead; one that changed since the last look is alive. No wall clock is read, so a clock that steps
(NTP, a resumed VM, a drifting node) on the watcher or on the holder changes nothing, as for the launchers'
heartbeats in launcher/host/peers.py.

The first look at a lock needs no wait: its age is the store's own clock at that moment (a probe written and read
back, Store.now) minus its LastModified, both by the store's clock. And a lock whose holder is obviously gone is
dead at once: its record names this machine's process table (boot and pid namespace) and a pid that is not
running, as after a kill -9 of a run on this host.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from launcher.ledger.store import Store

_seen: dict[str, tuple[bytes, float]] = {}  # lock address -> (its bytes, when first read: time.monotonic())
_guard = threading.Lock()


def _pid_space() -> str | None:
    """This machine's boot and pid namespace: where a lock record's pid names a process of this process table."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: no pid is trusted
        return None


PID_SPACE = _pid_space()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gone(record: dict) -> bool:
    """The record's holder is a process of this machine's process table that is not running any more (a reused
    pid reads as alive: then only its silence tells)."""
    pid, here = record.get("pid"), PID_SPACE is not None and record.get("pid_space") == PID_SPACE
    return here and isinstance(pid, int) and not pid_alive(pid)


def watch(store: Store, rel: str, stale_s: float) -> tuple[dict | None, bool]:
    """(the lock object's record, None if there is none or it is unreadable; whether its holder is alive)."""
    key = store.url(rel)
    before = time.monotonic()  # the bytes read next are at least this new: a pause of ours never ages them
    raw = store.read_bytes(rel)
    after = time.monotonic()
    record = _parse(raw)
    if raw is None or record is None or gone(record):
        with _guard:
            _seen.pop(key, None)
        return record, False
    with _guard:
        last = _seen.get(key)
        if last is not None and last[0] == raw:
            return record, before - last[1] < stale_s
        if last is not None:  # rewritten since our last look: alive then, watched from now on
            _seen[key] = (raw, after)
            return record, True
    # A first look: its age by the store's clock alone, the probe first so that the age is never overstated.
    now = store.now()
    written = store.mtime(rel)
    if written is None:  # released since we read it
        return record, False
    age = max(now - written, 0.0)
    with _guard:
        _seen.setdefault(key, (raw, after - age))
    return record, age < stale_s


def _parse(raw: bytes | None) -> dict | None:
    try:
        record = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None
