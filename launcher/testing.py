"""The `testing.*` keys' waits: a test acts on a run at a point it names, on an event, not after a guessed time.

None of these keys is part of the fingerprint (they change no byte of the output)."""

from __future__ import annotations

import os
import time

HOLD_LIMIT_S = 600.0  # a test that never releases its hold stops waiting after this: the run goes on


def hold_until(path: str | None) -> None:
    """Say so (`path`.waiting, for the test to wait on), then wait until `path` exists (at most HOLD_LIMIT_S)."""
    if not path:
        return
    open(f"{path}.waiting", "w").close()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
