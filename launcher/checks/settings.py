"""The job's own settings, the mesh's numbers against this host, and whether the output folder can be written:
steps of the preflight (launcher/checks/preflight.py), exit 2 on failure.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from pathlib import Path

from launcher.errors import ConfigError
from launcher.sizing.mesh_plan import local_chip_count

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32")
MODES = ("eager", "defer_and_fuse", "compile")
CACHES = ("none", "taylorseer", "first_block", "magcache")


def check_settings(cfg) -> None:
    from omegaconf import OmegaConf

    from launcher.ledger.addresses import check_config

    check_config(cfg)  # first: an address with credentials in it must not reach any line or file

    metrics = str(cfg.output.metrics)
    if metrics and ("://" in metrics or not metrics.endswith(".prom")):  # what node-exporter's collector reads
        raise ConfigError(
            f"output.metrics={metrics} must be a local file path ending in .prom "
            "(node-exporter's textfile collector reads *.prom), e.g. /var/lib/node_exporter/meshgen.prom"
        )
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is not set; give it on the command line ({missing[0]}=...) or in the job")
    g, r = cfg.generate, cfg.run
    for key, value in (
        ("generate.num_inference_steps", g.num_inference_steps),
        ("generate.batch_size", g.batch_size),
        ("run.shard_size", r.shard_size),
        ("generate.max_sequence_length", g.max_sequence_length),
        ("generate.height", g.height),
        ("generate.width", g.width),
        ("generate.images_per_prompt", g.images_per_prompt),
        ("run.timeout_s", r.timeout_s),  # 0 would fail the first collective of every run
        ("run.max_attempts", r.max_attempts),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if not isinstance(r.shards, (str, int)) and len(r.shards) == 0:
        raise ConfigError("run.shards=[] selects no shards; name some ([0,3]) or use pending, failed or all")
    if g.guidance_scale < 0:
        raise ConfigError(f"generate.guidance_scale={g.guidance_scale} is negative; use 0 or more")
    if not 0 <= cfg.testing.batch_sleep_s <= 60:  # NaN fails both comparisons
        raise ConfigError(f"testing.batch_sleep_s={cfg.testing.batch_sleep_s} must be between 0 and 60 seconds")
    for key in ("hold_after_ledger_read", "hold_batches_until"):  # a hold writes PATH.waiting beside PATH
        hold = cfg.testing[key]
        if hold and not os.path.isdir(os.path.dirname(os.path.abspath(hold))):
            raise ConfigError(f"testing.{key}={hold}: its folder does not exist; name a file in an existing folder")
    from launcher.sources.bounds import config_problems

    if problems := config_problems(g):  # what would exhaust a host or make nothing but black images
        raise ConfigError(problems[0])
    choices = {
        "model.dtype": (cfg.model.dtype, DTYPES),
        "execution.mode": (cfg.execution.mode, MODES),
        "execution.offload": (cfg.execution.offload, ("none", "model")),
        "execution.cache": (cfg.execution.cache, CACHES),
        "device": (cfg.device, ("auto", "tpu", "cuda", "cpu")),
        "run.on_error": (r.on_error, ("continue", "abort")),
        "run.stale": (r.stale, ("error", "regenerate", "keep")),
        "dataset.bad_rows": (cfg.dataset.bad_rows, ("refuse", "skip")),
        "generate.reference_fit": (g.reference_fit, ("crop", "pad", "stretch")),
        "job": (cfg.job, ("text_to_image", "edit")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    check_output_settings(cfg.output)
    from launcher.plan.sweep import check_sweep

    check_sweep(g, cfg.model.get("loras") or [])
    check_model_values(cfg)


def check_model_values(cfg) -> None:
    """`model.call_kwargs` and the LoRAs' scales within the bounds every other path to the pipeline meets."""
    import math

    from omegaconf import OmegaConf

    from launcher.plan.sweep import raw_sweep
    from launcher.sources.bounds import LORA_SCALE, call_kwargs_problem

    kwargs = cfg.model.get("call_kwargs") or {}
    if problem := call_kwargs_problem(
        OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else kwargs,  # ty: ignore[invalid-argument-type]
        raw_sweep(cfg.generate),
    ):
        raise ConfigError(problem)
    low, high = LORA_SCALE
    for i, entry in enumerate(cfg.model.get("loras") or []):
        scale = float(entry.get("scale", 1.0))
        if not (math.isfinite(scale) and low <= scale <= high):
            raise ConfigError(f"model.loras[{i}].scale={scale} must be a finite number from {low:g} to {high:g}")


def check_output_settings(o) -> None:
    from launcher.writer.encode import FORMATS, LIBRARIES

    if o.format not in FORMATS:
        raise ConfigError(f"output.format={o.format!r} is not one of {', '.join(FORMATS)}")
    if o.png_encoder not in LIBRARIES:
        raise ConfigError(f"output.png_encoder={o.png_encoder!r} is not one of {', '.join(LIBRARIES)}")
    for key, value, low, high in (
        ("output.quality", o.quality, 1, 100),
        ("output.png_level", o.png_level, 0, 9),
        ("output.webp_method", o.webp_method, 0, 6),
        ("output.row_group_size", o.row_group_size, 1, None),
    ):
        if value < low or (high is not None and value > high):
            raise ConfigError(f"{key}={value} must be in {low}..{high}" if high else f"{key}={value} must be >= {low}")
    if o.lossless and o.format != "webp":
        raise ConfigError(
            f"output.lossless=true applies to output.format=webp only ({o.format} is "
            f"{'always lossless' if o.format == 'png' else 'lossy'}); drop it or use output.format=webp"
        )


