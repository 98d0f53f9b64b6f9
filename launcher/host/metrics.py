"""`output.metrics=PATH`: the run's progress as a Prometheus textfile, for node-exporter's textfile collector
(`--collector.textfile.directory`: PATH must end in `.prom` and lie in that folder) or anything that reads the
text format (Cloud Monitoring's Prometheus ingestion, a sidecar).

Written by the launcher that keeps the books, from the ledger it already watches for the progress bar
(launcher/host/summary.py's Progress): at the start, each time a shard of this run finishes, and at the end with the
numbers of the run's record (`runs/<run id>.json`, key `metrics`). node-exporter reads the file whenever it likes,
so each version is written whole beside it and renamed over it. A local path only: a collector reads local files.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# name -> (type, help); every sample carries the labels output (output.dir) and run_id.
METRICS = {
    "meshgen_samples_planned": ("gauge", "Samples (images) this run set out to generate."),
    "meshgen_samples_done": ("gauge", "Samples of this run in done shards."),
    "meshgen_samples_failed": ("gauge", "Samples of this run in failed shards."),
    "meshgen_shards_done": ("gauge", "Shards this run finished done."),
    "meshgen_shards_failed": ("gauge", "Shards this run finished failed."),
    "meshgen_images_per_second": ("gauge", "Done samples per second of the run's wall time so far."),
    "meshgen_shard_seconds": ("summary", "Seconds a shard of this run took, from its first batch to its state."),
    "meshgen_shard_last_seconds": ("gauge", "Seconds the most recently finished shard of this run took."),
    "meshgen_stage_seconds": ("gauge", "Seconds per stage (label stage), summed over this run's shards."),
    "meshgen_run_seconds": ("gauge", "Wall seconds since the launch."),
    "meshgen_last_update_timestamp_seconds": ("gauge", "When this file was written (Unix time)."),
}


def numbers(ours: dict[int, dict], wall: float) -> dict:
    """The run's numbers from its own shards' states (`ours`: shard -> state, this run's only)."""
    done = [st for st in ours.values() if st.get("status") == "done"]
    failed = [st for st in ours.values() if st.get("status") != "done"]
    seconds = [(st.get("finished_at") or 0.0, st["seconds"]) for st in ours.values() if st.get("seconds") is not None]
    stages: dict[str, float] = {}
    for st in ours.values():
        for k, v in (st.get("stages") or {}).items():
            stages[k] = round(stages.get(k, 0.0) + v, 3)
    samples = sum(st.get("rows") or 0 for st in done)
    return {
        "samples_done": samples,
        "samples_failed": sum(st.get("rows") or 0 for st in failed),
        "shards_done": len(done),
        "shards_failed": len(failed),
        "images_per_second": round(samples / wall, 3) if wall > 0 else 0.0,
        "shard_seconds_count": len(seconds),
        "shard_seconds_sum": round(sum(s for _, s in seconds), 3),
        "shard_last_seconds": max(seconds)[1] if seconds else None,
        "stage_seconds": stages,
        "run_seconds": round(wall, 2),
    }


def write_textfile(path: str | os.PathLike, output: str, run_id: str, values: dict, planned: int | None) -> None:
    """`values` (from `numbers`) and the samples `planned` as a Prometheus textfile at `path`, replaced whole."""
    values = {**values, "samples_planned": planned}
    labels = f'output="{_escape(output)}",run_id="{_escape(run_id)}"'
    sample = {
        "meshgen_stage_seconds": [
            (f'{{{labels},stage="{_escape(k)}"}}', v) for k, v in sorted(values["stage_seconds"].items())
        ],
        "meshgen_shard_seconds": [
            (f"_count{{{labels}}}", values["shard_seconds_count"]),
            (f"_sum{{{labels}}}", values["shard_seconds_sum"]),
        ],
        "meshgen_last_update_timestamp_seconds": [(f"{{{labels}}}", round(time.time(), 3))],
    }
    lines = []
    for name, (kind, text) in METRICS.items():
        got = sample.get(name, [(f"{{{labels}}}", values.get(name.removeprefix("meshgen_")))])
        got = [(s, v) for s, v in got if v is not None]
        if got:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *(f"{name}{s} {v}" for s, v in got)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # a hidden name: the collector reads *.prom only
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def metrics_file(cfg, store, plan, run_id: str, start: float) -> MetricsFile | None:
    """output.metrics's file for this run (None where it is not set), written once now: the run has begun."""
    if not cfg.output.metrics:
        return None
    from launcher.plan.sweep import n_variants

    planned = plan.prompts(plan.selected) * cfg.generate.images_per_prompt * n_variants(cfg.generate)
    metrics = MetricsFile(cfg.output.metrics, str(store), run_id, planned, start)
    metrics.update({})
    return metrics


class MetricsFile:
    """The textfile of one run: rewritten when the set of this run's finished shards changes, and at the end. A
    file that cannot be written is a warning: monitoring never stops a run."""

    def __init__(self, path: str, output: str, run_id: str, planned: int | None, start: float):
        self.path, self.output, self.run_id, self.planned, self.start = path, output, run_id, planned, start
        self._seen: set[int] | None = None

    def update(self, ours: dict[int, dict]) -> None:
        """`ours`: this run's shards' states now (the progress bar's look at the ledger)."""
        if set(ours) != self._seen:
            self._seen = set(ours)
            self._write(numbers(ours, time.monotonic() - self.start))

    def final(self, values: dict) -> None:
        """The run record's numbers (`runs/<run id>.json`, key `metrics`)."""
        self._write(values)

    def _write(self, values: dict) -> None:
        try:
            write_textfile(self.path, self.output, self.run_id, values, self.planned)
        except OSError as e:
            logger.warning("could not write output.metrics=%s: %s", self.path, e)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
