"""The launcher: `./launch.sh [--dry-run] [conf=NAME] [overrides]` execs this process.

It composes and checks the job once (exit 2 on bad input, before any worker starts), takes the output folder's
lock (exit 4), then supervises dp*tp workers through torch's elastic launch, in-process: the same machinery as
the `torchrun` command, but this process stays the workers' parent, so a SIGTERM sent to it alone reaches every
worker, and it can map the outcome to the contract's exit codes (torchrun itself reports any failure as 1).
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field

from launcher.checks import prepare
from launcher.errors import EXIT_OK, EXIT_SHARDS_FAILED, ConfigError, LockHeld, OutputRefused
from launcher.host.summary import Progress, summarize
from launcher.host.worker_start import start_method
from launcher.sizing.space import best_effort, warn_if_short
from launcher.worker.execution import mode_env

logger = logging.getLogger(__name__)


@dataclass
class LaunchPlan:
    env: dict[str, str] = field(default_factory=dict)  # set before torch is imported, inherited by workers
    tpu_launch_env: bool = False  # torch.tpu.distributed.set_tpu_launch_env(...) in this process first
    torchrun_args: list[str] = field(default_factory=list)
    start: str = "subprocess"  # how the workers start: launcher/host/worker_start.py

    def describe(self, nproc: int, nnodes: int) -> list[str]:
        lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        if self.tpu_launch_env:
            lines.append(
                f'eval "$(python -m torch.tpu.distributed)"  # TorchTPU launch env: '
                f"set_tpu_launch_env(nnodes={nnodes}, nproc_per_node={nproc})"
            )
        if self.start == "forkserver":
            lines.append("# this host forks these workers from a server that has imported torch and diffusers once")
        lines.append(shlex.join(["torchrun", *self.torchrun_args]))
        return lines


def launch_plan(cfg, conf: str, overrides: list[str], device: str) -> LaunchPlan:
    nproc = cfg.mesh.dp * cfg.mesh.tp // cfg.mesh.nodes
    env = {}
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # CPU matmuls split their sums by thread count, which changes the last bits of an image; one thread per
        # worker keeps images bitwise equal whatever the mesh. An explicit OMP_NUM_THREADS wins.
        env["OMP_NUM_THREADS"] = "1"
    env.update(mode_env(cfg, device))
    if cfg.mesh.nodes == 1:
        rdzv = ["--standalone", "--nnodes=1"]
    else:  # every host runs this same command; NODE_RANK and MASTER_ADDR come from the scheduler or TorchTPU
        rdzv = [
            f"--nnodes={cfg.mesh.nodes}",
            f"--node-rank={os.environ.get('NODE_RANK', '$NODE_RANK')}",
            f"--master-addr={os.environ.get('MASTER_ADDR', '$MASTER_ADDR')}",
            f"--master-port={os.environ.get('MASTER_PORT', '29500')}",
        ]
    args = [
        *rdzv,
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        "launcher.worker.main",
        f"conf={conf}",
        *overrides,
    ]
    return LaunchPlan(env=env, tpu_launch_env=device == "tpu", torchrun_args=args, start=start_method(device, nproc))


def run_elastic(args: list[str], logs=None, start: str = "subprocess") -> int:
    """Run torchrun's elastic launch in this process; the first failed worker's exit code, or 0.

    `logs` (launcher/host/terminal.py's WorkerLogs): the workers' output goes to per-rank files instead of the
    terminal. `start`: how the workers start (launcher/host/worker_start.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args

    from launcher.errors import LAUNCHER_PID_ENV
    from launcher.host.terminal import launch_workers

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the parent every worker dies with: launcher/errors.py
    try:
        launch_workers(parse_args(args), logs, start)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        where = f"; its log: {logs.rank_log(rank)}" if logs is not None else ""
        logger.error("rank %d failed first, exit code %s%s", rank, failure.exitcode, where)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as e:
        logger.error("stopped by signal %s; done shards are kept, rerun the same command to finish", e.sigval)
        return 128 + int(e.sigval)
    finally:  # not for processes this one starts later (the tests run torchrun themselves after a launch)
        os.environ.pop(LAUNCHER_PID_ENV, None)
    return EXIT_OK


def run_hosts(cfg, plan_: LaunchPlan, logs=None) -> int:
    """run_elastic, and on a multi-host job the watch that stops this host when another is lost (exit 3)."""
    args = plan_.torchrun_args
    if cfg.mesh.nodes == 1:
        return run_elastic(args, logs, plan_.start)
    from launcher.checks.settings import store_address
    from launcher.host.peers import PeerWatch

    node = int(os.environ.get("NODE_RANK", "0"))
    with PeerWatch(node, cfg.mesh.nodes, *store_address()) as watch:
        with watch.agent():
            code = run_elastic(args, logs, plan_.start)
        if watch.lost or (code != EXIT_OK and watch.settle()):
            logger.error("lost a host (%s); run the same command on every host to finish the job", watch.lost)
            return EXIT_SHARDS_FAILED
    return code


def supervise(pf, conf: str, overrides: list[str], plan_: LaunchPlan) -> int:
    """`pf`: the preflight's findings (launcher/checks/preflight.py): the output folder, its ledger, the plan.

    The workers' server is forked here, before the books start their threads (launcher/host/worker_start.py)."""
    from launcher.host.agreement import hosts_agree
    from launcher.host.worker_start import server_forked_early
    from launcher.ledger.store import opened_remote

    cfg = pf.cfg
    os.environ.update(plan_.env)  # before torch is imported, in this process and in the workers' server
    first_host = cfg.mesh.nodes == 1 or os.environ.get("NODE_RANK", "0") == "0"
    works = not first_host or cfg.run.overwrite or pf.plan.selected
    # A process that has opened an object store's client (output, prompts, references, ...) holds its native threads
    # and connections, which a fork would copy half-alive: there the server starts as a fresh interpreter.
    # The hosts of a job agree on it after the fork (the store's thread must not be copied) and before any write.
    with server_forked_early(plan_.start if works and not opened_remote() else "subprocess"), hosts_agree(cfg):
        return keep_books(pf, conf, overrides, plan_) if first_host else run_hosts(cfg, plan_)


def keep_books(pf, conf: str, overrides: list[str], plan_: LaunchPlan) -> int:
    """The books of the run (lock, plan, records, summary), the workers in between. On a job over several hosts
    the first host's launcher keeps them; the others only run their workers."""
    from launcher.host.metrics import metrics_file
    from launcher.ledger import runs
    from launcher.ledger.lock import RunLock, other_live_runs
    from launcher.ledger.states import Ledger, clean_tmp
    from launcher.plan.plan import make_plan, tidy
    from launcher.plan.plan_ids import commit_ids
    from launcher.plan.stale import record_kept
    from launcher.publish.card import write_card
    from launcher.publish.run import start_publisher
    from launcher.sizing.space import stopped_by_space
    from launcher.sources import rejected
    from launcher.workers import resolve_workers

    cfg = pf.cfg
    store, sizes, ledger, plan = pf.store, pf.sizes, pf.ledger, pf.plan
    index, _ = resolve_workers(cfg)
    publisher = start_publisher(cfg, store)  # output.publish: the target is probed first (exit 2)
    start = time.monotonic()  # durations never come from the wall clock: it may step mid-run
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}"
    with RunLock(store, index, run_id) as lock:
        if cfg.run.overwrite:
            others = other_live_runs(store, index)
            if others:
                raise LockHeld(
                    f"run.overwrite would discard the work of live worker {others[0]['worker']} "
                    f"(host {others[0]['host']}, pid {others[0]['pid']}); wait for it or stop it first"
                )
            runs.discard_outputs(store)
            ledger = Ledger(store)
            plan = make_plan(cfg, ledger.refresh(), sizes, store)
        runs.check_run_json(store, cfg)
        commit_ids(store, plan)  # with dataset.id_column: the shards' ids, fixed now (launcher/ids/idmap.py)
        rerun = rerun_command(cfg, conf, overrides)
        full = best_effort("run.json", runs.write_run_json, store, cfg, len(plan.shards))
        full |= best_effort("the ledger's index", ledger.save_index)
        full |= best_effort("the rejected rows", rejected.write, store, run_id, plan.rejected)  # dataset.bad_rows=skip
        clean_tmp(store)
        if plan.stale and cfg.run.stale == "keep":
            logger.warning("keeping shards %s as they are although their prompts changed (run.stale=keep)", plan.stale)
            # Recorded, so that the same command without run.stale=keep then finds them done.
            full |= best_effort(
                "run.stale=keep",
                record_kept,
                store,
                {i: plan.shards[i].fingerprint for i in plan.stale},
                plan.ids.changed if plan.ids is not None else None,
            )
        code = EXIT_OK
        metrics = metrics_file(cfg, store, plan, run_id, start)  # output.metrics (launcher/host/metrics.py)
        if plan.selected and not full:
            code, full = generate(cfg, store, ledger, plan, run_id, start, plan_, sizes, publisher, metrics)
        elif not plan.selected and not plan.held:
            logger.info("nothing to do: every selected shard of %s is done", store)
        lines, record = summarize(store, ledger, plan, run_id, start, code, rerun)
        code = record["exit_code"]
        if metrics is not None:
            metrics.final(record["metrics"])
        full |= best_effort("the run's record", runs.write_record, store, record)
        if lock.held():  # else taken over (this run looked dead): the folder's books are the new holder's
            full |= best_effort("the ledger's index", ledger.save_index)
            full |= best_effort("the dataset card", write_card, store, ledger.states)
        best_effort("leftover plans", tidy, store, lock)
    push_failed = publisher.finish() if publisher else None  # after the card: it goes last
    for line in lines:
        logger.info(line)
    if push_failed:
        code = code if code != EXIT_OK else EXIT_SHARDS_FAILED
        print(f"error: {push_failed}", file=sys.stderr)
    last = stopped_by_space(cfg, store, ledger.states, run_id, full) if code == EXIT_SHARDS_FAILED else None
    if last:
        print(last, file=sys.stderr)  # the last line: what stopped the run and how to finish it
    return code


def rerun_command(cfg, conf: str, overrides: list[str]) -> list[str]:
    """The command that finishes this run from any folder: launch.sh and the paths as absolute as the run used them."""
    from launcher.config import REPO_ROOT

    paths = ("dataset.path", "output.dir", "model.path")
    out = [str(REPO_ROOT / "launch.sh"), f"conf={conf}"]
    for o in overrides:
        key = o.partition("=")[0].lstrip("+")
        if key in paths:
            group, leaf = key.split(".")
            o = f"{key}={cfg[group][leaf]}"
        if key not in ("run.shards", "run.overwrite"):
            out.append(o)
    return out


def generate(
    cfg, store, ledger, plan, run_id: str, start: float, plan_: LaunchPlan, sizes, publisher=None, metrics=None
):
    """Write the plan file, run the workers with a progress bar, remove the plan; (exit code, out of space)."""
    from launcher.host.terminal import WorkerLogs
    from launcher.plan.plan import plan_rel, write_plan_file
    from launcher.plan.sweep import n_variants

    samples = plan.prompts(plan.selected) * cfg.generate.images_per_prompt * n_variants(cfg.generate)
    logger.info("generating %d shards (%d samples) into %s", len(plan.selected), samples, store)
    warn_if_short(cfg, store, samples)
    if best_effort("the run's plan", write_plan_file, store, plan_rel(run_id), cfg, plan, sizes):
        return EXIT_SHARDS_FAILED, True
    os.environ["MESHGEN_RUN_ID"] = run_id
    try:
        with (
            WorkerLogs(store, run_id) as logs,
            Progress(ledger, samples, run_id, publisher and publisher.offer, metrics),
        ):
            return run_hosts(cfg, plan_, logs), False
    finally:
        best_effort("the removal of the run's plan", store.delete, plan_rel(run_id))


def set_tpu_launch_env(nnodes: int, nproc_per_node: int) -> None:
    """TorchTPU's launch environment, decided once here before workers spawn (every rank must agree on it)."""
    import torch

    tpu_dist = getattr(getattr(torch, "tpu", None), "distributed", None)
    if tpu_dist is not None and hasattr(tpu_dist, "set_tpu_launch_env"):
        tpu_dist.set_tpu_launch_env(nnodes=nnodes if nnodes > 1 else None, nproc_per_node=nproc_per_node)
        return
    try:  # torch_tpu before 0.2.0: the seed guide's internal wrapper
        from torch_tpu._internal.distributed.launchers import singlehost_wrapper  # noqa: F401
    except ImportError:
        from launcher.worker.dist import TPU_INSTALL_HINT

        raise ConfigError(f"cannot set up the TPU launch environment: {TPU_INSTALL_HINT} (0.2.0 or newer)") from None
    raise ConfigError(
        "torch_tpu is older than 0.2.0 (no torch.tpu.distributed.set_tpu_launch_env); "
        'upgrade it: pip install -e ".[tpu]"'
    )


def main(argv: list[str] | None = None) -> int:
    from launcher.logs import setup_logging

    setup_logging(0, hub_progress=True, who="launcher")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from launcher.help import help_text

        print(help_text())
        return EXIT_OK
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        show_cfg = _take_cfg_flag(argv)
        from launcher.checks.preflight import preflight
        from launcher.config import job_file, load_config, split_args

        conf, overrides = split_args(argv)
        cfg = load_config(conf, overrides)
        if show_cfg:
            from omegaconf import OmegaConf

            from launcher.ledger.addresses import masked

            print(masked(OmegaConf.to_yaml(cfg)), end="")  # before any check: an address may still hold a secret
            return EXIT_OK
        if job_file(conf):  # workers compose the same file, wherever they start
            conf = str(job_file(conf))
        pf = preflight(cfg, dry_run)  # every check, in order; a refusal is the run's only line
        mesh = pf.mesh
        plan_ = launch_plan(cfg, conf, prepare.worker_overrides(overrides, cfg, mesh), pf.device)
        if dry_run:
            print("\n".join(dry_run_lines(pf)))
            print("\n".join(plan_.describe(cfg.mesh.dp * cfg.mesh.tp // cfg.mesh.nodes, cfg.mesh.nodes)))
            return EXIT_OK
        for line in (mesh.line(), *mesh.why):
            logger.info(line.removeprefix("# mesh: "))
        if pf.device == "tpu":  # first: on a multi-host slice it decides NODE_RANK and MASTER_ADDR for torchrun
            set_tpu_launch_env(cfg.mesh.nodes, cfg.mesh.dp * cfg.mesh.tp // cfg.mesh.nodes)
        return supervise(pf, conf, overrides, plan_)
    except (ConfigError, LockHeld, OutputRefused) as e:
        from launcher.ledger.addresses import masked

        print(f"error: {masked(str(e))}", file=sys.stderr)  # an override Hydra cannot parse is shown whole
        return e.exit_code


def _take_cfg_flag(argv: list[str]) -> bool:
    """`--cfg job` (Hydra's spelling): removes it from argv; only `job` is known here."""
    for i, arg in enumerate(argv):
        if arg == "--cfg" or arg.startswith("--cfg="):
            what = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            if what != "job":
                raise ConfigError(f"--cfg {what or '(nothing)'}: only --cfg job is known here")
            del argv[i : i + (1 if "=" in arg else 2)]
            return True
    return False


def dry_run_lines(pf) -> list[str]:
    """What a dry run says before the commands: device, mesh, the plan's size, this host's share."""
    from launcher.workers import resolve_workers

    cfg, plan = pf.cfg, pf.plan
    lines = [f"# device: {pf.device} (device={cfg.device}), chip: {pf.mesh.chip.name}"]
    lines += [pf.mesh.line(), *(f"# mesh: {w}" for w in pf.mesh.why), *pf.notes]
    from launcher.plan.sweep import n_variants

    todo = plan.prompts(plan.selected)
    images = todo * cfg.generate.images_per_prompt * n_variants(cfg.generate)  # each prompt's samples, every variant
    counts = {st: sum(1 for s in plan.shards if s.status == st) for st in ("done", "failed", "stale")}
    lines.append(
        f"# plan: {len(plan.selected)} of {len(plan.shards)} shards to generate ({todo} prompts, {images} images); "
        + ", ".join(f"{n} {st}" for st, n in counts.items())
    )
    if plan.held:  # run.max_attempts
        why = "failed run.max_attempts times with the same error; run.shards=failed retries them"
        lines.append(f"# not retried: shards {plan.held} {why}")
    if plan.rejected:  # dataset.bad_rows=skip
        first = plan.rejected[0]
        at = f"{first['file']}, line {first['line']}" if first["file"] else f"row {first['position']}"
        n = len(plan.rejected)
        lines.append(f"# rejected: {n} rows set aside (dataset.bad_rows=skip), e.g. {at}: {first['reason']}")
    from launcher.sizing.cost import cost_lines

    lines += cost_lines(pf)  # replicas, output bytes and room, download, expected time
    index, count = resolve_workers(cfg)  # what the scheduler's environment makes of this host
    lines.append(f"# workers: index={index} count={count}")  # last: the torchrun command follows
    return lines


if __name__ == "__main__":
    from launcher.errors import exit_with

    exit_with(main())
