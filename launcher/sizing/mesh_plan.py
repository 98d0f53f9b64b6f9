"""The mesh: `mesh.tp=auto` and `mesh.dp=auto` resolved once, in the launcher, and whether the weights fit.

Per-rank weights come from the model's configs (launcher/sizing/memory.py), the chip's memory from a table or
`mesh.chip_memory_gib`. A rank needs its weights plus a working margin: a tenth of the chip (runtime, compiled
programs, allocator fragmentation) and 2 GiB per megapixel of a batch (latents, attention, the VAE decode of a
1024x1024 image). Which weights are on the chip together: all of them; with `execution.offload=model` one model
at a time; with `execution.staged` the text encoder and the transformer take turns (the VAE stays).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from launcher.errors import ConfigError
from launcher.sizing import memory
from launcher.sizing.work_bounds import check_work

logger = logging.getLogger(__name__)

CHIP_MEMORY_GIB = {"v5e": 16, "v5p": 95, "v6e": 32, "v7x": 192, "h100": 80, "h200": 141}
RESERVE = 0.10
ACTIVATION_GIB_PER_MEGAPIXEL = 2.0
PARTS = ("transformer", "text_encoder", "vae")
_TPU_TYPES = {"v5litepod": "v5e", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "v7x", "v7x": "v7x"}


@dataclass
class Chip:
    name: str
    memory_gib: float | None  # None: unknown (no check, and auto cannot choose)
    per_host: int | None


@dataclass
class MeshPlan:
    dp: int
    tp: int
    chip: Chip
    per_rank: dict[str, int] | None  # bytes per part on one rank; None where the configs are not known
    why: list[str] = field(default_factory=list)

    def line(self) -> str:
        mem = "?" if self.chip.memory_gib is None else f"{self.chip.memory_gib:g}"
        if self.per_rank is None:
            ranks = "unknown: the model's configs are neither local nor in the table of published checkpoints"
        else:
            ranks = ", ".join(f"{p} {gib(self.per_rank[p])} GiB" for p in PARTS)
        return f"# mesh: dp={self.dp} tp={self.tp} ({self.chip.name}, {mem} GiB per chip; per rank: {ranks})"


def gib(n: int) -> str:
    """Tenths of a GiB; "<0.1" for the tiny models' parts, so that none reads 0.0 nor 9e-05."""
    x = n / memory.GIB
    return f"{x:.1f}" if x >= 0.1 or x == 0 else "<0.1"


