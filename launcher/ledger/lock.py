"""One live run per (output folder, worker index), and how other runs tell whether that run is alive.

The lock's record names its holder: host, pid (and the machine's process table it belongs to), run id, start
time, and a beat counter that its holder increments.
- On disk the record lives in a file the launcher holds with flock: the kernel drops the lock the moment its
  holder dies, however it dies (kill -9 included), so a stale lock cannot block a later run; whether a run is
  alive is asked of the kernel too (can the lock be taken?), never guessed from a pid.
- On an object store there is no flock: the lock is an object created with a conditional PUT, rewritten by its
  holder every HEARTBEAT_S; a lock that has not changed for STALE_S, as the watcher's own monotonic clock sees it
  (launcher/ledger/liveness.py: no wall clock, no two hosts' clocks compared), or whose holder is a dead process of
  this very machine, is presumed dead and taken over (write, wait, read back: of two launchers taking over at
  once, the one whose record is read back wins, the other exits 4). A holder that finds its lock taken over (it
  was frozen, say) stops, and touches nothing that is not its own.
A refused launch exits 4 and names the holder.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import socket
import threading
import time

from launcher.errors import LockHeld, OutputRefused, unwritable
from launcher.ledger import liveness
from launcher.ledger.liveness import PID_SPACE, pid_alive  # noqa: F401 - pid_alive: read from here by states.py
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)
HEARTBEAT_S = 10
STALE_S = 60


def lock_rel(worker_index: int, store: Store) -> str:
    return f"locks/worker-{worker_index:05d}.{'lock' if store.is_local else 'json'}"


LOCK_NAME = re.compile(r"worker-(\d{5,})\.(?:lock|json)")  # what lock_rel names


def read_lock(store: Store, worker_index: int) -> dict | None:
    try:
        data = store.read_bytes(lock_rel(worker_index, store))
        return json.loads(data) if data else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def look(store: Store, worker_index: int) -> tuple[dict | None, bool]:
    """The lock's record (None: no lock) and whether its holder is alive."""
    rel = lock_rel(worker_index, store)
    if store.is_local:  # the kernel knows: the flock is held exactly while its holder lives
        record = read_lock(store, worker_index)
        return record, bool(record) and _flock_held(store.local(rel))
    return liveness.watch(store, rel, STALE_S)


def run_alive(store: Store, worker_index: int, run_id: str) -> bool:
    """Whether the run `run_id` of this worker index still holds its lock (so its claims are live)."""
    record, alive = look(store, worker_index)
    return bool(record) and record.get("run_id") == run_id and alive


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


def _live_locks(store: Store, but: int | None = None) -> list[dict]:
    """The lock records of the live runs on this output folder (but worker index `but`), with their worker index."""
    live = []
    for info in store.files("locks"):
        m = LOCK_NAME.fullmatch(info.base_name)
        index = int(m[1]) if m else None
        if index is None or f"locks/{info.base_name}" != lock_rel(index, store) or index == but:
            continue  # a file lock_rel did not name is not ours
        record, alive = look(store, index)
        if record and alive:
            live.append({**record, "worker": index})
    return live


def other_live_runs(store: Store, worker_index: int) -> list[dict]:
    """Lock records of the live runs of other worker indexes on this output folder."""
    return _live_locks(store, but=worker_index)


def live_run_ids(store: Store) -> set[str]:
    """The run ids of every live run on this output folder, this worker index's included."""
    return {r.get("run_id") for r in _live_locks(store)}


class RunLock:
    def __init__(self, store: Store, worker_index: int, run_id: str):
        self.store, self.index, self.rel = store, worker_index, lock_rel(worker_index, store)
        self.record: dict[str, str | int] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": run_id,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "pid_space": PID_SPACE,
        }
        self._beats = 0  # each write differs from the last: what a watcher sees change
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def _refused(self, holder: dict | None) -> LockHeld:
        h = holder or {}
        return LockHeld(
            f"another run is active on {self.store} (workers.index={self.index}): host {h.get('host', '?')}, "
            f"pid {h.get('pid', '?')}, started {h.get('started', '?')}; wait for it to finish or stop it"
        )

    def _payload(self) -> bytes:
        self._beats += 1
        return json.dumps({**self.record, "beat": self._beats}).encode()

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
            holder, alive = look(self.store, self.index)
            if holder and alive:
                raise self._refused(holder)
            self._write()  # take over a dead holder's lock, then make sure no other launcher did the same
            time.sleep(2)
            if (read_lock(self.store, self.index) or {}).get("run_id") != self.record["run_id"]:
                raise self._refused(read_lock(self.store, self.index))
        self._beating = threading.Thread(target=self._heartbeat, daemon=True)
        self._beating.start()

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

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    def held(self) -> bool:
        """Whether this run still holds its lock: on an object store another launcher may have taken it over (this
        one looked dead: frozen, or cut off from the store, for STALE_S). A store that does not answer: not held."""
        if self._fd is not None:
            return True
        try:
            return (read_lock(self.store, self.index) or {}).get("run_id") == self.run_id
        except OSError:
            return False

    def release(self) -> None:
        self._stop.set()
        if self._beating is not None:  # a beat under way would write the record back after it is cleared
            self._beating.join(timeout=2 * HEARTBEAT_S)
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
