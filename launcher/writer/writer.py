"""Write one finished shard: Parquet (with the Hugging Face Image feature), image files, WebDataset, each atomically."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq

from launcher.ledger.states import DATA_DIR, IMAGES_DIR, WDS_DIR
from launcher.ledger.store import Store
from launcher.plan.shards import file_stem
from launcher.writer.encode import EXTENSIONS

# Schema of a sample row. `image` is the struct that `datasets` decodes as an Image feature when the schema
# metadata below says so.
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("seed", pa.int64()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("num_inference_steps", pa.int32()),
        ("guidance_scale", pa.float32()),
        ("negative_prompt", pa.string()),
        ("model", pa.string()),
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ]
)
_HF_FEATURES = {
    "id": {"dtype": "string", "_type": "Value"},
    "prompt": {"dtype": "string", "_type": "Value"},
    "seed": {"dtype": "int64", "_type": "Value"},
    "height": {"dtype": "int32", "_type": "Value"},
    "width": {"dtype": "int32", "_type": "Value"},
    "num_inference_steps": {"dtype": "int32", "_type": "Value"},
    "guidance_scale": {"dtype": "float32", "_type": "Value"},
    "negative_prompt": {"dtype": "string", "_type": "Value"},
    "model": {"dtype": "string", "_type": "Value"},
    "image": {"_type": "Image"},
}
SCHEMA = SCHEMA.with_metadata({"huggingface": json.dumps({"info": {"features": _HF_FEATURES}})})
# With generate.images_per_prompt > 1, samples also name their prompt (and N = 1 writes exactly what it did).
_HF_FEATURES_N = {"id": _HF_FEATURES["id"], "prompt_id": {"dtype": "string", "_type": "Value"}, **_HF_FEATURES}
SCHEMA_N = SCHEMA.insert(1, pa.field("prompt_id", pa.string())).with_metadata(
    {"huggingface": json.dumps({"info": {"features": _HF_FEATURES_N}})}
)


# With generate.sweep, also the variant and the swept settings beyond SCHEMA's own columns (where swept).
_SWEEP_COLUMNS = {
    "variant": (pa.int32(), {"dtype": "int32", "_type": "Value"}),
    "true_cfg_scale": (pa.float32(), {"dtype": "float32", "_type": "Value"}),
    "lora_scales": (pa.list_(pa.float32()), {"feature": {"dtype": "float32", "_type": "Value"}, "_type": "List"}),
}


def schema_of(samples: list[dict]) -> pa.Schema:
    if not samples or "prompt_id" not in samples[0]:
        schema = SCHEMA
    else:
        extra = tuple(k for k in _SWEEP_COLUMNS if k in samples[0])
        schema = _sweep_schema(extra) if extra else SCHEMA_N
    return _with_extra(_with_references(schema, samples), samples)


# quality.*: columns scored on the chips (launcher/worker/quality.py), present when scored
QUALITY_COLUMNS = {
    "clip_score": (pa.float32(), {"dtype": "float32", "_type": "Value"}),
    "nsfw": (pa.bool_(), {"dtype": "bool", "_type": "Value"}),
}
KEPT_FIELDS = "_kept_fields"  # a sample's key: the dataset.keep_columns fields (Arrow types of the source)


def _with_extra(schema: pa.Schema, samples: list[dict]) -> pa.Schema:
    """The kept source columns (their own types; `datasets` derives their features from the Arrow types), then
    the quality columns."""
    if not samples:
        return schema
    kept = tuple(samples[0].get(KEPT_FIELDS, ()))
    quality = [k for k in QUALITY_COLUMNS if k in samples[0]]
    if not kept and not quality:
        return schema
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    for f in kept:
        schema = schema.append(f)
    for k in quality:
        schema = schema.append(pa.field(k, QUALITY_COLUMNS[k][0]))
        features[k] = QUALITY_COLUMNS[k][1]
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def image_path(shard_name: str, name: str, output_cfg) -> str:
    """The Parquet row's `image.path`: the file's name beside embedded bytes (what `datasets` shows); without
    them (output.embed_images=false), the file's path from the folder's root, which `datasets` opens relative to
    the working directory (load from OUTPUT_DIR, or join the folder's path)."""
    return name if output_cfg.get("embed_images", True) else f"{IMAGES_DIR}/{shard_name}/{name}"


# job=edit: each sample's references (lineage), and with output.reference_bytes the first one's image, which
# `datasets` loads as a second Image column.
REFERENCE = pa.list_(pa.struct([("id", pa.string()), ("path", pa.string()), ("sha256", pa.string())]))
_HF_REFERENCE = [
    {
        "id": {"dtype": "string", "_type": "Value"},
        "path": {"dtype": "string", "_type": "Value"},
        "sha256": {"dtype": "string", "_type": "Value"},
    }
]


def _with_references(schema: pa.Schema, samples: list[dict]) -> pa.Schema:
    if not samples or "reference" not in samples[0]:
        return schema
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    schema = schema.append(pa.field("reference", REFERENCE))
    features["reference"] = _HF_REFERENCE
    if "reference_image" in samples[0]:
        schema = schema.append(pa.field("reference_image", SCHEMA.field("image").type))
        features["reference_image"] = {"_type": "Image"}
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})


