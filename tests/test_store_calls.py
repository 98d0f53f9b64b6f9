"""The store's addresses and its object-store calls (launcher/ledger/store.py): an object-store call is tried again
after a transient error, 4 attempts in all, 0.5 s before the second and doubled before each next one, never after
15 s; a missing object is an answer, never tried again; a local file system is never tried again. The numbers
are the ones store.py documents; the waits are recorded, not slept."""

from __future__ import annotations

import logging

import pytest

from launcher.ledger import store as store_mod
from launcher.ledger.store import Store


class Flaky:
    """A store call that raises `errors` in turn, then answers "ok"; counts its calls."""

    def __init__(self, *errors: OSError):
        self.errors, self.calls = list(errors), 0

    def __call__(self, *args):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return ("ok", *args)


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(store_mod.time, "sleep", slept.append)
    return slept


def test_an_object_store_address_keeps_its_scheme_and_drops_a_trailing_slash(s3):
    store = Store("s3://meshgen-test/runs/a/")
    assert (store.uri, str(store), store.scheme, store.is_local) == ("s3://meshgen-test/runs/a",) * 2 + ("s3", False)
    assert store.url() == "s3://meshgen-test/runs/a"
    assert store.url("state/00001.json") == "s3://meshgen-test/runs/a/state/00001.json"
    assert store.path("") == "meshgen-test/runs/a"  # pyarrow's path: no scheme
    assert store.path("data/x.parquet") == "meshgen-test/runs/a/data/x.parquet"
    with pytest.raises(AssertionError, match="^only a local store has local paths$"):
        store.local("x")
    assert store_mod.opened_remote()


def test_a_local_address_is_its_resolved_folder(tmp_path):
    store = Store(f"{tmp_path}/out/../run/")
    assert (store.uri, store.root, store.scheme, store.is_local) == (str(tmp_path / "run"),) * 2 + ("file", True)
    assert store.url("a") == f"{tmp_path}/run/a" and store.path("a") == f"{tmp_path}/run/a"
    assert store.local("b/c") == tmp_path / "run" / "b" / "c" and store.local() == tmp_path / "run"


def test_a_transient_error_is_tried_again_after_doubling_waits_each_said_in_one_line(s3, waits, caplog):
    store, call = (
        Store("s3://meshgen-test/retry"),
        Flaky(OSError("SlowDown: reduce your rate\nrequest id 7"), OSError("x" * 300)),
    )
    with caplog.at_level(logging.WARNING, logger=store_mod.__name__):
        assert store._call(call, "a", 2) == ("ok", "a", 2)
    assert call.calls == 3 and waits == [0.5, 1.0]
    assert [r.getMessage() for r in caplog.records] == [
        "s3://meshgen-test/retry: SlowDown: reduce your rate; trying again in 0.5 s",
        f"s3://meshgen-test/retry: {'x' * 200}; trying again in 1.0 s",
    ]


def test_the_fourth_failure_is_raised(s3, waits):
    store, call = Store("s3://meshgen-test/retry"), Flaky(*(OSError(f"attempt {i}") for i in range(1, 6)))
    with pytest.raises(OSError, match="^attempt 4$"):
        store._call(call)
    assert call.calls == 4 and waits == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("missing", [FileNotFoundError("gone"), OSError("NoSuchKey: the key"), OSError("Not Found")])
def test_a_missing_object_is_never_tried_again(s3, waits, missing):
    store, call = Store("s3://meshgen-test/retry"), Flaky(missing)
    with pytest.raises(OSError):
        store._call(call)
    assert call.calls == 1 and waits == []


def test_no_call_is_tried_again_past_15_seconds(s3, waits, monkeypatch):
    store = Store("s3://meshgen-test/retry")
    clock = iter([100.0, 115.0, 116.0])  # the start; a failure 15 s after it: once more; 16 s: raised
    monkeypatch.setattr(store_mod.time, "monotonic", lambda: next(clock))
    call = Flaky(*(OSError(f"attempt {i}") for i in range(1, 5)))
    with pytest.raises(OSError, match="^attempt 2$"):
        store._call(call)
    assert call.calls == 2 and waits == [0.5]


def test_a_local_file_system_is_never_tried_again(tmp_path, waits):
    call = Flaky(OSError("disk on fire"))
    with pytest.raises(OSError, match="disk on fire"):
        Store(tmp_path)._call(call)
    assert call.calls == 1 and waits == []


def _hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


def test_a_file_is_written_into_folders_made_for_it_even_while_another_process_removes_them(tmp_path, monkeypatch):
    """A write makes its folders as needed, and makes them again when another process removes an emptied folder
    between the making and the opening (claims/ and plans/ go once a run is done): up to 5 tries, the last one
    raising what it meets."""
    import builtins

    store, refused = Store(tmp_path), []

    def racing_open(path, mode):
        if len(refused) < 4 and mode == "wb":  # the folder vanished 4 times in a row: the 5th try finds it
            refused.append(path)
            raise FileNotFoundError(path)
        return builtins.open(path, mode)

    monkeypatch.setattr(store_mod, "open", racing_open, raising=False)
    store.write_bytes("claims/00003/c00001.json", b"{}")
    assert (tmp_path / "claims" / "00003" / "c00001.json").read_bytes() == b"{}" and len(refused) == 4
    assert _hidden(tmp_path) == []
    calls = []

    def always_gone(path, mode):
        calls.append(path)
        raise FileNotFoundError(path)

    monkeypatch.setattr(store_mod, "open", always_gone, raising=False)
    with pytest.raises(FileNotFoundError):
        store.write_bytes("plans/r.arrow", b"x")
    assert len(calls) == 5


