"""Private memory per rank at tp=1 and tp=2, on a mid-size random-weight FLUX.2 transformer.

`bench_memory()` builds a pipeline folder (the tiny text encoder, VAE and tokenizer, with a transformer of a few
hundred MB in its place), then runs this file under torchrun (2 CPU processes, gloo) once with tp=1 (dp=2: each
rank holds a whole copy) and once with tp=2, each in fresh processes. Every rank loads the pipeline with
`launcher.worker.pipeline.load_pipeline`, as a worker does, and reports:
- RssAnon from /proc/self/status (private memory; safetensors files are memory-mapped, so file pages touched
  while loading show in RSS and VmHWM but are not private) after loading, and its growth over the loading;
- the bytes of its local parameters and buffers per component (a DTensor counts its local shard only).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_mid_model(out: Path, heads: int = 8, layers: int = 2, single_layers: int = 4) -> dict:
    """The tiny pipeline with a mid-size transformer (heads x 128 wide); its parameter count and bytes."""
    import torch
    from diffusers import Flux2Transformer2DModel

    from launcher.models.flux2 import build_tiny as build_tiny_flux2

    build_tiny_flux2(out)
    torch.manual_seed(3)
    # joint_attention_dim and in_channels match the tiny encoder and VAE, so the pipeline stays consistent.
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=128,
        num_attention_heads=heads,
        joint_attention_dim=64,
        axes_dims_rope=(32, 32, 32, 32),
    )
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    params = sum(p.numel() for p in transformer.parameters())
    return {"transformer_params": params, "transformer_bytes": params * 4}


def proc_status() -> dict[str, int]:
    """Memory lines of /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process that map files (safetensors are memory-mapped when loaded)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].startswith("/dev/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def local_bytes(module, mapped: list[tuple[int, int]]) -> dict[str, int]:
    """Bytes of the module's local parameters and buffers (a DTensor's local shard), and how many of them live
    in file mappings: those are not in RssAnon, so private memory is RssAnon plus them."""
    from torch.distributed.tensor import DTensor

    total = in_files = 0
    for t in [*module.parameters(), *module.buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        size = local.numel() * local.element_size()
        total += size
        ptr = local.data_ptr()
        in_files += size if any(lo <= ptr < hi for lo, hi in mapped) else 0
    return {"bytes": total, "file_backed": in_files}


def _preimport(model: str) -> None:
    """Import every class loading will use, so the baseline holds the libraries and the growth only the weights."""
    import importlib

    import diffusers
    from diffusers import TensorParallelConfig  # noqa: F401
    from transformers import DistributedConfig  # noqa: F401

    from launcher.worker.pipeline import component_classes

    getattr(diffusers, json.loads((Path(model) / "model_index.json").read_text())["_class_name"])
    for lib, name in component_classes(model).values():
        getattr(importlib.import_module(lib), name)


def _sample_peak(stop, peak: list[int]) -> None:
    while not stop.wait(0.005):
        peak[0] = max(peak[0], proc_status()["RssAnon"])


def rank_main(model: str, tp: int, out: str) -> None:
    """One torchrun rank: load the pipeline on the (dp, tp) mesh and report its memory."""
    import ctypes
    import gc
    import threading

    import torch
    import torch.distributed as dist

    from launcher.config import load_config
    from launcher.worker.dist import ParallelDims
    from launcher.worker.pipeline import load_pipeline

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = load_config("tiny", [f"model.path={model}", f"mesh.tp={tp}", f"mesh.dp={world // tp}", "device=cpu"])
    mesh = ParallelDims(world // tp, tp, world).build_mesh("cpu")
    _preimport(model)
    gc.collect()
    base = proc_status()["RssAnon"]
    stop, peak = threading.Event(), [base]
    sampler = threading.Thread(target=_sample_peak, args=(stop, peak), daemon=True)
    sampler.start()
    pipe = load_pipeline(cfg, torch.device("cpu"), mesh)
    gc.collect()
    stop.set()
    sampler.join()
    after = proc_status()
    mapped = file_mappings()
    local = {name: local_bytes(getattr(pipe, name), mapped) for name in ("transformer", "text_encoder", "vae")}
    file_backed = sum(v["file_backed"] for v in local.values())
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # last: it changes what it measures (freed heap kept by malloc)
    trimmed = proc_status()["RssAnon"]
    report = {
        "rank": dist.get_rank(),
        **after,
        "RssAnon_base": base,
        "RssAnon_peak": max(peak[0], after["RssAnon"]),
        "RssAnon_trimmed": trimmed,
        "local": local,
        "private": after["RssAnon"] + file_backed,
        "weights_private": after["RssAnon"] + file_backed - base,
        "weights_private_trimmed": trimmed + file_backed - base,
    }
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(reports))
    dist.destroy_process_group()


def run_ranks(model: Path, tp: int, out: Path, nproc: int = 2) -> list[dict]:
    # No GPU for these ranks: diffusers puts tensor-parallel shards on the default accelerator whatever the mesh's
    # device, so on a CUDA host the shards would land on the GPU and out of the measured host memory.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    from tools.bench import torchrun

    cmd = torchrun(nproc, out.with_suffix(".logs"))  # beside `out`, in its temporary folder
    cmd += [__file__, "--model", str(model), "--tp", str(tp), "--out", str(out)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"memory ranks at tp={tp} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_memory(heads: int = 8, layers: int = 2, single_layers: int = 4, workdir: str | None = None) -> dict:
    """Per-rank memory at tp=1 and tp=2 and their ratios (tp=2 over tp=1, the largest rank of each)."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=workdir) as tmp:
        model = Path(tmp) / "mid-flux2"
        built = build_mid_model(model, heads, layers, single_layers)
        per_tp = {tp: run_ranks(model, tp, Path(tmp) / f"tp{tp}.json") for tp in (1, 2)}

    def worst(tp: int, key) -> int:
        return max(key(r) for r in per_tp[tp])

    ratios = {
        "transformer_local_bytes": worst(2, lambda r: r["local"]["transformer"]["bytes"])
        / worst(1, lambda r: r["local"]["transformer"]["bytes"]),
        "weights_private": worst(2, lambda r: r["weights_private"]) / worst(1, lambda r: r["weights_private"]),
        "weights_private_trimmed": worst(2, lambda r: r["weights_private_trimmed"])
        / worst(1, lambda r: r["weights_private_trimmed"]),
        "private": worst(2, lambda r: r["private"]) / worst(1, lambda r: r["private"]),
    }
    return {
        "model": {"heads": heads, "layers": layers, "single_layers": single_layers, **built},
        "ranks": {f"tp{tp}": r for tp, r in per_tp.items()},
        "ratio_tp2_over_tp1": ratios,
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="one rank of the memory benchmark (run by bench_memory)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank_main(args.model, args.tp, args.out)