def plan_mesh(cfg, device: str, comps: dict | None, strict: bool = True) -> MeshPlan:
    """Resolve `auto` in cfg.mesh (written back as numbers), and refuse a mesh whose weights do not fit.

    `comps`: the model's components as (library, class, config), None where not known yet."""
    dp, tp = cfg.mesh.dp, cfg.mesh.tp  # numbers or "auto" (load_config checked)
    low = [f"mesh.{k}={v}" for k, v in (("dp", dp), ("tp", tp), ("nodes", cfg.mesh.nodes)) if v != "auto" and v < 1]
    if low:  # as check_mesh says it, which runs later, on numbers
        raise ConfigError(f"{' and '.join(low)} must be at least 1 (processes = mesh.dp * mesh.tp)")
    chip = detect_chip(cfg, device)
    comps = {k: v for k, v in comps.items() if memory.bucket(k)} if comps else None
    if comps is not None and not _countable(comps):
        comps = None
    why = []
    if tp == "auto":
        tp, reason = _auto_tp(cfg, device, chip, comps)
        why.append(f"tp=auto chose {tp}: {reason}")
    if dp == "auto":
        if not chip.per_host:
            raise ConfigError("mesh.dp=auto needs the number of chips per host; set mesh.chips_per_host")
        dp = max(1, chip.per_host * cfg.mesh.nodes // tp)
        hosts = f" x {cfg.mesh.nodes} hosts" if cfg.mesh.nodes > 1 else ""
        why.append(f"dp=auto chose {dp}: {chip.per_host} chips per host{hosts} / tp {tp}")
    cfg.mesh.dp, cfg.mesh.tp = dp, tp
    check_work(cfg, max(1, dp * tp // cfg.mesh.nodes))  # a shard's files and a call's images (work_bounds.py)
    per_rank = None if comps is None else rank_bytes(cfg, comps, tp)
    plan = MeshPlan(dp, tp, chip, per_rank, why)
    if per_rank is not None and chip.memory_gib is not None:
        need, have = need_gib(cfg, per_rank), usable_gib(chip, dp * tp // cfg.mesh.nodes)
        if need > have:
            better = _smallest_fitting_tp(cfg, device, chip, comps)  # ty: ignore[invalid-argument-type]
            hint = f"use mesh.tp={better} or mesh.tp=auto" if better and better != tp else _no_fit_hint(cfg)
            misfit = (
                f"mesh dp={dp} tp={tp} does not fit: {_need_text(cfg, per_rank)} > {have:.1f} GiB "
                f"usable per {chip.name} chip ({_usable_text(chip)}); {hint}"
            )
            if strict:
                raise ConfigError(misfit)
            plan.why.append(f"would be refused: {misfit}")
    return plan


def _countable(comps: dict) -> bool:
    """A folder whose classes this diffusers/transformers cannot build gets no memory check, not a crash."""
    try:
        for name, comp in comps.items():
            if memory.bucket(name):
                memory.counts(comp)
    except Exception as e:  # noqa: BLE001 - whatever the library raises for a config it cannot instantiate
        logger.warning("cannot count the weights of %s (%s); no memory check", comp[1], str(e).splitlines()[:1])
        return False
    return True


def rank_bytes(cfg, comps: dict, tp: int) -> dict[str, int]:
    """Bytes of each part's weights on one rank, sharded as the workers shard them (pipeline.py)."""
    out = dict.fromkeys(PARTS, 0)
    for name, comp in comps.items():
        part = memory.bucket(name)
        if part is None:
            continue
        shard = (name == "transformer" and cfg.model.shard_transformer) or (
            name == "text_encoder" and cfg.model.shard_text_encoder
        )
        out[part] += memory.counts(comp).rank_bytes(tp, cfg.model.dtype, shard)
    return out


def need_gib(cfg, per_rank: dict[str, int]) -> float:
    return (_on_chip(cfg, per_rank) + lora_bytes(cfg) + memory.quality_bytes(cfg)) / memory.GIB + _activation_gib(cfg)


def lora_bytes(cfg) -> int:
    """What `model.loras` add per rank: their own files' bytes, which each rank reads whole while fusing; the fused
    deltas land in weights counted already (launcher/worker/lora_fuse.py cuts each to the rank's slice)."""
    from launcher.errors import ConfigError
    from launcher.loras import lora_file, lora_refs

    total = 0
    for ref in lora_refs(cfg):
        try:
            total += lora_file(ref).stat().st_size
        except (ConfigError, OSError):
            pass  # not on this host yet (a hub id before its download): preflight says so once it should be
    return total


def usable_gib(chip: Chip, procs_per_host: int) -> float:
    total = chip.memory_gib * (1 - RESERVE)
    # On cpu all processes share the host's RAM. Fewer processes than hosts (dp * tp < mesh.nodes: 0 a host) are
    # refused by check_mesh, after the plan: taken as one here, not a ZeroDivisionError first.
    return total / max(1, procs_per_host) if chip.name == "cpu" else total


def _on_chip(cfg, per_rank: dict[str, int]) -> int:
    t, te, vae = (per_rank[p] for p in PARTS)
    if cfg.execution.offload == "model":
        return max(t, te, vae)
    if cfg.execution.get("staged", False):
        return max(t, te) + vae
    return t + te + vae


def _activation_gib(cfg) -> float:
    g = cfg.generate
    # A call denoises batch_size x images_per_prompt images at once.
    per_call = g.batch_size * g.get("images_per_prompt", 1)
    return ACTIVATION_GIB_PER_MEGAPIXEL * per_call * g.height * g.width / 2**20


def _need_text(cfg, per_rank: dict[str, int]) -> str:
    how = {"model": "one at a time (offload)"}.get(cfg.execution.offload) or (
        "text encoder and transformer in turn (staged)" if cfg.execution.get("staged", False) else "together"
    )
    parts = ", ".join(f"{p} {per_rank[p] / memory.GIB:.1f}" for p in PARTS)
    act = _activation_gib(cfg)
    return f"per-rank weights ({parts} GiB, on the chip {how}) + {act:.1f} GiB working margin = " + (
        f"{need_gib(cfg, per_rank):.1f} GiB"
    )


def _usable_text(chip: Chip) -> str:
    return f"{chip.memory_gib:g} GiB less {RESERVE:.0%} reserved"


def _no_fit_hint(cfg) -> str:
    if cfg.execution.offload == "none":
        return "use more chips (mesh.tp), execution.offload=model, a smaller generate.batch_size or size"
    return "use a chip with more memory or a smaller generate.batch_size or size"


def _tp_limit(cfg, chip: Chip) -> int:
    return (chip.per_host or 8) * cfg.mesh.nodes


def _divides_heads(cfg, comps: dict, tp: int) -> bool:
    for name, keys, sharded in (
        ("transformer", ("num_attention_heads",), cfg.model.shard_transformer),
        ("text_encoder", ("num_attention_heads", "num_key_value_heads"), cfg.model.shard_text_encoder),
    ):
        if not sharded or name not in comps:
            continue
        config = comps[name][2]
        config = config.get("text_config", config)
        if any(config.get(k) and config[k] % tp for k in keys):
            return False
    return True


def _candidates(cfg, chip: Chip, comps: dict) -> list[int]:
    if cfg.execution.offload != "none":
        return [1]  # offload moves whole models; it cannot combine with tp > 1 (check_mesh)
    return [t for t in range(1, _tp_limit(cfg, chip) + 1) if _divides_heads(cfg, comps, t)]


def _fits(cfg, chip: Chip, comps: dict, tp: int) -> bool:
    # Processes per host only matter on cpu, where they share the RAM; dp=auto fills the host.
    procs = chip.per_host if cfg.mesh.dp == "auto" else cfg.mesh.dp * tp // cfg.mesh.nodes
    return need_gib(cfg, rank_bytes(cfg, comps, tp)) <= usable_gib(chip, max(1, procs or 1))


def _smallest_fitting_tp(cfg, device: str, chip: Chip, comps: dict) -> int | None:
    return next((t for t in _candidates(cfg, chip, comps) if _fits(cfg, chip, comps, t)), None)


def _auto_tp(cfg, device: str, chip: Chip, comps: dict | None) -> tuple[int, str]:
    if comps is None or chip.memory_gib is None:
        what = "the model's configs" if comps is None else "the chip's memory (set mesh.chip or mesh.chip_memory_gib)"
        raise ConfigError(f"mesh.tp=auto needs {what}; or set mesh.tp to a number")
    tp = _smallest_fitting_tp(cfg, device, chip, comps)
    if tp is None:
        top = max(_candidates(cfg, chip, comps))
        raise ConfigError(
            f"mesh.tp=auto: no tp up to {top} fits a {chip.name} chip: at tp={top}, "
            f"{_need_text(cfg, rank_bytes(cfg, comps, top))} > {usable_gib(chip, 1):.1f} GiB usable; "
            + _no_fit_hint(cfg)
        )
    below = [t for t in _candidates(cfg, chip, comps) if t < tp]
    smaller = f"; tp={below[-1]} would need {need_gib(cfg, rank_bytes(cfg, comps, below[-1])):.1f} GiB" if below else ""
    return tp, (
        f"the smallest tp that divides the sharded heads and fits: {need_gib(cfg, rank_bytes(cfg, comps, tp)):.1f} "
        f"GiB per rank of {usable_gib(chip, 1):.1f} GiB usable{smaller}"
    )


# Which device each named chip belongs to (a name not here is not checked against the device).
CHIP_DEVICE = {"v5e": "tpu", "v5p": "tpu", "v6e": "tpu", "v7x": "tpu", "h100": "cuda", "h200": "cuda", "cpu": "cpu"}


def check_chip(cfg, device: str) -> None:
    """A named mesh.chip must be a chip of the device the workers run on (explicit, or what device=auto found)."""
    name = str(cfg.mesh.chip).lower()
    kind = CHIP_DEVICE.get(name)
    if kind is None or kind == device:
        return
    found = f"device=auto found {device} on this host" if cfg.device == "auto" else f"device={device}"
    raise ConfigError(
        f"mesh.chip={name} is a {kind} chip but {found}; set device={kind} (a dry run then shows the {kind} "
        f"launch), or mesh.chip=auto to plan for this host's {device}"
    )


def detect_chip(cfg, device: str) -> Chip:
    """mesh.chip (or what this host has), its memory (table, mesh.chip_memory_gib) and the chips per host."""
    name = str(cfg.mesh.chip).lower()
    detected = None
    if name == "auto":
        name, detected = _detect(device)
    memory_gib = cfg.mesh.chip_memory_gib or CHIP_MEMORY_GIB.get(name) or detected
    if memory_gib is None and cfg.mesh.chip != "auto":
        raise ConfigError(
            f"mesh.chip={cfg.mesh.chip} has no known memory (known: {', '.join(CHIP_MEMORY_GIB)}); "
            "set mesh.chip_memory_gib"
        )
    per_host = cfg.mesh.chips_per_host
    if per_host is None:
        per_host = local_chip_count(device) if device != "cpu" else 1
    return Chip(name, float(memory_gib) if memory_gib else None, per_host or None)


DETECT_TIMEOUT_S = 10.0  # a hung driver must not hang the launch: the chip is then unknown


def _detect(device: str) -> tuple[str, float | None]:
    if device == "tpu":  # TPU VMs name their slice, e.g. v6e-8, v5litepod-4, tpu7x-8
        kind = os.environ.get("TPU_ACCELERATOR_TYPE", "").split("-")[0].lower()
        return _TPU_TYPES.get(kind, kind or "tpu"), None
    if device == "cuda" and shutil.which("nvidia-smi"):  # not torch.cuda: no CUDA context in the launcher
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=DETECT_TIMEOUT_S,
                check=True,
            ).stdout.splitlines()[0]
            gpu, mib = (s.strip() for s in out.rsplit(",", 1))
            return next((k for k in CHIP_MEMORY_GIB if k in gpu.lower()), gpu), float(mib) / 1024
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return "cuda", None
    if device == "cpu":
        return "cpu", round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / memory.GIB, 1)
    return device, None


def local_chip_count(device: str) -> int | None:
    """Chips this host offers to `device` workers; None where any number of processes may run (cpu) or unknown."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()  # NVML: counts without creating a CUDA context in the launcher
    if device == "tpu":
        from launcher.worker.dist import tpu_chip_count

        return tpu_chip_count() or None
    return None
