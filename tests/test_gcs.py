"""gs:// end to end against a local GCS server (tests/gcs_server.py) reached through STORAGE_EMULATOR_HOST, as
Google's own clients read it. The object-store tests shared with S3 run on it too (the `store_env` fixture: claims
race, conditional create, lock and exit 4, two workers and resume, takeover of a killed run's lock); here what is
GCS's own: the index, the address of the server, and a server that cannot be reached."""

import socket
import time

import pytest
from conftest import launch

from launcher.ledger.states import Ledger, state_rel
from launcher.ledger.store import Store


def test_the_index_on_gcs_saves_a_read_per_unchanged_state(gcs):
    store = Store("gs://meshgen-test/index")
    for i in range(4):
        store.write_json(state_rel(i), {"status": "done", "rows": 2})
    first = Ledger(store)
    assert len(first.refresh()) == 4 and first.reads == 4
    first.save_index()
    again = Ledger(store)
    assert again.refresh() == first.states and again.reads == 0  # the listing's times and sizes match the index
    store.write_json(state_rel(2), {"status": "failed", "rows": 2, "error": "boom, a longer one"})
    later = Ledger(store)
    assert later.refresh()[2]["status"] == "failed" and later.reads == 1


def test_an_emulator_host_without_scheme_reaches_the_server_for_both_clients(gcs, monkeypatch):
    """Google's Go and C++ clients take host:port; the Python one wants a scheme. Both forms work, for pyarrow's
    client and for the conditional create alike."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs["STORAGE_EMULATOR_HOST"].removeprefix("http://"))
    store = Store("gs://meshgen-test/bare-host")
    assert store.create_exclusive("a.json", b"{}") and not store.create_exclusive("a.json", b"[]")
    assert [f.base_name for f in store.files("")] == ["a.json"]


@pytest.fixture
def dead_port():
    """A loopback port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("server", ["silent", "absent"])
def test_a_gcs_endpoint_that_cannot_be_reached_is_one_line_exit_2_within_30_s(
    server, tiny_model, tmp_path, silent_hub, dead_port
):
    """A server that accepts and never answers, and a port where nothing listens: one line, exit 2, in 30 s (pyarrow's
    client alone waited 2 minutes per request and retried for 15 minutes, without a word)."""
    url, requests = silent_hub
    host = url if server == "silent" else f"http://127.0.0.1:{dead_port}"
    began = time.monotonic()
    res = launch(f"model.path={tiny_model}", "output.dir=gs://meshgen-test/away", env={"STORAGE_EMULATOR_HOST": host})
    took = time.monotonic() - began
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert last.startswith("error: output.dir=gs://meshgen-test/away cannot be reached"), last
    assert took < 30, took
    if server == "silent":
        assert requests, "the request never reached the server that STORAGE_EMULATOR_HOST names"
