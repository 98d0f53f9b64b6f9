"""Adding LoRA deltas into weights: each rank only into its own tensor-parallel slice (see launcher/worker/lora.py).

`fuse(pipe, [(factors, scale), ...])` is the one entry: the load fuses `model.loras` with it, and anything that
changes scales later (a sweep over `lora_scale.<i>`) can fuse the difference of scales with it again.
"""

from __future__ import annotations

import logging

import torch

from launcher.worker.lora import Factor, Factors

logger = logging.getLogger(__name__)

CHUNK_BYTES = 32 * 2**20  # the most a fuse computes at once (part of one layer's delta)


def fuse(pipe, loras: list[tuple[Factors, float]]) -> int:
    """Add each LoRA times its scale into the pipeline's weights, in list order; the number of layers changed."""
    changed = 0
    for lora, scale in loras:
        for component, modules in lora.items():
            model = getattr(pipe, component)
            slices = _packed_slices(model)
            for name, factor in modules.items():
                layer = model.get_submodule(name)
                with torch.no_grad():
                    add_delta(layer.weight, factor, scale, slices.get(f"{name}.weight"))
                changed += 1
    return changed


def add_delta(weight: torch.Tensor, f: Factor, scale: float, block_sizes: list[int] | None = None) -> None:
    """weight += scale * f.scaling * B @ A, on this rank's slice only where `weight` is a sharded DTensor.

    The arithmetic is PEFT's `get_delta_weight` + merge (`fuse_lora(lora_scale=scale)` scales PEFT's scaling, then
    merges): factors in the weight's dtype, upcast to float32 on CPU for half types, the product cast back."""
    local, A, B = weight, f.A, f.B
    if getattr(weight, "placements", None) is not None:
        from diffusers.hooks.tensor_parallel import _local_shard

        local = weight.to_local()
        shard = [p for p in weight.placements if p.is_shard()]
        if shard:
            if f.fan_in_fan_out:
                raise ValueError("a fan_in_fan_out LoRA layer cannot be fused into a sharded weight")
            dim = shard[0].dim
            # The delta's rows are B's rows and its columns A's columns: cut them as the load cut the weight
            # (block by block for packed layers), so no rank ever computes more than its own slice.
            blocks = block_sizes or [B.shape[0] if dim == 0 else A.shape[1]]
            if dim == 0:
                B = _local_shard(B, 0, blocks, weight.device_mesh)
            else:
                A = _local_shard(A, 1, blocks, weight.device_mesh)
    A, B = A.to(local.device, local.dtype), B.to(local.device, local.dtype)
    if local.device.type == "cpu" and local.dtype in (torch.float16, torch.bfloat16):
        A, B = A.float(), B.float()
    # A few output rows at a time: the working buffer stays under CHUNK_BYTES whatever the layer's size (FLUX.2's
    # packed to_qkv_mlp_proj is 55296 x 6144), so a rank holds the LoRA's own bytes and hardly anything more.
    rows = max(1, CHUNK_BYTES // (A.shape[1] * A.element_size()))
    for start in range(0, B.shape[0], rows):
        delta = B[start : start + rows] @ A
        delta.mul_(f.scaling * scale)  # in place: one buffer per step (PEFT's `* scaling`, the same numbers)
        if f.fan_in_fan_out:
            local[:, start : start + rows] += delta.T.to(local.dtype)
        else:
            local[start : start + rows] += delta.to(local.dtype)
        del delta  # before the next step's product, not after it


def _packed_slices(model) -> dict[str, list[int]]:
    """Parameter name -> block sizes, for the parameters a diffusers tensor-parallel plan shards in blocks."""
    plan = getattr(type(model), "_tp_plan", None)
    tp = _tp_degree(model)
    if not plan or tp <= 1:
        return {}
    if not hasattr(model, "load_lora_adapter"):  # transformers: its plans here split evenly (checked at preflight)
        return _refuse_packed(model)
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    return {k: s.block_sizes for k, s in resolve_tp_shard_specs(model, plan, tp).items() if s.dim is not None}


def _tp_degree(model) -> int:
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh.size()
    return 1


def _refuse_packed(model) -> dict:
    """transformers' packed styles cut blocks we do not model; none of our families' text encoders use one."""
    packed = [k for k, v in (getattr(model, "tp_plan", None) or {}).items() if "packed" in str(v)]
    if packed:
        raise ValueError(f"the text encoder's tensor-parallel plan packs {packed[0]}: LoRA fusing does not cut it yet")
    return {}


def read_configured(pipe, cfg) -> list[tuple[Factors, float]]:
    """`model.loras` as (factors, scale) pairs for this pipeline (files as the launcher resolved them)."""
    from launcher.loras import lora_file, lora_refs
    from launcher.worker.lora import factors

    return [(factors(type(pipe).__name__, lora_file(r), cfg.model.path), r.scale) for r in lora_refs(cfg)]


def fuse_configured(pipe, cfg) -> list[tuple[Factors, float]]:
    """Fuse `model.loras` into the loaded pipeline, each with its scale; returns what it fused, so that a caller
    can move to other scales later with `fuse(pipe, [(factors, new - old), ...])` (a LoRA is linear in its
    scale; the weights then differ from a fresh fuse at the new scale by rounding only)."""
    import time

    start = time.perf_counter()
    loras = read_configured(pipe, cfg)
    if loras:
        n = fuse(pipe, loras)
        logger.info("fused %d LoRA(s) into %d layers in %.2f s", len(loras), n, time.perf_counter() - start)
    return loras
