"""`model.loras` as files: where each LoRA is on this host, and its content hash for the fingerprint.

Shared by the launcher (download, preflight, fingerprint) and the workers (which read the files the launcher
resolved, from the same places). A hub id is fetched once by the launcher (`ensure_downloaded`); afterwards it
is read from the Hugging Face cache without the network.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraRef:
    index: int
    path: str
    scale: float
    weight_name: str | None


def lora_refs(cfg) -> list[LoraRef]:
    entries = (cfg.get("model") or {}).get("loras") or []  # a partial config (tests, tools) may lack model
    return [LoraRef(i, str(e.path), float(e.scale), e.weight_name) for i, e in enumerate(entries)]


def _is_hub_id(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith(("/", ".", "~")) and not path.endswith((".safetensors", "/"))


def _pick(folder: Path, ref: LoraRef) -> Path:
    if ref.weight_name:
        return folder / ref.weight_name
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError(
            f"model.loras[{ref.index}].path {ref.path} holds {len(files)} .safetensors files; name one with "
            f"model.loras[{ref.index}].weight_name"
        )
    return files[0]


def lora_file(ref: LoraRef) -> Path:
    """The LoRA's .safetensors file on this host (never the network); ConfigError when it is not there."""
    p = Path(ref.path).expanduser()
    if p.is_dir():
        f = _pick(p, ref)
    elif p.is_file() or not _is_hub_id(ref.path):
        f = p
    else:
        f = _cached(ref)
        if f is None:
            raise ConfigError(
                f"model.loras[{ref.index}].path {ref.path} is neither a local file or folder nor in the Hugging Face "
                f"cache; download it first (hf download {ref.path}) or point it at a local .safetensors file"
            )
    if f.is_file() and f.suffix != ".safetensors":  # a pickle (.bin, .pt) could run code when loaded
        raise ConfigError(
            f"model.loras[{ref.index}]: {f} is not a .safetensors file; convert it (safetensors.torch.save_file)"
        )
    if not f.is_file():
        raise ConfigError(
            f"model.loras[{ref.index}]: {f} does not exist; point model.loras[{ref.index}].path at a LoRA "
            ".safetensors file, a folder holding one, or a hub id"
        )
    return f


def _cached(ref: LoraRef) -> Path | None:
    """The file in the Hugging Face cache's snapshot that refs/main names (the cache's documented layout). Not
    snapshot_download(local_files_only=True): huggingface_hub 2.4 checks it against the repo's whole file list,
    and we fetch only the LoRA's .safetensors files."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    repo = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.path, repo_type="model")
    try:
        folder = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    f = _pick(folder, ref)  # several files and no weight_name: that one line, not "not cached"
    return f if f.is_file() else None


def ensure_downloaded(cfg) -> None:
    """Fetch each LoRA given as a hub id that the cache lacks (its .safetensors files only), once, here."""
    for ref in lora_refs(cfg):
        p = Path(ref.path).expanduser()
        if p.exists() or not _is_hub_id(ref.path) or os.environ.get("HF_HUB_OFFLINE") == "1" or _cached(ref):
            continue
        from huggingface_hub import snapshot_download

        from launcher.checks.download import hub_answers

        patterns = [ref.weight_name] if ref.weight_name else ["*.safetensors"]
        try:
            hub_answers(ref.path, f"model.loras[{ref.index}].path")
            logger.info("fetching LoRA %s", ref.path)
            snapshot_download(ref.path, allow_patterns=patterns)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - one line; the file checks then say what is missing
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"cannot download model.loras[{ref.index}].path {ref.path} ({first}); check the id and the network, "
                "or point it at a local .safetensors file"
            ) from None


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered across runs by path and stamps (launcher/hashes.py, shared with the weights)."""
    from launcher.hashes import file_sha256 as cached_sha256

    return cached_sha256(path)


def fingerprint_entries(cfg) -> list[dict]:
    """What of the LoRAs determines the images: each file's content hash and its scale, in order."""
    return [{"sha256": file_sha256(lora_file(r)), "scale": r.scale} for r in lora_refs(cfg)]
