"""`make mutants-e2e ROOM=host`: the room's mutants that no fast test reaches, sampled and run against the
end-to-end tests that launch jobs.

    python tools/mutants_e2e.py ROOM [-n 12] [--seed 0] [--survivors]    after `make mutants ROOM=...`

mutmut picks a mutant's tests by which tests call its function in mutmut's own process; code that runs only in the
processes a launch starts (the launcher's run loop, the hosts' watch, the workers' entry) has no test there, though
the launched tests run it. Those tests take 10-60 s each, too slow for a whole room, so this takes a random sample of
the room's no-test mutants (the same one for the same seed and verdicts) and runs, for each, the launched tests that
reach its module (E2E below), from mutants/ with MUTANT_UNDER_TEST set: every process a test starts inherits it, and
launch.sh there puts the mutated code first on PYTHONPATH. A control run with no mutant active must pass first.
The counts estimate the share of the room's no-test mutants that the suite kills; results go to
mutants/e2e-ROOM.json. `--survivors` samples the mutants that survived their fast tests as well (code that a fast
test enters but whose launched paths, tp > 1, a second host, torchrun's agent, only a launch takes), into
mutants/e2e-ROOM-survivors.json: its counts are of that mix, not of the no-test mutants alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import REPO, ROOMS, module_of, server_pool, verdicts  # noqa: E402

JOB = "tests/test_job.py::test_tiny_job_at_tp2_writes_complete_shards"
FAULTS = "tests/test_faults.py::test_an_injected_failure_on_the_last_tp_rank_fails_only_that_shard"
WRITE = "tests/test_faults.py::test_a_failed_write_fails_only_that_shard_and_a_killed_writes_leftovers_go"
STOPS = "tests/test_faults.py::test_every_way_a_job_is_stopped_then_the_same_command_finishes_it"  # whose server
LORA = "tests/test_lora.py::test_loras_fused_at_tp1_equal_diffusers_and_tp2_within_2_levels"
SWEEP = "tests/test_sweep.py::test_every_prompt_at_every_variant_with_the_plain_runs_seed_and_image"
# Module-name prefix -> the launched tests that run its code; the longest prefix that matches wins.
E2E = {
    "launcher.worker": [JOB, FAULTS, WRITE],
    # Code that only a LoRA or a sweep runs: the generic jobs above never reach it (session 26's sample).
    "launcher.worker.lora": [LORA],
    "launcher.worker.lora_fuse": [LORA],
    "launcher.worker.staged": [JOB, SWEEP],
    "launcher.writer": [JOB, WRITE, "tests/test_outputs.py"],
    "launcher.host": [JOB, "tests/test_job.py::test_rerunning_a_finished_job_does_nothing", FAULTS],
    "launcher.host.peers": ["tests/test_hosts.py"],
    "launcher.host.agreement": ["tests/test_hosts.py"],
    "launcher.host.terminal": ["tests/test_terminal.py"],
    "launcher.host.metrics": ["tests/test_metrics.py"],
    "launcher.host.worker_start": [JOB, "tests/test_launch.py", STOPS],
    "launcher.publish": ["tests/test_publish.py"],
    "launcher.checks": ["tests/test_launch.py", "tests/test_hosts.py::test_a_port_in_use_is_one_line_at_start"],
    "launcher.checks.download": ["tests/test_download.py"],
    "launcher.checks.quality_models": [
        "tests/test_quality.py::test_the_launcher_downloads_the_quality_models_once_for_offline_workers"
    ],
    "launcher.sizing": ["tests/test_launch.py"],
    "jobs": [JOB],
}
CONTROL = "meshgen-e2e-control__mutmut_0"  # a name no mutant has: every process runs the code as written


def tests_of(mutant: str) -> list[str]:
    module = module_of(mutant)
    prefixes = [p for p in E2E if module == p or module.startswith(p + ".")]
    return E2E[max(prefixes, key=len)] if prefixes else []


def pytest(mutant: str, tests: list[str], env: dict, timeout_s: float) -> tuple[str, float]:
    """One mutant's launched tests, the first failure ending them: (verdict, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        code = subprocess.run(
            cmd, cwd=REPO / "mutants", env={**env, "MUTANT_UNDER_TEST": mutant}, capture_output=True, timeout=timeout_s
        ).returncode
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    return ("survived" if code == 0 else "killed"), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("room", choices=list(ROOMS))
    parser.add_argument("-n", type=int, default=12, help="mutants in the sample (default 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--survivors", action="store_true", help="sample the survivors too, not only no-test ones")
    args = parser.parse_args(argv)
    kinds = ("no tests", "survived", "suspicious") if args.survivors else ("no tests",)
    pool = sorted(name for name, v in verdicts(args.room).items() if v in kinds)
    if not pool:
        print(f"room {args.room}: no mutant {' or '.join(kinds)} (run `make mutants ROOM={args.room}` first)")
        return 0
    sample = random.Random(args.seed).sample(pool, min(args.n, len(pool)))
    with server_pool(1) as servers:
        env = {**os.environ, **servers, "OMP_NUM_THREADS": "1"}
        controls = {}
        for tests in {tuple(tests_of(m)) for m in sample if tests_of(m)}:
            verdict, took = pytest(CONTROL, list(tests), env, timeout_s=900)
            if verdict != "survived":
                sys.exit(f"error: {' '.join(tests)} fail(s) with no mutant active, from mutants/: fix them first")
            controls[tests] = took
        results = {}
        for i, mutant in enumerate(sample, 1):
            tests = tests_of(mutant)
            if not tests:
                results[mutant] = {"verdict": "no e2e test", "tests": []}
                continue
            verdict, took = pytest(mutant, tests, env, timeout_s=4 * controls[tuple(tests)] + 30)
            results[mutant] = {"verdict": verdict, "seconds": round(took, 1), "tests": tests}
            print(f"[{i}/{len(sample)}] {verdict:8} {took:6.1f} s  {mutant}", flush=True)
    name = f"e2e-{args.room}-survivors.json" if args.survivors else f"e2e-{args.room}.json"
    (REPO / "mutants" / name).write_text(json.dumps(results, indent=1) + "\n")
    killed = sum(r["verdict"] in ("killed", "timeout") for r in results.values())
    print(
        f"room {args.room}: {killed} of {len(sample)} sampled {' or '.join(kinds)} mutants killed by launched tests "
        f"({len(pool)} such mutants in the room)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
