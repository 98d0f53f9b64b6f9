"""`make mutants ROOM=worker`: mutmut over one room of the code (or every room), then each room's counts.

    python tools/mutants.py [ROOM|all] [--max-children N]   run the room's mutants, then print every room's counts
    python tools/mutants.py --counts                         print the counts of the last runs only
    python tools/mutants.py ROOM --survivors                 list the room's survivors (`mutmut show NAME`)
    python tools/mutants.py ROOM --again                     run only what the last run did not kill
    python tools/mutants.py ROOM --again --fresh-stats       the same, each function's tests recorded afresh first
    python tools/mutants.py [ROOM] --kinds                   what each room's survivors change (tools/mutant_kinds.py)
    python tools/mutants.py ROOM --sample 20 [--seed 1]      a seeded sample of its "behaviour" survivors, each
                                                             with its change, to judge by hand (docs/mutation-audit.md)
    python tools/mutants.py ROOM --unjudged                  the survivors docs/survivors/ROOM.txt does not judge,
                                                             each as a block to judge there (tools/mutant_verdicts.py)

A room is a folder (sources, plan, ids, ledger, checks, sizing, host, publish, worker, writer, jobs); pyproject's
[tool.mutmut] mutates them all and names one list of fast tests for them all. mutmut's stats run (once, kept in
mutants/mutmut-stats.json until that list changes) records which of those tests call each function, and each mutant runs
only those, so each room gets the tests that cover it without a list per room. A room is chosen by a mutant-name glob
(`launcher.worker.*`), which also makes mutmut run that room's mutants again even where an earlier run left a result.
`--again` names instead the room's mutants that the last run left alive, without a test, suspicious or not checked
(after new tests, minutes instead of the room's hour); a function changed since then gets new mutants as that run
starts, which it then runs too. A change of pyproject's test list makes mutmut forget every result: then run the room
whole. mutmut updates its stats by running only tests that are new: a function added or renamed since (a helper
split out of another) is seen called by none of the old tests that reach it, and its mutants read "no tests" or
"survived" against too few tests; `--fresh-stats` records them all again first (one run of the fast tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mutant_verdicts import VERDICTS, Survivor, judge, parse, survivors  # tools/, beside this script

REPO = Path(__file__).resolve().parent.parent
LAUNCHER_ROOMS = ("sources", "plan", "ids", "ledger", "checks", "sizing", "host", "publish", "worker", "writer")
ROOMS = {room: f"launcher/{room}" for room in LAUNCHER_ROOMS} | {"jobs": "jobs"}
# mutmut's exit codes of a mutant's test run (mutmut/stats.py status_by_exit_code); anything else is suspicious.
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout"}
STATUS |= {-24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", 37: "type error", None: "not checked"}
COLUMNS = ("killed", "type error", "survived", "no tests", "timeout", "suspicious", "not checked")
SURVIVED = ("survived", "no tests", "suspicious")
JUDGED = (*VERDICTS, "unjudged")


def room_glob(room: str) -> str:
    """The mutant names of a room: mutmut names each mutant `<module>.<function>__mutmut_<n>`."""
    return ROOMS[room].replace("/", ".") + ".*"


def verdicts(room: str, mutants: Path = REPO / "mutants") -> dict[str, str]:
    """Each of the room's mutants and how the last run judged it, from mutmut's meta file beside each module."""
    found = {}
    for meta in sorted((mutants / ROOMS[room]).glob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = STATUS.get(code, "suspicious")
    return found


def module_of(mutant: str) -> str:
    """The dotted module a mutant's name starts with: `<module>.x_<function>` or `<module>.xǁClassǁmethod`."""
    return mutant.split("__mutmut_")[0].rsplit(".", 1)[0]


def unkilled_by_module(room: str, statuses: tuple[str, ...] = ("survived", "no tests")) -> dict[str, list[str]]:
    """The room's mutants of those statuses (survived and no-test), by the mutated file (relative to mutants/) that
    holds them."""
    out: dict[str, list[str]] = {}
    for name, verdict in verdicts(room).items():
        if verdict in statuses:
            out.setdefault(module_of(name).replace(".", "/") + ".py", []).append(name)
    return out


def kinds_table(rooms: list[str]) -> str:
    from mutant_kinds import kind_counts

    kinds = ("behaviour", "error text", "log text")
    lines = [f"{'room':8} {'unkilled':>8} " + " ".join(f"{k:>10}" for k in kinds)]
    for room in rooms:
        c = kind_counts(REPO / "mutants", unkilled_by_module(room))
        lines.append(f"{room:8} {sum(c.values()):>8} " + " ".join(f"{c[k]:>10}" for k in kinds))
    return "\n".join(lines)


