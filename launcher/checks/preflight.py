"""The preflight: every check a run makes before any worker starts, as one sequence of named steps.

The real run and `--dry-run` walk the same sequence, so a dry run exits 2 wherever the real run would. Each step
lives in the module that owns its knowledge and reads configs, never weights; only `fetch` (a download or the
tiny model's build) is left out of a dry run. The steps that read the model's configs run before `fetch`, with
what is known without the network (a folder, the Hugging Face cache, the published checkpoints' table; for a
dry run, a tiny model built in a temporary folder), so a refusal costs no download; where nothing was known
(a hub id neither cached nor in the table), they run again once `fetch` has the files.

To add a step: write `def step(pf: Preflight) -> None` that raises ConfigError (one line) and put it in STEPS.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launcher.testing import hold_until

logger = logging.getLogger(__name__)


@dataclass
class Preflight:
    cfg: Any
    dry_run: bool = False
    device: str = ""
    model: Any = None  # model_checks.Model
    mesh: Any = None  # mesh_plan.MeshPlan
    sizes: Any = None  # sources.prompts.SizeRule
    store: Any = None  # ledger.store.Store
    ledger: Any = None  # ledger.states.Ledger
    plan: Any = None  # plan.plan.Plan
    notes: list[str] = field(default_factory=list)  # what a dry run says beyond the mesh line

    @property
    def keeps_books(self) -> bool:
        """On a job over several hosts the first host's launcher keeps the books (output folder, plan, records)."""
        return self.dry_run or self.cfg.mesh.nodes == 1 or os.environ.get("NODE_RANK", "0") == "0"


def settings(pf: Preflight) -> None:
    from launcher.checks.settings import check_settings
    from launcher.config import renamed_keys_notice

    check_settings(pf.cfg)
    if notice := renamed_keys_notice(pf.cfg):
        logger.warning(notice)


def device(pf: Preflight) -> None:
    """The device the workers run on, and the named chip against it."""
    from launcher.sizing.mesh_plan import check_chip
    from launcher.worker.dist import resolve_device

    if pf.cfg.device != "auto":
        check_chip(pf.cfg, pf.cfg.device)  # first: a contradiction is the line, not a missing torch_tpu
    # A dry run of a TPU job may run anywhere (a laptop, CI): it needs no torch_tpu.
    pf.device = "tpu" if pf.dry_run and pf.cfg.device == "tpu" else resolve_device(pf.cfg.device)
    check_chip(pf.cfg, pf.device)


def hosts(pf: Preflight) -> None:
    """A job over several hosts: this host's NODE_RANK and the first host's MASTER_ADDR, set by the scheduler (a dry
    run prints them as shell variables where unset: it may check a job for other hosts)."""
    if pf.cfg.mesh.nodes > 1:
        from launcher.checks.settings import check_host_env

        check_host_env(pf.cfg.mesh.nodes, pf.device)


def store_port(pf: Preflight) -> None:
    """A job over several hosts: the first host serves the rendezvous store on MASTER_PORT, which must be free."""
    if pf.cfg.mesh.nodes > 1:
        from launcher.checks.settings import check_store_port

        check_store_port(int(os.environ.get("NODE_RANK", "0")))


def lora_files(pf: Preflight) -> None:
    """Each LoRA given as a hub id, downloaded once (small files): its content hash is part of the fingerprint."""
    from launcher.loras import ensure_downloaded

    ensure_downloaded(pf.cfg)


def sweep(pf: Preflight) -> None:
    """`generate.sweep` against the model: swept sizes, and keys its family cannot follow."""
    from launcher.checks.sweep_checks import check_sweep_model

    if pf.model.configs is not None:
        check_sweep_model(pf.cfg, pf.model)


def loras(pf: Preflight) -> None:
    """`model.loras` against the model's components on the meta device (once the model's files are here)."""
    from launcher.checks.lora_checks import check_loras

    if pf.model.root is not None:
        check_loras(pf.cfg, pf.model.root)


def weights(pf: Preflight) -> None:
    """The weights by content, a digest per component (each file hashed once, then remembered): part of the
    fingerprint that `output` judges and that the hosts of a job compare."""
    from launcher.weights import model_weights

    if model_weights(str(pf.cfg.model.path)) is None and pf.dry_run:
        pf.notes.append(
            f"# weights: {pf.cfg.model.path} is not on this host yet, so this dry run cannot fingerprint them; the "
            "real run does once they are here, and refuses a folder made with other weights then"
        )


