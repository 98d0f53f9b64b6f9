"""What a model family cannot do, refused at preflight (exit 2) instead of crashing on every rank later.

The family module (launcher/models/) says what it supports; these checks hold a job's mesh and execution
settings against it. A missing tiny model is built only at its own default location: a typo in model.path must
not silently build and run a random model somewhere else.
"""

from __future__ import annotations

from pathlib import Path

from launcher.errors import ConfigError
from launcher.models import Family, builders, default_dir, families


def tiny_family(cfg) -> Family:
    """The family that builds the missing `model.path`, or ConfigError where it must not be built."""
    fam = builders().get(cfg.model.build)
    if fam is None:
        known = ", ".join(sorted(builders()))
        raise ConfigError(f"model.build={cfg.model.build!r} is unknown; builders: {known} (or null)")
    default = default_dir(cfg.model.build)
    if Path(cfg.model.path).resolve() != default.resolve():
        raise ConfigError(
            f"model.path {cfg.model.path} does not exist; a tiny model is built on first use only at its own "
            f"location {default}; fix the path, or build one there: python tools/make_tiny_model.py "
            f"{cfg.model.path} --family {fam.name}"
        )
    return fam


def check_family(cfg, fam: Family, what: str) -> None:
    """`what` names the model in messages (its pipeline class)."""
    ex, tp = cfg.execution, cfg.mesh.tp
    if cfg.job == "edit" and not fam.max_references:
        editors = ", ".join(f.name for f in families() if f.max_references)
        raise ConfigError(
            f"job=edit: {what} does not take reference images (family {fam.name}); use a model that edits "
            f"(families: {editors}) or job=text_to_image"
        )
    if ex.mode == "compile" and ex.offload == "model" and not fam.repeated_blocks:
        raise ConfigError(
            f"execution.mode=compile with execution.offload=model compiles the transformer's repeated blocks, "
            f"which {what} does not define; use execution.offload=none (whole-transformer compile) or "
            "execution.mode=eager"
        )
    if tp == 1:
        return
    if cfg.model.shard_transformer and not fam.tp_transformer:
        raise ConfigError(
            f"mesh.tp={tp}: {what} has no tensor-parallel plan for its transformer; use mesh.tp=1 "
            "(and mesh.dp for more chips), or model.shard_transformer=false"
        )
    sharded = (cfg.model.shard_transformer and fam.tp_transformer) or (
        cfg.model.shard_text_encoder and fam.tp_text_encoder
    )
    if not sharded:
        encoder = "is false" if fam.tp_text_encoder else f"cannot be: {what} has no tensor-parallel plan for it"
        raise ConfigError(
            f"mesh.tp={tp} shards nothing: model.shard_transformer is false and model.shard_text_encoder {encoder}; "
            "use mesh.tp=1 and mesh.dp for more chips"
        )


def check_cache(cfg, family: Family) -> None:
    """execution.staged and execution.cache: declared by the model's family, and the cache's options accepted by
    diffusers' config class."""
    if cfg.execution.staged and family.encode is None:
        raise ConfigError(
            f"execution.staged=true is not supported for this model (family {family.name} declares no separate "
            "prompt encoding); use execution.staged=false"
        )
    name = cfg.execution.cache
    if name == "none":
        return
    if name not in family.caches:
        raise ConfigError(
            f"execution.cache={name} is not supported for this model (family {family.name}; supported: "
            f"{', '.join(family.caches) or 'none'}); use execution.cache=none or one of those"
        )
    from omegaconf import OmegaConf

    from launcher.worker.cache import CONFIG_CLASSES, cache_config

    options = OmegaConf.to_container(cfg.execution.cache_options)
    try:
        cache_config(name, options, cfg.generate.num_inference_steps)  # ty: ignore[invalid-argument-type]
    except (TypeError, ValueError, RuntimeError, IndexError) as e:  # torch's, on mag_ratios it cannot use
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"execution.cache_options={options} are not accepted by diffusers' {CONFIG_CLASSES[name]} ({first}); "
            "fix or remove them"
        ) from None
