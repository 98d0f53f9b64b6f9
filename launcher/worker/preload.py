"""What every worker imports before it reads its config: imported once by the forkserver that starts CPU workers
(launcher/host/worker_start.py), so each forked worker starts with it loaded. Imports only: no threads, no device.

Imported there, it also ties the forkserver's life to the launcher's: each worker holds the server's "alive" pipe
open, so the server would outlive a launcher killed with -9, and the workers, which die with their parent, with
it. A server that dies with the launcher takes them along.
"""

import gc
import os

import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
from diffusers import DiffusionPipeline  # noqa: F401
from transformers import PreTrainedModel  # noqa: F401
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

import launcher.worker.runner  # noqa: F401
from launcher.errors import die_with_parent, launcher_pid

die_with_parent(launcher_pid())
SERVER_PID = os.getpid()  # in a forked worker: the parent it dies with (launcher/worker/main.py, entry)

# transformers builds its table of checkpoint weight renamings (~900 regular expressions, 0.25 s) at a process's
# first model load, and caches it: built here once, every forked worker starts with it.
get_checkpoint_conversion_mapping("llama")

# Everything imported above lives as long as the process: moved out of the collector's reach (the gc module's own
# advice for a process that forks without exec), so that no collection in a forked worker walks it again and its
# pages stay shared with the server's.
gc.freeze()
