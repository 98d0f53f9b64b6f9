"""A clean terminal (issue 17): worker lines above the bar, one per shard event; per-rank log files hold the rest."""

import json
import re

from conftest import launch

from launcher.host.terminal import shown_by_default


def segments(stderr: str) -> list[str]:
    """What a terminal would show as separate pieces: a bar redraw starts with a carriage return."""
    return [s.strip() for s in re.split(r"[\r\n]", stderr) if s.strip()]


def run_log_dir(out, stderr: str):
    [pointer] = [s for s in segments(stderr) if "worker logs: " in s]
    path = pointer.split("worker logs: ")[1].split(" ")[0]
    assert path.startswith(str(out / "logs")) and path.endswith("/rank-N.log")
    return out / "logs" / path.split("/")[-2]


def test_default_terminal_shows_one_line_per_shard_event_and_files_hold_the_rest(tiny_model, tmp_path):
    out = tmp_path / "out"
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "testing.fail_shards=[1]")
    assert res.returncode == 3, res.stderr[-3000:]
    pieces = segments(res.stderr)
    # No worker line cuts through the bar: every piece that holds a log line starts with it.
    assert all(p.startswith("[rank") for p in pieces if "[rank" in p), [p for p in pieces if "[rank" in p][:5]
    events = [p for p in pieces if "meshgen.shards" in p]
    assert sorted(re.search(r"shard \d (done|failed)", p)[0] for p in events) == [
        "shard 0 done",
        "shard 1 failed",
        "shard 2 done",
    ], events
    assert "InjectedFailure" in next(p for p in events if "shard 1 failed" in p)
    # Every stage on the bar before the first image (rank 0's stage lines set its description, never print).
    first_event = pieces.index(events[0])
    bar = [p.split(":")[0] for p in pieces[:first_event] if re.search(r"\d+/20 \[", p)]
    assert "starting workers" in bar and "loading transformer" in bar and "loading text_encoder" in bar, bar
    assert not [p for p in pieces if "meshgen.stage" in p]
    assert [p for p in pieces if p.startswith("[launcher] ") and "generating 3 shards" in p]  # not a rank
    stages = next(p for p in pieces if "time per stage" in p)
    assert re.search(r"load \d", stages) and "warmup" in stages and re.search(r"start-up \d+\.?\d* s", stages)
    assert not [p for p in pieces if "launcher.worker." in p]  # routine worker lines stay in the files
    logs = run_log_dir(out, res.stderr)
    [record] = (out / "runs").glob("*.json")
    assert logs.name == json.loads(record.read_text())["run_id"]  # DESIGN: logs/<run id>/rank-N.log
    assert sorted(f.name for f in logs.glob("rank-*.log")) == ["rank-0.log", "rank-0.stdout.log", "rank-1.log"] + [
        "rank-1.stdout.log"
    ]
    rank1 = (logs / "rank-1.log").read_text()
    assert "[rank1]" in rank1 and "transformer sharded over tp=2" in rank1  # every rank logs everything to its file
    assert "shard 1 failed" in (logs / "rank-0.log").read_text()


def test_verbose_shows_every_rank_line(tiny_model, tmp_path):
    out = tmp_path / "out"
    res = launch(f"model.path={tiny_model}", f"output.dir={out}", "dataset.limit=2", env={"MESHGEN_VERBOSE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    pieces = segments(res.stderr)
    assert [p for p in pieces if p.startswith("[rank1]") and "transformer sharded over tp=2" in p]
    assert [p for p in pieces if p.startswith("[rank0]") and "launcher.worker.runner" in p]
    assert all(p.startswith("[rank") for p in pieces if "[rank" in p)
    assert (run_log_dir(out, res.stderr) / "rank-1.log").is_file()


def test_the_default_filter():
    assert shown_by_default("[rank0] 10:00:00 INFO meshgen.shards: shard 3 done: 8 images in 1.0 s\n")
    assert shown_by_default("[rank2] 10:00:00 WARNING launcher.worker.runner: slow\n")
    assert shown_by_default("[rank1] 10:00:00 ERROR launcher.worker.main: boom\n")
    assert not shown_by_default("[rank0] 10:00:00 INFO launcher.worker.pipeline: transformer sharded over tp=2\n")
    assert not shown_by_default('  File "x.py", line 3, in <module>\n')  # a traceback's lines stay in the file
    assert not shown_by_default("some library's print\n")


def test_library_warnings_once_in_a_worker_log_never_on_the_launchers_terminal():
    """huggingface_hub's own handler printed each retry warning twice (raw, then with our prefix); torch elastic's
    closing-signal lines reached the terminal. A worker's file gets a hub warning once; the launcher shows none."""
    import subprocess
    import sys

    code = (
        "import logging, sys\n"
        "from launcher.logs import setup_logging, quiet_torch_elastic\n"
        "setup_logging(int(sys.argv[1]), who=sys.argv[2] or None)\n"
        "import huggingface_hub.file_download\n"
        "import torch.distributed.elastic.multiprocessing.api as api\n"
        "quiet_torch_elastic()\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('retrying in 1s')\n"
        "api.logger.warning('Sending process 7 closing signal SIGINT')\n"
        "logging.getLogger('launcher.x').warning('ours')\n"
    )
    for rank, who, hub_lines in (("1", "", 1), ("0", "launcher", 0)):
        res = subprocess.run([sys.executable, "-c", code, rank, who], capture_output=True, text=True, timeout=120)
        err = res.stderr
        assert res.returncode == 0, err
        assert err.count("retrying in 1s") == hub_lines and err.count("ours") == 1, err
        assert "closing signal" not in err, err
        assert all(ln.startswith(f"[{who or 'rank' + rank}] ") for ln in err.splitlines()), err


def test_rendezvous_events_keep_the_names_torch_gives_them():
    """The launcher's cheap frame walk names a rendezvous event as torch's own `inspect.stack()` does."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as d

    from launcher.logs import cheap_rendezvous_records

    def names() -> tuple[str, str]:
        def _record() -> str:  # as torch's handlers call it: from _record, on behalf of _record's caller
            return d.get_method_name()

        def next_rendezvous() -> str:
            return _record()

        return next_rendezvous(), d.get_method_name(10_000)

    original = d.get_method_name
    try:
        torch_names = names()
        cheap_rendezvous_records()
        assert d.get_method_name is not original
        assert names() == torch_names == ("next_rendezvous", "no_method_name")
    finally:
        d.get_method_name = original
