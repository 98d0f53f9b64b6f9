"""Exit codes of the public contract, and the errors that carry them."""

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
