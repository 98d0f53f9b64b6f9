"""Moving a model's weights off the chip and back without rebuilding it (staged execution's swap).

The module, its parameters and any tensor-parallel DTensor wrappers stay in place: only the bytes move. Parking
copies each weight to host memory and points the tensor at an empty storage (the chip's allocator gets the
memory back); unparking points it at a fresh copy on its device. For a text encoder sharded by transformers,
`module.to("cpu")` would fight its device mesh; this touches each rank's own shard only. Nothing may run the
module while it is parked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)
MOVED = {"bytes": 0}  # bytes moved by park and unpark in this process (tools/bench reads it)


@dataclass
class Parked:
    entries: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (tensor, its host copy)

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes for _, host in self.entries)


def _tensors(module: torch.nn.Module):
    seen = set()
    for t in (*module.parameters(), *module.buffers()):
        local = getattr(t, "_local_tensor", t)  # a DTensor's own shard
        if id(local) not in seen and local.numel():
            seen.add(id(local))
            yield local


@torch.no_grad()
def park(module: torch.nn.Module) -> Parked:
    """Move `module`'s weights to host memory; its tensors hold nothing until `unpark`."""
    parked = Parked()
    for t in _tensors(module):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
        host.copy_(t)
        t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        parked.entries.append((t, host))
    MOVED["bytes"] += parked.nbytes
    return parked


@torch.no_grad()
def unpark(parked: Parked) -> None:
    for t, host in parked.entries:
        t.set_(host.to(t.device, copy=True))  # ty: ignore[invalid-argument-type]
    MOVED["bytes"] += parked.nbytes
    parked.entries.clear()


def resident_bytes(*modules) -> int:
    """Bytes the modules' weights hold now (a parked module holds none)."""
    return sum(t.nbytes for m in modules if m is not None for t in _tensors(m))
