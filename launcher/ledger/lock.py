"""One live run per (output folder, worker index), and how other runs tell whether that run is alive.

The lock's record names its holder: host, pid, run id, start time and a heartbeat that its holder refreshes.
- On disk the record lives in a file the launcher holds with flock: the kernel drops the lock the moment its
  holder dies, however it dies (kill -9 included), so a stale lock cannot block a later run; whether a run is
  alive is asked of the kernel too (can the lock be taken?), never guessed from a pid.
- On an object store there is no flock: the lock is an object created with a conditional PUT, rewritten by its
  holder every HEARTBEAT_S; a lock that the store says was last written more than STALE_S ago, by the store's own
  clock (LastModified against the store's now, see Store.now), is presumed dead and taken over (write, wait, read
  back: of two launchers taking over at once, the one whose record is read back wins, the other exits 4). No
  host's clock is compared with another's: a host running 90 s behind keeps its lock.
A refused launch exits 4 and names the holder.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time

from launcher.errors import LockHeld, OutputRefused, unwritable
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)
HEARTBEAT_S = 10
STALE_S = 60


def lock_rel(worker_index: int, store: Store) -> str:
    return f"locks/worker-{worker_index:05d}.{'lock' if store.is_local else 'json'}"


def read_lock(store: Store, worker_index: int) -> dict | None:
    try:
        data = store.read_bytes(lock_rel(worker_index, store))
        return json.loads(data) if data else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_alive(store: Store, worker_index: int, run_id: str) -> bool:
    """Whether the run `run_id` of this worker index still holds its lock (so its claims are live)."""
    rec = read_lock(store, worker_index)
    return bool(rec) and rec.get("run_id") == run_id and _holder_alive(store, worker_index, rec)


def _holder_alive(store: Store, worker_index: int, rec: dict) -> bool:
    if store.is_local:  # the kernel knows: the flock is held exactly while its holder lives
        return _flock_held(store.local(lock_rel(worker_index, store)))
    written = store.mtime(lock_rel(worker_index, store))
    return written is not None and store.now() - written < STALE_S


def _flock_held(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own shared lock, if it got one
    return False


def other_live_runs(store: Store, worker_index: int) -> list[dict]:
    """Lock records of the live runs of other worker indexes on this output folder."""
    live = []
    for info in store.files("locks"):
        if not info.base_name.startswith("worker-"):
            continue
        index = int(info.base_name[7:12])
        rec = read_lock(store, index) if index != worker_index else None
        if rec and _holder_alive(store, index, rec):
            live.append({**rec, "worker": index})
    return live


class RunLock:
    def __init__(self, store: Store, worker_index: int, run_id: str):
        self.store, self.index, self.rel = store, worker_index, lock_rel(worker_index, store)
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": run_id,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self._fd: int | None = None
        self._stop = threading.Event()

    def _refused(self, holder: dict | None) -> LockHeld:
        h = holder or {}
        return LockHeld(
            f"another run is active on {self.store} (workers.index={self.index}): host {h.get('host', '?')}, "
            f"pid {h.get('pid', '?')}, started {h.get('started', '?')}; wait for it to finish or stop it"
        )

    def _payload(self) -> bytes:
        return json.dumps({**self.record, "heartbeat": time.time()}).encode()

    def acquire(self) -> None:
        try:
            self._acquire()
        except OSError as e:
            if not unwritable(e):
                raise
            why = str(e).splitlines()[0][:200]
            raise OutputRefused(
                f"{self.store} refuses writes ({why}): its lock cannot be taken; make it writable again and run "
                "the same command to finish"
            ) from None

    def _acquire(self) -> None:
        if self.store.is_local:
            path = self.store.local(self.rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            for attempt in range(5):  # a liveness probe (_flock_held) holds it for an instant: try a few times
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt == 4:
                        os.close(fd)
                        raise self._refused(read_lock(self.store, self.index)) from None
                    time.sleep(0.1)
            self._fd = fd
            self._write()
        elif not self.store.create_exclusive(self.rel, self._payload()):
            holder = read_lock(self.store, self.index)
            if holder and _holder_alive(self.store, self.index, holder):
                raise self._refused(holder)
            self._write()  # take over a dead holder's lock, then make sure no other launcher did the same
            time.sleep(2)
            if (read_lock(self.store, self.index) or {}).get("run_id") != self.record["run_id"]:
                raise self._refused(read_lock(self.store, self.index))
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _write(self) -> None:
        if self._fd is not None:
            data = self._payload()
            os.pwrite(self._fd, data, 0)  # then cut the rest: a reader never sees an empty record
            os.ftruncate(self._fd, len(data))
        else:
            self.store.write_bytes(self.rel, self._payload())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (
                    not self.store.is_local
                    and (read_lock(self.store, self.index) or {}).get("run_id") != self.record["run_id"]
                ):
                    # Another launcher took the lock over (we looked dead to it): stop rather than run twice.
                    logger.error("lost the lock %s to another run; stopping", self.rel)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                self._write()
            except Exception as e:  # a transient store error: try again at the next beat
                logger.warning("could not refresh the lock %s: %s", self.rel, str(e).splitlines()[0][:200])

    def release(self) -> None:
        self._stop.set()
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError as e:  # a folder remounted read-only: the flock still goes with the descriptor
                logger.warning("could not clear the lock %s: %s", self.rel, e)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        elif (read_lock(self.store, self.index) or {}).get("run_id") == self.record["run_id"]:
            try:
                self.store.delete(self.rel)
            except OSError as e:  # its heartbeat stops: the next run takes the lock over once it is stale
                logger.warning("could not remove the lock %s: %s", self.rel, str(e).splitlines()[0][:200])

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