def check_mesh(cfg, device: str | None = None, host: bool = True) -> None:
    """The mesh's numbers (resolved), and (`host`) its processes against this host's chips."""
    dp, tp, nodes = cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.nodes
    low = [f"mesh.{k}={v}" for k, v in (("dp", dp), ("tp", tp), ("nodes", nodes)) if v < 1]
    if low:
        raise ConfigError(f"{' and '.join(low)} must be at least 1 (processes = mesh.dp * mesh.tp)")
    if (dp * tp) % nodes:
        raise ConfigError(f"mesh.dp * mesh.tp = {dp * tp} processes do not split evenly over mesh.nodes={nodes}")
    if tp > 1 and cfg.execution.offload != "none":
        raise ConfigError(
            f"execution.offload={cfg.execution.offload} cannot combine with mesh.tp={tp}: offload "
            "moves whole models between host and chip; use mesh.tp=1 or execution.offload=none"
        )
    if device is None:
        from launcher.worker.dist import resolve_device

        device = resolve_device(cfg.device)
    chips = local_chip_count(device) if host else None
    per_host = dp * tp // nodes
    if chips is not None and per_host > chips:
        raise ConfigError(
            f"mesh.dp * mesh.tp = {per_host} processes per host but this host has {chips} "
            f"{device} chips; lower mesh.dp or mesh.tp"
        )


def check_output(cfg) -> None:
    out = Path(cfg.output.dir)
    if "://" in str(cfg.output.dir):
        return check_object_store(str(cfg.output.dir))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} is a file; choose a folder")
    probe = out
    while not os.path.lexists(probe):
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"output.dir {out} cannot be created: {probe} is a file; choose another folder")
    try:  # an unnamed temporary file (O_TMPFILE where supported): nothing appears, even for a moment
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(
            f"output.dir {out} cannot be written (creating a file in {probe} fails: {e.strerror}); "
            "choose another folder or fix its permissions"
        ) from None


def check_object_store(url: str) -> None:
    """gs:// or s3://: the client libraries are there and the bucket answers (nothing is written)."""
    import importlib.util

    scheme, _, rest = url.partition("://")
    needs = {"s3": ("boto3", "s3"), "gs": ("google.cloud.storage", "gcs")}.get(scheme)
    if needs is None:
        raise ConfigError(f"output.dir={url}: unknown scheme {scheme}://; use a local path, gs:// or s3://")
    if importlib.util.find_spec(needs[0].split(".")[0]) is None:
        raise ConfigError(f'output.dir={url} needs {needs[0]}: pip install -e ".[{needs[1]}]"')
    import pyarrow.fs as pafs

    from launcher.ledger.gcs import probe_gcs
    from launcher.ledger.store import open_uri

    try:
        if scheme == "gs":  # bounded: pyarrow's client waits minutes on a server that never answers
            probe_gcs(url)
        fs, root = open_uri(url)
        found = fs.get_file_info(root.split("/", 1)[0]).type != pafs.FileType.NotFound
        problem = "" if found else "no such bucket"
    except Exception as e:  # whatever the store says: no credentials, unreachable
        problem = str(e).splitlines()[0]
    if problem:
        raise ConfigError(
            f"output.dir={url} cannot be reached ({problem}); check the bucket name and the credentials "
            "(the AWS_* variables, or gcloud application default credentials; "
            "STORAGE_EMULATOR_HOST for a local GCS server)"
        )


def check_host_env(nodes: int, device: str) -> None:
    """A job over several hosts: every host's launcher needs its place among them (NODE_RANK, 0 to nodes - 1) and
    the first host's address (MASTER_ADDR) from the scheduler. Without them torchrun's rendezvous fails, or another
    host's books are kept twice, only once the run has begun: refused here, before anything is written. On a TPU
    slice TorchTPU derives both (set_tpu_launch_env, after this check) from TPU_WORKER_HOSTNAMES or
    JOB_COMPLETION_INDEX (FINDINGS.md), so either of those will do there."""
    if device == "tpu" and ("," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or "JOB_COMPLETION_INDEX" in os.environ):
        return
    rank = os.environ.get("NODE_RANK")
    if rank is None:
        raise ConfigError(
            f"mesh.nodes={nodes} needs NODE_RANK, this host's place among them (0 to {nodes - 1}), and it is not "
            "set: set NODE_RANK and MASTER_ADDR on every host as the scheduler's recipes do (docs/operations.md)"
        )
    if not (rank.isascii() and rank.isdigit()) or int(rank) >= nodes:
        raise ConfigError(
            f"NODE_RANK={rank!r} is not a host of mesh.nodes={nodes}: set it to this host's place, 0 to {nodes - 1}"
        )
    if not os.environ.get("MASTER_ADDR"):
        raise ConfigError(
            f"mesh.nodes={nodes} needs MASTER_ADDR, the first host's address, and it is not set: set it to the "
            "address of the host with NODE_RANK=0, the same on every host"
        )


def store_address() -> tuple[str, int]:
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def check_store_port(node_rank: int) -> None:
    """On the first host, the rendezvous port must be free: torch's agent binds it, and fails deep inside."""
    if node_rank != 0:
        return
    import errno

    _, port = store_address()
    for family in (socket.AF_INET6, socket.AF_INET):  # torch's store listens on both where it can
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    continue  # no IPv6 here
                raise ConfigError(
                    f"MASTER_PORT {port} cannot be bound on this host ({e.strerror}); another program holds it: "
                    "pick a free port and set MASTER_PORT to it on every host"
                ) from None