@functools.cache
def _sweep_schema(extra: tuple[str, ...]) -> pa.Schema:
    """SCHEMA_N with `variant` after `prompt_id` and the other swept columns before `image`."""
    schema = SCHEMA_N.insert(2, pa.field("variant", _SWEEP_COLUMNS["variant"][0]))
    for k in extra:
        if k != "variant":
            schema = schema.insert(schema.get_field_index("image"), pa.field(k, _SWEEP_COLUMNS[k][0]))
    features = {**_HF_FEATURES_N, **{k: f for k, (_, f) in _SWEEP_COLUMNS.items()}}
    features = {f.name: features[f.name] for f in schema}
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def write_shard(store: Store, shard_name: str, samples: list[dict], output_cfg) -> dict:
    """Write a shard's files. `samples` hold the row fields of SCHEMA, with `encoded` holding the image's bytes
    in `output.format`. Returns what the state file keeps of them: `files`, each file's size and sha256, hashed
    here from the bytes written (launcher/ledger/verify.py checks them), and `data_bytes`, the Parquet data's
    uncompressed size (what `datasets` calls num_bytes), so that the dataset card need not read every footer.

    Each file appears whole or not at all (launcher/ledger/store.py). The caller writes the state file after this.
    """
    files: dict[str, list] = {}
    data_bytes = None
    ext = EXTENSIONS[output_cfg.format]
    names = [f"{file_stem(s['id'])}.{ext}" for s in samples]
    schema = schema_of(samples)

    def put(rel: str, data: bytes) -> None:
        store.write_bytes(rel, data)
        files[rel] = [len(data), hashlib.sha256(data).hexdigest()]

    if output_cfg.image_files:
        folder = f"{IMAGES_DIR}/{shard_name}"
        images = {n: s["encoded"] for n, s in zip(names, samples, strict=True)}
        store.put_folder(folder, images)
        files.update((f"{folder}/{n}", [len(b), hashlib.sha256(b).hexdigest()]) for n, b in images.items())
    if output_cfg.parquet:
        embed = output_cfg.get("embed_images", True)
        rows = [
            {**{k: s.get(k) for k in schema.names}, "image": {"bytes": s["encoded"] if embed else None, "path": name}}
            for s, name in zip(samples, [image_path(shard_name, n, output_cfg) for n in names], strict=True)
        ]
        buf = io.BytesIO()
        # Row groups of a fixed row count: `datasets` streaming and pyarrow read one group at a time, so a loader
        # never holds a whole shard (256 megapixel PNGs are ~500 MB).
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(table, buf, compression="zstd", row_group_size=output_cfg.row_group_size)
        put(f"{DATA_DIR}/{shard_name}.parquet", buf.getvalue())
        meta = pq.ParquetFile(buf).metadata
        data_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    if output_cfg.webdataset:
        put(f"{WDS_DIR}/{shard_name}.tar", webdataset_tar(samples, ext))
    return {"files": files, **({"data_bytes": data_bytes} if data_bytes is not None else {})}


def warm_up() -> None:
    """Pay the first Parquet write's one-off cost (pyarrow imports pandas then, 0.2-0.4 s) before generation
    starts, not while the second shard generates."""
    pq.write_table(pa.Table.from_pylist([], schema=SCHEMA), io.BytesIO(), compression="zstd")


def delete_shard_files(store: Store, shard_name: str) -> None:
    """Remove a shard's data files (before recording it failed: a loader must not read a failed shard's rows)."""
    errors = []
    for delete, rel in (
        (store.delete, f"{DATA_DIR}/{shard_name}.parquet"),
        (store.delete, f"{WDS_DIR}/{shard_name}.tar"),
        (store.delete_dir, f"{IMAGES_DIR}/{shard_name}"),
    ):
        try:  # each one, whatever happened to the others
            delete(rel)
        except OSError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def webdataset_tar(samples: list[dict], ext: str) -> bytes:
    """A WebDataset shard: `<key>.<ext>` and `<key>.json` per sample, in order, with fixed metadata so that the
    same samples always give the same bytes."""
    buf, names = io.BytesIO(), schema_of(samples).names
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for s in samples:
            meta = {k: s.get(k) for k in names if k not in ("image", "reference_image")}
            for name, data in (
                (f"{file_stem(s['id'])}.{ext}", s["encoded"]),
                (f"{file_stem(s['id'])}.json", json.dumps(meta, sort_keys=True, default=str).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