def sample(room: str, n: int, seed: int) -> str:
    """`n` of the room's unkilled "behaviour" mutants, drawn with `seed` (the same draw for the same verdicts)."""
    import random

    from mutant_kinds import diff, kinds

    found = []
    for module_path, names in sorted(unkilled_by_module(room).items()):
        found += sorted(k for k, v in kinds(REPO / "mutants", module_path, names).items() if v == "behaviour")
    drawn = random.Random(seed).sample(found, min(n, len(found)))
    lines = [f"room {room}: {len(drawn)} of {len(found)} behaviour survivors (seed {seed})"]
    for name in drawn:
        lines += [f"== {name}", *diff(REPO / "mutants", module_of(name).replace(".", "/") + ".py", name)]
    return "\n".join(lines)


def judged_survivors(room: str) -> list[tuple[Survivor, str]]:
    """The room's survivors (survived, no tests, suspicious), each with its verdict in docs/survivors/ROOM.txt or
    ROOM.<part>.txt."""
    found = survivors(REPO / "mutants", unkilled_by_module(room, SURVIVED))
    folder, verdicts_found = REPO / "docs" / "survivors", {}
    for path in [folder / f"{room}.txt", *sorted(folder.glob(f"{room}.*.txt"))]:  # a large room's parts
        verdicts_found |= parse(path)
    said = judge(found, verdicts_found)
    return [(s, said[s.name]) for s in found]


def counts(room: str) -> Counter:
    return Counter(verdicts(room).values())


def score(c: Counter, judged_by_hand: Counter | None = None) -> float:
    """Killed (a timeout is a change the tests noticed, a type error one that `make test`'s type check refuses)
    over every mutant judged, no-test ones included: a mutant that no test runs is a change no test would notice.
    With the survivors' verdicts: over the mutants not judged equivalent or text, a survivor a new test was seen to
    kill (applied by hand) counted killed before the next run counts it."""
    v = judged_by_hand or Counter()
    judged = sum(c[k] for k in ("killed", "type error", "timeout", *SURVIVED)) - v["equivalent"] - v["text"]
    return (c["killed"] + c["type error"] + c["timeout"] + v["killed"]) / judged if judged else 0.0


def table(walls: dict[str, float]) -> str:
    head = f"{'room':8} {'mutants':>7} " + " ".join(f"{k:>11}" for k in COLUMNS) + f" {'score':>6} {'wall':>8}"
    lines, judged = [head], [f"{'room':8} {'survivors':>9} " + " ".join(f"{k:>10}" for k in JUDGED) + "  score*"]
    for room in ROOMS:
        c, v = counts(room), Counter(verdict for _, verdict in judged_survivors(room))
        wall = f"{walls[room] / 60:.1f} min" if room in walls else "-"
        cells = " ".join(f"{c[k]:>11}" for k in COLUMNS)
        lines.append(f"{room:8} {c.total():>7} {cells} {score(c):>6.1%} {wall:>8}")
        cells = " ".join(f"{v[k]:>10}" for k in JUDGED)
        judged.append(f"{room:8} {v.total():>9} {cells} {score(c, v):>7.1%}")
    lines += ["", "survivors judged by hand (docs/survivors/ROOM.txt; score*: of the mutants not equivalent)", *judged]
    return "\n".join(lines)


@contextmanager
def server_pool(n: int) -> Iterator[dict]:
    """n local S3 (moto) and n GCS servers for the whole run; the env that hands them to the tests' fixtures
    (tests/server_pool.py), which otherwise start a server of each for every mutant whose tests reach a store."""
    sys.path.insert(0, str(REPO / "tests"))
    import gcs_server
    import s3_server
    from server_pool import POOL_ENV

    folder, procs = Path(tempfile.mkdtemp(prefix="meshgen-mutants-")), []
    try:
        for i in range(n):
            for kind, server_module in (("s3", s3_server), ("gcs", gcs_server)):
                server, url = server_module.start(folder / f"{kind}-{i}.log")
                procs.append(server)
                (folder / f"{kind}-{i}.url").write_text(url)
        yield {POOL_ENV: str(folder)}
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def room_ty(room: str) -> Iterator[Path]:
    """A folder holding `ty`, for pyproject's type_check_command: this venv's ty over the room's folder only.
    mutmut maps each error to its mutant by parsing the whole file that holds it (libcst: ~0.4 ms a line, and the
    mutated tree is ~640,000 lines: ~5 minutes a run); the room's own files are all it needs."""
    folder = Path(tempfile.mkdtemp(prefix="meshgen-ty-"))
    try:
        (folder / "ty").write_text(f'#!/bin/sh\nexec "{Path(sys.executable).parent / "ty"}" "$@" {ROOMS[room]}\n')
        (folder / "ty").chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def unkilled(room: str) -> list[str]:
    """The room's mutants that the last run did not kill (a timeout is killed)."""
    return [n for n, v in verdicts(room).items() if v in ("survived", "no tests", "suspicious", "not checked")]


