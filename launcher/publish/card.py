"""What a run folder says about itself, and its dataset card: `python -m launcher.publish.card OUTPUT_DIR`.

Everything here reads only the run folder (run.json, state/, data/), through a `Store`, so the card and the
inspection tools (tools/contact_sheet.py, tools/report.py) work during a run, after it, or on a copy. The card is
OUTPUT_DIR/README.md with the YAML front matter that the Hugging Face Hub and `datasets` read, so the folder
can be pushed to the Hub as is.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from launcher.errors import ConfigError, error_line
from launcher.ledger.states import DATA_DIR, STATE_DIR, read_states
from launcher.ledger.store import Store
from launcher.plan.stale import KEPT_IDS, kept_stale
from launcher.publish.card_facts import model_name, runs_section, settings_lines, source_name, weights_lines


def open_run(out: str | Path | Store) -> Store:
    """The run folder at `out`: a local path, or a gs:// or s3:// URL."""
    return out if isinstance(out, Store) else Store(out)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def stage_seconds(state: dict) -> dict[str, float]:
    """Per-stage timings of a shard, when the state file records them (older runs do not)."""
    for key in ("stages", "timings"):
        value = state.get(key)
        if isinstance(value, dict):
            return {k: float(v) for k, v in value.items() if isinstance(v, int | float)}
    return {}


_PENDING = {
    "status": "pending",
    **dict.fromkeys(("rows", "seconds", "images_per_s", "finished_at", "data_bytes", "parquet_size", "run_id")),
    "error": "",
    "stages": {},
    "kept_stale": False,
    "kept_ids": [],
}


def run_meta(run: Store) -> dict:
    """run.json as meshgen wrote it: FileNotFoundError where there is none, one line (ConfigError) for another."""
    try:
        meta: dict | str | None = run.read_json("run.json")
    except ValueError as e:  # not JSON, or not UTF-8
        meta = f"not JSON: {str(e).splitlines()[0][:80]}"
    if meta is None:
        raise FileNotFoundError(f"{run.uri} has no run.json; is it a meshgen output folder?")
    shaped = isinstance(meta, dict) and isinstance(meta.get("shards"), int)
    if not (shaped and isinstance(meta.get("config"), dict) and isinstance(meta.get("settings"), dict)):
        why = meta if isinstance(meta, str) else "no shard count, config and settings"
        raise ConfigError(f"{run.uri}/run.json is not one meshgen wrote ({why}); give a meshgen run's output.dir")
    return meta  # ty: ignore[invalid-return-type]


def summarize(run: Store, states: dict[int, dict] | None = None) -> dict:
    """The run's config, per-shard outcomes and totals, from run.json and the state files (or the states given:
    the launcher passes what its ledger already holds)."""
    meta = run_meta(run)
    mtimes = {i.base_name: i.mtime.timestamp() for i in run.files(STATE_DIR, ".json") if i.mtime}
    listed = {int(n[6:-5]) for n in mtimes if n.startswith("shard-") and n[6:-5].isdigit()}
    states = read_states(run) if states is None else states
    shards, from_mtime = [], False
    for index in range(meta["shards"]):
        st = states.get(index)
        if st is None and index not in listed:  # most shards of a big source are pending: a copy each, no lookups
            shards.append({"index": index, **_PENDING, "stages": {}, "kept_ids": []})  # fresh, not shared
            continue
        name, st = f"{shard_name(index)}.json", st or {}
        finished = st.get("finished_at")
        if finished is None and name in mtimes:
            # The state file is written last, so its mtime is when the shard finished, for runs that predate
            # `finished_at` (a copy that did not keep mtimes makes this wrong, hence `time_source`).
            finished, from_mtime = mtimes[name], True
        shards.append(
            {
                "index": index,
                "status": st.get("status", "pending"),
                "rows": st.get("rows"),
                "seconds": st.get("seconds"),
                "images_per_s": st.get("images_per_s"),
                "error": (st.get("error") or "").strip().split("\n")[0],
                "finished_at": finished,
                "stages": stage_seconds(st),
                "data_bytes": st.get("data_bytes"),
                "parquet_size": (st.get("files") or {}).get(f"{DATA_DIR}/{shard_name(index)}.parquet", [None])[0],
                "run_id": st.get("run_id"),
                "kept_stale": kept_stale(st),  # run.stale=keep: its images are of the prompts as they were
                "kept_ids": st.get(KEPT_IDS, []) if kept_stale(st) else [],
            }
        )
    done = [s for s in shards if s["status"] == "done"]
    images = sum(s["rows"] or 0 for s in done)
    # Time spent on shards, failed ones included: with dp replicas this is more than the wall time.
    seconds = sum(s["seconds"] or 0 for s in shards if s["status"] != "pending")
    ends = [(s["finished_at"], s["seconds"] or 0) for s in shards if s["finished_at"] is not None]
    span = max(e for e, _ in ends) - min(e - d for e, d in ends) if ends else None
    return {
        "meta": meta,
        "shards": shards,
        "counts": {k: sum(s["status"] == k for s in shards) for k in ("done", "failed", "pending")},
        "images": images,
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 3) if images and seconds else None,
        # First shard start to last shard finish; it includes any pause between reruns.
        "span_seconds": round(span, 3) if span else None,
        "time_source": "state file mtime" if from_mtime else "finished_at",
    }


