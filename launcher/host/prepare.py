"""Before any worker starts: the mesh resolved and checked against the chips' memory, and the model on this host
(the project's tiny model built at its own location, or a hub id downloaded once).
"""

from __future__ import annotations

from pathlib import Path


def plan_mesh_early(cfg, device: str, strict: bool = True):
    """The mesh plan if the model's configs are known without the network (a folder, the cache, the table)."""
    from launcher.host.download import cached_root
    from launcher.host.mesh_plan import plan_mesh
    from launcher.models.checkpoints import published

    root = cached_root(cfg.model.path)
    return plan_mesh(cfg, device, root, strict) if root is not None or published(cfg.model.path) else None


def plan_mesh_now(cfg, device: str, strict: bool = True):
    from launcher.host.download import cached_root
    from launcher.host.mesh_plan import plan_mesh

    return plan_mesh(cfg, device, cached_root(cfg.model.path), strict)


def worker_overrides(overrides: list[str], cfg, mesh) -> list[str]:
    """Workers compose the same config; where the launcher resolved `auto`, they get its numbers."""
    if not mesh.why:
        return overrides
    kept = [o for o in overrides if not o.lstrip("+").startswith(("mesh.dp=", "mesh.tp="))]
    return [*kept, f"mesh.dp={cfg.mesh.dp}", f"mesh.tp={cfg.mesh.tp}"]


def ensure_model(cfg) -> None:
    """Build the project's own tiny model on first use, or download a hub id not yet cached (once per host); the
    same for each LoRA given as a hub id."""
    from launcher.loras import ensure_downloaded as ensure_loras

    ensure_loras(cfg)
    if cfg.model.build and not Path(cfg.model.path).exists():
        from launcher.host.family_checks import tiny_family

        tiny_family(cfg).build_tiny(cfg.model.path)  # only at the tiny model's own location, else exit 2
        return
    from launcher.host.download import ensure_downloaded

    ensure_downloaded(cfg.model.path)
