"""The job's typed schema, and composing a job config from `conf/NAME.yaml` plus overrides.

YAML files only pick values; every key and its type are declared here, so a misspelt key fails at compose time.
We use Hydra's compose API rather than `@hydra.main`: under torchrun every rank composes the same config, and
compose creates no run folder, changes no working directory and installs no logging handlers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config_errors import one_line, parse_error, unknown_key_message, unknown_keys
from launcher.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


@dataclass
class LoraEntry:
    path: str = MISSING  # a .safetensors file, a folder holding one (or `weight_name`), or a hub id
    scale: float = 1.0
    weight_name: str | None = None  # the file inside a folder or hub repo with several


@dataclass
class ModelConfig:
    path: str = MISSING  # hub id or local folder of a diffusers pipeline
    dtype: str = "bfloat16"
    shard_text_encoder: bool = True
    shard_transformer: bool = True
    # Extra keyword arguments for the pipeline call that a model family needs (e.g. which encoder layers to use).
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    # A builder that creates `path` when it is missing (only for the project's own tiny test model).
    build: str | None = None
    license: str = ""
    loras: list[LoraEntry] = field(default_factory=list)  # fused into the weights at load (launcher/worker/lora.py)


@dataclass
class MeshConfig:
    # A whole number or "auto" (tp: the smallest that fits the chip; dp: fill the host's chips). The launcher
    # resolves auto once (launcher/sizing/mesh_plan.py) and hands the workers numbers.
    dp: Any = 1
    tp: Any = 1
    nodes: int = 1
    chip: str = "auto"  # auto (what this host has) | v5e | v5p | v6e | v7x | h100 | h200 | another name
    chip_memory_gib: float | None = None  # None: from the chip table (or the device, for auto)
    chips_per_host: int | None = None  # None: counted from the device files (TPU) or the driver (CUDA)


@dataclass
class DatasetConfig:
    path: str = MISSING
    prompt_column: str = "prompt"
    id_column: str | None = None
    limit: int | None = None
    image_column: str = "image"  # job=edit: each row's reference image(s) (launcher/sources/references.py)
    bad_rows: str = "refuse"  # refuse (exit 2 naming the row) | skip (rejected/<run id>.parquet: sources/rejected.py)
    # source columns carried into every output with their Arrow types: a list of names, or "all"
    keep_columns: Any = field(default_factory=list)


@dataclass
class GenerateConfig:
    height: int = 1024
    width: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 4.0
    max_sequence_length: int = 512
    batch_size: int = 1  # prompts per pipeline call: a call denoises batch_size * images_per_prompt images
    seed: int = 0
    images_per_prompt: int = 1  # samples <prompt id>-<k>, k = 0..N-1, encoded once per prompt
    size_from_reference: bool = False  # job=edit: the first reference's size, rounded to the model's factor
    reference_fit: str = "crop"  # job=edit: crop (cover, center-crop) | pad (fit, black borders) | stretch
    # key -> values: every prompt at every combination, samples <base id>@<v> (launcher/plan/sweep.py)
    sweep: Any = None


@dataclass
class RunConfig:
    shard_size: int = 256
    shards: Any = "pending"  # pending | failed | all | [i, ...]
    overwrite: bool = False
    on_error: str = "continue"  # continue | abort
    stale: str = "error"  # error | regenerate | keep: what to do with done shards whose prompts changed
    timeout_s: int = 600  # process-group timeout: how long a rank waits on a silent peer
    max_attempts: int = 3  # a shard failed this often with one error class is not retried by run.shards=pending


@dataclass
class OutputConfig:
    dir: str = "${repo:}/outputs/${name}"
    format: str = "png"  # png | jpeg | webp
    quality: int = 95  # jpeg and lossy webp, 1..100
    lossless: bool = False  # webp only (png is always lossless)
    # images/shard-NNNNN/<id>.<ext>. Off by default since issue 35: the Parquet holds each image once
    image_files: bool = False
    embed_images: bool = True  # false: the Parquet's image column points at the files (which are then written)
    png: bool | None = None  # the old name of image_files: still works, with a notice (load_config maps it)
    parquet: bool = True
    reference_bytes: bool = False  # job=edit: also keep the first reference's bytes (column reference_image)
    webdataset: bool = False  # also webdataset/shard-NNNNN.tar with <id>.<ext> and <id>.json per sample
    row_group_size: int = 64  # Parquet rows per row group: loaders read a shard one group at a time
    png_encoder: str = "imagecodecs"  # imagecodecs (libpng) | pil
    png_level: int = 1  # zlib level: 1 is fast, 9 small
    webp_method: int = 0  # libwebp effort 0..6: 0 is ~3x faster than 4 for 0.2 dB at quality 95
    encode_workers: int = 0  # PNG encoding processes per writer rank; 0: half the cores, shared by the writers
    queue_shards: int = 2  # finished batches waiting for the writer before generation waits (backpressure)
    publish: str = ""  # hf://datasets/ORG/NAME, s3:// or gs://: each done shard is pushed there, the card at the end
    metrics: str = ""  # a local PATH.prom: the run's progress as a Prometheus textfile (node-exporter's collector)


@dataclass
class QualityConfig:
    """Columns scored on the chips as the images are made (launcher/worker/quality.py); they change no image."""

    clip_score: bool = False  # clip_score (float32): 100 * cosine of the CLIP image and prompt embeddings
    clip_model: str = "openai/clip-vit-large-patch14"
    safety: bool = False  # nsfw (bool): diffusers' StableDiffusionSafetyChecker
    safety_model: str = "CompVis/stable-diffusion-safety-checker"
    batch_size: int = 16  # images per scoring call


@dataclass
class ExecutionConfig:
    mode: str = "eager"  # eager | defer_and_fuse | compile
    offload: str = "none"  # none | model
    compile_cache_dir: str | None = None
    # Per shard: encode every prompt, then denoise every batch, then decode (launcher/worker/staged.py).
    staged: bool = False
    release_text_encoder: bool = True  # staged without offload: the text encoder leaves the chip while denoising
    cache: str = "none"  # none | taylorseer | first_block | magcache (step caching; changes the images)
    cache_options: dict[str, Any] = field(default_factory=dict)  # passed to diffusers' cache config class


@dataclass
class WorkersConfig:
    index: int | None = None  # None: from the scheduler's environment, else 0
    count: int | None = None


@dataclass
class TestingConfig:
    fail_shards: list[int] = field(default_factory=list)
    # torch.compile backend in place of the device's (tests: aot_eager traces the same fullgraph graphs as
    # inductor without its C++ build, which costs minutes on a busy 2-core machine)
    compile_backend: str | None = None
    # the launcher waits, after reading the ledger and before planning, until this file exists (race tests: another
    # worker finishes shards while this one plans)
    hold_after_ledger_read: str | None = None
    # seconds each batch takes longer, asleep (fault tests: a run slow enough to act on mid-run, like a slow chip,
    # without burning the CPU that the other tests run on)
    batch_sleep_s: float = 0.0
    # each batch waits, once generated, until this file exists (race tests: a run that holds its lock and its
    # workers while another launch tries the folder, then finishes at full speed)
    hold_batches_until: str | None = None


@dataclass
class JobConfig:
    name: str = MISSING  # the conf file's name, set by load_config
    device: str = "auto"  # auto | tpu | cuda | cpu
    job: str = "text_to_image"  # text_to_image | edit (jobs/<job>.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    run: RunConfig = field(default_factory=RunConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)


ConfigStore.instance().store(name="schema", node=JobConfig)
if not OmegaConf.has_resolver("repo"):
    OmegaConf.register_new_resolver("repo", lambda: str(REPO_ROOT))


def available_confs() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def split_args(args: list[str]) -> tuple[str, list[str]]:
    """`conf=NAME` picks the job; every other argument is a Hydra override."""
    conf, overrides = "tiny", []
    for arg in args:
        if arg.startswith("conf="):
            conf = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return conf, overrides


def job_file(conf: str) -> Path | None:
    """`conf=PATH.yaml`: a job file kept anywhere (absolute, or relative to the working directory)."""
    return Path(os.path.abspath(os.path.expanduser(conf))) if conf.endswith((".yaml", ".yml")) else None


def load_config(conf: str = "tiny", overrides: list[str] | None = None) -> DictConfig:
    """Compose `conf/<conf>.yaml`, or the job file `conf` names, with `overrides`; ConfigError (one line) if that
    fails. A job file's `defaults:` may name the project's groups and files beside it."""
    path, extra = job_file(conf), []
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"conf={conf}: no such job file ({path}); give a .yaml file's path or a conf name")
        config_dir, name = path.parent, path.stem
        extra = [f"hydra.searchpath=[file://{CONF_DIR}]"]  # after the file's own folder: the project's groups
    elif conf not in available_confs():
        raise ConfigError(
            f"unknown conf={conf!r}; available: {', '.join(available_confs())} (or conf=PATH.yaml, a job file)"
        )
    else:
        config_dir, name = CONF_DIR, conf
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=name, overrides=[*extra, f"name={name}", *(overrides or [])])
        OmegaConf.resolve(cfg)
    except OverrideParseException as e:
        raise ConfigError(parse_error(overrides or [], e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(one_line(e, JobConfig)) from None
    # Hydra lets `+key=value` add keys the schema lacks; such a key would be silently ignored, so refuse it.
    unknown = unknown_keys(cfg, JobConfig)
    if unknown:
        raise ConfigError(unknown_key_message(unknown[0], JobConfig) or f"unknown config key {unknown[0]}")
    for key in ("dp", "tp"):  # typed Any in the schema, since OmegaConf has no int-or-"auto" type
        v = cfg.mesh[key]
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"mesh.{key}={v!r} must be a whole number or auto")
    if cfg.output.png is not None:  # the old name wins where it is given: it is what the user wrote
        cfg.output.image_files = cfg.output.png
    if not cfg.output.embed_images:  # rows that point at files need the files
        cfg.output.image_files = True
    if cfg.output.format == "jpg":  # the files' own suffix: the same format, one name in the fingerprint
        cfg.output.format = "jpeg"
    resolve_paths(cfg)
    return cfg


def resolve_paths(cfg: DictConfig) -> None:
    """Relative local paths resolve against the working directory, once, here: the run's records and the commands
    it prints then name the same files from any folder (workers compose in the same directory, so agree)."""
    for key in ("dataset.path", "output.dir", "model.path"):
        group, leaf = key.split(".")
        if OmegaConf.is_missing(cfg[group], leaf):
            continue  # said at preflight, in one line
        value = cfg[group][leaf]
        if not isinstance(value, str) or "://" in value or os.path.isabs(os.path.expanduser(value)):
            continue
        if key == "model.path" and not Path(value).exists():
            continue  # a hub id ("org/name") is not a path
        cfg[group][leaf] = os.path.abspath(os.path.expanduser(value))


def renamed_keys_notice(cfg: DictConfig) -> str | None:
    """One line for a config that uses an old key name (said by the launcher once, not by every rank)."""
    if cfg.output.png is None:
        return None
    value = str(cfg.output.image_files).lower()
    return f"output.png is now called output.image_files; the old name still works (output.image_files={value})"
