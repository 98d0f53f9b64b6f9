"""Work is addressed by shard and sample, never by process: shard ids, seeds and assignment live here.

A shard is `run.shard_size` consecutive rows of the prompt source (shard i holds rows i*size ... (i+1)*size-1),
so appending prompts never reshuffles existing shards.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

# Settings that determine the images. Everything else (mesh, batch size, workers, execution mode,
# dataset.limit, testing.*) only decides how the work is run, and may change between runs of one job.
FINGERPRINT_KEYS = {
    "model": ("path", "dtype", "call_kwargs", "loras"),  # loras: each file's content hash and scale
    "generate": (
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "max_sequence_length",
        "seed",
        "images_per_prompt",
        "size_from_reference",
        "sweep",
        "reference_fit",
    ),
    "run": ("shard_size",),
    "execution": ("cache", "cache_options"),  # step caching changes the images; the other execution keys do not
    "output": (
        "format",
        "quality",
        "lossless",
        "reference_bytes",
    ),  # how the images are stored: a dataset is not a mix of formats
}
# Keys added after runs were made: at these values they are left out of the settings, so that the folders of
# older runs keep their fingerprints (a resume with the defaults is no change).
LATER_DEFAULTS = {
    ("model", "loras"): [],
    ("generate", "images_per_prompt"): 1,
    ("generate", "sweep"): None,
    ("execution", "cache"): "none",
    ("execution", "cache_options"): {},
    ("output", "format"): "png",
    ("output", "quality"): 95,
    ("output", "lossless"): False,
    ("generate", "size_from_reference"): False,
    # What edit runs did before the key existed: left out at that value, so an older edit folder resumed with the
    # new default (crop) exits 2 naming the key instead of mixing stretched and cropped references.
    ("generate", "reference_fit"): "stretch",  # and left out for every job but edit (settings)
    ("output", "reference_bytes"): False,
    ("model", "weights"): None,  # not on this host yet (a hub id the run downloads): judged once it is
}


@dataclass(frozen=True)
class Shard:
    """A shard as a worker generates it: its rows (dicts: id, prompt, overrides) and their fingerprint."""

    index: int
    rows: tuple[dict, ...]
    fingerprint: str
    kept: tuple = ()  # dataset.keep_columns: the kept columns' Arrow fields (their values are in the rows)

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


FILE_STEM_UNSAFE = r"[^A-Za-z0-9_-]"


def file_stem(sample_id: str) -> str:
    """A sample's file name stem: its id, with anything unsafe in a path or a WebDataset key replaced."""
    return re.sub(FILE_STEM_UNSAFE, "_", sample_id)


FINGERPRINT_PREFIX = "v2-"
UNHASHED = frozenset({"ref_loc"})  # where a reference is read from (its content hash is fingerprinted)


def prompts_fingerprint(table) -> str:
    """Hash of what a shard's rows contribute to its images: ids, prompts and per-row overrides.

    Computed over the Arrow columns (launcher/sources/prompts.py SCHEMA), buffer by buffer, on zero-copy slices:
    hashing the rows one by one in Python costs ~3 us each, half a minute for a 10M-prompt source, and even a
    pyarrow compute call per column costs ~50 us, which 40k shards feel. A column that is empty throughout is
    left out, so a source with an all-empty column hashes like one without it.
    """
    import numpy as np
    import pyarrow as pa

    h = hashlib.sha256()
    for name, col in zip(table.schema.names, table.columns, strict=True):
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        nulls, n = col.null_count, len(col)
        if nulls == n or name in UNHASHED:
            continue
        h.update(name.encode() + b"\0")
        if nulls:
            h.update(np.asarray(col.is_valid()).tobytes())
        if pa.types.is_string(col.type):
            offsets = np.frombuffer(col.buffers()[1], np.int32)[col.offset : col.offset + n + 1]
            h.update((offsets - offsets[0]).astype("<i4").tobytes())  # a null's offsets span no bytes
            data = col.buffers()[2]
            h.update(memoryview(data)[offsets[0] : offsets[-1]] if data is not None else b"")
        elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            values = col.fill_null(0) if nulls else col
            h.update(np.asarray(values, dtype="<i8" if pa.types.is_integer(col.type) else "<f8").tobytes())
        else:  # a kept source column of any other type (launcher/sources/keep.py): its values, as JSON
            h.update(str(col.type).encode() + json.dumps(col.to_pylist(), default=str, sort_keys=True).encode())
    return FINGERPRINT_PREFIX + h.hexdigest()[:16]


