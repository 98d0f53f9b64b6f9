"""Shared fixtures: the tiny model is built once per session, and each distinct job runs once."""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
LAUNCH = str(REPO / "launch.sh")
# A prompt source that exists: the real confs name the user's own prompts.txt, and a dry run checks the source.
PROMPTS = f"dataset.path={REPO / 'conf' / 'prompts' / 'tiny.txt'}"
# What conf `tiny` passes the tiny FLUX.2 pipeline besides sizes and steps: a bare loop's call needs the same.
FLUX2_KW = dict(guidance_scale=4.0, max_sequence_length=256, text_encoder_out_layers=(1, 2))


# The slowest modules first (their wall time in one `make test` on 2 cores, longest first): `make test` hands each
# module to one xdist worker (--dist loadscope, --no-loadscope-reorder: else xdist orders modules by their number
# of tests), in collection order, and a long module collected last runs alone at the end while the other workers
# sit idle (faults, hosts, trust and incremental did: 14 min instead of ~12).
# Measured in session 12's clean clone (`--durations`, summed per module); a module missing here runs last.
# test_nightly (43 s), test_hub_source (30 s less the tiny model's build) and test_mutant_kills (0.2 s) sit
# where their `-n 0` times fall among their neighbours' measured beside them at the same load (~6.5):
# test_incremental 61, test_bad_rows 43, test_verified 41, test_download 39, test_terminal 37.
SLOW_FIRST = (
    "test_faults test_workers test_families test_hosts test_execution test_bench test_liveness test_lora "
    "test_edit test_trust test_speed test_sweep test_space test_runtime_bounds test_deploy test_publish "
    "test_incremental test_nightly test_download test_verified test_terminal test_bad_rows test_hub_source "
    "test_inputs test_docs_commands "
    "test_job test_quality test_image_formats test_nonfinite test_weights test_bad_input test_dry_run_cost "
    "test_integrity_values test_integrity_sources test_outputs test_gcs test_jobfiles test_metrics test_formats "
    "test_writer_pool test_contract_seeds test_memory_plan test_launch test_mutant_kills"
).split()


# An override of one of these keys to a plain absolute path is set on a copy of the composition without it, which
# is what composing with it gives: load_config's resolve_paths leaves absolute paths as they are.
_PATH_OVERRIDE = re.compile(r"(dataset\.path|output\.dir|model\.path)=(/[\w./-]+)")


def _cache_compositions() -> None:
    """Hydra composes a job in ~60 ms, ~40 % of the fast tests' time (and of each mutant's, `make mutants`), and the
    tests compose the project's confs with the same overrides again and again, their own folders aside. The
    composition of a conf of conf/ (no `hydra.` override: a job file's folder is elsewhere) is kept per conf and
    overrides, each call gets a copy, and every test still goes through load_config's own checks. Nothing that
    composition runs is mutated (launcher/config.py and Hydra), so a mutant's tests may share what the clean run
    composed. A composition that fails is never kept."""
    import copy

    import launcher.config

    compose = launcher.config.compose
    if getattr(compose, "cached", False):  # once a process: mutmut runs pytest many times in one, and forks it
        return

    @functools.cache
    def composed(config_name: str, overrides: tuple[str, ...]):
        return compose(config_name=config_name, overrides=list(overrides))

    def cached(config_name: str, overrides: list[str]):
        matches = [_PATH_OVERRIDE.fullmatch(o) for o in overrides]
        paths = {m[1]: m[2] for m in matches if m}
        keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
        if any(k.startswith("hydra.") for k in keys) or len(set(keys)) < len(keys):
            return compose(config_name=config_name, overrides=overrides)
        cfg = copy.deepcopy(composed(config_name, tuple(o for o, m in zip(overrides, matches, strict=True) if not m)))
        for key, value in paths.items():
            group, leaf = key.split(".")
            cfg[group][leaf] = value
        return cfg

    cached.cached = True
    launcher.config.compose = cached


def pytest_configure(config) -> None:
    """A mutant's tests run in a process forked from mutmut's (make mutants), as do all the others': tqdm's default
    write lock is a multiprocessing lock shared by every such process, and one killed holding it (a timeout mid-bar)
    left it held for good, so that every later mutant whose tests draw a bar hung to its timeout (a whole room's
    worth judged "timeout" after the first). Each of those processes gets a lock of its own."""
    _cache_compositions()
    _libraries_log_to_the_current_stderr()
    _counts_and_hashes_cached_in_a_folder_of_this_run(config)
    if os.environ.get("MUTANT_UNDER_TEST"):
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


