"""What fusing LoRAs at load costs: `python -m tools.bench.lora [--out bench-lora.json]`.

- tiny: the tiny FLUX.2 loaded as a worker loads it (`load_pipeline`, 2 CPU processes under torchrun, gloo) at
  tp=1 (dp=2) and tp=2, with no LoRA and with 2 LoRAs fused (transformer and text encoder, packed and row-wise
  layers: tools/make_tiny_lora.py); per rank the load time and the peak private memory (RssAnon) over the load.
- real: the real-size FLUX.2-dev transformer (launcher/models/checkpoints.py) on the meta device, laid out as
  rank 0 of tp=2 holds it after diffusers' sharded load (its `_local_shard` per planned weight, a fake process
  group), and a rank-16 LoRA on every attention and MLP linear. The fuse runs on these meta tensors under a
  dispatch mode that counts every tensor it allocates, live at once: the extra bytes a rank holds are the
  LoRA's own factors plus that working peak (bounded by lora_fuse.CHUNK_BYTES); the weights' local bytes do not
  change (the deltas are added in place, each rank only into its slice).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def rank_main(model: str, tp: int, loras: list[str], out: str) -> None:
    """One torchrun rank: load (and fuse), report load seconds and private memory."""
    import threading

    import torch
    import torch.distributed as dist

    from launcher.config import load_config
    from launcher.worker.dist import ParallelDims
    from launcher.worker.pipeline import load_pipeline
    from tools.bench.memory import _preimport, _sample_peak, proc_status

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    overrides = [f"model.path={model}", f"mesh.tp={tp}", f"mesh.dp={world // tp}", "device=cpu"]
    if loras:
        overrides.append("model.loras=[" + ",".join(f"{{path:{f}}}" for f in loras) + "]")
    cfg = load_config("tiny", overrides)
    mesh = ParallelDims(world // tp, tp, world).build_mesh("cpu")
    _preimport(model)
    import peft.tuners.lora  # noqa: F401 - imported before the baseline, as the libraries are

    base = proc_status()["RssAnon"]
    stop, peak = threading.Event(), [base]
    sampler = threading.Thread(target=_sample_peak, args=(stop, peak), daemon=True)
    sampler.start()
    start = time.perf_counter()
    load_pipeline(cfg, torch.device("cpu"), mesh)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    report = {"rank": dist.get_rank(), "load_s": seconds, "peak_private_growth": peak[0] - base}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(reports))
    dist.destroy_process_group()


def run_ranks(model: Path, tp: int, loras: list[Path], out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    from tools.bench import torchrun

    cmd = torchrun(2, out.with_suffix(".logs"))  # beside `out`, in its temporary folder
    cmd += ["-m", "tools.bench.lora", "--rank", "--model", str(model), "--tp", str(tp), "--out", str(out)]
    cmd += [arg for f in loras for arg in ("--lora", str(f))]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"lora ranks at tp={tp} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_tiny(repeats: int = 2) -> dict:
    from launcher.models.flux2 import build_tiny
    from tools.make_tiny_lora import FLUX2, make_lora

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model = build_tiny(Path(tmp) / "tiny-flux2")
        files = [make_lora(model, Path(tmp) / f"l{s}.safetensors", FLUX2, seed=s) for s in (1, 2)]
        out = {"lora_file_bytes": sum(f.stat().st_size for f in files)}
        for tp in (1, 2):
            for n in (0, 2):
                runs = [run_ranks(model, tp, files[:n], Path(tmp) / f"r{tp}{n}{i}.json") for i in range(repeats)]
                out[f"tp{tp}_loras{n}"] = {
                    "load_s": [max(r["load_s"] for r in run) for run in runs],
                    "peak_private_growth_mib": [max(r["peak_private_growth"] for r in run) / MIB for run in runs],
                }
    return out


def _real_transformer_rank0_tp2():
    """FLUX.2-dev's transformer on meta, each planned weight replaced by rank 0's slice of it at tp=2."""
    import torch
    import torch.distributed as dist
    from diffusers import Flux2Transformer2DModel
    from diffusers.hooks.tensor_parallel import _local_shard, resolve_tp_shard_specs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher.models.checkpoints import published

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    _, _, config = published("black-forest-labs/FLUX.2-dev")["transformer"]
    with torch.device("meta"):
        model = Flux2Transformer2DModel.from_config(config).to(torch.bfloat16)
    for name, spec in resolve_tp_shard_specs(model, type(model)._tp_plan, 2).items():
        if spec.dim is None:
            continue
        module, _, leaf = name.rpartition(".")
        param = model.get_submodule(module).get_parameter(leaf)
        local = _local_shard(param.data, spec.dim, spec.block_sizes, mesh)
        dt = DTensor.from_local(local, mesh, [Shard(spec.dim)], run_check=False)
        model.get_submodule(module).register_parameter(leaf, torch.nn.Parameter(dt, requires_grad=False))
    return model


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def bench_real(rank: int = 16) -> dict:
    """Extra bytes on rank 0 of tp=2 when a rank-`rank` LoRA on every attention and MLP linear is fused."""
    import types
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from launcher.worker import lora_fuse
    from launcher.worker.lora import Factor

    model = _real_transformer_rank0_tp2()
    targets = [n for n in type(model)._tp_plan]  # every planned linear: attention, MLP, packed projections
    names = [n for n, _ in model.named_modules() if any(_matches(t, n) for t in targets)]
    factors = {}
    for n in names:
        p = model.get_submodule(n).weight
        o, i = p.shape  # the global shape (a DTensor's)
        factors[n] = Factor(
            torch.empty(rank, i, dtype=torch.bfloat16, device="meta"),
            torch.empty(o, rank, dtype=torch.bfloat16, device="meta"),
            1.0,
        )
    lora_bytes = sum(f.A.nbytes + f.B.nbytes for f in factors.values())
    full_delta = max(f.B.shape[0] * f.A.shape[1] * 2 for f in factors.values())

    live, peak = [0], [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            returns = func._schema.returns
            for t, ret in zip(out if isinstance(out, (tuple, list)) else [out], returns, strict=False):
                if isinstance(t, torch.Tensor) and ret.alias_info is None:  # a new tensor, not a view or in place
                    live[0] += t.nbytes
                    peak[0] = max(peak[0], live[0])
                    weakref.finalize(t, lambda n=t.nbytes: live.__setitem__(0, live[0] - n))
            return out

    before = _local_bytes(model)
    with torch.no_grad(), Count():
        layers = lora_fuse.fuse(types.SimpleNamespace(transformer=model), [({"transformer": factors}, 1.0)])
    return {
        "layers": layers,
        "lora_rank": rank,
        "lora_bytes": lora_bytes,
        "weights_local_bytes_before": before,
        "weights_local_bytes_after": _local_bytes(model),
        "fuse_working_peak_bytes": peak[0],
        "largest_full_delta_bytes": full_delta,
        "extra_bytes_per_rank": lora_bytes + peak[0],
        "chunk_bytes": lora_fuse.CHUNK_BYTES,
    }


def bench_read(rank: int = 16) -> dict:
    """Reading a rank-`rank` LoRA on every planned linear of FLUX.2-dev (a file of real bf16 factors) through
    diffusers' loader on the meta-device transformer: seconds, and this process's private memory growth."""
    import gc

    import torch
    from safetensors.torch import save_file

    from launcher.models.checkpoints import published
    from launcher.worker.lora import factors
    from tools.bench.memory import proc_status

    _, _, config = published("black-forest-labs/FLUX.2-dev")["transformer"]
    model = _real_transformer_rank0_tp2()
    names = [n for n, _ in model.named_modules() if any(_matches(t, n) for t in type(model)._tp_plan)]
    with tempfile.TemporaryDirectory(prefix="bench-lora-real-") as tmp:
        root = Path(tmp)
        (root / "transformer").mkdir()
        (root / "model_index.json").write_text(
            json.dumps({"_class_name": "Flux2Pipeline", "transformer": ["diffusers", "Flux2Transformer2DModel"]})
        )
        (root / "transformer" / "config.json").write_text(
            json.dumps({"_class_name": "Flux2Transformer2DModel", **config})
        )
        sd = {}
        for n in names:
            o, i = model.get_submodule(n).weight.shape
            sd[f"transformer.{n}.lora_A.weight"] = torch.full((rank, i), 0.01, dtype=torch.bfloat16)
            sd[f"transformer.{n}.lora_B.weight"] = torch.full((o, rank), 0.01, dtype=torch.bfloat16)
        save_file(sd, str(root / "lora.safetensors"))
        size = (root / "lora.safetensors").stat().st_size
        del sd, model
        gc.collect()
        base = proc_status()["RssAnon"]
        start = time.perf_counter()
        got = factors("Flux2Pipeline", root / "lora.safetensors", str(root))
        seconds = time.perf_counter() - start
        gc.collect()
        growth = proc_status()["RssAnon"] - base
    held = sum(f.A.nbytes + f.B.nbytes for m in got.values() for f in m.values())
    return {"file_bytes": size, "factor_bytes_held": held, "read_s": seconds, "private_growth_bytes": growth}


def _matches(pattern: str, name: str) -> bool:
    import re

    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-lora.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--lora", action="append", default=[])
    args, _ = parser.parse_known_args()
    if args.rank:
        rank_main(args.model, args.tp, args.lora, args.out)
        return
    result = {
        "real_flux2_dev_tp2_rank0": bench_real(),
        "real_flux2_dev_read": bench_read(),
        "tiny_flux2": bench_tiny(args.repeats),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    real = result["real_flux2_dev_tp2_rank0"]
    print(f"FLUX.2-dev transformer, rank 0 of tp=2, rank-{real['lora_rank']} LoRA on {real['layers']} layers:")
    print(
        f"  LoRA bytes {real['lora_bytes'] / MIB:.1f} MiB; "
        f"fuse working peak {real['fuse_working_peak_bytes'] / MIB:.1f} MiB "
        f"(a whole delta of the largest layer would be {real['largest_full_delta_bytes'] / MIB:.0f} MiB)"
    )
    print(
        f"  weights local bytes {real['weights_local_bytes_before'] / 2**30:.2f} GiB before, "
        f"{real['weights_local_bytes_after'] / 2**30:.2f} GiB after"
    )
    read = result["real_flux2_dev_read"]
    print(
        f"  reading that LoRA ({read['file_bytes'] / MIB:.0f} MiB file) through diffusers' loader on the meta "
        f"transformer: {read['read_s']:.1f} s, private memory +{read['private_growth_bytes'] / MIB:.0f} MiB "
        f"(factors held {read['factor_bytes_held'] / MIB:.0f} MiB)"
    )
    tiny = result["tiny_flux2"]
    print(f"tiny FLUX.2 (2 LoRAs: {tiny['lora_file_bytes']} bytes of files), per rank, worst rank of each repeat:")
    for key in ("tp1_loras0", "tp1_loras2", "tp2_loras0", "tp2_loras2"):
        r = tiny[key]
        print(
            f"  {key}: load {', '.join(f'{s:.2f}' for s in r['load_s'])} s; peak private growth "
            f"{', '.join(f'{m:.1f}' for m in r['peak_private_growth_mib'])} MiB"
        )


if __name__ == "__main__":
    main()
