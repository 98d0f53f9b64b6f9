"""Where a pipeline's files are on this host and whether they are all there: a folder, or a hub id's snapshot in
the Hugging Face cache. No network, no weights read (file names and config.json files only).

Both the download (launcher/checks/download.py) and the model checks (model_checks.py) ask this module; neither
asks the other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from launcher.errors import ConfigError
from launcher.weights import WEIGHT_SUFFIXES  # one list for these checks and the fingerprint

# How transformers and diffusers name the shards of a sharded checkpoint ("model-00002-of-00005.safetensors"): they
# load them only through the index that names them, so such a file never stands alone.
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.")


def looks_like_hub_id(path: str) -> bool:
    # "org/name" or "name": a relative path with more parts, or one that starts like a path, is a path.
    return path.count("/") <= 1 and not path.startswith(("/", ".", "~")) and not path.endswith("/")


def cached_root(path: str) -> Path | None:
    """The pipeline's folder without the network: `path` itself, or its cached snapshot; None if neither."""
    p = Path(path)
    if p.is_dir():
        return p
    if not looks_like_hub_id(path):
        return None
    from huggingface_hub import try_to_load_from_cache

    # The snapshot folder that refs/main points to. Not snapshot_download(local_files_only=True): in
    # huggingface_hub 2.4 that checks the snapshot against the repo's whole file list and calls a pipeline
    # that diffusers downloaded (which skips e.g. text_encoder/generation_config.json) incomplete.
    index = try_to_load_from_cache(path, "model_index.json")
    return Path(index).parent if isinstance(index, str) else None


def read_json(path: Path) -> dict:
    """A config file's contents ({} if missing); a broken one is one line."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); download the pipeline again or fix that file") from None


def check_components(path: str, root: Path) -> None:
    """Every component in model_index.json has its folder, and every model among them its weight files.

    File names only, no weights read: a half-finished download otherwise fails after minutes of loading.
    """
    for name, spec in read_json(root / "model_index.json").items():
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
        # or if there is a weight file no index refers to and that is no shard.
        maps = [set(read_json(i).get("weight_map", {}).values()) for i in folder.glob("*.index*.json")]
        maps = [m for m in maps if m]  # an index that names no shard (damaged, or not one) vouches for nothing
        missing = [sorted(s for s in m if not (folder / s).exists()) for m in maps]
        weights = [f.name for f in folder.iterdir() if f.name.endswith(WEIGHT_SUFFIXES) and f.exists()]
        unmapped = [f for f in weights if not any(f in m for m in maps)]
        standalone = [f for f in unmapped if not _SHARD.search(f)]
        if not standalone and all(missing):
            what = "weight files"
            if missing:
                what = f"weight files {missing[0][:3]}"
            elif unmapped:  # shards no index names: a damaged or missing index
                what = f"an index naming its weight shards {sorted(unmapped)[:3]}"
            raise ConfigError(
                f"model.path {path} is an incomplete pipeline: {name}/ lacks {what}; download the whole pipeline again"
            )


def complete_in_cache(path: str) -> bool:
    root = cached_root(path)
    if root is None:
        return False
    try:
        check_components(path, root)  # every component's folder and weight files are there
    except ConfigError:
        return False
    return True
