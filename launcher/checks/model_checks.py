"""The model, found and checked from its configs, never its weights nor the network: where it is (a folder, the
Hugging Face cache, the table of published checkpoints, or the project's tiny model still to be built), its
family's limits, tensor-parallel degree against its heads, and sizes against its VAE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launcher.checks.family_checks import check_cache, check_family, tiny_family
from launcher.errors import ConfigError
from launcher.models import GENERIC, Family, family_of, pipeline_class
from launcher.models.checkpoints import Component, published, published_pipeline
from launcher.sizing.model_files import cached_root, check_components, looks_like_hub_id, read_json


@dataclass
class Model:
    path: str
    root: Path | None  # its folder on this host; None: not here yet (a hub id to download, a tiny model to build)
    family: Family | None  # None: not known before a download
    what: str  # how messages name it (its pipeline class)
    configs: dict[str, Component] | None  # model components as (library, class, config); None: not known yet


def locate(cfg, dry_run: bool = False) -> Model:
    """Where the model is and what is known of it without the network; ConfigError where no run could find it.

    A dry run learns the configs of a tiny model not yet built from a build in a temporary folder (seconds)."""
    path = cfg.model.path
    if cfg.model.build and not Path(path).exists():
        fam = tiny_family(cfg)  # built on first use, only at its own location
        return Model(path, None, fam, f"the tiny {fam.pipelines[0]}", _tiny_configs(fam) if dry_run else None)
    root = cached_root(path)  # the local cache only: a preflight must never wait on the network
    if root is None:
        if not looks_like_hub_id(path):
            raise ConfigError(f"model.path {path} does not exist; point it at a diffusers pipeline folder or a hub id")
        if os.environ.get("HF_HUB_OFFLINE") == "1":  # the real run could not download it either
            raise ConfigError(
                f"model.path {path} is neither a local folder nor in the Hugging Face cache; download "
                f"it first (hf download {path}) or set model.path to a local folder"
            )
        if not published(path):
            return Model(path, None, None, "this pipeline", None)  # the run downloads it, then checks it
        cls = published_pipeline(path)
        return Model(path, None, family_of(cls), cls, published(path))
    if not (root / "model_index.json").is_file():
        raise ConfigError(
            f"model.path {path} is not a diffusers pipeline (no model_index.json in {root}); "
            "point it at the pipeline's top folder"
        )
    check_components(path, root)
    cls = pipeline_class(root)
    return Model(path, root, family_of(cls), cls or "this pipeline", _configs(root))


def _configs(root: Path) -> dict[str, Component]:
    """The model components of a pipeline folder, from model_index.json and each one's config.json."""
    return {
        name: (spec[0], spec[1], read_json(root / name / "config.json"))
        for name, spec in read_json(root / "model_index.json").items()
        if isinstance(spec, list) and len(spec) == 2 and spec[0] and (root / name / "config.json").is_file()
    }


def _tiny_configs(fam: Family) -> dict[str, Component]:
    import contextlib
    import io
    import logging
    import tempfile

    quiet = contextlib.redirect_stderr(io.StringIO())  # the build's progress bars and log lines: not a dry run's
    with tempfile.TemporaryDirectory(prefix="meshgen-tiny-") as tmp, quiet:
        logging.disable(logging.INFO)
        try:
            return _configs(Path(fam.build_tiny(Path(tmp) / "model")))
        finally:
            logging.disable(logging.NOTSET)


def check_model(cfg, model: Model) -> None:
    """The job against its model: the family's limits, tp against the sharded heads, sizes against the VAE."""
    if model.family is None:
        return  # a hub id to download first: checked once it is here
    check_family(cfg, model.family, model.what)
    check_cache(cfg, model.family)
    if model.configs is None:
        return  # the tiny model still to be built (its configs are known to be sound), or a download to come
    if model.root is not None and not Path(model.path).is_dir():
        # The whole pipeline is in the cache (checked), so workers need no network: without this, each rank asks
        # the hub for updates, and hangs until a timeout where the hub cannot be reached.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg.mesh.tp > 1:
        fam, te_keys = model.family, ("num_attention_heads", "num_key_value_heads")
        for part, keys, sharded in (
            ("transformer", ("num_attention_heads",), cfg.model.shard_transformer and fam.tp_transformer),
            ("text_encoder", te_keys, cfg.model.shard_text_encoder and fam.tp_text_encoder),
        ):
            _check_heads(_config(model, part), cfg.mesh.tp, part.replace("_", " "), keys, sharded)
    multiple = size_multiple(model)
    for key in ("height", "width"):
        v = cfg.generate[key]
        if multiple and v % multiple:
            raise ConfigError(
                f"generate.{key}={v} is not a multiple of {multiple} (VAE scale factor x "
                f"patch size for this model); use e.g. {max(multiple, v // multiple * multiple)}"
            )
    if cfg.generate.height * cfg.generate.width > model.family.max_pixels:
        raise ConfigError(
            f"generate.height x generate.width = {cfg.generate.height}x{cfg.generate.width} is more than the "
            f"{model.family.max_pixels / 2**20:.1f} megapixels this model family allows; use a smaller size"
        )


def _config(model: Model, part: str) -> dict:
    return (model.configs or {}).get(part, (None, None, {}))[2]


def size_multiple(model: Model) -> int | None:
    """What image sizes must be a multiple of: the VAE's scale factor times the latent patch size."""
    vae, tr = _config(model, "vae"), _config(model, "transformer")
    if "block_out_channels" in vae:
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
    elif "temperal_downsample" in vae:  # Qwen-Image's video-style VAE (diffusers spells it so)
        scale = 2 ** len(vae["temperal_downsample"])
    else:
        return None
    # Latents are patchified, by the transformer (SD3: patch_size 2) or by the pipeline (FLUX: packing 2x2).
    return scale * max(int(tr.get("patch_size") or 1), (model.family or GENERIC).latent_patch)


def size_rule(cfg, model: Model):
    """The checks of per-row sizes (launcher/sources/prompts.py), from the model's configs."""
    from launcher.plan.sweep import sweep_of, true_cfg_scales
    from launcher.sources.prompts import SizeRule

    fam = model.family or GENERIC
    # A row that sets one side is checked against the largest value the other side takes (swept or not).
    swept = sweep_of(cfg.generate)
    h, w = (max(swept.get(k, [cfg.generate[k]])) for k in ("height", "width"))
    ignored = tuple(fam.ignored_columns(true_cfg_scales(cfg)).items())  # row columns its pipeline would not see
    return SizeRule(size_multiple(model) or 1, fam.max_pixels, h, w, fam.max_references, ignored)


def _check_heads(config: dict, tp: int, what: str, keys: tuple[str, ...], sharded: bool) -> None:
    config = config.get("text_config", config)
    for key in keys:
        n = config.get(key)
        if sharded and n and n % tp:
            raise ConfigError(f"mesh.tp={tp} does not divide the {what}'s {key}={n}; use a tp that divides {n}")
