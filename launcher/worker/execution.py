"""Execution modes: strict eager, TorchTPU's deferred-and-fused eager, and torch.compile with static shapes.

- `defer_and_fuse` is an environment variable that TorchTPU reads at import, so the launcher sets it before any
  worker starts (see `mode_env`).
- `compile` compiles the transformer (`backend="tpu"` on TPU, inductor elsewhere) with `fullgraph=True,
  dynamic=False`: one graph per input shape. With model offload it compiles only the repeated blocks
  (`compile_repeated_blocks`), since offload hooks move whole models between host and chip around each call.
  Batches are padded and bucketed by shape upstream, so each shape compiles once, during its warm-up.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def mode_env(cfg, device: str) -> dict[str, str]:
    """Environment the workers need for the execution mode and compile cache, set before torch is imported."""
    env = {}
    if cfg.execution.mode == "defer_and_fuse":
        env["TORCH_TPU_DEFER_AND_FUSE"] = "1"
    cache = cfg.execution.compile_cache_dir
    if cache:
        if device == "tpu":
            env["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] = cache  # a folder or gs://, shared across hosts
        else:
            path = os.path.abspath(cache)
            env.update(TORCHINDUCTOR_CACHE_DIR=path, TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    return env


class CompileStats:
    """Counts graph compilations by wrapping the backend: one per new input shape when shapes are static."""

    def __init__(self):
        self.compiles = 0

    def backend(self, name: str):
        from torch._dynamo import lookup_backend

        inner = lookup_backend(name)

        def counted(gm, example_inputs):
            self.compiles += 1
            return inner(gm, example_inputs)

        return counted


def compile_backend(device_type: str, override: str | None = None) -> str:
    return override or ("tpu" if device_type == "tpu" else "inductor")


def compile_args(device_type: str, stats: CompileStats, backend: str | None = None) -> dict:
    return {
        "backend": stats.backend(compile_backend(device_type, backend)),
        "fullgraph": True,
        "dynamic": False,
    }


def apply_compile(pipe, cfg, device_type: str, stats: CompileStats) -> None:
    """Compile the transformer in place as `execution.mode=compile` asks; a no-op in the eager modes."""
    if cfg.execution.mode != "compile":
        return
    backend = compile_backend(device_type, cfg.get("testing", {}).get("compile_backend"))
    kwargs = compile_args(device_type, stats, backend)
    if cfg.execution.offload == "model":
        pipe.transformer.compile_repeated_blocks(**kwargs)
        logger.info("compiling the transformer's repeated blocks (model offload), fullgraph, static shapes")
    else:
        pipe.transformer.compile(**kwargs)
        logger.info("compiling the transformer (%s backend), fullgraph, static shapes", backend)


def cache_hits() -> int:
    """Inductor FX-graph cache hits so far in this process (0 where the backend keeps no such count)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("fxgraph_cache_hit", 0))
