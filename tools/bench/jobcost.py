"""What one small job costs the host's CPU, by process: `python -m tools.bench.jobcost [--repeats 5]
[--at-once 1] [--model models/tiny-flux2] [--out bench-jobcost.json] [-- OVERRIDE ...]`.

Runs `./launch.sh` (conf `tiny`: 20 prompts, 64x64, 4 steps, tp=2 unless overridden) into a fresh folder per
repeat. `total` is the CPU (user + system) of the whole process tree, exact: the rusage of the launcher and every
process it waited for, directly or through its children. The split by role (launcher, forkserver, worker,
writer) samples every process of the tree every 20 ms, so it misses what a process spends in its last 20 ms and
does not add up to the total. On a 2-core CI machine the test suite's ~90 real jobs are most of its CPU, and
their start-up (imports, model load, exit) is most of each job's. `--at-once N` starts N copies of the job together
in each repeat and reports their CPU per job (no split by role): what a job costs beside others, as in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROLES = {"host.launch": "launcher", "forkserver": "forkserver", "worker.main": "worker", "spawn_main": "writer"}


def role(cmdline: str) -> str:
    return next((name for key, name in ROLES.items() if key in cmdline), "other")


def one_job(overrides: list[str], out: Path) -> dict:
    """(total CPU s, wall s, {role: [CPU s per process]}) of one run of the job."""
    import psutil

    env = {**os.environ, "PYTHON": sys.executable}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # The job's terminal output goes to a file: a pipe read only at the end would stall a job that fills it.
    log = open(f"{out}.log", "w+")
    proc = subprocess.Popen(
        [str(REPO / "launch.sh"), f"output.dir={out}", *overrides], stdout=subprocess.DEVNULL, stderr=log, env=env
    )
    seen: dict[int, tuple[str, float]] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                t = p.cpu_times()
                # the last role its command line showed: a forked worker shows the server's until it renames
                # itself, and a process killed at the end is a zombie with no command line by its last sample
                name = role(" ".join(p.cmdline()))
                if name == "other" and p.pid in seen:
                    name = seen[p.pid][0]
                seen[p.pid] = (name, t.user + t.system)
            except psutil.Error:  # ended between the listing and the read
                continue
        time.sleep(0.02)
    with log:
        if proc.wait() != 0:
            log.seek(0)
            raise SystemExit(f"the job failed (exit {proc.returncode}): {log.read().strip().splitlines()[-1:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    roles: dict[str, list[float]] = {}
    for name, cpu in seen.values():
        roles.setdefault(name, []).append(round(cpu, 2))
    total = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"total": round(total, 2), "wall": round(time.perf_counter() - t0, 2), "roles": roles}


def jobs_at_once(overrides: list[str], outs: list[Path]) -> dict:
    """Runs of the job started together, one per folder: their exact CPU per job, and the wall time of them all."""
    env = {**os.environ, "PYTHON": sys.executable}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    logs = [open(f"{o}.log", "w") for o in outs]
    procs = [
        subprocess.Popen(
            [str(REPO / "launch.sh"), f"output.dir={o}", *overrides], stdout=subprocess.DEVNULL, stderr=log, env=env
        )
        for o, log in zip(outs, logs, strict=True)
    ]
    failed = any([p.wait() for p in procs])  # a list: wait for every one
    for log in logs:
        log.close()
    if failed:
        raise SystemExit(f"a job failed (exits {[p.returncode for p in procs]}); see {outs[0]}.log and its siblings")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"total": round(total / len(outs), 2), "wall": round(time.perf_counter() - t0, 2), "roles": {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--at-once", type=int, default=1, help="copies of the job started together in each repeat")
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-flux2"))
    ap.add_argument("--out", default="bench-jobcost.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the job, after --")
    args = ap.parse_args(argv)
    if args.at_once < 1 or args.repeats < 1:
        ap.error(f"--at-once {args.at_once} and --repeats {args.repeats} must be 1 or more")
    overrides = [f"model.path={args.model}", *args.overrides]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            if args.at_once > 1:
                runs.append(jobs_at_once(overrides, [Path(tmp) / f"out{i}-{j}" for j in range(args.at_once)]))
            else:
                runs.append(one_job(overrides, Path(tmp) / f"out{i}"))
    med = {k: statistics.median(r[k] for r in runs) for k in ("total", "wall")}
    per_role = {}
    for name in sorted({n for r in runs for n in r["roles"]}):
        cpu = [c for r in runs for c in r["roles"].get(name, [])]
        per_role[name] = {"median": statistics.median(cpu), "processes per job": len(cpu) / len(runs)}
    totals = sorted(r["total"] for r in runs)
    print(f"job: {' '.join(overrides)}")
    together = f", {args.at_once} at once" if args.at_once > 1 else ""
    print(f"CPU per job (s{together}): median {med['total']:.2f}, min {totals[0]:.2f}, max {totals[-1]:.2f}", end="")
    print(f"; wall {med['wall']:.1f} s")
    for name, v in per_role.items():
        print(f"  {name:10s} {v['median']:5.2f} CPU-s each, {v['processes per job']:.1f} per job (sampled)")
    record = {"overrides": overrides, "at_once": args.at_once, "median": med, "roles": per_role, "runs": runs}
    Path(args.out).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
