"""How the workers start: each as a fresh interpreter (torchrun's way), or forked from a server that has already
imported what every worker imports (a CPU host).

A worker spends about 4 s of CPU importing torch, diffusers, transformers and peft before its first line runs
(measured on the 2-core CI machine: torch 1.1 s, diffusers 1.3 s, transformers 0.9 s, the pipelines 0.4 s). On
an accelerator host that is noise beside minutes of weight loading, and a fresh interpreter per worker is the
safe start: a device runtime must never be loaded into a process that then forks. On a CPU host the imports run
on the very cores that generate, once per worker. There, for two workers or more, the launcher starts Python's
forkserver with launcher/worker/preload.py preloaded, and torch elastic forks each worker from it (a function
entrypoint, `launcher.worker.main.entry`, with `start_method="forkserver"`). Only the imports are shared: the
server holds no threads, no device and no process group.

`MESHGEN_WORKER_START=subprocess|forkserver` overrides the choice.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from launcher.errors import ConfigError

START_ENV = "MESHGEN_WORKER_START"
STARTS = ("subprocess", "forkserver")
PRELOAD = ["launcher.worker.preload"]


def start_method(device: str, nproc: int) -> str:
    """`forkserver` for 2+ workers on a CPU host, else `subprocess` (torchrun's own), unless START_ENV says.

    One worker shares its imports with nobody: the server would only add its own start (~1 s measured)."""
    forked = device == "cpu" and nproc > 1
    chosen = os.environ.get(START_ENV) or ("forkserver" if forked else "subprocess")
    if chosen not in STARTS:
        raise ConfigError(f"{START_ENV}={chosen!r} is not a way to start workers; use one of {', '.join(STARTS)}")
    return chosen


@contextmanager
def preloaded_forkserver() -> Iterator[None]:
    """Workers started inside this block fork from a server that imported PRELOAD once.

    The server is started by the first worker, with this process's environment at that moment (OMP_NUM_THREADS
    included, which the C runtime reads at import), and stopped at the end: a second launch from the same
    process (the tests call main() repeatedly) gets a server with its own environment."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        yield
    finally:
        server = multiprocessing.forkserver._forkserver
        # Its workers have ended (torch elastic stops them before it returns or raises): killed, not asked to
        # stop, since it holds nothing to flush, and asked, its interpreter's exit frees all of torch and diffusers
        # (~1 CPU-s on this process's path, per job).
        if getattr(server, "_forkserver_pid", None):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        stop = getattr(server, "_stop", None)  # CPython's own way to stop it (3.8+): closes its pipe, reaps it
        if stop is not None:
            stop()
