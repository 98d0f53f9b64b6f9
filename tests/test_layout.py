"""The folder layout is the architecture: imports run one way between the rooms of launcher/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "launcher"
# room -> rooms it must never import (the root's shared modules and launcher/models are open to all)
BOOKS = ("sources", "plan", "ids", "ledger")  # the bookkeeping: rows in, the plan (by row and by id), what is done
# host runs a job; checks/ is its preflight (which applies the worker's rules), sizing/ what the job takes (mesh,
# memory, bytes, time), publish/ its dataset card (which describes the worker's files) and push, which a tool also
# runs without a job; worker/ generates, and hands each batch to writer/, which encodes and writes a shard's files
RUNS = ("host", "checks", "sizing", "publish", "worker", "writer")
FORBIDDEN = {room: RUNS for room in BOOKS} | {
    "models": (*RUNS, *BOOKS),
    "worker": ("host", "checks", "sizing", "publish"),
    "writer": ("host", "checks", "sizing", "publish", "worker"),
}
FORBIDDEN |= {"checks": ("host", "publish"), "sizing": ("host", "checks", "publish"), "publish": ("host", "checks")}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_imports_run_one_way(room):
    bad = [
        f"{p.relative_to(LAUNCHER.parent)} imports {m}"
        for p in sorted((LAUNCHER / room).rglob("*.py"))
        for m in sorted(_imports(p))
        if any(m == f"launcher.{f}" or m.startswith(f"launcher.{f}.") for f in FORBIDDEN[room])
    ]
    assert not bad, bad


def test_every_family_module_declares_its_family():
    from launcher.models import FAMILY_MODULES, families

    # checkpoints.py and speeds.py are data, not families: the published configs and sizes of the real
    # checkpoints, and measured or published seconds per image; _*.py are helpers.
    data = {"checkpoints", "speeds"}
    on_disk = sorted(
        p.stem for p in (LAUNCHER / "models").glob("*.py") if not p.stem.startswith("_") and p.stem not in data
    )
    assert sorted(FAMILY_MODULES) == on_disk
    assert all(f.pipelines for f in families())


def test_jobs_import_nothing_of_the_worker_its_writer_or_the_launcher():
    jobs = LAUNCHER.parent / "jobs"
    bad = [
        f"{p.name} imports {m}"
        for p in sorted(jobs.glob("*.py"))
        for m in sorted(_imports(p))
        if m.startswith(("launcher.worker", "launcher.writer", "launcher.host"))
    ]
    assert not bad, bad
