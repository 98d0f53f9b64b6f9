"""Per-shard claims: how the workers of one job share its shards, none skipped and none done twice.

Any worker may generate any selected shard; the modulo split (shard i to worker i % count) is only the order in
which each worker tries them, so workers that start together rarely contend, and a rerun with a few shards left
is shared by all workers instead of falling to the one that owned them. To generate shard i, a dp group's first
rank creates `claims/shard-<i>/g<N>.json` with an atomic create-if-absent (launcher/ledger/store.py), where N is one
more than the newest claim there:
- no claim yet: create g0;
- the newest claim's run still holds its worker lock (launcher/ledger/lock.py): the shard is taken, skip it;
- its run is dead (killed, preempted): create the next generation; of two workers taking over at once only one
  creation succeeds, so no claim is ever deleted to be replaced.
Having won a claim, the worker reads the shard's state again: a done state other than the one this run's plan
read (another attempt's, told apart by `state_token`, never by comparing clocks) means another worker finished
it since the ledger was read, even while this run was still planning: skip it. Before writing a shard's files
and again before its state, the writer checks that its claim is still the newest (`still_held`): a worker whose
claim was taken over (it looked dead) leaves the shard to the new holder and deletes nothing. After writing the
shard's state, its owner deletes its claim and the dead generations below it. A worker's run is alive while it
holds its lock: see launcher/ledger/lock.py.
"""

from __future__ import annotations

import json
import os
import socket

from launcher.errors import unwritable
from launcher.ledger.lock import run_alive
from launcher.ledger.states import CLAIMS_DIR, read_state, state_token
from launcher.ledger.store import Store


class Claims:
    def __init__(self, store: Store, worker_index: int, run_id: str):
        self.store, self.worker, self.run_id = store, worker_index, run_id
        self.held: dict[int, int] = {}  # shard -> the generation of our claim on it
        self.skipped: set[int] = set()  # shards another live run held when we tried them
        self.out_of_space = False  # a claim could not be written: the output is full or read-only
        self.write_error: OSError | None = None

    def try_claim(self, shard_index: int, seen: str | None = None) -> bool:
        """Claim a shard to generate; `seen`: the state_token of the state this run's plan read for it."""
        gens = _generations(self.store, shard_index)
        if gens and _live(self.store, _newest(self.store, shard_index, gens)):
            self.skipped.add(shard_index)
            return False
        record = {"worker": self.worker, "run_id": self.run_id, "host": socket.gethostname()}
        nxt = gens[-1] + 1 if gens else 0
        try:
            created = self.store.create_exclusive(f"{_dir(shard_index)}/g{nxt:05d}.json", json.dumps(record).encode())
        except OSError as e:
            if not unwritable(e):
                raise
            self.out_of_space = True  # nothing more can be written here; the launcher says so
            self.write_error = e
            return False
        if not created:
            self.skipped.add(shard_index)
            return False
        self.held[shard_index] = nxt
        self.skipped.discard(shard_index)
        state = read_state(self.store, shard_index)
        if state and state.get("status") == "done" and state_token(state) != seen:
            self.release(shard_index)
            return False
        return True

    def attempt(self, shard_index: int) -> str:
        """This run's attempt at a shard it holds: what its state records (see state_token)."""
        return f"{self.run_id}/g{self.held[shard_index]:05d}"

    def still_held(self, shard_index: int) -> bool:
        """Whether our claim on the shard is still its newest: nobody took it over since (one listing)."""
        gens = _generations(self.store, shard_index)
        return shard_index in self.held and bool(gens) and gens[-1] == self.held[shard_index]

    def drop(self, shard_index: int) -> None:
        """Forget a claim that another run took over, deleting nothing: the files are the new holder's now."""
        self.held.pop(shard_index, None)

    def release(self, shard_index: int) -> None:
        """Give up our claim (after the shard's state is written), and the dead generations below it."""
        gen = self.held.pop(shard_index, None)
        if gen is None:
            return
        try:
            for g in _generations(self.store, shard_index):
                if g <= gen:
                    self.store.delete(f"{_dir(shard_index)}/g{g:05d}.json")
        except OSError as e:  # a dead run's claim is harmless: the next claimer creates the next generation
            if not unwritable(e):
                raise
            return
        if self.store.is_local:
            try:
                self.store.local(_dir(shard_index)).rmdir()  # only if empty
            except OSError:
                pass


def _dir(shard_index: int) -> str:
    return f"{CLAIMS_DIR}/shard-{shard_index:05d}"


def _generations(store: Store, shard_index: int) -> list[int]:
    return sorted(int(f.base_name[1:6]) for f in store.files(_dir(shard_index), ".json"))


def _newest(store: Store, shard_index: int, gens: list[int]) -> dict:
    try:
        return store.read_json(f"{_dir(shard_index)}/g{gens[-1]:05d}.json") or {}
    except ValueError:  # unreadable: its writer died mid-write on a store without atomic create
        return {}


def _live(store: Store, claim: dict) -> bool:
    return run_alive(store, claim.get("worker", -1), claim.get("run_id", ""))


def forget_dead(store: Store) -> None:
    """Delete the claims of runs that hold no lock: a run killed after writing a shard's state and before releasing
    its claim leaves one on a done shard, which no later run claims again, so nobody else would delete it. Each claim
    is judged by its own run's lock, so a live run's claims, those created since included, are kept. Only by a run
    that still holds its own lock (launcher/plan/plan.py's tidy): one taken over judges nobody."""
    import pyarrow.fs as pafs

    # Recursive: pyarrow's GCS listing names no folder of a non-recursive one, so the claims' own paths tell them.
    listed = store.fs.get_file_info(pafs.FileSelector(store.path(CLAIMS_DIR), allow_not_found=True, recursive=True))
    skip = len(store.path(CLAIMS_DIR)) + 1
    names = {i.path[skip:].split("/")[0] for i in listed if "/" in i.path[skip:] or i.type == pafs.FileType.Directory}
    for folder in (f"{CLAIMS_DIR}/{name}" for name in sorted(names)):
        for info in store.files(folder, ".json"):
            rel = f"{folder}/{info.base_name}"
            try:
                claim = store.read_json(rel) or {}
            except ValueError:  # unreadable: its writer died mid-write on a store without atomic create
                claim = {}
            if not _live(store, claim):
                store.delete(rel)
        if store.is_local:  # an object store has no folders
            try:
                os.rmdir(store.local(folder))
            except OSError:  # a live run's claim is in it
                pass


def held_elsewhere(store: Store, shard_index: int, run_id: str) -> int | None:
    """The worker index of another live run whose claim holds this shard, if any (one listing, one read)."""
    gens = _generations(store, shard_index)
    newest = _newest(store, shard_index, gens) if gens else {}
    return newest.get("worker") if newest.get("run_id") not in (None, run_id) and _live(store, newest) else None
