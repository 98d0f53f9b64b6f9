"""The launchers of a multi-host job watch each other, so that a lost host stops the whole job in seconds.

torch's elastic agent on each host watches only its own workers: when another host dies, a worker blocked in a
collective waits for `run.timeout_s`, and a worker that is not waits at the agent's exit barrier (300 s), after
which the job used to look finished. So each launcher keeps a heartbeat in the store that torch's launch already
runs for the rendezvous (the c10d TCPStore on `MASTER_ADDR:MASTER_PORT`, served by the first host's agent): a
counter per host, `meshgen/peer/<node>/beat`, that its launcher increments every second, and that every other
launcher watches. That adds no listener and no trust boundary of meshgen's own: a port scan, a health probe or
an HTTP request on that port meets torch's store, which drops what it cannot parse.

A host is lost when its counter stops changing for LOST_AFTER_S as the watcher's own monotonic clock sees it
(no two hosts' clocks are ever compared), or, for the first host that serves the store, when the store stays
unreachable that long. A launcher that ends sets `meshgen/peer/<node>/bye` first, so that its silence is not a
loss. On a loss this launcher stops its own workers, as a SIGTERM would, and exits 3 with done shards kept.
Before any of this, the launchers agree on the job through the same store (launcher/host/agreement.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
LOST_AFTER_S = 10.0
CONNECT_FOR_S = 900.0  # how long a host waits for the first host's store to come up (torch's own join timeout)
OP_TIMEOUT_S = 3.0  # one store call; a slower answer counts as no answer
RDZV_ID = "none"  # torchrun's default --rdzv-id, which launch.py's multi-host command keeps


class PeerWatch:
    """Heartbeats of this host's launcher in the job's store, and the watch on the others'; `lost` says why."""

    def __init__(self, node_rank: int, nnodes: int, addr: str, port: int):
        self.node_rank, self.nnodes, self.addr, self.port = node_rank, nnodes, addr, port
        self.lost: str | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()  # a loss and the end of the run never cross
        self._store: Any = None  # torch's TCPStore, once connected
        self._server: Any = None
        self._others = [n for n in range(nnodes) if n != node_rank]
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (its counter, when that value was first seen)
        self._said_bye: set[int] = set()
        self._agent_running = False

    def __enter__(self) -> PeerWatch:
        if self.node_rank == 0:
            # Serve the job's store from this watch first; the agent's own TCPStore (multi-tenant) then shares
            # this server, which so outlives the agent: a failed worker group tears the agent's store down, and
            # the watch must still tell a lost host from a local failure (settle).
            from torch.distributed import TCPStore

            self._server = TCPStore(self.addr, self.port, is_master=True, wait_for_workers=False, multi_tenant=True)
        threading.Thread(target=self._watch, daemon=True, name="peer-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closing.set()
        store = self._store
        if store is not None:
            try:  # our silence from now on is an end, not a loss
                store.set(key(self.node_rank, "bye"), "1")
            except Exception:  # noqa: BLE001 - the store's host may be gone already; nobody is left to tell
                pass
        self._server = None  # the first host's store goes with this launcher; every agent has left its barrier

    def settle(self) -> str | None:
        """After workers failed: whether a lost host caused it. Waits until every other host's heartbeat has
        been seen to change twice since (alive: a failure of our own), or the loss shows (at most LOST_AFTER_S).
        Twice: the first change seen may be the last beat of a host that died just before, which the watch read
        only now (a lost host taken for alive made its exit 1, a crash, instead of 3; seen on a loaded machine)."""
        start = time.monotonic()
        deadline = start + LOST_AFTER_S + 2 * HEARTBEAT_S
        first: dict[int, int] = {}  # node -> the first value of its counter seen since start
        while self.lost is None and time.monotonic() < deadline:
            for n in self._others:
                value, when = self._seen.get(n, (0, 0.0))
                if when > start:
                    first.setdefault(n, value)
            if all(n in self._said_bye or (n in first and self._seen[n][0] != first[n]) for n in self._others):
                return None
            time.sleep(0.1)
        return self.lost

    def _connect(self):
        store = connect(self.addr, self.port, self._closing.is_set, time.monotonic() + CONNECT_FOR_S)
        if store is None and not self._closing.is_set():
            self._lose(f"the first host's store ({self.addr}:{self.port}) never answered")
        return store

    def _watch(self) -> None:
        self._store = store = self._connect()
        if store is None:
            return
        seen, unreachable_since = self._seen, None
        while not self._closing.wait(HEARTBEAT_S):
            now = time.monotonic()
            try:
                store.add(key(self.node_rank, "beat"), 1)
                for n in self._others:
                    if n in self._said_bye or store.check([key(n, "bye")]):
                        self._said_bye.add(n)
                        seen.pop(n, None)
                        continue
                    value = store.add(key(n, "beat"), 0)  # reads without waiting; 0 until that host starts
                    if value and seen.get(n, (None,))[0] != value:
                        seen[n] = (value, now)
                unreachable_since = None
            except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError, DistStoreError, RuntimeError
                unreachable_since = unreachable_since or now
                if now - unreachable_since > LOST_AFTER_S:
                    self._lose(f"the first host ({self.addr}:{self.port}) stopped answering ({type(e).__name__})")
                    return
                continue
            for n, (_, since) in list(seen.items()):
                if now - since > LOST_AFTER_S:
                    self._lose(f"host {n} (node rank {n}) stopped answering")
                    return

    @contextlib.contextmanager
    def agent(self):
        """Around the elastic agent's run: only then does a loss stop it with a SIGTERM (afterwards torch's
        handler would raise in whatever the launcher does next)."""
        with self._lock:
            self._agent_running = True
        try:
            yield
        finally:
            with self._lock:
                self._agent_running = False

    def _lose(self, why: str) -> None:
        with self._lock:
            if self.lost is not None or self._closing.is_set():
                return
            self.lost = why
            logger.error("%s: stopping this host's workers; done shards are kept", why)
            if not self._agent_running:
                return
            os.kill(os.getpid(), signal.SIGTERM)  # the elastic agent stops its workers as for any SIGTERM
        self._release_exit_barrier()

    def _release_exit_barrier(self) -> None:
        """A host whose workers are all done waits in the agent's exit barrier for the others, inside one C++
        store call that the SIGTERM cannot interrupt (up to 300 s). The lost host never checks in, so check in
        for it: the barrier returns, and the pending SIGTERM stops the agent at once. The barrier's keys are
        torch's (torch/distributed/elastic), under torchrun's default rendezvous id; tests/test_hosts.py fails
        if they move."""
        try:
            from torch.distributed import PrefixStore
            from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
            from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN

            if self._store is not None:
                PrefixStore(RDZV_ID, self._store).set(_TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN, "lost")
        except Exception as e:  # noqa: BLE001 - the agent then waits out its barrier: slower, still exit 3
            logger.warning("could not release the agents' exit barrier: %s", e)


def connect(addr: str, port: int, stop: Callable[[], bool], until: float):
    """A client of the job's store, once the first host serves it (polled with plain connects, so that torch does
    not print a warning for each try); None once `stop()` or past `until` (monotonic)."""
    from torch.distributed import TCPStore

    while not stop():
        try:
            socket.create_connection((addr, port), timeout=2.0).close()
            store = TCPStore(addr, port, is_master=False, wait_for_workers=False)
            store.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
            return store
        except Exception:  # noqa: BLE001 - not up yet (or torch's store refused us): try again
            if time.monotonic() > until:
                return None
            time.sleep(0.5)
    return None


def key(node: int, what: str) -> str:
    return f"meshgen/peer/{node}/{what}"
