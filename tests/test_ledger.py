"""The control plane's pieces at small scale: the two prompt readers agree, and the ledger's index saves reads."""

import json

import pyarrow as pa
import pytest
from test_formats import ROWS, write_source

from launcher.ledger.prompts import SCHEMA, Source, _batches, _exact_rows, source_files
from launcher.ledger.prompts_fast import fast_batches
from launcher.ledger.shards import legacy_fingerprint, prompts_fingerprint
from launcher.ledger.states import Ledger, state_rel
from launcher.ledger.store import Store


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "parquet", "saved"])
def test_the_fast_reader_gives_the_exact_readers_rows(tmp_path, fmt):
    rows = ROWS if fmt != "txt" else [{"prompt": r["prompt"]} for r in ROWS]
    rows = rows + [{"prompt": f"more {i}, with a comma"} for i in range(5)]
    [f] = source_files(str(write_source(tmp_path, fmt, rows)))
    src = Source(f)
    fast = pa.Table.from_batches(list(fast_batches(f, src, 0)), schema=SCHEMA)
    exact = pa.Table.from_batches(list(_batches(_exact_rows(f, src, 0))), schema=SCHEMA)
    assert fast.to_pylist() == exact.to_pylist() and fast.num_rows == len(rows)
    assert prompts_fingerprint(fast) == prompts_fingerprint(exact)


def test_fingerprints_see_every_field_and_old_ones_still_verify(tmp_path):
    t = pa.Table.from_pylist([{"id": "0", "prompt": "a", "seed": 1}, {"id": "1", "prompt": "b"}], schema=SCHEMA)
    edits = [{"prompt": "a!"}, {"id": "9"}, {"seed": 2}, {"height": 64}, {"negative_prompt": ""}]
    rows = t.to_pylist()
    fps = {prompts_fingerprint(pa.Table.from_pylist([{**rows[0], **e}, rows[1]], schema=SCHEMA)) for e in edits}
    assert len(fps | {prompts_fingerprint(t)}) == len(edits) + 1
    # A state file of an earlier version carries the json-of-rows fingerprint; it must still match.
    import hashlib

    h = hashlib.sha256()
    for r in ({"id": "0", "prompt": "a", "seed": 1}, {"id": "1", "prompt": "b"}):
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    assert legacy_fingerprint(t) == h.hexdigest()[:16]


def test_the_index_saves_a_read_per_unchanged_state(tmp_path):
    store = Store(tmp_path)
    for i in range(5):
        store.write_json(state_rel(i), {"status": "done", "rows": 2, "traceback": "long"})
    first = Ledger(store)
    assert len(first.refresh()) == 5 and first.reads == 5
    assert "traceback" not in first.states[0]  # the index keeps what readers use
    first.save_index()
    again = Ledger(store)
    assert again.refresh() == first.states and again.reads == 0
    store.write_json(state_rel(3), {"status": "failed", "rows": 2, "error": "boom, a longer one"})
    store.delete(state_rel(4))
    states = Ledger(store).refresh()
    assert states[3]["status"] == "failed" and 4 not in states
    later = Ledger(store)
    later.refresh()
    assert later.reads == 1  # only the state that changed since the index was written