def data_files(run: Store, summary: dict) -> tuple[list[str], list[str], dict]:
    """What the card names (relative paths or a glob), the done shards' Parquet files, and their sizes: rows,
    `num_bytes` (the data uncompressed, as `datasets` counts a split: from the files' footers, not their data)
    and `download_size` (the files' bytes).

    A glob when every file belongs to a done shard, so the card stays short for big runs; otherwise the done
    shards' files by name, since a file whose shard is not done (an earlier attempt) is not vouched for.
    """
    listing = run.files(DATA_DIR, ".parquet")
    present = [f"{DATA_DIR}/{i.base_name}" for i in listing]
    sizes = {i.base_name: i.size for i in listing}
    # A done shard whose Parquet has another size than its state recorded is damaged (launcher/ledger/verify.py):
    # not vouched for, and its footer may not even read.
    by_file = {f"{shard_name(s['index'])}.parquet": s for s in summary["shards"] if s["status"] == "done"}
    by_file = {f: s for f, s in by_file.items() if s.get("parquet_size") in (None, sizes.get(f))}
    files = [f for f in present if f.split("/")[-1] in by_file]
    # From the states and the listing, not a read per Parquet file (40k shards would cost 40k requests): each
    # state keeps its data's uncompressed size (states of older runs do not: their file's size stands in).
    download = sum(sizes[f.split("/")[-1]] for f in files)
    num_bytes = sum(by_file[f.split("/")[-1]].get("data_bytes") or sizes[f.split("/")[-1]] for f in files)
    rows = sum(s["rows"] or 0 for s in by_file.values())
    totals = {"rows": rows, "num_bytes": num_bytes, "download_size": download}
    return ([f"{DATA_DIR}/*.parquet"] if files and files == present else files), files, totals


# The Hub's size categories: the first bound above the row count names it.
_SIZE_CATEGORIES = [(10**3, "n<1K"), (10**4, "1K<n<10K"), (10**5, "10K<n<100K"), (10**6, "100K<n<1M")]
_SIZE_CATEGORIES += [(10**7, "1M<n<10M"), (10**8, "10M<n<100M"), (10**9, "100M<n<1B"), (10**10, "1B<n<10B")]


def size_category(rows: int) -> str:
    return next((name for bound, name in _SIZE_CATEGORIES if rows < bound), "n>10B")


def hf_features(run: Store, first_file: str) -> list[dict]:
    """The `dataset_info.features` list, from the Parquet schema's Hugging Face metadata (the file is the truth)."""
    schema = run.parquet(first_file).schema_arrow
    raw = schema.metadata or {}
    if b"huggingface" in raw:
        features = json.loads(raw[b"huggingface"])["info"]["features"]
    else:  # a file written without the metadata: the writer's own declaration
        from launcher.writer.writer import _HF_FEATURES as features
    declared = [_feature(k, f) for k, f in features.items()]
    # Columns the metadata does not describe (kept source columns, scores): from their Arrow types. The Hub reads
    # the card's features and casts every file to them, so a column left out here fails the whole load.
    return declared + [{"name": f.name, **_arrow_feature(f.type)} for f in schema if f.name not in features]