def _counts_and_hashes_cached_in_a_folder_of_this_run(config) -> None:
    """The launcher caches parameter counts and file hashes in ~/.cache/meshgen or MESHGEN_CACHE_DIR
    (launcher/sizing/memory.py): the suite's go to a folder of its own, which every process it starts inherits
    (xdist's workers share their controller's), so no test reads what an earlier run, the user or a mutant's test
    (writing under a mutated name) left in a cache, and none writes there."""
    import shutil
    import tempfile

    ours = Path(tempfile.gettempdir()) / "meshgen-test-cache-"
    if not os.environ.get("MESHGEN_CACHE_DIR", "").startswith(str(ours)):  # none yet, or the user's
        folder = tempfile.mkdtemp(prefix=ours.name)
        before = os.environ.get("MESHGEN_CACHE_DIR")
        os.environ["MESHGEN_CACHE_DIR"] = folder

        def restore() -> None:
            shutil.rmtree(folder, ignore_errors=True)
            os.environ.pop("MESHGEN_CACHE_DIR") if before is None else os.environ.update(MESHGEN_CACHE_DIR=before)

        config.add_cleanup(restore)


@pytest.fixture(scope="session", autouse=True)
def _counts_afresh_under_each_mutant(tmp_path_factory):
    """Under `make mutants` each mutant's tests run in a session of their own: there the cache starts empty, so a
    mutant of the counting or hashing code is judged by what it counts, not by what the clean run cached."""
    if not os.environ.get("MUTANT_UNDER_TEST"):
        yield
        return
    import launcher.hashes

    patch = pytest.MonkeyPatch()
    patch.setenv("MESHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("meshgen-cache")))
    patch.setattr(launcher.hashes, "_MEMO", {})  # the in-memory hashes too: a mutant's process is forked, filled
    yield
    patch.undo()


class _CurrentStderr:
    """sys.stderr as it is at each write, not as it was when a handler was made."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _libraries_log_to_the_current_stderr() -> None:
    """diffusers and transformers give their library's logger a handler of sys.stderr as it is at their first log
    call: made during a test that captures stderr (capsys), it holds that test's stream, closed once the test ends,
    and every later record of theirs in the process is a "--- Logging error ---" traceback on stderr (which a test
    of a refusal's one line sees: make mutants' clean run, whose tests run in another order, did)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.get_logger()  # makes the handler now
        handler = library._default_handler
        handler.stream = _CurrentStderr()  # ty: ignore[invalid-assignment]
        handler.__dict__.pop("flush", None)  # they also bind the handler's flush to that stream's


def pytest_collection_modifyitems(items: list) -> None:
    if os.environ.get("MUTANT_UNDER_TEST"):  # a mutant's tests (make mutants), run until the first that fails
        durations = _mutmut_durations()
        items.sort(key=lambda item: durations.get(item.nodeid, 0.0))  # the quickest first: a killed mutant ends soon
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))  # stable


@functools.cache
def _mutmut_durations() -> dict[str, float]:
    """Each test's seconds in mutmut's stats run (its file in mutmut's working folder, `mutants/`)."""
    import json

    try:
        return json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.fixture
def launcher_main():
    """The launcher's main() in this process (cheap: no interpreter start per call); the logging handlers it
    installs (on the test's captured stderr) are removed after the test, and the environment it sets for its
    workers (the libraries' verbosity) is restored."""
    import logging

    from launcher.host.launch import main

    saved, level, env = logging.root.handlers[:], logging.root.level, dict(os.environ)
    yield main
    logging.root.handlers[:] = saved
    logging.root.setLevel(level)
    os.environ.clear()
    os.environ.update(env)


SESSION_MARK = "MESHGEN_TEST_SESSION"  # in the environment of every process this pytest process starts


