"""The quality models (quality.clip_model, quality.safety_model) on this host before any worker starts: a hub id
not yet cached is downloaded once by the launcher, as the pipeline is (launcher/checks/download.py), since the
workers may run offline. Only what from_pretrained loads: configs, tokenizer files and the safetensors weights."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.errors import ConfigError

WANTED = ["*.json", "*.txt", "*.safetensors"]


def fetch_quality_models(cfg) -> None:
    q = cfg.get("quality")
    for on, key in (("clip_score", "clip_model"), ("safety", "safety_model")):
        if q and q.get(on):
            _fetch(str(q[key]), f"quality.{key}")


def _fetch(path: str, what: str) -> None:
    from launcher.sizing.model_files import looks_like_hub_id

    if Path(path).expanduser().is_dir() or not looks_like_hub_id(path) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return  # a folder, or offline: from_pretrained says what is missing
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    from launcher.checks.download import hub_answers

    try:
        hub_answers(path, what)
        folder = Path(snapshot_download(path, allow_patterns=WANTED))
        if not any(folder.glob("*.safetensors")):  # an older repo: its PyTorch pickle only
            snapshot_download(path, allow_patterns=["pytorch_model.bin"])
    except HfHubHTTPError as e:
        first = str(e).splitlines()[0][:200]
        raise ConfigError(f"{what}={path} cannot be downloaded ({first}); check the id and your HF_TOKEN") from None
