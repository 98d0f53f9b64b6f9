"""Rank-prefixed logging: rank 0 logs at INFO, the other ranks only warnings, unless MESHGEN_VERBOSE=1 or each
rank writes its own log file (the launcher sets RANK_LOGS_ENV then: a file holds everything of its rank)."""

from __future__ import annotations

import logging
import os
import warnings

# The logger of shard events (one line per shard done or failed): the launcher's terminal shows these by default.
SHARD_EVENTS = "meshgen.shards"
# The logger of a worker's stages before its first image (load, warmup, generate): the launcher's bar shows them.
STAGE_EVENTS = "meshgen.stage"
# Libraries that set their own loggers' levels (and huggingface_hub its own handler) when imported, after ours.
QUIETED = ("torch.distributed", "huggingface_hub")
RANK_LOGS_ENV = "MESHGEN_RANK_LOGS"


def setup_logging(rank: int | None = None, hub_progress: bool = False, who: str | None = None) -> None:
    """`hub_progress`: keep huggingface_hub's progress bars (the launcher's model download shows one). `who`: the
    lines' prefix where the process is not a rank (the launcher)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    verbose = os.environ.get("MESHGEN_VERBOSE") == "1"
    level = logging.INFO if rank == 0 or verbose or os.environ.get(RANK_LOGS_ENV) == "1" else logging.WARNING
    logging.basicConfig(level=level, force=True)
    for handler in logging.getLogger().handlers:
        prefix = f"[{who or f'rank{rank}'}]"
        handler.setFormatter(_Masked(f"{prefix} %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    _quiet_libraries(verbose, in_file=rank != 0 or os.environ.get(RANK_LOGS_ENV) == "1")
    if not verbose:
        # The libraries' routine warnings and progress bars drown our own lines; MESHGEN_VERBOSE=1 shows them.
        for name in ("diffusers", "transformers", "httpx", "httpx2"):  # QUIETED: by the filter
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


def _quiet_libraries(verbose: bool, in_file: bool) -> None:
    """Each library record once, through our handler: huggingface_hub's own handler printed its retry warnings a
    second time, unprefixed, and both it and torch elastic reset their levels on import, so a level set here did
    not hold. A filter on our handler holds: their warnings go to a worker's log file (`in_file`), never to the
    launcher's terminal (torch's "Sending process N closing signal SIGINT", a hub retry), unless verbose."""
    import huggingface_hub.utils.logging  # noqa: F401 - configures its handler at import: import it, then undo that

    logging.getLogger("huggingface_hub").handlers.clear()
    logging.getLogger("huggingface_hub").setLevel(logging.INFO if verbose else logging.WARNING)
    least = logging.DEBUG if verbose else logging.WARNING if in_file else logging.ERROR

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= least or not record.name.startswith(QUIETED)

    for handler in logging.getLogger().handlers:
        handler.addFilter(keep)


def quiet_torch_elastic() -> None:
    """torch elastic's module loggers, after their import: each sets its own level (LOGLEVEL, else WARNING) and
    writes through torch's handler, so "Sending process N closing signal SIGINT" reached the terminal once per
    signal. Our own lines say what failed and what to do; MESHGEN_VERBOSE=1 keeps theirs."""
    if os.environ.get("MESHGEN_VERBOSE") == "1":
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def cheap_rendezvous_records() -> None:
    """torch elastic's rendezvous names each event it records by its caller with `inspect.stack()`, twice, which
    reads the source line of every frame of the stack: ~0.5 CPU-s of each launch's agent on the rendezvous's
    ~30 events. The caller's name is one frame walk away; the events and their names stay the same."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # depth frames above this one, as inspect.stack() counts
        except ValueError:  # a stack not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name