def test_a_file_in_the_way_of_a_folder_is_raised_and_nothing_is_left(tmp_path):
    (tmp_path / "state").write_bytes(b"not a folder")
    with pytest.raises(OSError):
        Store(tmp_path).write_bytes("state/00001.json", b"{}")
    assert (tmp_path / "state").read_bytes() == b"not a folder"


@pytest.mark.parametrize("what", ["a file", "a folder", "a stream"])
def test_a_rename_into_place_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch, what):
    """Write atomically: when the last step (the rename) fails, the write raises and neither the final name nor
    a hidden temporary one is left."""
    store = Store(tmp_path)
    store.write_bytes("keep.txt", b"here before")

    def refuse(src, dst):
        raise PermissionError(f"rename {src} -> {dst} refused")

    monkeypatch.setattr(store_mod.os, "replace", refuse)
    with pytest.raises(PermissionError, match="refused"):
        if what == "a file":
            store.write_bytes("data/shard-00001.parquet", b"x" * 100)
        elif what == "a folder":
            store.put_folder("images/00001", {"a.png": b"1", "b.png": b"2"})
        else:
            with store.open_output("data/shard-00002.parquet") as f:
                f.write(b"y" * 100)
    assert _hidden(tmp_path) == []
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == ["keep.txt"]


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_listing_leaves_out_a_live_runs_hidden_files_and_folders_and_sorts_by_name(tmp_path, where, request):
    """Store.files: the files directly under a folder (or anywhere below it), by name, with a suffix if given;
    temporary files of a live run (hidden names, and every file in a hidden folder) left out; folders are no
    files. A missing folder lists nothing."""
    if where == "s3":
        request.getfixturevalue("s3")
    store = Store(f"s3://meshgen-test/{tmp_path.name}" if where == "s3" else str(tmp_path))
    for rel in ("d/b.json", "d/a.json", "d/c.txt", "d/.a.json.tmp-h-1", "d/e/f.json", "d/e/.g.json",
                "d/.staging/x.json", "d/e/.h/y.json", "d/z.JSON"):  # fmt: skip
        store.write_bytes(rel, b"{}")
    names = lambda infos: [i.path.rsplit("/", 1)[1] if "/" in i.path else i.path for i in infos]  # noqa: E731
    assert names(store.files("d")) == ["a.json", "b.json", "c.txt", "z.JSON"]
    assert names(store.files("d", ".json")) == ["a.json", "b.json"]
    assert names(store.files("d", ".json", recursive=True)) == ["a.json", "b.json", "f.json"]
    assert names(store.files("d", recursive=True)) == ["a.json", "b.json", "c.txt", "f.json", "z.JSON"]
    assert store.files("nothing") == [] and store.files("nothing", recursive=True) == []
    assert store.mtime("d/none.json") is None and store.mtime("d/a.json") is not None
    assert abs(store.now() - store.mtime("d/a.json")) < 600  # the store's clock, as mtime reads it
    assert store.files("locks") == []  # the clock probe is gone


@pytest.mark.parametrize("call", ["read", "create", "etag"])
def test_an_s3_endpoint_that_never_answers_is_given_up_on_within_the_bounds(silent_s3, monkeypatch, call):
    """store.py: no S3 request of ours waits past S3_TIMEOUT_S to connect or for an answer (boto3's reads:
    twice that, 2 tries): pyarrow's reads (which Store._call tries again until RETRY_BUDGET_S), boto3's conditional
    create, and the ETag a glob asks for where two objects share a size and a time. With those at 0.2 s and 0.5 s
    each call gives up within 2 s of waiting, with an OSError as every store error is; the clients' own defaults
    (boto3: 60 s, 5 tries) would hold it for minutes. The call runs in a thread, so a wait past the bound fails
    the test, not the suite."""
    import socket
    import threading

    from launcher.sources import globs

    monkeypatch.setattr(store_mod, "S3_TIMEOUT_S", 0.2)
    monkeypatch.setattr(store_mod, "RETRY_BUDGET_S", 0.5)
    monkeypatch.setattr(store_mod, "RETRY_DELAY_S", 0.05)
    store = Store("s3://meshgen-test/run")
    run = {
        "read": lambda: store.read_bytes("state/00000.json"),
        "create": lambda: store.create_exclusive("lock", b"{}"),
        "etag": lambda: globs._etag("s3://", "meshgen-test/run/a.txt"),
    }[call]
    raised: list[BaseException] = []

    def attempt():
        try:
            run()
        except Exception as e:  # what the client says: a timeout
            raised.append(e)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=10)  # 2 s of waits, and room for a loaded host
    assert not worker.is_alive(), f"the {call} call still waits on a silent endpoint after 10 s"
    assert raised, f"the {call} call answered from an endpoint that never answers"
    assert isinstance(raised[0], OSError), repr(raised[0])
    with socket.socket() as closed:  # a port where nothing listens: refused at once, an OSError too
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        store = Store("s3://meshgen-test/run")
        with pytest.raises(OSError):
            run()
    # pyarrow's client gives up after 3 s of silence of its own accord (the AWS SDK's default), inside the bound
    # above: its options are what bounds it, on a loaded host as on an idle one.
    options = store.fs.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"]) == (0.2, 0.2)
