"""Entry of one torchrun worker process: `python -m launcher.worker.main conf=NAME [overrides]`."""

from __future__ import annotations

import sys

from launcher.errors import die_with_parent
from launcher.logs import setup_logging


def main() -> None:
    die_with_parent()
    setup_logging()
    from torch.distributed.elastic.multiprocessing.errors import record

    from launcher.config import load_config, split_args
    from launcher.errors import ConfigError, exit_with
    from launcher.worker.runner import run_worker

    @record  # torchrun then names the rank that failed first, with its traceback
    def run() -> int:
        try:
            return run_worker(load_config(*split_args(sys.argv[1:])))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code

    exit_with(run())


if __name__ == "__main__":
    main()
