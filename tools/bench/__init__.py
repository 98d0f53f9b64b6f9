"""Benchmarks: `python -m tools.bench` (tools/bench/__main__.py) and one module per measured target."""

from __future__ import annotations

import sys
from pathlib import Path


def torchrun(nproc: int, log_dir: Path) -> list[str]:
    """`python -m torch.distributed.run` on this host with `nproc` processes, its logs in `log_dir`, a folder the
    caller removes (torch's default is a new folder in /tmp that nothing removes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    return [*cmd, f"--nproc-per-node={nproc}", f"--log-dir={log_dir}"]