def run(room: str, max_children: int, names: list[str] | None = None) -> float:
    """One room's mutants (or only `names` of them), by mutmut in this checkout; its wall time in seconds. Raises
    SystemExit where mutmut fails (its stats or clean run: a selected test fails without any mutant)."""
    mutmut = Path(sys.executable).parent / "mutmut"  # `python -m mutmut` re-executes its main module
    start = time.monotonic()
    # One thread per torch op: mutants are forked from the process that ran the stats (and torch), and a child
    # forked from a process with an OpenMP pool segfaults in its first parallel op (217 of jobs' 659 mutants did).
    # mutmut's fork server (process_isolation) avoids it too, but took ~8 s of wall time a mutant here, not ~0.6 s.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [str(mutmut), "run", "--max-children", str(max_children), *(names or [room_glob(room)])]
    with server_pool(max_children + 1) as servers, room_ty(room) as bin_dir:  # a server for each test run at once
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        code = subprocess.run(cmd, cwd=REPO, env={**env, **servers}).returncode
    if code:
        sys.exit(f"error: mutmut failed on room {room} (above); fix the failing test, then run again")
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("room", nargs="?", default="all", help=f"one of {', '.join(ROOMS)}, or all (the default)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--counts", action="store_true", help="only print the counts of the last runs")
    parser.add_argument("--survivors", action="store_true", help="only list the room's surviving mutants")
    parser.add_argument("--again", action="store_true", help="run only the mutants the last run did not kill")
    parser.add_argument("--kinds", action="store_true", help="only say what the unkilled mutants change, by kind")
    parser.add_argument("--sample", type=int, metavar="N", help="only show N behaviour survivors, drawn at random")
    parser.add_argument("--seed", type=int, default=1, help="the draw of --sample (default 1)")
    parser.add_argument("--fresh-stats", action="store_true", help="record again which tests call each function")
    parser.add_argument("--unjudged", action="store_true", help="only show the survivors no one has judged yet")
    args = parser.parse_args(argv)
    # A SIGTERM (kill, a scheduler's stop) ends the run through server_pool's cleanup, not around it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    room = args.room or "all"
    if room != "all" and room not in ROOMS:
        print(f"error: no room {room!r}: ROOM must be one of {', '.join(ROOMS)} or all", file=sys.stderr)
        return 2
    rooms = list(ROOMS) if room == "all" else [room]
    if args.kinds:
        print(kinds_table(rooms))
        return 0
    if args.sample is not None:
        if args.sample < 1:
            print(f"error: --sample {args.sample}: draw at least 1 mutant", file=sys.stderr)
            return 2
        print("\n\n".join(sample(r, args.sample, args.seed) for r in rooms))
        return 0
    if args.unjudged:
        for r in rooms:
            print("\n\n".join(s.block() for s, v in judged_survivors(r) if v == "unjudged"))
        return 0
    if args.survivors:  # `mutmut show NAME` shows one
        print("\n".join(n for r in rooms for n, v in verdicts(r).items() if v in ("survived", "suspicious")))
        return 0
    walls: dict[str, float] = {}
    if args.fresh_stats:  # mutmut runs only new tests for its stats: a function added since has old tests unseen
        (REPO / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    if not args.counts:
        for r in rooms:
            names = unkilled(r) if args.again else None
            if names == []:
                print(f"room {r}: the last run killed every mutant", flush=True)
                continue
            walls[r] = run(r, args.max_children, names)
            # mutmut makes a changed function's mutants anew as the run starts: names the list above could not hold
            fresh = [n for n, v in verdicts(r).items() if v == "not checked"] if args.again else []
            if fresh:
                walls[r] += run(r, args.max_children, fresh)
            print(f"room {r}: {walls[r] / 60:.1f} min", flush=True)
    print(table(walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
