"""Entry of one worker process: `python -m launcher.worker.main conf=NAME [overrides]` (torchrun's way), or
`entry(conf=NAME, ...)` in a worker forked from the launcher's forkserver (a CPU host: launcher/host/worker_start.py).
"""

from __future__ import annotations

import os
import sys
import time

from launcher.errors import die_with_parent, error_line
from launcher.logs import setup_logging

CRASH_GRACE_S = 1.0  # a forked rank that crashed waits this long before it exits: see entry()


def run(argv: list[str]) -> int:
    from launcher.config import load_config, split_args
    from launcher.errors import ConfigError
    from launcher.worker.runner import run_worker

    try:
        return run_worker(load_config(*split_args(argv)))
    except ConfigError as e:
        print(error_line(e), file=sys.stderr)
        return e.exit_code


def main() -> None:
    from launcher.errors import launcher_pid

    die_with_parent(launcher_pid())
    setup_logging()
    from torch.distributed.elastic.multiprocessing.errors import record

    from launcher.errors import exit_with

    exit_with(record(run)(sys.argv[1:]))  # record: torchrun names the rank that failed first, with its traceback  # ty: ignore[invalid-argument-type]


def entry(*argv: str) -> int:
    """A forked worker: torch elastic has set its environment and redirected its output.

    Its own session, as torchrun gives each worker: a terminal's Ctrl-C goes to the launcher, which stops the
    workers in order. The parent it dies with is the forkserver, which ends when the launcher does.

    It ends as a fresh interpreter would, never through multiprocessing's exit path: that joins the worker's
    writer process before anything has told the writer to stop (an interpreter's exit tells it first), so a
    worker stopped by Ctrl-C or a crash would hang until the agent's SIGKILL 30 s later. Success is a return,
    which torch elastic waits for from every rank; a failure is an exit code."""
    import signal
    import traceback

    from setproctitle import setproctitle
    from torch.distributed.elastic.multiprocessing.errors import record

    from launcher.errors import exit_with
    from launcher.worker.preload import SERVER_PID  # imported already: it is what the server preloads

    os.setsid()
    # This module as __main__, as in a worker that torchrun starts with `-m launcher.worker.main`: multiprocessing
    # made the launcher's module this process's __main__, and a process spawned from here (the writer) imports
    # __main__ again: the launcher's would cost it 0.15 s of imports.
    sys.modules["__main__"] = sys.modules[__name__]
    # ps, pkill -f and psutil see what torchrun would have started, not the forkserver's command line
    setproctitle(" ".join([sys.executable, "-m", __spec__.name, *argv]))
    die_with_parent(SERVER_PID)
    setup_logging()
    try:
        code = record(run)(list(argv))  # record: the error file that names the rank that failed first
    except KeyboardInterrupt:  # die of the signal, as an interpreter does; the writer dies with us
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - a crash: its traceback, then exit 1 (exit handlers would join the writer)
        traceback.print_exc()
        sys.stderr.flush()
        # Torch elastic names a forked group's failed rank by rank order among those found dead at one poll (every
        # 0.1 s), not by time: a rank that fails because a peer died (a collective broke) must not be found first,
        # or the job's exit code would be this 1 instead of the peer's own (137 for a kill -9).
        time.sleep(CRASH_GRACE_S)
        os._exit(1)
    if code:
        exit_with(code)
    return code


if __name__ == "__main__":
    main()
