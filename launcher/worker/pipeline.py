"""Load a diffusers pipeline with its text encoder and transformer sharded over the mesh's `tp` axis.

Each rank reads only its own slice: diffusers shards the transformer while reading (`TensorParallelConfig`),
transformers shards the text encoder (`DistributedConfig`). Components without a tensor-parallel plan are
replicated.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from pathlib import Path

import torch

from launcher.logs import STAGE_EVENTS

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def component_classes(path: str) -> dict[str, tuple[str, str]]:
    """model_index.json of a local folder or a cached hub pipeline: component -> (library, class name)."""
    from diffusers import DiffusionPipeline

    index = (
        json.loads((Path(path) / "model_index.json").read_text())
        if Path(path).is_dir()
        else DiffusionPipeline.load_config(path)
    )
    return {k: tuple(v) for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0]}


def _cls(lib_and_name: tuple[str, str]):
    return getattr(importlib.import_module(lib_and_name[0]), lib_and_name[1])


@contextlib.contextmanager
def cpu_tp_shims(device_type: str):
    """diffusers 0.42 tensor parallelism on CPU (gloo), which only tests and the demo use.

    Two CPU-only obstacles, both in diffusers' TP loading: its list of TP devices lacks "cpu", and it picks the
    rank's device as `rank % torch.accelerator.device_count()`, which is 0 on CPU (ZeroDivisionError). On TPU
    and CUDA this is a no-op.
    """
    if device_type != "cpu":
        yield
        return
    import diffusers.hooks.tensor_parallel as tp_hooks

    saved_devices, saved_count = tp_hooks._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    tp_hooks._SUPPORTED_TP_DEVICES = (*saved_devices, "cpu")
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        tp_hooks._SUPPORTED_TP_DEVICES, torch.accelerator.device_count = saved_devices, saved_count


def text_encoder_has_tp_plan(path: str, cls) -> bool:
    config = cls.config_class.from_pretrained(path, subfolder="text_encoder")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "base_model_tp_plan", None) or getattr(cls, "_tp_plan", None))


def load_pipeline(cfg, device: torch.device, mesh):
    """The pipeline on `device`, with components sharded over `mesh["tp"]` as the config asks."""
    import os

    from diffusers import DiffusionPipeline

    if os.environ.get("MESHGEN_VERBOSE") != "1":
        import diffusers.utils.logging
        import transformers.utils.logging

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
    tp, dp = cfg.mesh.tp, cfg.mesh.dp
    classes = component_classes(path)
    parts = {}
    stage = logging.getLogger(STAGE_EVENTS)  # the launcher's bar shows rank 0's
    if tp > 1 and cfg.model.shard_transformer and "transformer" in classes:
        stage.info("loading transformer")
        from diffusers import TensorParallelConfig

        with cpu_tp_shims(device.type):
            parts["transformer"] = _cls(classes["transformer"]).from_pretrained(
                path,
                subfolder="transformer",
                dtype=dtype,
                parallel_config=TensorParallelConfig(mesh=mesh["tp"]),
            )
        logger.info("transformer sharded over tp=%d", tp)
    te_cls = _cls(classes["text_encoder"]) if "text_encoder" in classes else None
    if tp > 1 and cfg.model.shard_text_encoder and te_cls is not None and text_encoder_has_tp_plan(path, te_cls):
        from transformers import DistributedConfig

        stage.info("loading text_encoder")
        # transformers builds its own (dp, tp) mesh with the same tp groups as ours on CPU and CUDA; on TPU
        # its groups may not follow our topology-aware layout, which costs speed, not correctness.
        parts["text_encoder"] = te_cls.from_pretrained(
            path,
            subfolder="text_encoder",
            dtype=dtype,
            distributed_config=DistributedConfig(tp_size=tp, dp_replicate_size=dp),
        )
        logger.info("text encoder sharded over tp=%d", tp)
    for lib, _ in component_classes(path).values():  # our own components (a tiny model's processor) by name
        if lib.startswith("launcher.models."):
            importlib.import_module(lib)
    rest = [c for c in classes if c not in parts]
    stage.info("loading %s", ", ".join(rest) if rest else "the pipeline")
    pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype, **parts)
    stage.info("placing on %s", device)
    place(pipe, cfg, device)
    if cfg.model.get("loras"):
        from launcher.worker.lora_fuse import fuse_configured

        fuse_configured(pipe, cfg)  # into each rank's own slices, after placing: on the chip where they live
    if parts:
        release_freed_heap()
    return pipe


def release_freed_heap() -> None:
    """Give the heap that sharded loading freed back to the system.

    Each rank reads whole tensors and keeps its slices; glibc keeps the freed rest in the process. Measured by
    tools/bench on a 520 MB transformer at tp=2: 70-100 MB per rank, so the weights' private memory was
    0.73-0.78x of tp=1's instead of 0.59x. Elsewhere than glibc there is nothing to do.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def place(pipe, cfg, device: torch.device) -> None:
    """Put the pipeline on the chip, or let accelerate move each model there only while it runs (offload)."""
    if cfg.execution.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
