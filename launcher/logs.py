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
    logging.basicConfig(level=level, force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_Masked(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
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


class _Masked(logging.Formatter):
    """Lines with any credentials inside an address masked (`s3://***@bucket`), whoever logs them: the launcher
    refuses such addresses in its config, but an endpoint from the environment or a library's message may hold one."""

    def format(self, record: logging.LogRecord) -> str:
        from launcher.ledger.addresses import masked

        return masked(super().format(record))
