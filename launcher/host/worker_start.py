"""How the workers start: each as a fresh interpreter (torchrun's way), or forked from a server that has already
imported what every worker imports (a CPU host).

A worker spends about 5 s of CPU importing torch, diffusers, transformers and peft before its first line runs
(measured on the 2-core CI machine: torch 1.2 s, torch._dynamo 1.2 s, diffusers 1.5 s, transformers 0.5 s, peft
0.6 s). On an accelerator host that is noise beside minutes of weight loading, and a fresh interpreter per worker
is the safe start: a device runtime must never be loaded into a process that then forks. On a CPU host the imports
run on the very cores that generate, once per worker. There the launcher starts Python's forkserver with
launcher/worker/preload.py preloaded, and torch elastic forks each worker from it (a function entrypoint,
`launcher.worker.main.entry`, with `start_method="forkserver"`). Only the imports are shared: the server holds no
threads, no device and no process group.

The server is itself forked from the launcher (`server_forked_early`), before the launcher starts any thread
(the run's lock heartbeat, the progress bar), so that it shares the launcher's own torch import instead of
starting an interpreter and importing torch again: 0.9-1.0 CPU-s and ~1.5 s less per launch, measured with one
worker and with two. That makes the server cheaper than a fresh interpreter even for one worker. Where the
launcher already runs other threads (its main() called inside another program), or has talked to an object store
(whose client's native threads and connections a fork would copy half-alive), multiprocessing starts the server as
a fresh interpreter instead.

`MESHGEN_WORKER_START=subprocess|forkserver` overrides the choice.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import connection, resource_tracker

from launcher.errors import ConfigError, die_with_parent

START_ENV = "MESHGEN_WORKER_START"
STARTS = ("subprocess", "forkserver")
PRELOAD = ["launcher.worker.preload"]
_early: dict = {}  # the server forked by server_forked_early, until preloaded_forkserver takes it


def start_method(device: str, nproc: int) -> str:
    """`forkserver` on a CPU host, else `subprocess` (torchrun's own), unless START_ENV says."""
    chosen = os.environ.get(START_ENV) or ("forkserver" if device == "cpu" else "subprocess")
    if chosen not in STARTS:
        raise ConfigError(f"{START_ENV}={chosen!r} is not a way to start workers; use one of {', '.join(STARTS)}")
    return chosen


@contextmanager
def server_forked_early(start: str) -> Iterator[None]:
    """With `start="forkserver"`, fork the workers' server from this process now, while it runs no other thread.

    The server waits until preloaded_forkserver sends it the workers' environment (the launcher completes it
    later: the run id, where the workers log), then imports PRELOAD and serves. If this block ends first (nothing
    to generate, an error), it is told to end. A no-op where the launcher already runs threads: a fork copies
    whatever locks they hold, so there multiprocessing starts a fresh server."""
    if start != "forkserver" or threading.active_count() > 1:
        yield
        return
    import torch.distributed.run  # noqa: F401 - the launcher imports it anyway; forked after, the server shares it

    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # as multiprocessing's: the server ends once no process holds alive_w open
    control_r, control_w = os.pipe()
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server
        os.close(alive_w)
        os.close(control_w)
        _serve(listener, alive_r, control_r, launcher)
    os.close(alive_r)
    os.close(control_r)
    listener.close()
    _early.update(pid=pid, address=address, alive_w=alive_w, control_w=control_w)
    try:
        yield
    finally:
        if _early:  # never handed to multiprocessing: end it
            early = dict(_early)
            _early.clear()
            for fd in (early["control_w"], early["alive_w"]):
                os.close(fd)
            os.waitpid(early["pid"], 0)
            os.unlink(address)


def _serve(listener: socket.socket, alive_r: int, control_r: int, launcher: int) -> None:
    """The forked server: wait for the workers' environment, then be multiprocessing's forkserver. Never returns."""
    try:
        die_with_parent(launcher)
        from setproctitle import setproctitle

        setproctitle(f"{sys.executable} -c from multiprocessing.forkserver import main  # meshgen, pid {launcher}")
        # A Ctrl-C meanwhile is the launcher's to act on (as multiprocessing's server ignores it while it serves).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logging.root.handlers.clear()  # the launcher's; every worker sets up its own
        with os.fdopen(control_r, "rb") as control:
            message = control.read()
        if message:
            os.environ.clear()
            os.environ.update(pickle.loads(message))
            # The workers get the handlers the server had before it served: a fresh interpreter's, not the launcher's
            signal.signal(signal.SIGINT, signal.default_int_handler)
            multiprocessing.forkserver.main(listener.fileno(), alive_r, PRELOAD)
    finally:
        os._exit(0)


@contextmanager
def preloaded_forkserver() -> Iterator[None]:
    """Workers started inside this block fork from a server that imported PRELOAD once.

    The server gets this process's environment at this moment (OMP_NUM_THREADS included, which the C runtime
    reads at import). It is the one server_forked_early forked, or else multiprocessing starts one with the first
    worker; either is stopped at the end: a second launch from the same process (the tests call main()
    repeatedly) gets a server with its own environment."""
    server = multiprocessing.forkserver._forkserver
    multiprocessing.set_forkserver_preload(PRELOAD)  # also for a server started afresh if the forked one died
    early = dict(_early)
    _early.clear()
    if early:
        resource_tracker.ensure_running()  # as multiprocessing does before it starts a server
        server._forkserver_address, server._forkserver_alive_fd = early["address"], early["alive_w"]
        server._forkserver_pid = early["pid"]
        with os.fdopen(early["control_w"], "wb") as control:
            control.write(pickle.dumps(dict(os.environ)))
    try:
        yield
    finally:
        # Its workers have ended (torch elastic stops them before it returns or raises): killed, not asked to
        # stop, since it holds nothing to flush, and asked, its interpreter's exit frees all of torch and diffusers
        # (~1 CPU-s on this process's path, per job).
        if getattr(server, "_forkserver_pid", None):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        stop = getattr(server, "_stop", None)  # CPython's own way to stop it (3.8+): closes its pipe, reaps it
        if stop is not None:
            stop()
