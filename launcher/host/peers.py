"""The launchers of a multi-host job watch each other, so that a lost host stops the whole job in seconds.

torch's elastic agent on each host watches only its own workers: when another host dies, a worker blocked in a
collective waits for `run.timeout_s`, and a worker that is not waits at the agent's exit barrier (300 s), after
which the job used to look finished. So the launchers keep one TCP connection each to the first host's launcher
(`MASTER_ADDR`, port `MASTER_PORT + 1` unless `MESHGEN_PEER_PORT` says otherwise) and send a heartbeat every
second. A connection that closes without a goodbye (kill -9 closes it at once) or stays silent for LOST_AFTER_S
(a host that lost power sends nothing at all) means a lost host: this launcher then stops its own workers, as a
SIGTERM would, and exits 3 with done shards kept. The first host closes every other connection when it stops,
so every host learns of the loss.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

logger = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
LOST_AFTER_S = 10.0
CONNECT_FOR_S = 900.0  # how long a host waits for the first host's launcher to come up (torch's own join timeout)


def peer_port() -> int:
    return int(os.environ.get("MESHGEN_PEER_PORT") or int(os.environ.get("MASTER_PORT", "29500")) + 1)


class PeerWatch:
    """Heartbeats between this host's launcher and the others'; `lost` names the host that went away."""

    def __init__(self, node_rank: int, nnodes: int, master_addr: str, port: int):
        self.node_rank, self.nnodes, self.addr, self.port = node_rank, nnodes, master_addr, port
        self.lost: str | None = None
        self._conns: dict[int, socket.socket] = {}
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> PeerWatch:
        target = self._serve if self.node_rank == 0 else self._join
        threading.Thread(target=target, daemon=True, name="peer-watch").start()
        threading.Thread(target=self._beat, daemon=True, name="peer-heartbeat").start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        with self._lock:
            for conn in self._conns.values():
                _send(conn, b"bye\n")
                conn.close()
            self._conns.clear()

    def settle(self, seconds: float = 2.0) -> str | None:
        """After workers failed: wait briefly for a loss that caused it to show, and say it."""
        deadline = time.monotonic() + seconds
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.lost

    # -- connections
    def _serve(self) -> None:
        server = socket.create_server(("", self.port), reuse_port=False)
        server.settimeout(0.5)
        while not self._closing.is_set() and len(self._conns) < self.nnodes - 1:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            rank = int(_readline(conn, CONNECT_FOR_S) or b"-1")
            self._add(rank, conn)
        server.close()

    def _join(self) -> None:
        deadline = time.monotonic() + CONNECT_FOR_S
        while not self._closing.is_set():
            try:
                conn = socket.create_connection((self.addr, self.port), timeout=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self._lose(f"the first host ({self.addr}:{self.port}) never answered")
                    return
                time.sleep(0.5)
        else:
            return
        _send(conn, f"{self.node_rank}\n".encode())
        self._add(0, conn)

    def _add(self, rank: int, conn: socket.socket) -> None:
        conn.settimeout(LOST_AFTER_S)
        with self._lock:
            self._conns[rank] = conn
        threading.Thread(target=self._listen, args=(rank, conn), daemon=True).start()

    def _listen(self, rank: int, conn: socket.socket) -> None:
        while not self._closing.is_set():
            line = _readline(conn, LOST_AFTER_S)
            if line == b"bye":
                with self._lock:
                    self._conns.pop(rank, None)
                return
            if line is None and not self._closing.is_set():
                self._lose(f"host {rank} (node rank {rank}) stopped answering")
                return

    def _beat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S):
            with self._lock:
                for conn in list(self._conns.values()):
                    _send(conn, b".\n")

    def _lose(self, why: str) -> None:
        if self.lost is not None or self._closing.is_set():
            return
        self.lost = why
        logger.error("%s: stopping this host's workers; done shards are kept", why)
        with self._lock:  # the first host tells the others by closing their connections
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
        os.kill(os.getpid(), signal.SIGTERM)  # the elastic agent stops its workers as for any SIGTERM


def _send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass  # the listener sees the closed connection


def _readline(conn: socket.socket, timeout: float) -> bytes | None:
    """One line without its newline, skipping heartbeats; None when the connection closed or went silent."""
    buf = b""
    while True:
        try:
            conn.settimeout(timeout)
            ch = conn.recv(1)
        except (TimeoutError, OSError):
            return None
        if not ch:
            return None
        if ch == b"\n":
            if buf == b".":
                buf = b""
                continue
            return buf
        buf += ch
