"""Exit codes of the public contract, the errors that carry them, and how our processes end."""

import ctypes
import os
import signal
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


def error_line(e: BaseException) -> str:
    """The one line a refusal prints: `error: ...`, with any credentials in an address masked (a library's message
    may quote an address, or an endpoint from the environment, whole)."""
    from launcher.ledger.addresses import masked  # here: launcher.ledger imports this module

    return f"error: {masked(str(e))}"


def out_of_space(e: BaseException) -> bool:
    """A write refused for want of room: a full disk (ENOSPC), a quota (EDQUOT), or an object store's quota."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text or "QuotaExceeded" in text


def refused_write(e: BaseException) -> bool:
    """A write refused for want of permission: a folder made read-only (EROFS: remounted after a disk error),
    permissions taken away (EACCES, EPERM), or an object store's AccessDenied."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return True
    text = str(e)
    return "Read-only file system" in text or "Permission denied" in text or "AccessDenied" in text


def unwritable(e: BaseException) -> bool:
    """The output takes no more writes (no room, or no permission): stop claiming, keep what is done, exit 3."""
    return out_of_space(e) or refused_write(e)


class OutputRefused(Exception):
    """The output folder refused the run's first writes (read-only, no permission). Exit 3: nothing lost."""

    exit_code = EXIT_SHARDS_FAILED


def exit_with(code: int) -> NoReturn:
    """Exit with `code` once the exit handlers have run, and skip the interpreter's own teardown.

    The teardown costs a second (its last collections walk every object that torch, diffusers and transformers
    created: 1.1 s measured on CPU), and it can turn a clean exit into SIGABRT: Arrow's thread pools, destroyed
    with the process's C++ statics while one of their threads still runs, call std::terminate ("terminate called
    without an active exception", apache/arrow#34314; seen here after a refused prompt source, exit -6 instead
    of 2). Exit handlers (multiprocessing's, logging's flush) still run; then the streams are flushed by hand.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code)


LAUNCHER_PID_ENV = "MESHGEN_LAUNCHER_PID"  # set by the launcher for its workers: the parent they must die with


def launcher_pid() -> int | None:
    """The launcher's pid from LAUNCHER_PID_ENV; None where no launcher set it (torchrun's own workers), or where
    the value is no pid: then die_with_parent names the parent it finds."""
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(value) if value.isdigit() else None


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    torchrun puts each worker in its own session, so a kill -9 of the launcher would orphan it; and a pool process
    (writer, encoder) waits on a queue whose write end it holds itself, so it would wait for ever. The signal is
    tied to the parent *thread*: call this in a child started by a thread that lives as long as its parent.

    `parent`: the pid of the process that started this one, as that process knew it. A child asks only once it
    runs, after its imports (a spawned writer: a second or more): a parent that died before then has already
    handed it to init, and `os.getppid()` would name init as the parent to die with. Seen in the suite: a worker
    stopped right after starting its writer left the writer waiting for ever, holding the job's stderr open.
    """
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request took effect, or before we asked
        os._exit(1)
