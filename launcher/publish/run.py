"""`output.publish`: a run pushes each shard to the target as it is done, and the card at the end.

The launcher's progress watcher (launcher/host/summary.py) already lists the ledger every few seconds; it hands
the shards this run has finished to `RunPublisher.offer`, which never blocks it: the shards wait in a set (at most
one entry per shard) for a background thread that pushes whatever has gathered since its last push as one batch
(one Hub commit). The target is probed when the run starts (a bad token or a missing repo is exit 2 before any
shard is generated). A failed push never fails or loses a shard: the thread stops pushing, and at the end one
whole push (launcher/publish/push.py: only what the target lacks, earlier runs' shards included) is tried; if it
fails too, the run ends with exit 3 and a last line naming the failure and how to finish the push.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from launcher.ledger.store import Store
from launcher.publish.push import publish
from launcher.publish.targets import open_target

logger = logging.getLogger(__name__)


def start_publisher(cfg, store: Store) -> RunPublisher | None:
    uri = str(cfg.output.get("publish") or "")
    return RunPublisher(uri, store) if uri else None


class RunPublisher:
    def __init__(self, uri: str, store: Store):
        self.uri, self.store = uri, store
        self.target = open_target(uri, store)  # the probe: ConfigError, exit 2, before anything is generated
        self.sent: set[int] = set()
        self.error: str | None = None
        self._pending: set[int] = set()
        self._pushing: set[int] = set()  # offered again at each look while pushed: not pushed twice
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), False
        self._thread = threading.Thread(target=self._loop, name="publish", daemon=True)
        self._thread.start()

    def offer(self, done: Iterable[int]) -> None:
        with self._lock:
            new = set(done) - self.sent - self._pending - self._pushing
            if new and self.error is None:
                self._pending |= new
                self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._pending, stop = sorted(self._pending), set(), self._stop
                self._pushing = set(batch)
            if batch:
                try:
                    publish(self.store, self.uri, only=batch, card=False, say=logger.info, target=self.target)
                    with self._lock:
                        self.sent |= set(batch)
                except Exception as e:  # noqa: BLE001 - any failure: stop pushing; finish() tries once more
                    self.error = _why(e)
                    logger.warning("the push of shards %s to %s failed (%s); retried at the end", batch, self.uri, e)
                with self._lock:
                    self._pushing = set()
            if stop:
                return

    def finish(self) -> str | None:
        """Wait for the pushes under way, then push what is left and the card; the line to end the run with if the
        push failed, else None."""
        with self._lock:
            self._stop = True
            self._wake.set()
        self._thread.join()
        try:
            sent = publish(self.store, self.uri, say=logger.info, target=self.target)
        except Exception as e:  # noqa: BLE001 - the shards are done and kept; only the push is unfinished
            return (
                f"the push to output.publish={self.uri} failed ({_why(e)}); the generated shards are kept: run the "
                f"same command, or python -m tools.publish {self.store} {self.uri}, to finish it"
            )
        logger.info(
            "published to %s: %d shards during the run, %d at the end", self.uri, len(self.sent), sent["shards"]
        )
        return None


def _why(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
