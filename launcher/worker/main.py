"""Entry of one worker process: `python -m launcher.worker.main conf=NAME [overrides]` (torchrun's way), or
`entry(conf=NAME, ...)` in a worker forked from the launcher's forkserver (a CPU host: launcher/host/worker_start.py).
"""

from __future__ import annotations

import os
import sys

from launcher.errors import die_with_parent
from launcher.logs import setup_logging


def run(argv: list[str]) -> int:
    from launcher.config import load_config, split_args
    from launcher.errors import ConfigError
    from launcher.worker.runner import run_worker

    try:
        return run_worker(load_config(*split_args(argv)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


def main() -> None:
    die_with_parent()
    setup_logging()
    from torch.distributed.elastic.multiprocessing.errors import record

    from launcher.errors import exit_with

    exit_with(record(run)(sys.argv[1:]))  # record: torchrun names the rank that failed first, with its traceback


def entry(*argv: str) -> int:
    """A forked worker: torch elastic has set its environment and redirected its output; it records errors.

    Its own session, as torchrun gives each worker: a terminal's Ctrl-C goes to the launcher, which stops the
    workers in order. The parent it dies with is the forkserver, which ends when the launcher does. A failure is
    an exit code; success must be a return, which torch elastic waits for from every rank."""
    from setproctitle import setproctitle

    os.setsid()
    # ps, pkill -f and psutil see what torchrun would have started, not the forkserver's command line
    setproctitle(" ".join([sys.executable, "-m", __spec__.name, *argv]))
    die_with_parent()
    setup_logging()
    code = run(list(argv))
    if code:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
