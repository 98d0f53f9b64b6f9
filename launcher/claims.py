"""Per-shard claims: how the workers of one job share its shards, none skipped and none done twice.

Any worker may generate any selected shard; the modulo split (shard i to worker i % count) is only the order in
which each worker tries them, so workers that start together rarely contend, and a rerun with a few shards left
is shared by all workers instead of falling to the one that owned them. To generate shard i, a dp group's first
rank creates `claims/shard-<i>/g<N>.json` with an atomic create-if-absent (launcher/store.py), where N is one
more than the newest claim there:
- no claim yet: create g0;
- the newest claim's run still holds its worker lock (launcher/lock.py): the shard is taken, skip it;
- its run is dead (killed, preempted): create the next generation; of two workers taking over at once only one
  creation succeeds, so no claim is ever deleted to be replaced.
Having won a claim, the worker reads the shard's state again: finished since this run started means another
worker got there first. After writing the shard's state, its owner deletes the shard's claims.
A worker's run is alive while it holds its lock: see launcher/lock.py.
"""

from __future__ import annotations

import json
import socket
import time

from launcher.ledger import CLAIMS_DIR, read_state
from launcher.lock import run_alive
from launcher.store import Store


class Claims:
    def __init__(self, store: Store, worker_index: int, run_id: str, started: float):
        self.store, self.worker, self.run_id, self.started = store, worker_index, run_id, started

    def _dir(self, shard_index: int) -> str:
        return f"{CLAIMS_DIR}/shard-{shard_index:05d}"

    def _generations(self, shard_index: int) -> list[int]:
        return sorted(int(f.base_name[1:6]) for f in self.store.files(self._dir(shard_index), ".json"))

    def try_claim(self, shard_index: int) -> bool:
        gens = self._generations(shard_index)
        if gens:
            newest = self.store.read_json(f"{self._dir(shard_index)}/g{gens[-1]:05d}.json") or {}
            if run_alive(self.store, newest.get("worker", -1), newest.get("run_id", "")):
                return False
        record = {"worker": self.worker, "run_id": self.run_id, "host": socket.gethostname(), "time": time.time()}
        nxt = gens[-1] + 1 if gens else 0
        if not self.store.create_exclusive(f"{self._dir(shard_index)}/g{nxt:05d}.json", json.dumps(record).encode()):
            return False
        state = read_state(self.store, shard_index)
        if state and state.get("finished_at", 0) >= self.started:
            self.release(shard_index)
            return False
        return True

    def release(self, shard_index: int) -> None:
        # Safe to remove whole: the state is written, so a claim created meanwhile is given up at its state check.
        self.store.delete_dir(self._dir(shard_index))
