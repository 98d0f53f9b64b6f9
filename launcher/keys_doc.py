"""What each configuration key means and which values it takes: the one place `./launch.sh --help`
(launcher/help.py) and docs/reference.md (`python -m tools.reference --write`) read it from.

The schema (launcher/config.py) declares the keys and their types; this mapping describes them. A key added to the
schema needs a line here (tests/test_reference.py fails until it has one), and a key with a fixed set of values
lists them in ALLOWED (the same test checks each against the preflight's checks).
"""

from __future__ import annotations

DESCRIPTIONS: dict[str, str] = {
    "name": "The job's name: the conf file's name, set by the launcher; names the default output folder.",
    "device": "Where the workers run: auto picks tpu if TorchTPU finds chips, else cuda, else cpu.",
    "job": "What each row becomes: text_to_image, or edit (each row's reference images go to the pipeline's image=).",
    # model
    "model.path": "A hub id or a local folder of a diffusers pipeline; a hub id not cached is downloaded once, "
    "before the workers start (only the files the pipeline loads).",
    "model.dtype": "The weights' and the computation's dtype.",
    "model.shard_text_encoder": "Shard the text encoder over the tp axis (else each rank holds it whole).",
    "model.shard_transformer": "Shard the transformer over the tp axis (else each rank holds it whole).",
    "model.call_kwargs": "Extra keyword arguments for the pipeline call that a family needs; may not set a key that "
    "has its own setting (steps, guidance, sizes, ...).",
    "model.build": "A builder that creates model.path when it is missing (the project's own tiny test models only).",
    "model.license": "The weights' license, written into the dataset card.",
    "model.loras": "LoRAs fused into the weights at load: a list of {path, scale (default 1.0), weight_name}; path "
    "a file, a folder or a hub id; part of the fingerprint.",
    # mesh
    "mesh.dp": "Data-parallel replicas; processes = dp * tp. auto: fill the host's chips "
    "(chips_per_host * nodes / tp).",
    "mesh.tp": "Tensor-parallel degree of each replica. auto: the smallest tp that divides the sharded heads and "
    "whose per-rank weights fit the chip.",
    "mesh.nodes": "Hosts that one torchrun job spans (each runs the same command); dp * tp processes in all.",
    "mesh.chip": "The accelerator, for the memory check and auto: auto (what this host has) or a name (v5e, v5p, "
    "v6e, v7x, h100, h200, cpu); a named chip must belong to the device.",
    "mesh.chip_memory_gib": "The chip's memory in GiB, for a chip the table does not know (null: from the table).",
    "mesh.chips_per_host": "Chips per host, for dp=auto and the process count (null: counted on this host).",
    # dataset
    "dataset.path": "The prompt source: .txt (one prompt a line), .jsonl, .csv, .parquet, a glob, a save_to_disk "
    "folder; local, gs://, s3:// or hf://datasets/ORG/NAME[@REVISION][/glob] (a Hub dataset, read-only; the repo alone "
    "means all its .txt/.jsonl/.csv/.parquet files).",
    "dataset.prompt_column": "The column that holds each row's prompt (not for .txt).",
    "dataset.id_column": "The column that holds each row's id (null: the row number). With ids, shards hold ids "
    "fixed when first planned: new ids go to new shards, inserted, deleted or moved rows change no other shard, and "
    "unchanged source files are not read again (the id map under sources/).",
    "dataset.limit": (
        "Use only the first N rows (not part of the fingerprint); a shard done cut short by a lower limit is "
        "generated again once a higher limit, or none, asks for more of its rows."
    ),
    "dataset.image_column": "job=edit: the column holding each row's reference image(s): an Image struct, a path, "
    "or a list of those.",
    "dataset.bad_rows": "A row that cannot be generated: refuse (exit 2 naming it) or skip (set aside in "
    "rejected/<run id>.parquet with its reason).",
    "dataset.keep_columns": "Source columns carried into every output with their types: a list of names, or all.",
    # generate
    "generate.height": "Image height in pixels (a row's height column overrides it).",
    "generate.width": "Image width in pixels (a row's width column overrides it).",
    "generate.num_inference_steps": "Denoising steps (a row's column overrides it; 1..1000).",
    "generate.guidance_scale": "Guidance scale (a row's column overrides it; 0..100).",
    "generate.max_sequence_length": "Text tokens per prompt; a longer prompt is truncated and counted.",
    "generate.batch_size": "Prompts per pipeline call (a call makes batch_size * images_per_prompt images).",
    "generate.seed": "The job's seed: each sample's seed is sha256('<seed>:<sample id>'), whatever the mesh or batch.",
    "generate.images_per_prompt": "Images per prompt, samples <prompt id>-<k>; each prompt is encoded once.",
    "generate.size_from_reference": "job=edit: each image takes its first reference's size, rounded to the model's "
    "factor.",
    "generate.reference_fit": "job=edit: how a reference meets the row's size: crop (keep the aspect ratio, center-"
    "crop), pad or stretch.",
    "generate.sweep": "A mapping from a generation key (guidance_scale, num_inference_steps, height, width, "
    "true_cfg_scale, lora_scale.<i>) to a list of values: every prompt at every combination, samples <id>@<v>.",
    # run
    "run.shard_size": "Prompts per shard: the unit of work, of resuming and of output files; part of the fingerprint.",
    "run.shards": "Which shards to run: pending (all not done), failed, all, or a list such as [0,3].",
    "run.overwrite": "Discard the folder's earlier results and start fresh.",
    "run.on_error": "A failed shard: continue with the others, or abort the run.",
    "run.stale": "Done shards whose prompts changed: error (exit 2 naming them), regenerate, or keep.",
    "run.timeout_s": "Seconds a rank waits on a silent peer before the job ends.",
    "run.max_attempts": "A shard failed this often with the same error is not retried by pending; failed retries it.",
    # output
    "output.dir": "The output folder: a local path, gs:// or s3:// (default outputs/<name> in the checkout).",
    "output.format": "Image encoding.",
    "output.quality": "jpeg and lossy webp quality, 1..100.",
    "output.lossless": "webp only: lossless (png is always lossless).",
    "output.image_files": "Also write images/shard-NNNNN/<id>.<ext> (the Parquet holds each image already).",
    "output.embed_images": "false: the Parquet's image column points at the image files (which are then written).",
    "output.png": "The old name of output.image_files; still works, with a notice.",
    "output.parquet": "Write data/shard-NNNNN.parquet, one row per image.",
    "output.reference_bytes": "job=edit: also keep the first reference's bytes (column reference_image).",
    "output.webdataset": "Also write webdataset/shard-NNNNN.tar with <id>.<ext> and <id>.json per sample.",
    "output.row_group_size": "Parquet rows per row group: loaders read a shard one group at a time.",
    "output.png_encoder": "The PNG encoder library.",
    "output.png_level": "PNG zlib level, 0..9: 1 is fast, 9 small.",
    "output.webp_method": "libwebp effort, 0..6: 0 is fastest.",
    "output.encode_workers": "PNG encoding processes per writer rank; 0: half the cores, shared by the writers.",
    "output.queue_shards": "Finished batches (and shard ends) waiting for the writer before generation waits "
    "(backpressure).",
    "output.publish": "Push each finished shard and the card to hf://datasets/ORG/NAME, s3:// or gs:// during the run "
    "(the dataset only, never state, logs or host names).",
    "output.metrics": "A local PATH.prom: the run's progress as a Prometheus textfile for node-exporter's textfile "
    "collector (samples done and failed, images/s, shard seconds, stage seconds), updated as shards finish.",
    # quality
    "quality.clip_score": "Add a clip_score column (float32): 100 * cosine of the CLIP image and prompt embeddings.",
    "quality.clip_model": "The CLIP model for quality.clip_score (a hub id or folder).",
    "quality.safety": "Add an nsfw column (bool) from diffusers' safety checker.",
    "quality.safety_model": "The safety checker model for quality.safety (a hub id or folder).",
    "quality.batch_size": "Images per scoring call.",
    # execution
    "execution.mode": "eager; defer_and_fuse (TorchTPU's deferred, fused eager); compile (torch.compile, static "
    "shapes).",
    "execution.offload": "model: diffusers' enable_model_cpu_offload, one model on the chip at a time (tp=1 only).",
    "execution.compile_cache_dir": "A persistent compile cache: TorchTPU's (a folder or gs://) or inductor's FX "
    "graph cache on CUDA and CPU; keep it across runs.",
    "execution.staged": "Per shard: encode every prompt, then denoise every batch, then decode; with offload each "
    "model moves to the chip once per shard.",
    "execution.release_text_encoder": "staged without offload: park the model a stage does not use in host memory.",
    "execution.cache": "Step caching (changes the images, so part of the fingerprint).",
    "execution.cache_options": "Options passed to diffusers' cache config class for execution.cache.",
    # workers
    "workers.index": "This host's worker number when several hosts share one job (null: from the scheduler's "
    "environment, else 0).",
    "workers.count": "How many workers share the job (null: from the scheduler's environment, else 1).",
    # testing
    "testing.fail_shards": "Shard indices whose processing raises an injected error (fault tests).",
    "testing.compile_backend": "A torch.compile backend in place of the device's (tests).",
    "testing.hold_after_ledger_read": "The launcher waits after reading the ledger until this file exists "
    "(race tests).",
    "testing.batch_sleep_s": "Seconds each batch sleeps (fault tests: a slow chip without burning CPU), 0..60.",
    "testing.hold_batches_until": "Each batch, once generated, waits until this file exists (race tests).",
}

# Keys with a fixed set of values (the preflight refuses any other: launcher/checks/settings.py).
ALLOWED: dict[str, tuple[str, ...]] = {
    "device": ("auto", "tpu", "cuda", "cpu"),
    "job": ("text_to_image", "edit"),
    "model.dtype": ("bfloat16", "float16", "float32"),
    "dataset.bad_rows": ("refuse", "skip"),
    "generate.reference_fit": ("crop", "pad", "stretch"),
    "run.on_error": ("continue", "abort"),
    "run.stale": ("error", "regenerate", "keep"),
    "output.format": ("png", "jpeg", "webp"),
    "output.png_encoder": ("imagecodecs", "pil"),
    "execution.mode": ("eager", "defer_and_fuse", "compile"),
    "execution.offload": ("none", "model"),
    "execution.cache": ("none", "taylorseer", "first_block", "magcache"),
}


def describe(key: str) -> str:
    """The key's description, with its allowed values where it has a fixed set."""
    text = DESCRIPTIONS.get(key, "")
    if key in ALLOWED:
        text = f"{text} One of: {', '.join(ALLOWED[key])}."
    return text.strip()
