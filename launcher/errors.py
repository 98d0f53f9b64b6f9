"""Exit codes of the public contract, the errors that carry them, and a quick exit with one."""

import gc
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_SHARDS_FAILED = 3
EXIT_LOCKED = 4


class ConfigError(Exception):
    """Bad configuration or input: one line saying what is wrong and how to fix it. Exit 2."""

    exit_code = EXIT_BAD_INPUT


class LockHeld(Exception):
    """Another live run of the same worker holds the output folder. Exit 4."""

    exit_code = EXIT_LOCKED


def exit_with(code: int) -> NoReturn:
    """sys.exit(code), minus a second of shut-down: the interpreter's last collections would walk every object
    that torch, diffusers and transformers created (1.1 s measured on CPU; 0.2 s frozen). Exit handlers still run.
    """
    gc.freeze()
    sys.exit(code)
