"""What the dataset card (launcher/publish/card.py) says of the model, the settings and the runs, without a local path
or a host name: the card travels with the dataset (launcher/publish/push.py), the run folder's books do not.

A local model or LoRA is named as local with its content hashes (which say exactly which weights made the
images); a local prompt source by its file name. Runs are listed by date: their ids and commands hold host names
and paths.
"""

from __future__ import annotations

import re
from pathlib import Path

from launcher.ledger.runs import read_records
from launcher.ledger.store import Store

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# Settings shown elsewhere on the card (model.path, its weights, the LoRAs) or that name a place, not a value.
_SHOWN_ELSEWHERE = {("model", "path"), ("model", "weights"), ("model", "loras")}


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).exists()


def model_name(path: str, local: str = "a local pipeline (its weights by content below)") -> str:
    return f"`{path}`" if is_hub_id(path) else local


def source_name(path: str) -> str:
    """A Hub dataset by its address; any other source by its file name only (its folder is someone's disk)."""
    if path.startswith("hf://"):
        return f"`{path}`"
    return f"`{public(path)}`"


def public(value):
    """`value` with any path-like string cut to its last part: a setting may hold a file's path."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public(v) for v in value]
    if isinstance(value, str) and ("/" in value or "\\" in value) and not value.startswith("hf://"):
        return value.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    return value


def weights_lines(settings: dict) -> str:
    """The weights by content: each component's digest, as the fingerprint recorded them."""
    weights = settings.get("model", {}).get("weights") or {}
    return "".join(f"\n- weights of {c}: `{d}`" for c, d in sorted(weights.items()))


def settings_lines(settings: dict) -> str:
    """Every fingerprinted setting, `group.key: value`, but those the model section shows."""
    lines = []
    for group, values in settings.items():
        for key, value in (values or {}).items():
            if (group, key) not in _SHOWN_ELSEWHERE and value is not None:
                lines.append(f"- {group}.{key}: {public(value)}")
    return "\n".join(lines)


def runs_section(run: Store) -> str:
    """The runs that made the folder, by date, with what each did (from runs/<run id>.json)."""
    records = read_records(run)  # a damaged record (its run died as it wrote it) is left out, not a crash
    if not records:
        return ""
    rows = [
        "| started | exit | shards made | images | failed | stale (kept) | rejected rows | damaged, regenerated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        failed = len(r.get("failed_now") or [])
        made = r.get("generated", 0) - failed
        rejected = r.get("rejected", 0)
        rejected = len(rejected) if isinstance(rejected, list | dict) else rejected
        repaired = len(r.get("damaged_regenerated") or [])
        cells = [r.get("start", "?"), r.get("exit_code"), made, r.get("images", 0), failed, r.get("stale", 0)]
        rows.append("| " + " | ".join(str(c) for c in [*cells, rejected, repaired]) + " |")
    return "\nThe runs that made it, by start:\n\n" + "\n".join(rows) + "\n"