@pytest.fixture(scope="session", autouse=True)
def no_orphans():
    """At the end, no process started by this pytest process (they inherit SESSION_MARK) outlives its parent, and
    none is still running as its child.

    Every process of a job must end with the job: a writer orphaned under init kept a job's stderr open, so the
    test that ran it waited 300 s for the end of its output and failed, and only on a loaded machine."""
    import uuid

    import psutil

    mark = uuid.uuid4().hex
    os.environ[SESSION_MARK] = mark
    yield
    os.environ.pop(SESSION_MARK, None)

    def orphans() -> list:
        me = psutil.Process()
        ours = {me.pid} | {p.pid for p in me.children(recursive=True)}  # a live child is not an orphan (yet)
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid not in ours and p.environ().get(SESSION_MARK) == mark and p.status() != "zombie":
                    found.append(p)
            except psutil.Error:  # gone meanwhile, or not ours to read
                continue
        return found

    def strays() -> list:
        """This process's children still running once every test is over: a test started them and never ended
        them (a wait that timed out). multiprocessing's resource tracker lives as long as this process does."""
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != "zombie" and "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.Error:  # gone meanwhile
                continue
        return found

    # A killed job's processes may still be dying.
    _, alive = psutil.wait_procs(orphans() + strays(), timeout=10)
    left = []
    for p in alive:
        try:
            left.append(" ".join(p.cmdline())[:300])
            p.kill()
        except psutil.NoSuchProcess:  # ended after all
            continue
    assert not left, f"processes outlived the tests that started them (killed now): {left}"


@pytest.fixture(scope="session")
def _started_tmp(tmp_path_factory):
    """The processes the tests start make their temporary files in a folder of this session (TMPDIR), not in /tmp,
    so that what one leaves is seen (`no_temp_left`), and pytest removes the folder with its own."""
    folder = tmp_path_factory.mktemp("started-tmp")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


class _TempWatch:
    """What the processes a test starts leave in their temporary folder (`_started_tmp`)."""

    def __init__(self, folder: Path):
        self.folder, self.killing = folder, False
        self.seen = self._listing()

    def _listing(self) -> set[str]:
        return set(os.listdir(self.folder))

    def accept(self) -> None:
        """What the processes killed so far left is theirs to leave (kill -9 runs no clean-up); later runs' is not."""
        self.seen, self.killing = self._listing(), False

    def left(self) -> list[str]:
        return sorted(n for n in self._listing() - self.seen if not n.startswith("torchinductor_"))


@pytest.fixture(autouse=True)
def no_temp_left(_started_tmp):
    """A process a test started and that ended on its own leaves nothing in its temporary folder: a run's fetched
    id map, staged id map, worker logs or torch's log folder stay in a host's /tmp night after night (the id map's
    hash runs alone are 8 bytes an id). torch's compile cache (torchinductor_*) is meant to stay."""
    watch = _TempWatch(_started_tmp)
    yield watch
    left = watch.left()
    assert watch.killing or not left, f"processes this test started left temporary files: {left} (in {watch.folder})"


@pytest.fixture
def kills_a_process(no_temp_left) -> _TempWatch:
    """For a test that kills processes it started: what they leave is not checked, until it calls `.accept()`."""
    no_temp_left.killing = True
    return no_temp_left


@pytest.fixture(scope="session")
def once(tmp_path_factory, worker_id):
    """once(name, make) -> a folder that make(folder) filled, made once per `make test` for all xdist workers.

    The first worker to ask makes it under an exclusive lock while the others wait for it (waiting costs no CPU,
    and CPU is what the suite runs out of); a failed make leaves nothing, so the next asker tries again. Callers
    must not change what they get: copy it first."""
    import fcntl
    import hashlib
    import shutil

    # Every xdist worker's temporary folder sits in the one of this `pytest` call; a lone pytest has only its own.
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if worker_id != "master" else root) / "once"
    shared.mkdir(exist_ok=True)
    seen: dict[Path, dict] = {}  # what each folder held when this worker got it

    def listing(folder: Path) -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}

    def get(name: str, make, unmutated: bool = False) -> Path:
        """`unmutated`: `make` runs only code make mutants never mutates, so a mutation run may share what it made."""
        root = (_mutants_models() if unmutated else None) or shared
        folder = root / hashlib.sha256(name.encode()).hexdigest()[:16]
        with open(f"{folder}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not folder.exists():
                building = folder.with_name(folder.name + ".tmp")
                shutil.rmtree(building, ignore_errors=True)
                building.mkdir()
                make(building)
                building.rename(folder)
            seen.setdefault(folder, listing(folder))
        return folder

    yield get
    # A test that writes into a shared folder breaks another module's test, on whichever worker runs it after.
    changed = {}
    for f, before in seen.items():
        now = listing(f)
        diff = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if diff:
            changed[str(f)] = diff[:10]  # the entries that differ name the test that wrote them
    assert not changed, f"a test changed a folder that once() made for every module (copy it first): {changed}"


@pytest.fixture(scope="session")
def tiny_family(once):
    """tiny_family(name) -> the folder of that family's tiny pipeline (flux1, sd3, ...), built once per session."""
    from launcher.models import build

    def get(name: str) -> Path:
        def make(folder: Path) -> None:
            build(f"tiny_{name}", folder / f"tiny-{name}")

        return once(f"model {name}", make, unmutated=True) / f"tiny-{name}"

    return get


@functools.cache
def _mutants_models() -> Path | None:
    """Under `make mutants`, where each mutant's tests are a pytest session of their own (in mutants/), one folder
    for the tiny pipelines of the whole mutation run, named by the code that builds them: built once there instead
    of once per mutant (4.5 s each, a survivor's whole test time several times over). Only the models may be
    shared so: launcher/models/ is never mutated, and anything else a test makes once comes from mutated code."""
    if not os.environ.get("MUTANT_UNDER_TEST"):
        return None
    import hashlib

    code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path("launcher/models").rglob("*.py"))))
    root = Path("tiny-models") / code.hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