def model(pf: Preflight) -> None:
    from launcher.checks.model_checks import locate

    pf.model = locate(pf.cfg, pf.dry_run)


def mesh(pf: Preflight) -> None:
    """`auto` resolved, the weights against the chip's memory, the processes against this host's chips."""
    from launcher.checks.settings import check_mesh, local_chip_count
    from launcher.sizing.mesh_plan import plan_mesh

    if pf.model.configs is None and pf.cfg.mesh.tp == "auto" and not pf.dry_run:
        return  # tp=auto needs the model's configs: decided once `fetch` has them
    earlier = pf.mesh
    pf.mesh = plan_mesh(pf.cfg, pf.device, pf.model.configs)
    if earlier is not None:  # planned again after `fetch`: what `auto` chose the first time still holds
        pf.mesh.why[:0] = earlier.why
    # A dry run may check a job for another host: this host's chip count only counts where it has that device.
    check_mesh(pf.cfg, pf.device, host=not pf.dry_run or bool(local_chip_count(pf.device)))


def model_fit(pf: Preflight) -> None:
    """The job against its model: family limits, tensor-parallel degree against its heads, sizes."""
    from launcher.checks.model_checks import check_model, size_rule

    check_model(pf.cfg, pf.model)
    pf.sizes = size_rule(pf.cfg, pf.model)


def output(pf: Preflight) -> None:
    """The output folder: writable, meshgen's own (or empty), made with these settings."""
    from launcher.checks.settings import check_output
    from launcher.ledger import runs
    from launcher.ledger.store import Store
    from launcher.sources.reach import check_output_outside_source

    check_output_outside_source(str(pf.cfg.dataset.path), str(pf.cfg.output.dir))  # before anything is written
    check_output(pf.cfg)
    pf.store = Store(pf.cfg.output.dir)
    runs.check_ours(pf.store)
    if not pf.cfg.run.overwrite:
        runs.check_run_json(pf.store, pf.cfg)


def prompts(pf: Preflight) -> None:
    """Every row of the prompt source (ids, sizes, per-row values), the selection, and what is done."""
    from launcher.ledger.states import Ledger
    from launcher.plan.plan import make_plan

    pf.ledger = Ledger(pf.store)
    states = pf.ledger.refresh()
    hold_until(pf.cfg.testing.hold_after_ledger_read)
    pf.plan = make_plan(pf.cfg, states, pf.sizes, pf.store)


def fetch(pf: Preflight) -> None:
    """The model's files on this host; where its configs were not known before, the steps that need them now."""
    from launcher.checks.prepare import fetch_model

    known = pf.model.configs is not None
    fetch_model(pf.cfg)
    if not known:
        for step in STEPS:
            if step.again:
                run_step(pf, step)


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Preflight], None]
    again: bool = False  # runs again after `fetch` where the model's configs were not known before it
    books: bool = False  # the output folder's: only on the host that keeps the books
    real_only: bool = False  # fetches or builds: not in a dry run


STEPS = [
    Step("settings", settings),
    Step("device", device),
    Step("hosts", hosts, real_only=True),
    Step("store port", store_port, real_only=True),
    Step("lora files", lora_files, real_only=True),
    Step("model", model, again=True),
    Step("mesh", mesh, again=True),
    Step("model fit", model_fit, again=True),
    Step("sweep", sweep, again=True),
    Step("loras", loras, again=True),
    Step("weights", weights, again=True),
    Step("output", output, books=True),
    Step("prompts", prompts, again=True, books=True),
    Step("fetch", fetch, real_only=True),
]


def run_step(pf: Preflight, step: Step) -> None:
    if step.books and not pf.keeps_books:
        return
    logger.debug("preflight: %s", step.name)
    step.run(pf)


def preflight(cfg, dry_run: bool = False) -> Preflight:
    """Every step in order; the first refusal raises ConfigError (exit 2)."""
    pf = Preflight(cfg, dry_run)
    for step in STEPS:
        if not (step.real_only and dry_run):
            run_step(pf, step)
    if dry_run and pf.model.configs is None:
        pf.notes.append(
            f"# model: {cfg.model.path} is neither on this host nor in the published checkpoints' table; the real "
            "run downloads it first, then checks the mesh, its heads and sizes against its configs"
        )
    return pf
