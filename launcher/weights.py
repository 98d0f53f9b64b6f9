"""The model's weights by content, for the fingerprint: one digest per component of the pipeline.

A component's digest is the sha256 over its weight files' names and hashes. A local folder's files are hashed
(launcher/hashes.py remembers each across runs, so a rerun reads none of a 64 GB pipeline again). A hub id's
snapshot in the Hugging Face cache needs no hashing: each file there links to a blob named by its etag (the
cache's documented layout), which for the LFS files that weights are is the sha256 of their bytes; so a folder
and the hub snapshot it was copied from digest alike. Shared by the launcher (preflight, the hosts' agreement)
and the bookkeeping (run.json).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ConfigError
from launcher.hashes import files_sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


@dataclass(frozen=True)
class ModelWeights:
    components: dict[str, str]  # component -> sha256 over its weight files' names and hashes
    revision: str | None  # a hub snapshot's commit; None for a local folder


def model_root(path: str) -> tuple[Path | None, str | None]:
    """The pipeline's folder on this host and, for a hub id, the commit of its cached snapshot; no network."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p, None
    if path.count("/") > 1 or path.startswith(("/", ".", "~")) or path.endswith("/"):
        return None, None  # a path that is not there
    from huggingface_hub import try_to_load_from_cache

    try:
        index = try_to_load_from_cache(path, "model_index.json")  # the snapshot that refs/main names
    except ValueError:  # not a valid repo id (HFValidationError): a path that is not there
        return None, None
    if not isinstance(index, str):
        return None, None
    root = Path(index).parent
    return root, root.name if root.parent.name == "snapshots" else None


def weight_files(folder: Path) -> list[Path]:
    """The weight files a pipeline loads from one component's folder: safetensors where there are any (diffusers
    and transformers pick them over pickles), without a variant's (`model.fp16.safetensors`: none is asked for)."""
    files = sorted(f for f in folder.iterdir() if f.name.endswith(WEIGHT_SUFFIXES) and f.is_file())
    safe = [f for f in files if f.suffix == ".safetensors"] or files
    plain = [f for f in safe if "." not in f.name[: -len(f.suffix)]]
    return plain or safe


def model_weights(path: str) -> ModelWeights | None:
    """The weights' digests of the pipeline at `path`; None where it is not on this host (yet) or is not a
    pipeline (the model checks say so)."""
    root, revision = model_root(path)
    if root is None:
        return None
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    files = {
        name: weight_files(root / name)
        for name, spec in sorted(index.items())
        if not name.startswith("_") and isinstance(spec, list) and (root / name).is_dir()
    }
    try:
        etags = {f: _etag(f) for fs in files.values() for f in fs}
        unlinked = [f for f, e in etags.items() if e is None]
        etags.update(zip(unlinked, files_sha256(unlinked, what=path), strict=True))
    except OSError as e:  # unreadable, or replaced while we looked: one line, not a traceback
        raise ConfigError(
            f"model.path {path}: cannot read its weights to fingerprint them ({type(e).__name__}: {e}); "
            "make the files readable (or wait for a copy in progress to finish) and run the same command"
        ) from None
    digests = {}
    for name, fs in files.items():
        if fs:
            h = hashlib.sha256()
            for f in fs:
                h.update(f"{f.name}\0{etags[f]}\n".encode())
            digests[name] = h.hexdigest()
    return ModelWeights(digests, revision)


def _etag(f: Path) -> str | None:
    """The etag of a hub snapshot's file: the name of the blob it links to (None: not such a link)."""
    if not f.is_symlink():
        return None
    blob = Path(os.path.realpath(f))
    return blob.name if blob.parent.name == "blobs" and blob.is_file() else None