@pytest.fixture(scope="session")
def tiny_model(tiny_family) -> Path:
    return tiny_family("flux2")


@pytest.fixture(scope="session")
def default_model(tiny_model) -> Path:
    """The checkout's models/tiny-flux2 (conf tiny's model.path), as `make demo` leaves it: a copy of this session's
    tiny FLUX.2 (the same deterministic build) where it is missing. A dry run of a tiny model not yet built learns
    its configs from a build in a temporary folder, which imports diffusers (~6 CPU-s a launch); with the model in
    place it reads them (<1 CPU-s). That path stays tested: the image tree's dry run (tests/test_deploy.py) has no
    models/ folder."""
    import shutil

    from launcher.models import default_dir

    target = default_dir("tiny_flux2")
    if not target.exists():
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.copytree(tiny_model, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another xdist worker's copy got there first
            shutil.rmtree(tmp)
    return target


def contract_seed(base: int, sample_id: str) -> int:
    """DESIGN.md's seed of a sample, from its words (not the product's code): the first 8 bytes of
    sha256("<generate.seed>:<sample id>") read little-endian, masked to 63 bits."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{base}:{sample_id}".encode()).digest()[:8], "little") & (2**63 - 1)


def launch(*args: str, env: dict | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run ./launch.sh as a user would, with the test venv's Python."""
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([LAUNCH, *args], capture_output=True, text=True, env=full_env, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def run_job(tiny_model, once):
    """run_job(*overrides) -> output folder of the tiny job with those overrides; each distinct job runs once per
    `make test`, whichever module asks first. Read it, or copy it before changing anything."""

    def make(out: Path, overrides: tuple[str, ...]) -> None:
        res = launch(f"model.path={tiny_model}", f"output.dir={out}", *overrides)
        assert res.returncode == 0, res.stderr[-3000:]

    def run(*overrides: str) -> Path:
        return once(f"run {overrides}", lambda d: make(d / "out", overrides)) / "out"

    return run


def slow_job(tiny_model: Path, folder: Path, n: int, *extra: str) -> list[str]:
    """Overrides of a tiny job over `n` prompts in shards of 2, slow enough to act on mid-run (each batch sleeps
    0.4 s more, as on a slow chip: 30 steps did the same with 7 times the CPU the other tests need)."""
    prompts = folder / "p.txt"
    prompts.write_text("".join(f"prompt number {i}, a small test scene\n" for i in range(n)))
    return [
        f"model.path={tiny_model}",
        f"dataset.path={prompts}",
        "run.shard_size=2",
        "testing.batch_sleep_s=0.4",
        *extra,
    ]


SLOW_N = 32  # prompts, in shards of 2: long enough (about 0.5 s a shard) to interrupt mid-run five times


def unslowed(job: list[str]) -> list[str]:
    """The slow job without its sleeps, for its clean runs: nobody interrupts them, and testing.* changes no byte
    of a run (it is outside the fingerprint), so each spares ~6 s of a core sitting idle."""
    return [o for o in job if not o.startswith("testing.batch_sleep_s=")]


@pytest.fixture(scope="session")
def slow(tiny_model, once, tmp_path_factory) -> tuple[list[str], Path]:
    """(job, clean): the slow job over SLOW_N prompts that the fault tests interrupt, and its clean run, made once.

    The clean run starts its workers as torchrun does (a fresh interpreter each, as on TPU and CUDA hosts): every
    rerun, forked on this CPU host, must give these same bytes."""
    job = slow_job(tiny_model, tmp_path_factory.mktemp("slow"), SLOW_N)

    def make(d: Path) -> None:
        res = launch(*unslowed(job), f"output.dir={d / 'out'}", env={"MESHGEN_WORKER_START": "subprocess"})
        assert res.returncode == 0 and "workers start as fresh interpreters" in res.stderr, res.stderr[-2000:]

    return job, once("slow clean", make) / "out"


@pytest.fixture(scope="session")
def slow_clean(slow, once) -> Callable[[int], Path]:
    """slow_clean(tp) -> the clean run of the slow job's SLOW_N prompts at tp=1 or tp=2 (dp=1), made once.

    The reference of every test that runs the slow job's first n prompts (slow_job writes the same lines) on a mesh
    with that tp, whatever its dp (dp changes no image: tests/test_job.py) or its number of hosts: compare with
    `first_rows` or `first_shards` of it. One run serves them all: each costs a torchrun start."""
    job, tp2 = slow

    def make(d: Path) -> None:
        res = launch(*unslowed(job), "mesh.tp=1", f"output.dir={d / 'out'}")
        assert res.returncode == 0, res.stderr[-2000:]

    return lambda tp: tp2 if tp == 2 else once("slow clean tp=1", make) / "out"


def first_rows(out, n: int) -> dict[str, dict]:
    """The rows of a run of the slow job whose ids (row numbers) are below n."""
    return {k: r for k, r in read_rows(out).items() if int(k) < n}


def first_shards(files: dict[str, object], n: int) -> dict[str, object]:
    """The entries of a {path in a run folder: ...} map but those of shards past the first n prompts of a slow job
    (shards of 2); a file of no shard (the ledger's index) stays."""
    shard = lambda k: int(m.group(1)) if (m := re.search(r"shard-(\d+)", k)) else -1  # noqa: E731
    return {k: v for k, v in files.items() if shard(k) < -(-n // 2)}


def worker_logs(out: Path) -> str:
    """Every worker's own lines: they go to OUTPUT_DIR/logs/<run id>/rank-N.log, not to the terminal."""
    return "".join(p.read_text() for p in sorted(Path(out).glob("logs/*/rank-*.log")))


def read_rows(out) -> dict[str, dict]:
    """Every sample of a run folder (a local path or an s3:// URL), by id, read back from its Parquet files."""
    from launcher.ledger.store import Store

    store, rows = Store(out), {}
    for f in store.files("data", ".parquet"):
        for r in store.parquet(f"data/{f.base_name}").read().to_pylist():
            assert r["id"] not in rows, f"sample {r['id']} appears twice"
            rows[r["id"]] = r
    return rows


@functools.cache
def _flux2(model: Path):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def bare_flux2(model: Path, seeds: list[int], **call) -> list[np.ndarray]:
    """A bare diffusers call of the tiny FLUX.2 pipeline as a worker makes it: one thread (OMP_NUM_THREADS=1 there,
    so bitwise equal, not just close), conf tiny's call (64x64, 4 steps, FLUX2_KW) where `call` does not say
    otherwise, one generator per seed; the images as int16 levels, as `pixels` reads a row's."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = {"height": 64, "width": 64, "num_inference_steps": 4, "output_type": "np", **FLUX2_KW, **call}
        images = _flux2(model)(generator=[torch.Generator("cpu").manual_seed(s) for s in seeds], **kw).images
    finally:
        torch.set_num_threads(threads)
    return [(image * 255).round().astype(np.int16) for image in images]


def pixels(png: bytes) -> np.ndarray:
    import io

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def max_diff(a: Path, b: Path) -> int:
    ra, rb = read_rows(a), read_rows(b)
    assert ra.keys() == rb.keys()
    return max(int(np.abs(pixels(ra[k]["image"]["bytes"]) - pixels(rb[k]["image"]["bytes"])).max()) for k in ra)


def file_snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """The run folder's data, images, state files and run.json, with their bytes and mtimes.

    Left out: locks, and what runs write on purpose (run records, the dataset card, the ledger's index, a cache
    of the state files)."""
    return {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
        and (p.parts[len(out.parts)] in ("data", "images", "state") or p.name == "run.json")
        and p.name != "index.json.gz"
    }


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A local S3-compatible server (moto, with S3's atomic conditional create: tests/s3_server.py) on 127.0.0.1,
    with a bucket; yields the env that reaches it. Under `make mutants`, one of the run's servers
    (tests/server_pool.py), emptied."""
    import boto3
    from s3_server import start
    from server_pool import empty_s3, lease

    leased = lease("s3")
    server, url = (None, leased[0]) if leased else start(tmp_path_factory.mktemp("moto") / "server.log")
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)  # for this process's own reads (status, card, comparisons)
        empty_s3("meshgen-test") if leased else boto3.client("s3").create_bucket(Bucket="meshgen-test")
        yield env
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        if leased:
            leased[1].close()  # the lease: free for the next session
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A local GCS server (fake-gcs-server, see tests/gcs_server.py) on 127.0.0.1, with the bucket meshgen-test;
    yields the env that reaches it (STORAGE_EMULATOR_HOST, as Google's clients read it)."""
    from gcs_server import BUCKET, start
    from server_pool import empty_gcs, lease

    leased = lease("gcs")
    server, url = (None, leased[0]) if leased else start(tmp_path_factory.mktemp("gcs") / "server.log")
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = url  # for this process's own reads (status, card, comparisons)
        from launcher.ledger.gcs import gcs_client

        empty_gcs(BUCKET) if leased else gcs_client().create_bucket(BUCKET)
        yield {"STORAGE_EMULATOR_HOST": url}
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        if leased:
            leased[1].close()
        os.environ.pop("STORAGE_EMULATOR_HOST") if old is None else os.environ.__setitem__("STORAGE_EMULATOR_HOST", old)


@pytest.fixture(params=["s3", "gs"])
def store_env(request) -> tuple[str, dict]:
    """Each local object store in turn: (the scheme, the env that reaches its server, bucket meshgen-test)."""
    return request.param, request.getfixturevalue("s3" if request.param == "s3" else "gcs")


def shifted_clock(folder: Path, seconds: float) -> dict:
    """The env of a run whose processes all see time.time() shifted by `seconds` (a host whose clock drifted):
    a sitecustomize on PYTHONPATH, imported by every Python process of the run, the workers included."""
    site = folder / f"clock{seconds:+.0f}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import time\n_real = time.time\n"
        f"time.time = lambda: _real() + {seconds!r}\n"
        f"time.time_ns = lambda: int((_real() + {seconds!r}) * 1e9)\n"
    )
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def silent_hub():
    """A hub address on loopback that accepts each connection, reads its request, and never answers: a stranger
    (or a proxy) that holds a connection open. Yields the request paths it was sent."""
    server, paths, held = socket.create_server(("127.0.0.1", 0)), [], []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the test is over
            held.append(conn)
            paths.append((conn.recv(65536).decode("latin-1").split(" ") + ["", ""])[1])

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", paths
    server.close()
    for conn in held:
        conn.close()


# The Hub that tools.publish and output.publish push to in the tests.
REPO_ID = "org/ds"
TARGET = f"hf://datasets/{REPO_ID}"


@pytest.fixture
def hub(tmp_path):
    """The fake Hub on loopback (tests/fake_hub.py) with an empty dataset repo REPO_ID and a write token."""
    from fake_hub import FakeHub, Repo, serve

    hub = FakeHub(tokens={"wtok": "write", "rtok": "read"})
    hub.repos[f"datasets/{REPO_ID}"] = Repo({})
    server = serve(hub)
    hub.env = {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": "wtok",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_XET": "1",  # the fake speaks the LFS protocol; the real Hub takes either
        "HF_HUB_ETAG_TIMEOUT": "2",
    }
    yield hub
    server.shutdown()


def load_from_hub(hub, cache: Path, printed: str) -> str:
    """What `printed` (a Python expression of `ds`) prints after `ds = datasets.load_dataset('org/ds', split='train')`
    from the fake Hub, in a fresh interpreter (as a user loads it; `cache`: its datasets cache)."""
    code = f"import datasets, json; ds = datasets.load_dataset('{REPO_ID}', split='train'); print({printed})"
    env = {**os.environ, **hub.env, "HF_DATASETS_CACHE": str(cache)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def publish(out, target: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m tools.publish OUT TARGET ARGS` as a user runs it."""
    cmd = [sys.executable, "-m", "tools.publish", str(out), target, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def until(check, timeout_s: float = 20.0) -> None:
    """Wait for an event another thread makes happen, polling; fail past timeout_s."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the event never happened"
        time.sleep(0.02)


@pytest.fixture
def silent_s3(monkeypatch):
    """An S3 endpoint on loopback that accepts every connection and never answers."""
    server, held = socket.create_server(("127.0.0.1", 0)), []

    def serve():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not): the thread ends, and is joined
    server.close()
    thread.join(timeout=10)
    for conn in held:
        conn.close()
