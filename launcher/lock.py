"""One live run per (output folder, worker index): an flock'd file that names its owner.

We chose a kernel lock (flock) over a lock file with liveness checks: the kernel drops it the moment its owner
dies, however it dies (kill -9 included), so a stale lock cannot exist and two launchers can never both take it.
The file's content (host, pid, start time) is only there so that a refused launch can name the holder (exit 4).
It needs a local or POSIX-locking file system; object stores get per-shard claims instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from launcher.errors import LockHeld


class RunLock:
    def __init__(self, out: Path, worker_index: int):
        self.path = Path(out) / "locks" / f"worker-{worker_index:05d}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "{}"
            os.close(fd)
            h = json.loads(holder) if holder.startswith("{") else {}
            raise LockHeld(
                f"another run is active on {self.path.parent.parent} ({self.path.stem}): "
                f"host {h.get('host', '?')}, pid {h.get('pid', '?')}, started {h.get('started', '?')}; "
                "wait for it to finish or stop it"
            ) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
