"""What a shard's files hold: the row schema (with the Hugging Face Image feature), each image's path, and the
removal of a failed shard's files. launcher/writer/stream.py writes them, batch by batch, each file atomically."""

from __future__ import annotations

import functools
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from launcher.ledger.states import DATA_DIR, IMAGES_DIR, WDS_DIR
from launcher.ledger.store import Store

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
