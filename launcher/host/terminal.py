"""A clean terminal: the progress bar stays at the bottom, with the launcher's and the workers' lines above it.

Each worker's stdout and stderr go to files, `OUTPUT_DIR/logs/<run id>/rank-N.log` (stderr, where logging
goes) and `rank-N.stdout.log`, through torch elastic's own redirection: a `LogsSpecs` decides where each local
rank's streams go (torchrun's `--log-dir/--redirects/--tee` build its `DefaultLogsSpecs`, whose layout is
`<dir>/<rdzv id>_<random>/attempt_0/<local rank>/stderr.log`; ours is named by run id and global rank). Torch's
own tee would write every line straight to the terminal, through the bar; instead one `TailLog` (torch's
tailer) per stream follows the files and hands the lines it keeps to `tqdm.write`, which clears the bar, prints
the line and redraws the bar. The launcher's own log records go through `tqdm`'s logging redirection.

By default the terminal gets one line per shard event (a shard done or failed, logged by the workers on the
`SHARD_EVENTS` logger) and the workers' warnings and errors; the files hold everything. MESHGEN_VERBOSE=1 shows
every line of every rank. On an object store the files are written locally and uploaded at the end.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import uuid
from contextlib import ExitStack, nullcontext
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.tail_log import TailLog
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from launcher.ledger.store import Store
from launcher.logs import RANK_LOGS_ENV, SHARD_EVENTS, STAGE_EVENTS

logger = logging.getLogger(__name__)
LOGS_DIR = "logs"
# A worker's log line, as launcher/logs.py formats it: "[rank3] 12:00:00 WARNING name: message".
_RECORD = re.compile(r"^\[rank\d+\] \S+ (?P<level>[A-Z]+) (?P<name>\S+): ")
_SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")


def shown_by_default(line: str) -> bool:
    """A shard event, our own warnings and errors; not the routine lines, continuation lines, libraries' prints or
    libraries' warnings (a hub retry: the worker's log has it, the terminal gets the final error)."""
    m = _RECORD.match(line)
    ours = bool(m) and m["name"].startswith(("launcher.", "jobs.", "meshgen.", "__main__"))
    return ours and (m["name"] == SHARD_EVENTS or m["level"] in _SHOWN_LEVELS)


def stage_of(line: str) -> str | None:
    """The stage a rank-0 worker line announces (launcher/logs.py's STAGE_EVENTS), else None."""
    m = _RECORD.match(line)
    if m and m["name"] == STAGE_EVENTS and line.startswith("[rank0] "):
        return line[m.end() :].strip()
    return None


# Where announced stages go: the progress bar's description (launcher/host/summary.py's Progress sets it).
stage_listeners: list = []


class _BarSafe:
    """A text stream whose lines go through tqdm.write, so they appear above the bar instead of through it."""

    def write(self, text: str) -> None:
        stage = stage_of(text)
        if stage is not None:
            for listener in stage_listeners:
                listener(stage)
            return
        tqdm.write(text.rstrip("\n"), file=sys.stderr)

    def flush(self) -> None:
        sys.stderr.flush()


class RankLogs(LogsSpecs):
    """torch elastic's LogsSpecs: every local rank's streams to `<folder>/rank-<global rank>.log`, with tailers."""

    def __init__(self, folder: Path, verbose: bool):
        super().__init__(str(folder), redirects=Std.ALL, tee=Std.NONE)
        self.folder, self.verbose = folder, verbose
        self.tailers: list[TailLog] = []

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Called by the agent right before it starts the workers: their files, and a tailer over them."""
        self.folder.mkdir(parents=True, exist_ok=True)
        dest = LogsDest()
        for local, env in envs.items():
            base = self.folder / f"rank-{env.get('RANK', local)}"
            dest.stdouts[local], dest.stderrs[local] = f"{base}.stdout.log", f"{base}.log"
            dest.error_files[local] = env["TORCHELASTIC_ERROR_FILE"] = f"{base}.error.json"
            # Made before the tailers start: a tailer that finds no file yet may see stop() and quit unread
            # (torch's tail_logfile checks the file, then the stop), losing lines written just before the end.
            Path(dest.stdouts[local]).touch(), Path(dest.stderrs[local]).touch()
        keep = (lambda _: True) if self.verbose else (lambda line: shown_by_default(line) or stage_of(line) is not None)
        prefixes = {local: f"[rank{env.get('RANK', local)}] " for local, env in envs.items()}
        for files, prefix in ((dest.stderrs, {k: "" for k in envs}), (dest.stdouts, prefixes)):
            # Lines of the stderr files carry their rank already (launcher/logs.py's format); stdout's do not.
            if not self.verbose and files is dest.stdouts:
                continue
            self.tailers.append(TailLog("rank", files, _BarSafe(), prefix, log_line_filter=keep).start())  # ty: ignore[invalid-argument-type]
        return dest

    def stop(self) -> None:
        for t in self.tailers:  # each reads its files to the end first
            t.stop()
        self.tailers.clear()


class WorkerLogs:
    """`with WorkerLogs(store, run_id) as logs:` around the workers' run; `logs.specs` goes to elastic_launch."""

    def __init__(self, store: Store, run_id: str, verbose: bool | None = None):
        self.store, self.run_id = store, run_id
        verbose = os.environ.get("MESHGEN_VERBOSE") == "1" if verbose is None else verbose
        rel = f"{LOGS_DIR}/{run_id}"
        self._upload = not store.is_local
        self.folder = Path(tempfile.mkdtemp(prefix="meshgen-logs-")) / run_id if self._upload else Path(store.path(rel))
        self.shown_folder = store.url(rel)  # with its scheme: s3://...
        self.specs = RankLogs(self.folder, verbose)
        self._stack = ExitStack()

    def rank_log(self, rank: int) -> str:
        return f"{self.shown_folder}/rank-{rank}.log"

    def __enter__(self) -> WorkerLogs:
        self._stack.enter_context(logging_redirect_tqdm())
        os.environ[RANK_LOGS_ENV] = "1"  # the workers log everything to their files (every rank at INFO)
        logger.info("worker logs: %s/rank-N.log (MESHGEN_VERBOSE=1 shows every line here)", self.shown_folder)
        return self

    def __exit__(self, *exc) -> None:
        self.specs.stop()
        os.environ.pop(RANK_LOGS_ENV, None)
        self._stack.close()
        if self._upload and self.folder.exists():
            try:
                for f in sorted(self.folder.iterdir()):
                    self.store.write_bytes(f"{LOGS_DIR}/{self.run_id}/{f.name}", f.read_bytes())
            except BaseException:  # the only copy left: say where it is
                logger.warning("the worker logs stay in %s: their upload to %s failed", self.folder, self.shown_folder)
                raise
            shutil.rmtree(self.folder.parent, ignore_errors=True)


def launch_workers(args, logs: WorkerLogs | None = None, start: str = "subprocess") -> None:
    """What torch.distributed.run.run does with parsed torchrun arguments, with our LogsSpecs when given.

    `start="forkserver"`: the same workers, forked with their imports done (launcher/host/worker_start.py)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from launcher.logs import cheap_rendezvous_records, quiet_torch_elastic

    quiet_torch_elastic()  # after the imports that create its loggers
    cheap_rendezvous_records()

    if args.standalone:  # as torch.distributed.run.run: a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    # torch's default specs make a torchelastic_ folder in /tmp that nothing removes (one a run): ours need none;
    # without ours, torch's (the workers' error files) go in a folder removed once they were read.
    temp = tempfile.TemporaryDirectory(prefix="torchelastic_") if logs is None else nullcontext(os.devnull)
    with temp as args.log_dir:
        config, cmd, cmd_args = config_from_args(args)
        if logs is not None:
            config.logs_specs = logs.specs
        logger.info("workers start %s", "as fresh interpreters" if start == "subprocess" else "forked, imports done")
        if start == "subprocess":
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
            return
        from launcher.host.worker_start import preloaded_forkserver
        from launcher.worker.main import entry

        config.start_method = "forkserver"
        with preloaded_forkserver():
            elastic_launch(config=config, entrypoint=entry)(*args.training_script_args)
