"""Checks that need no weights, run once in the launcher before any worker starts (exit 2 on failure).

They read configs, not weights: the model's config.json files, the prompt source, the output folder. A typo
then costs seconds, not a model load on every chip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")
MODES = ("eager", "defer_and_fuse", "compile")


def preflight(cfg) -> None:
    check_settings(cfg)
    check_mesh(cfg)
    check_model(cfg)
    check_output(cfg)


def check_settings(cfg) -> None:
    g, r = cfg.generate, cfg.run
    for key, value in (
        ("generate.num_inference_steps", g.num_inference_steps),
        ("generate.batch_size", g.batch_size),
        ("run.shard_size", r.shard_size),
        ("generate.max_sequence_length", g.max_sequence_length),
        ("generate.height", g.height),
        ("generate.width", g.width),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if g.guidance_scale < 0:
        raise ConfigError(f"generate.guidance_scale={g.guidance_scale} is negative; use 0 or more")
    choices = {
        "model.dtype": (cfg.model.dtype, DTYPES),
        "execution.mode": (cfg.execution.mode, MODES),
        "execution.offload": (cfg.execution.offload, ("none", "model")),
        "device": (cfg.device, ("auto", "tpu", "cuda", "cpu")),
        "run.on_error": (r.on_error, ("continue", "abort")),
        "run.stale": (r.stale, ("error", "regenerate", "keep")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def check_mesh(cfg) -> None:
    dp, tp, nodes = cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.nodes
    if dp < 1 or tp < 1 or nodes < 1:
        raise ConfigError(f"mesh.dp={dp}, mesh.tp={tp} and mesh.nodes={nodes} must all be at least 1")
    if (dp * tp) % nodes:
        raise ConfigError(f"mesh.dp * mesh.tp = {dp * tp} processes do not split evenly over mesh.nodes={nodes}")
    if tp > 1 and cfg.execution.offload != "none":
        raise ConfigError(
            f"execution.offload={cfg.execution.offload} cannot combine with mesh.tp={tp}: offload "
            "moves whole models between host and chip; use mesh.tp=1 or execution.offload=none"
        )
    from launcher.dist import resolve_device

    device = resolve_device(cfg.device)
    chips = local_chip_count(device)
    per_host = dp * tp // nodes
    if chips is not None and per_host > chips:
        raise ConfigError(
            f"mesh.dp * mesh.tp = {per_host} processes per host but this host has {chips} "
            f"{device} chips; lower mesh.dp or mesh.tp"
        )


def local_chip_count(device: str) -> int | None:
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    if device == "tpu":
        import torch

        return torch.tpu.device_count()
    return None  # cpu: any number of processes


def _model_dir(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if path.startswith((".", "/", "~")) or os.sep in path and not _looks_like_hub_id(path):
        raise ConfigError(f"model.path {path} does not exist; point it at a diffusers pipeline folder or a hub id")
    from huggingface_hub import snapshot_download

    try:  # local cache only: a preflight must never wait on the network
        return Path(snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.txt"]))
    except Exception:
        raise ConfigError(
            f"model.path {path} is neither a local folder nor in the Hugging Face cache; download "
            f"it first (hf download {path}) or set model.path to a local folder"
        ) from None


def _looks_like_hub_id(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith(("/", "."))


def check_model(cfg) -> None:
    if cfg.model.build and not Path(cfg.model.path).exists():
        return  # built on first use (the tiny test model); its config is known to be sound
    root = _model_dir(cfg.model.path)
    if not (root / "model_index.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path} is not a diffusers pipeline (no model_index.json)")
    tp = cfg.mesh.tp
    if tp > 1:
        _check_heads(
            root / "transformer" / "config.json",
            tp,
            "transformer",
            ("num_attention_heads",),
            cfg.model.shard_transformer,
        )
        _check_heads(
            root / "text_encoder" / "config.json",
            tp,
            "text encoder",
            ("num_attention_heads", "num_key_value_heads"),
            cfg.model.shard_text_encoder,
        )
    vae = _read(root / "vae" / "config.json")
    tr = _read(root / "transformer" / "config.json")
    if vae and "block_out_channels" in vae:
        # Latents are patchified 2x2, by the transformer (SD3: patch_size 2) or by the pipeline (FLUX: packing).
        multiple = 2 ** (len(vae["block_out_channels"]) - 1) * max(int(tr.get("patch_size") or 1), 2)
        for key in ("height", "width"):
            v = cfg.generate[key]
            if v % multiple:
                raise ConfigError(
                    f"generate.{key}={v} is not a multiple of {multiple} (VAE scale factor x "
                    f"patch size for this model); use e.g. {max(multiple, v // multiple * multiple)}"
                )


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_heads(path: Path, tp: int, what: str, keys: tuple[str, ...], sharded: bool) -> None:
    config = _read(path)
    config = config.get("text_config", config)
    for key in keys:
        n = config.get(key)
        if sharded and n and n % tp:
            raise ConfigError(f"mesh.tp={tp} does not divide the {what}'s {key}={n}; use a tp that divides {n}")


def check_output(cfg) -> None:
    out = Path(cfg.output.dir)
    if str(cfg.output.dir).startswith(("gs://", "s3://")):
        raise ConfigError(f"output.dir={cfg.output.dir}: object storage is not supported yet; use a local path")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} is a file; choose a folder")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"output.dir {out} cannot be written ({probe} is not writable); choose another folder")
