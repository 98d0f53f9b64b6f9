"""Rank-prefixed logging: rank 0 logs at INFO, the other ranks only warnings, unless MESHGEN_VERBOSE=1 or each
rank writes its own log file (the launcher sets RANK_LOGS_ENV then: a file holds everything of its rank)."""

from __future__ import annotations

import logging
import os
import warnings

# The logger of shard events (one line per shard done or failed): the launcher's terminal shows these by default.
SHARD_EVENTS = "meshgen.shards"
RANK_LOGS_ENV = "MESHGEN_RANK_LOGS"


def setup_logging(rank: int | None = None, hub_progress: bool = False) -> None:
    """`hub_progress`: keep huggingface_hub's progress bars (the launcher's model download shows one)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    verbose = os.environ.get("MESHGEN_VERBOSE") == "1"
    level = logging.INFO if rank == 0 or verbose or os.environ.get(RANK_LOGS_ENV) == "1" else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    if not verbose:
        # The libraries' routine warnings and progress bars drown our own lines; MESHGEN_VERBOSE=1 shows them.
        for name in ("diffusers", "transformers", "torch.distributed", "huggingface_hub", "httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        if not hub_progress:
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
