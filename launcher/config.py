"""The job's typed schema, and composing a job config from `conf/NAME.yaml` plus overrides.

YAML files only pick values; every key and its type are declared here, so a misspelt key fails at compose time.
We use Hydra's compose API rather than `@hydra.main`: under torchrun every rank composes the same config, and
compose creates no run folder, changes no working directory and installs no logging handlers.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from launcher.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


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


@dataclass
class MeshConfig:
    dp: int = 1
    tp: int = 1
    nodes: int = 1


@dataclass
class DatasetConfig:
    path: str = MISSING
    prompt_column: str = "prompt"
    id_column: str | None = None
    limit: int | None = None


@dataclass
class GenerateConfig:
    height: int = 1024
    width: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 4.0
    max_sequence_length: int = 512
    batch_size: int = 1
    seed: int = 0


@dataclass
class RunConfig:
    shard_size: int = 256
    shards: Any = "pending"  # pending | failed | all | [i, ...]
    overwrite: bool = False
    on_error: str = "continue"  # continue | abort
    stale: str = "error"  # error | regenerate | keep: what to do with done shards whose prompts changed
    timeout_s: int = 600  # process-group timeout: how long a rank waits on a silent peer


@dataclass
class OutputConfig:
    dir: str = "${repo:}/outputs/${name}"
    png: bool = True
    parquet: bool = True
    webdataset: bool = False  # also webdataset/shard-NNNNN.tar with <id>.png and <id>.json per sample
    png_encoder: str = "imagecodecs"  # imagecodecs (libpng) | pil
    png_level: int = 1  # zlib level: 1 is fast, 9 small
    encode_workers: int = 0  # PNG encoding processes per writer rank; 0: half the cores, shared by the writers
    queue_shards: int = 2  # finished shards waiting for the writer before generation waits (backpressure)


@dataclass
class ExecutionConfig:
    mode: str = "eager"  # eager | defer_and_fuse | compile
    offload: str = "none"  # none | model
    compile_cache_dir: str | None = None


@dataclass
class WorkersConfig:
    index: int | None = None  # None: from the scheduler's environment, else 0
    count: int | None = None


@dataclass
class TestingConfig:
    fail_shards: list[int] = field(default_factory=list)


@dataclass
class JobConfig:
    name: str = MISSING  # the conf file's name, set by load_config
    device: str = "auto"  # auto | tpu | cuda | cpu
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    run: RunConfig = field(default_factory=RunConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
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


def load_config(conf: str = "tiny", overrides: list[str] | None = None) -> DictConfig:
    """Compose `conf/<conf>.yaml` with `overrides`; raise ConfigError with one clear line if that fails."""
    if conf not in available_confs():
        raise ConfigError(f"unknown conf={conf!r}; available: {', '.join(available_confs())}")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=conf, overrides=[f"name={conf}", *(overrides or [])])
        OmegaConf.resolve(cfg)
    except OverrideParseException as e:
        raise ConfigError(_parse_error(overrides or [], e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_one_line(e)) from None
    # Hydra lets `+key=value` add keys the schema lacks; such a key would be silently ignored, so refuse it.
    unknown = _unknown_keys(cfg, JobConfig)
    if unknown:
        raise ConfigError(_unknown_key_message(unknown[0]) or f"unknown config key {unknown[0]}")
    return cfg


def _unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    out = []
    for key in node:
        if key not in hints:
            out.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):
            out += _unknown_keys(node[key], hints[key], f"{prefix}{key}.")
    return out


def _unknown_key_message(full_key: str) -> str | None:
    """`generate.heigth` -> the valid keys of `generate`, and the closest one; None if free-form (call_kwargs)."""
    *parents, leaf = full_key.split(".")
    schema: type = JobConfig
    for i, part in enumerate(parents):
        hint = typing.get_type_hints(schema).get(part)
        if hint is None:  # the unknown key is a parent: report that one
            return _unknown_key_message(".".join(parents[: i + 1]))
        if not dataclasses.is_dataclass(hint):
            return None
        schema = hint
    keys = [f.name for f in dataclasses.fields(schema)]
    group = ".".join(parents)
    prefix = f"{group}." if group else ""
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    return (
        f"bad configuration: unknown key {leaf!r} (full_key: {full_key}); {hint}"
        f"the keys of {group or 'a job'} are: {', '.join(keys)}"
    )


def _one_line(e: Exception) -> str:
    # Hydra wraps the useful message (e.g. "Key 'heigth' not in 'GenerateConfig'") in a multi-line text.
    cause = e.__cause__ or e
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key:
        text = _unknown_key_message(full_key)
        if text:
            return text
    if cause is not e and full_key:
        # Hydra's own lines after the first say how to fix it (e.g. "To append to your config use +key=value").
        return "; ".join([f"bad configuration: {_lines(cause)[0]} (full_key: {full_key})", *_lines(e)[1:]])
    return f"bad configuration: {'; '.join(_lines(e))}"


def _parse_error(overrides: list[str], e: Exception) -> str:
    """Name the override that does not parse: Hydra's message may not, when several are given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception as err:  # whatever the parser raises for this one override
            detail = _lines(err)[-1]
            return (
                f"bad configuration: cannot parse the override {o!r} ({detail}); write key=value, and quote a "
                f"value with special characters, e.g. 'model.path=\"~/models/x\"'"
            )
    return f"bad configuration: {'; '.join(_lines(e))}; overrides look like key=value"


def _lines(e: Exception) -> list[str]:
    """The message's lines, with a listing ("Available options in 'mesh':" then one per line) on one line."""
    out: list[str] = []
    listing = False
    for ln in (ln.strip() for ln in str(e).splitlines()):
        if not ln or ln.startswith(("See https://", "Config search path")):
            if ln:
                break
            continue
        if listing and not ln.endswith(":") and "=" not in ln:
            out[-1] += (" " if out[-1].endswith(":") else ", ") + ln
            continue
        listing = ln.endswith(":")
        if not ln.startswith(("full_key:", "reference_type=", "object_type=")):
            out.append(ln)
    return out or [type(e).__name__]