def _arrow_feature(t) -> dict:
    """A column's `dataset_info.features` entry from its Arrow type, as `datasets` writes it in a card."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _arrow_feature(t.value_type)
        return {"list": inner.get("dtype") or inner.get("struct") or inner}
    if pa.types.is_struct(t):
        return {"struct": [{"name": f.name, **_arrow_feature(f.type)} for f in t]}
    names = {pa.float16(): "float16", pa.float32(): "float32", pa.float64(): "float64"}
    return {"dtype": names.get(t, str(t))}


def _feature(name: str, f) -> dict:
    if isinstance(f, list):  # a list of structs (job=edit's `reference` lineage)
        return {"name": name, "list": [_feature(k, v) for k, v in f[0].items()]}
    return {"name": name, "dtype": f.get("dtype", f["_type"].lower())}


# License ids the Hub knows that a model's license note may spell as is; anything else becomes `other`.
_HUB_LICENSES = {"apache-2.0", "mit", "openrail", "openrail++", "creativeml-openrail-m", "cc-by-4.0", "cc0-1.0"}


def hub_license(note: str) -> dict:
    if not note.strip():
        return {}
    if note.strip().lower() in _HUB_LICENSES:
        return {"license": note.strip().lower()}
    url = re.search(r"https?://\S+", note)
    name = re.sub(r"[^a-z0-9]+", "-", note[: url.start()] if url else note, flags=re.I).strip("-").lower()
    return {"license": "other", "license_name": name or "model-license", **({"license_link": url[0]} if url else {})}


def front_matter(run: Store, summary: dict) -> dict:
    model = summary["meta"]["config"]["model"]
    task = "image-to-image" if summary["meta"]["config"].get("job") == "edit" else "text-to-image"
    front = {**hub_license(model.get("license", "")), "task_categories": [task], "tags": ["synthetic"]}
    named, files, size = data_files(run, summary)
    if files:  # none yet (or output.parquet=false): the card goes without configs, and still renders
        front["size_categories"] = [size_category(size["rows"])]
        front["configs"] = [
            {
                "config_name": "default",
                "data_files": [{"split": "train", "path": named if len(named) > 1 else named[0]}],
            }
        ]
        # `datasets` reads the split only with all three of name, num_examples and num_bytes (else it warns).
        split = {"name": "train", "num_bytes": size["num_bytes"], "num_examples": size["rows"]}
        front["dataset_info"] = {
            "features": hf_features(run, files[0]),
            "splits": [split],
            "download_size": size["download_size"],
            "dataset_size": size["num_bytes"],
        }
    return front


def files_section(output: dict) -> str:
    """What a loader needs to know of the files: the image encoding and the Parquet row groups."""
    from launcher.writer.encode import Encoding

    known = {k: output[k] for k in ("format", "quality", "lossless", "png_level") if k in output}
    enc = Encoding(**known)
    embed = output.get("embed_images", True)
    files = not embed or output.get("image_files", output.get("png", False))
    where = "the `image` column's bytes" if embed else ""
    if files:
        named = f"`images/shard-NNNNN/<id>.{enc.extension}` files"
        where = f"{where} and {named} (the same bytes)" if embed else f"{named}; the `image` column's `path` names each"
    lines = [f"- images: {enc.describe()}, stored as {where}"]
    if "row_group_size" in output:
        lines.append(
            f"- `data/shard-NNNNN.parquet`: one per shard, in row groups of {output['row_group_size']} rows "
            "(loaders read one group at a time; the last group of a shard may be smaller)"
        )
    return "\n".join(lines)


def sweep_text(sweep: dict | None) -> str:
    """The card's paragraph on a sweep: its variants, their ids and seeds (empty without one)."""
    if not sweep:
        return ""
    import itertools

    combos = list(itertools.product(*sweep.values()))
    listed = "; ".join(
        f"{v}: " + ", ".join(f"{k}={x}" for k, x in zip(sweep, c, strict=True)) for v, c in enumerate(combos)
    )
    return (
        f"\nA sweep: every prompt at {len(combos)} combinations of settings (the `variant` column, v = {listed}). "
        "A sample's id is `<base id>@<v>` and it has the base id's seed, so the variants of one image differ only "
        "in the swept settings.\n"
    )