def legacy_fingerprint(table) -> str:
    """The fingerprint that state files of runs before the Arrow plan carry (json of each row dict), so their
    done shards stay done."""
    h = hashlib.sha256()
    for r in table.to_pylist():
        r = {k: v for k, v in r.items() if v is not None}
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def same_prompts(fingerprint: str | None, table, known: str | None = None) -> bool:
    """Whether a state's fingerprint is that of `table` (whose fingerprint is `known`, when computed already)."""
    if fingerprint is None:
        return True
    if fingerprint.startswith(FINGERPRINT_PREFIX):
        return fingerprint == (known or prompts_fingerprint(table))
    return fingerprint == legacy_fingerprint(table)


def settings(cfg) -> dict:
    """The settings that determine the images, as a plain dict (the part of run.json that is fingerprinted)."""
    out = {}
    if cfg.get("job", "text_to_image") != "text_to_image":  # left out for text-to-image: older runs keep theirs
        out["job"] = {"name": cfg.job}
    for group, keys in FINGERPRINT_KEYS.items():
        special = {("model", "loras"), ("generate", "sweep")}
        values = {k: _plain(cfg[group][k]) for k in keys if (group, k) not in special}
        if group == "model" and "loras" in keys:
            values["loras"] = _loras(cfg)
        if group == "model":  # by content: new weights at the same path are another model
            values["weights"] = _weights(cfg)
        if group == "generate":  # its values as the pipeline takes them; {} and null are no sweep
            from launcher.plan.sweep import sweep_of

            values["sweep"] = sweep_of(cfg.generate) or None
        values = {k: v for k, v in values.items() if LATER_DEFAULTS.get((group, k), ()) != v}
        if cfg.get("job", "text_to_image") != "edit":
            values.pop("reference_fit", None)
        if values:
            out[group] = values
    return out


def settings_diff(old: dict, new: dict) -> list[str]:
    """`group.key: old -> new` for each fingerprinted setting that differs (a key left out reads as its default)."""

    def get(s: dict, g: str, k: str):
        return s.get(g, {}).get(k, LATER_DEFAULTS.get((g, k)))

    jobs = [old.get("job", {}).get("name", "text_to_image"), new.get("job", {}).get("name", "text_to_image")]
    return [f"job: {jobs[0]!r} -> {jobs[1]!r}"] * (jobs[0] != jobs[1]) + [
        f"{g}.{k}: {get(old, g, k)!r} -> {get(new, g, k)!r}"
        for g, keys in FINGERPRINT_KEYS.items()
        for k in keys
        if get(old, g, k) != get(new, g, k)
    ]


def settings_fingerprint(cfg) -> str:
    return fingerprint_of(settings(cfg))


def fingerprint_of(settings_: dict) -> str:
    return hashlib.sha256(json.dumps(settings_, sort_keys=True).encode()).hexdigest()[:16]


def _weights(cfg) -> dict[str, str] | None:
    from launcher.weights import model_weights

    found = model_weights(str(cfg.model.path))
    return found.components if found else None


def _loras(cfg) -> list[dict]:
    from launcher.loras import fingerprint_entries

    return fingerprint_entries(cfg)


def _plain(v):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v


