"""This host's share of a job's shards when several hosts (workers) run one job."""

from __future__ import annotations

import os

from launcher.errors import ConfigError


def resolve_workers(cfg, env=os.environ) -> tuple[int, int]:
    """(workers.index, workers.count): from the config, else the scheduler's environment, else (0, 1).

    A multi-host torchrun job (mesh.nodes > 1) is one worker: its hosts share the mesh, not the shards.
    """
    index, count = cfg.workers.index, cfg.workers.count
    if index is None and count is None and cfg.mesh.nodes == 1:
        index, count = _from_env(env)
    index = 0 if index is None else int(index)
    count = 1 if count is None else int(count)
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"workers.index={index} must be in 0..workers.count-1 (workers.count={count})")
    return index, count


def _from_env(env) -> tuple[int | None, int | None]:
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        return int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
    if "JOB_COMPLETION_INDEX" in env:
        # Indexed Job / JobSet: the count is the Job's completions, which we pass down as an env var.
        count = env.get("MESHGEN_WORKERS") or env.get("JOB_COMPLETIONS")
        if count is None:
            raise ConfigError(
                "JOB_COMPLETION_INDEX is set but not the worker count; set workers.count "
                "(or the env var MESHGEN_WORKERS) to the Job's completions"
            )
        return int(env["JOB_COMPLETION_INDEX"]), int(count)
    if "TPU_WORKER_ID" in env:
        hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        return int(env["TPU_WORKER_ID"]), max(len(hosts), 1)
    return None, None