def card_text(run: Store, states: dict[int, dict] | None = None, repo_id: str | None = None) -> str:
    """The card; `repo_id`: the Hub repo it is published to (its load line names it). It names no local path or
    host: a local model or source by its base name, the runs by date (their ids hold host names)."""
    summary = summarize(run, states)
    meta, counts, cfg = summary["meta"], summary["counts"], summary["meta"]["config"]
    model = cfg["model"]
    load = f'"{repo_id}"' if repo_id else '"path/to/this/folder"'
    incomplete = (
        "This run is not complete: the card names only the done shards' data. "
        if counts["pending"] or counts["failed"]
        else ""
    )
    body = f"""# {cfg["name"]}: images generated with {model_name(model["path"], "a local pipeline")}

Generated by meshgen from the prompts in {source_name(cfg["dataset"]["path"])}.

## Model

- model: {model_name(model["path"])} in {model["dtype"]}
- license: {model.get("license") or "not stated; see the model's page"}{weights_lines(meta["settings"])}\
{_loras_lines(model, meta["settings"])}

The images are outputs of this model; their use is subject to its license.

## Generation settings

{settings_lines(meta["settings"])}
- mesh: dp={cfg["mesh"]["dp"]} x tp={cfg["mesh"]["tp"]} on {cfg["device"]}, batch size {cfg["generate"]["batch_size"]}

Each sample's seed is the first 8 bytes of `sha256("<seed>:<id>")` unless its row sets `seed`; rows may also set
their own `height`, `width` and `negative_prompt`. The data records what each sample used.
{sweep_text(meta["settings"]["generate"].get("sweep"))}
## Files

{files_section(cfg.get("output", {}))}

## Contents

{incomplete}{len(summary["shards"])} shards of {meta["shard_size"]} prompts: {counts["done"]} done, \
{counts["failed"]} failed, {counts["pending"]} pending; {summary["images"]} images.{kept_text(summary)}
{runs_section(run)}
```python
from datasets import load_dataset
ds = load_dataset({load}, split="train")  # `image` decodes to a PIL image
```

Versions: {", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())}
"""
    yaml_text = yaml.safe_dump(front_matter(run, summary), sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{yaml_text}---\n\n{body}"


def write_card(out: str | Path | Store, states: dict[int, dict] | None = None) -> str:
    """Write OUTPUT_DIR/README.md (the dataset card) atomically; return its path."""
    run = open_run(out)
    text = card_text(run, states).encode()
    if run.read_bytes("README.md") != text:  # a rerun with nothing new leaves the folder untouched
        run.write_bytes("README.md", text)
    return run.url("README.md")


def write_output(out: str | Path | Store, name: str, data: bytes, dest: Path | None = None) -> str:
    """Write `data` to `dest` (a local file) if given, else into the run folder as `name`; where it went."""
    if dest is not None:
        Store(dest.parent).write_bytes(dest.name, data)
        return str(dest)
    run = open_run(out)
    run.write_bytes(name, data)
    return run.url(name)


def _loras_lines(model: dict, settings: dict) -> str:
    """One line per LoRA fused into the weights: its hub id or file name, scale and content hash (the fingerprint's)."""
    hashed = settings.get("model", {}).get("loras", [])
    lines = []
    for entry, h in zip(model.get("loras") or [], hashed, strict=False):
        path = str(entry.get("path"))
        name = model_name(path, f"a local file `{Path(path).name}`")
        lines.append(f"\n- LoRA: {name} at scale {h['scale']} (sha256 {h['sha256']})")
    return "".join(lines)


def kept_text(summary: dict) -> str:
    """The kept-stale shards (run.stale=keep), named, so that nobody takes their images for the source's prompts."""
    kept = [s for s in summary["shards"] if s.get("kept_stale")]
    if not kept:
        return ""
    ids = [i for s in kept for i in s["kept_ids"]]
    named = f" (samples {', '.join(ids[:5])}{' and more' if len(ids) > 5 else ''})" if ids else ""
    return (
        f" {len(kept)} done shards are kept-stale{named}: their prompts changed in the source after they were "
        "generated, and run.stale=keep kept the images of the prompts as they were."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write OUTPUT_DIR/README.md, the dataset card of a run folder.")
    parser.add_argument("output_dir")
    args = parser.parse_args(argv)
    try:
        print(write_card(args.output_dir))
    except (FileNotFoundError, NotImplementedError, ConfigError) as e:  # ConfigError: credentials in the address
        print(error_line(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