def sample_seed(base_seed: int, sample_id: str) -> int:
    """The seed of one sample: the first 8 bytes of sha256("<generate.seed>:<id>"), as a non-negative int64.

    It depends on nothing but the job's seed and the sample's id, so any mesh, batch size or rerun gives the
    same image; a row's own `seed` column takes precedence (see `row_seed`).
    """
    digest = hashlib.sha256(f"{base_seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def row_seed(row: dict, base_seed: int) -> int:
    return int(row["seed"]) if row.get("seed") is not None else sample_seed(base_seed, row["id"])


def sample_ids(prompt_id: str, images_per_prompt: int, variants: int = 0) -> list[str]:
    """The ids of one prompt's samples: the prompt's id, or `<prompt id>-<k>` for k = 0..N-1 when N > 1; with a
    sweep of V variants (`variants` > 0), each of those as `<base id>@<v>` for v = 0..V-1 (base-major)."""
    base = [prompt_id] if images_per_prompt == 1 else [f"{prompt_id}-{k}" for k in range(images_per_prompt)]
    return [f"{b}@{v}" for b in base for v in range(variants)] if variants else base


def image_seeds(row: dict, base_seed: int, images_per_prompt: int) -> list[int]:
    """The seeds of one prompt's samples, in sample order.

    With N > 1, each sample is seeded from its own id as usual; a row's own `seed` cannot seed N different
    images, so it seeds them as a job seed would: sample k gets sha256("<row seed>:<k>").
    """
    if images_per_prompt == 1:
        return [row_seed(row, base_seed)]
    if row.get("seed") is not None:
        return [sample_seed(int(row["seed"]), str(k)) for k in range(images_per_prompt)]
    return [sample_seed(base_seed, i) for i in sample_ids(row["id"], images_per_prompt)]


def check_sample_ids(
    prompt_ids: Iterable[str], images_per_prompt: int, where: str = "the dataset", variants: int = 0
) -> None:
    """Refuse prompt ids that a sample id of another prompt repeats (`a-1` beside `a` with N >= 2, `a@0` beside
    `a` with a sweep).

    Sample ids themselves never coincide (k has no '-', v no '@'), but a sample `a-1` beside a prompt `a-1` makes
    the `id` and `prompt_id` columns ambiguous to anyone joining them back to the prompts. One pass, a set of ids.
    """
    if images_per_prompt == 1 and not variants:
        return
    from launcher.errors import ConfigError

    seen: set[str] = set()
    for pid in prompt_ids:
        owner = _owner(pid, images_per_prompt, variants)
        if owner in seen:
            clash = (owner, pid)
        else:
            clash = next(((pid, s) for s in sample_ids(pid, images_per_prompt, variants) if s in seen), None)
        if clash:
            what = f"generate.images_per_prompt={images_per_prompt}" if images_per_prompt > 1 else ""
            what = " and ".join(w for w in (what, "generate.sweep" if variants else "") if w)
            raise ConfigError(
                f"{where}: with {what}, prompt {clash[0]!r} has a sample "
                f"id {clash[1]!r}, which is also the id of another prompt; rename one of them "
                "(or use dataset.id_column)"
            )
        seen.add(pid)


def _owner(pid: str, images_per_prompt: int, variants: int) -> str | None:
    """The prompt id of which `pid` would be a sample id, if it has that form."""
    for sep, count, wanted in (("@", variants, variants > 0), ("-", images_per_prompt, images_per_prompt > 1)):
        if not wanted:
            continue
        base, _, k = pid.rpartition(sep)
        if not (base and k.isdigit() and str(int(k)) == k and int(k) < count):
            return None
        pid = base
    return pid


def preference(selected: list[int], slot: int, slots: int) -> list[int]:
    """The order in which one dp group (slot `slot` of `slots` = workers x dp) tries the selected shards.

    Its own share first (every `slots`-th of them, so the slots split any selection evenly), then the others,
    which it generates only when their own slot has not claimed them (launcher/ledger/claims.py).
    """
    own = selected[slot::slots]
    mine = set(own)
    return own + [i for i in selected if i not in mine]


def parse_selection(spec, n_shards: int) -> str | list[int]:
    """`run.shards`: pending | failed | all | a list of shard indices (checked against the shard count)."""
    from launcher.errors import ConfigError

    if isinstance(spec, str) and spec in ("pending", "failed", "all"):
        return spec
    try:
        ids = [int(i) for i in (spec if not isinstance(spec, (str, int)) else [spec])]
    except (TypeError, ValueError):
        raise ConfigError(f"run.shards={spec!r} is not pending, failed, all or a list like [0,3]") from None
    bad = [i for i in ids if not 0 <= i < n_shards]
    if bad:
        raise ConfigError(
            f"run.shards names shards {bad} that do not exist: the dataset has {n_shards} shards (0..{n_shards - 1})"
        )
    return sorted(set(ids))
