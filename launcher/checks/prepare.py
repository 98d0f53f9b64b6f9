"""The model on this host before any worker starts: the project's tiny model built at its own location, or a hub
id downloaded once. And what the workers are told of the launcher's decisions.
"""

from __future__ import annotations

from pathlib import Path


def fetch_model(cfg) -> None:
    """Build the project's own tiny model on first use, or download a hub id not yet cached (once per host)."""
    from launcher.checks.quality_models import fetch_quality_models

    fetch_quality_models(cfg)  # quality.*: their models too, for workers that may be offline
    if cfg.model.build and not Path(cfg.model.path).exists():
        from launcher.checks.family_checks import tiny_family

        tiny_family(cfg).build_tiny(cfg.model.path)  # only at the tiny model's own location, else exit 2
        return
    from launcher.checks.download import ensure_downloaded

    ensure_downloaded(cfg.model.path)


def worker_overrides(overrides: list[str], cfg, mesh) -> list[str]:
    """Workers compose the same config; where the launcher resolved `auto`, they get its numbers."""
    if not mesh.why:
        return overrides
    kept = [o for o in overrides if not o.lstrip("+").startswith(("mesh.dp=", "mesh.tp="))]
    return [*kept, f"mesh.dp={cfg.mesh.dp}", f"mesh.tp={cfg.mesh.tp}"]
