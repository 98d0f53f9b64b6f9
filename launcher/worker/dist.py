"""Devices, process groups and the ("dp", "tp") mesh.

Every rank runs the same code; the mesh decides its role: ranks with the same dp coordinate form a
tensor-parallel group that generates one shard together, and that group's first rank (tp == 0) writes it.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from launcher.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = {"tpu": "tpu_dist", "cuda": "nccl", "cpu": "gloo"}
TPU_INSTALL_HINT = 'torch_tpu is not installed; on a TPU VM run: pip install -e ".[tpu]"'


def torch_tpu_installed() -> bool:
    return importlib.util.find_spec("torch_tpu") is not None


def resolve_device(device: str) -> str:
    """`auto` means tpu if TorchTPU finds chips, else cuda, else cpu."""
    if device not in ("auto", "tpu", "cuda", "cpu"):
        raise ConfigError(f"device={device!r} is not one of auto, tpu, cuda, cpu")
    if device == "tpu" and not torch_tpu_installed():
        raise ConfigError(f"device=tpu but {TPU_INSTALL_HINT}")
    if device != "auto":
        return device
    import torch

    if torch_tpu_installed() and tpu_chip_count():
        return "tpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def tpu_chip_count() -> int:
    """TPU chips on this host, from the kernel's device files.

    Not torch.tpu.device_count(): in the launcher that would start the TPU runtime, which then holds the chips
    its workers need.
    """
    visible = os.environ.get("TPU_VISIBLE_CHIPS")
    if visible:
        return len([c for c in visible.split(",") if c.strip()])
    return len(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def local_device(device_type: str):
    """The torch.device this process computes on: its own chip on TPU, cuda:LOCAL_RANK on CUDA."""
    import torch

    if device_type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device_type)  # each TorchTPU process sees only its own chip


@dataclass
class ParallelDims:
    dp: int
    tp: int
    world_size: int

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1:
            raise ConfigError(f"mesh.dp={self.dp} and mesh.tp={self.tp} must both be at least 1")
        if self.dp * self.tp != self.world_size:
            raise ConfigError(
                f"mesh.dp * mesh.tp = {self.dp} * {self.tp} = {self.dp * self.tp} "
                f"but the world size is {self.world_size}; launch dp*tp processes"
            )

    def build_mesh(self, device_type: str):
        import torch
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if device_type == "tpu":
            # Ranks laid out so that each tp group sits on physically neighbouring chips.
            tpu_dist = getattr(torch.tpu, "distributed", None)
            layout_fn = getattr(tpu_dist, "topology_aware_mesh", None) or torch.tpu.topology_aware_mesh
            layout = layout_fn((self.dp, self.tp))
            return DeviceMesh("tpu", layout, mesh_dim_names=("dp", "tp"))
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


def init_distributed(device_type: str, timeout_s: int):
    """Initialise the default process group with the device's backend and a finite timeout."""
    import torch.distributed as dist

    if device_type == "tpu" and not torch_tpu_installed():
        raise ConfigError(TPU_INSTALL_HINT)
    dev = local_device(device_type)
    kwargs = {"device_id": dev} if device_type == "cuda" else {}
    dist.init_process_group(backend=BACKENDS[device_type], timeout=timedelta(seconds=timeout_s), **kwargs)
    return dev


@dataclass
class Groups:
    """This rank's place in the mesh, plus CPU (gloo) groups for small control messages.

    Shard outcomes and errors are exchanged over gloo even on TPU and CUDA: they are Python objects, and keeping
    them off the accelerator's stream keeps them from queueing behind generation work.
    """

    mesh: object
    dp_rank: int
    tp_rank: int
    tp_size: int  # kept: mesh["tp"] builds a sub-mesh on every call (0.1 ms), too slow for once a batch
    tp_control: Any  # gloo group of this rank's tp group
    world_control: Any  # gloo group of all ranks

    @property
    def is_writer(self) -> bool:
        return self.tp_rank == 0


def build_groups(mesh) -> Groups:
    import torch.distributed as dist

    layout = mesh.mesh.tolist()  # [dp][tp] global ranks
    tp_control = None
    for ranks in layout:  # every rank must take part in creating every group
        # Unsorted: group rank 0 must be the tp group's first rank, the one that claims and writes its shards
        # (a topology-aware TPU layout need not list ranks in increasing order).
        g = dist.new_group(ranks, backend="gloo", sort_ranks=False)
        if dist.get_rank() in ranks:
            tp_control = g
    world_control = dist.new_group(backend="gloo")
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    return Groups(mesh, dp_rank, tp_rank, len(layout[0]), tp_control, world_control)
