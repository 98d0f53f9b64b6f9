"""What a job does with its shard, one module per job (`job=<name>` picks `jobs/<name>.py`).

Each job module gives the worker `shard_batches(rows, cfg)` (the shard's pipeline calls), `pipeline_kwargs`,
`run_batch` and `count_truncated`; the worker (launcher/worker/) runs them, staged or not. A job imports nothing
of the worker: what it needs is handed to it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

JOBS = ("text_to_image", "edit")


def job_of(name: str) -> ModuleType:
    return importlib.import_module(f"jobs.{name}")
