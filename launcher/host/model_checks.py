"""Checks of the model that read its configs, never its weights: a folder or a cached hub id, its components,
tensor-parallel degree against its heads, and sizes against its VAE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.errors import ConfigError
from launcher.host.family_checks import check_family, tiny_family
from launcher.models import Family, family_of_folder, pipeline_class


def model_dir(path: str) -> Path:
    """The pipeline's folder: `path` itself, or its snapshot in the Hugging Face cache (never the network)."""
    p = Path(path)
    if p.is_dir():
        return p
    if not _looks_like_hub_id(path):
        raise ConfigError(f"model.path {path} does not exist; point it at a diffusers pipeline folder or a hub id")
    from launcher.host.download import cached_root

    root = cached_root(path)  # the local cache only: a preflight must never wait on the network
    if root is None:
        raise ConfigError(
            f"model.path {path} is neither a local folder nor in the Hugging Face cache; download "
            f"it first (hf download {path}) or set model.path to a local folder"
        )
    return root


def _looks_like_hub_id(path: str) -> bool:
    # "org/name" or "name": a relative path with more parts, or one that starts like a path, is a path.
    return path.count("/") <= 1 and not path.startswith(("/", ".", "~")) and not path.endswith("/")


def check_model(cfg) -> None:
    if cfg.model.build and not Path(cfg.model.path).exists():
        fam = tiny_family(cfg)  # built on first use (a tiny test model); its config is known to be sound
        check_family(cfg, fam, f"the tiny {fam.pipelines[0]}")
        check_cache(cfg, fam)
        return
    root = model_dir(cfg.model.path)
    if not (root / "model_index.json").is_file():
        raise ConfigError(
            f"model.path {cfg.model.path} is not a diffusers pipeline (no model_index.json in {root}); "
            "point it at the pipeline's top folder"
        )
    _check_components(cfg.model.path, root)
    check_family(cfg, family_of_folder(root), pipeline_class(root) or "this pipeline")
    check_cache(cfg, family_of_folder(root))
    if not Path(cfg.model.path).is_dir():
        # The whole pipeline is in the cache (just checked), so workers need no network: without this, each
        # rank asks the hub for updates, and hangs until a timeout where the hub cannot be reached.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg.mesh.tp > 1:
        te_keys = ("num_attention_heads", "num_key_value_heads")
        fam = family_of_folder(root)
        for part, keys, sharded in (
            ("transformer", ("num_attention_heads",), cfg.model.shard_transformer and fam.tp_transformer),
            ("text_encoder", te_keys, cfg.model.shard_text_encoder and fam.tp_text_encoder),
        ):
            _check_heads(root / part / "config.json", cfg.mesh.tp, part.replace("_", " "), keys, sharded)
    multiple = size_multiple(root)
    for key in ("height", "width"):
        v = cfg.generate[key]
        if multiple and v % multiple:
            raise ConfigError(
                f"generate.{key}={v} is not a multiple of {multiple} (VAE scale factor x "
                f"patch size for this model); use e.g. {max(multiple, v // multiple * multiple)}"
            )
    rule = size_rule(cfg)
    if cfg.generate.height * cfg.generate.width > rule.max_pixels:
        raise ConfigError(
            f"generate.height x generate.width = {cfg.generate.height}x{cfg.generate.width} is more than the "
            f"{rule.max_pixels / 2**20:.1f} megapixels this model family allows; use a smaller size"
        )


def size_multiple(root: Path) -> int | None:
    """What image sizes must be a multiple of: the VAE's scale factor times the latent patch size."""
    vae = _read(root / "vae" / "config.json")
    tr = _read(root / "transformer" / "config.json")
    if "block_out_channels" in vae:
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
    elif "temperal_downsample" in vae:  # Qwen-Image's video-style VAE (diffusers spells it so)
        scale = 2 ** len(vae["temperal_downsample"])
    else:
        return None
    # Latents are patchified, by the transformer (SD3: patch_size 2) or by the pipeline (FLUX: packing 2x2).
    return scale * max(int(tr.get("patch_size") or 1), family_of_folder(root).latent_patch)


def size_rule(cfg):
    """The checks of per-row sizes (launcher/ledger/prompts.py), from the model's configs."""
    from launcher.ledger.prompts import SizeRule
    from launcher.ledger.sweep import sweep_of

    root = model_dir(cfg.model.path)
    fam = family_of_folder(root)
    # A row that sets one side is checked against the largest value the other side takes (swept or not).
    swept = sweep_of(cfg.generate)
    h, w = (max(swept.get(k, [cfg.generate[k]])) for k in ("height", "width"))
    return SizeRule(size_multiple(root) or 1, fam.max_pixels, h, w)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def _check_components(path: str, root: Path) -> None:
    """Every component in model_index.json has its folder, and every model among them its weight files.

    File names only, no weights read: a half-finished download otherwise fails after minutes of loading.
    """
    for name, spec in _read(root / "model_index.json").items():
        if name.startswith("_") or not (isinstance(spec, list) and len(spec) == 2 and spec[0]):
            continue  # metadata, or an optional component the pipeline leaves out (null)
        folder = root / name
        if not folder.is_dir():
            raise ConfigError(
                f"model.path {path} is an incomplete pipeline: model_index.json lists {name} but {folder} is "
                "missing; download the whole pipeline again"
            )
        if not (folder / "config.json").is_file():
            continue  # a tokenizer or scheduler: configs only
        # Complete if one index has all its shards (a repo may also carry the index of a format not downloaded),
        # or if there is a weight file no index refers to.
        maps = [set(_read(i).get("weight_map", {}).values()) for i in folder.glob("*.index*.json")]
        missing = [sorted(s for s in m if not (folder / s).exists()) for m in maps]
        standalone = [
            f
            for f in folder.iterdir()
            if f.name.endswith(WEIGHT_SUFFIXES) and f.exists() and not any(f.name in m for m in maps)
        ]
        if not standalone and all(missing):
            what = f"weight files {missing[0][:3]}" if missing else "weight files"
            raise ConfigError(
                f"model.path {path} is an incomplete pipeline: {name}/ lacks {what}; download the whole pipeline again"
            )


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); download the pipeline again or fix that file") from None


def _check_heads(path: Path, tp: int, what: str, keys: tuple[str, ...], sharded: bool) -> None:
    config = _read(path)
    config = config.get("text_config", config)
    for key in keys:
        n = config.get(key)
        if sharded and n and n % tp:
            raise ConfigError(f"mesh.tp={tp} does not divide the {what}'s {key}={n}; use a tp that divides {n}")


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
        cache_config(name, options, cfg.generate.num_inference_steps)
    except (TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"execution.cache_options={options} are not accepted by diffusers' {CONFIG_CLASSES[name]} ({first}); "
            "fix or remove them"
        ) from None
