"""TPU and CUDA paths through their seams, and compile mode for real on CPU."""

import json
import types

import numpy as np
import pytest
import torch
from conftest import bare_flux2, launch, pixels, read_rows
from omegaconf import OmegaConf

from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.host import launch as mlaunch
from launcher.worker import dist as mdist
from launcher.worker import execution
from launcher.worker.pipeline import place


def test_auto_device_prefers_tpu_then_cuda_then_cpu(monkeypatch):
    monkeypatch.setattr(mdist, "torch_tpu_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mdist.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mdist.resolve_device("auto") == "cuda"
    monkeypatch.setattr(mdist, "torch_tpu_installed", lambda: True)
    monkeypatch.setattr(mdist, "tpu_chip_count", lambda: 0)
    assert mdist.resolve_device("auto") == "cuda"
    monkeypatch.setattr(mdist, "tpu_chip_count", lambda: 8)
    assert mdist.resolve_device("auto") == "tpu"


def test_tpu_without_torch_tpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(mdist, "torch_tpu_installed", lambda: False)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[tpu\]"'):
        mdist.resolve_device("tpu")


def test_backends_and_devices(monkeypatch):
    assert mdist.BACKENDS == {"tpu": "tpu_dist", "cuda": "nccl", "cpu": "gloo"}
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mdist.local_device("cuda") == torch.device("cuda", 3) and chosen == [3]
    assert mdist.local_device("cpu") == torch.device("cpu")  # "tpu" only parses once torch_tpu registered it


def test_tpu_mesh_is_topology_aware(monkeypatch):
    calls = {}

    def layout(shape):
        calls["shape"] = shape
        return torch.tensor([[0, 1, 3, 2], [4, 5, 7, 6]])

    monkeypatch.setattr(
        torch,
        "tpu",
        types.SimpleNamespace(distributed=types.SimpleNamespace(topology_aware_mesh=layout)),
        raising=False,
    )
    monkeypatch.setattr(
        torch.distributed.device_mesh,
        "DeviceMesh",
        lambda dev, mesh, mesh_dim_names: (dev, mesh.tolist(), mesh_dim_names),
    )
    dev, ranks, names = mdist.ParallelDims(2, 4, 8).build_mesh("tpu")
    assert (dev, ranks, names, calls["shape"]) == ("tpu", [[0, 1, 3, 2], [4, 5, 7, 6]], ("dp", "tp"), (2, 4))


def test_tpu_launch_env_is_set_in_the_launcher(monkeypatch):
    calls = []
    monkeypatch.setattr(
        torch,
        "tpu",
        types.SimpleNamespace(distributed=types.SimpleNamespace(set_tpu_launch_env=lambda **kw: calls.append(kw))),
        raising=False,
    )
    mlaunch.set_tpu_launch_env(1, 8)
    mlaunch.set_tpu_launch_env(4, 4)
    assert calls == [{"nnodes": None, "nproc_per_node": 8}, {"nnodes": 4, "nproc_per_node": 4}]


@pytest.mark.parametrize(
    ("device", "mode", "cache", "expected"),
    [
        ("tpu", "defer_and_fuse", None, {"TORCH_TPU_DEFER_AND_FUSE": "1"}),
        ("tpu", "compile", "gs://bucket/cache", {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "gs://bucket/cache"}),
        ("cuda", "eager", None, {}),
        (
            "cuda",
            "compile",
            "/c",
            {"TORCHINDUCTOR_CACHE_DIR": "/c", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"},
        ),
    ],
)
def test_mode_env(device, mode, cache, expected):
    cfg = load_config("tiny", [f"execution.mode={mode}", f"execution.compile_cache_dir={cache or 'null'}"])
    assert execution.mode_env(cfg, device) == expected


class FakeTransformer:
    def __init__(self):
        self.calls = []

    def compile(self, **kw):
        self.calls.append(("compile", kw))

    def compile_repeated_blocks(self, **kw):
        self.calls.append(("compile_repeated_blocks", kw))


@pytest.mark.parametrize(
    ("device", "offload", "method"),
    [("tpu", "none", "compile"), ("cuda", "none", "compile"), ("tpu", "model", "compile_repeated_blocks")],
)
def test_compile_call_and_its_arguments(monkeypatch, device, offload, method):
    looked_up = []
    monkeypatch.setattr("torch._dynamo.lookup_backend", lambda name: looked_up.append(name) or (lambda gm, ex: gm))
    pipe = types.SimpleNamespace(transformer=FakeTransformer())
    cfg = OmegaConf.create({"execution": {"mode": "compile", "offload": offload}})
    stats = execution.CompileStats()
    execution.apply_compile(pipe, cfg, device, stats)
    [(called, kw)] = pipe.transformer.calls
    assert called == method and kw["fullgraph"] is True and kw["dynamic"] is False
    assert looked_up == ["tpu" if device == "tpu" else "inductor"]
    kw["backend"]("graph", [])
    assert stats.compiles == 1


def test_offload_uses_enable_model_cpu_offload():
    calls = []
    pipe = types.SimpleNamespace(
        enable_model_cpu_offload=lambda device: calls.append(("offload", device)),
        to=lambda device: calls.append(("to", device)),
        set_progress_bar_config=lambda **kw: None,
    )
    place(pipe, OmegaConf.create({"execution": {"offload": "model"}}), torch.device("cuda", 1))
    place(pipe, OmegaConf.create({"execution": {"offload": "none"}}), torch.device("cuda", 1))
    assert calls == [("offload", torch.device("cuda", 1)), ("to", torch.device("cuda", 1))]


# Inductor as cheaply as it still compiles for real: kernels built one at a time (its pool of compile processes, one
# per core, costs more than it saves on the 2-core test host), scalar (vectorised kernels take g++ longer), and with
# the C++ wrapper (the graph's kernels in a few g++ runs, not one each: 7 where there were ~40). None changes what
# compile mode does (one graph per shape, the FX-graph cache and its hits), and the images stay within 2 levels of
# eager. Measured on the first launch (user CPU-s): 76 by default, 64 with one thread, 55 also scalar, 46 with all
# three; the whole test 100 CPU-s and 159 s before, 55 CPU-s and 79 s after (load ~7.5 on 2 cores).
QUICK_INDUCTOR = {
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "TORCHINDUCTOR_VEC_ISA_OK": "0",
    "TORCHINDUCTOR_CPP_WRAPPER": "1",
}


def test_compile_mode_on_cpu_compiles_once_per_shape_and_reuses_its_cache(tiny_model, tmp_path):
    rows = [{"prompt": f"prompt {i}", **({"height": 96} if i % 3 == 0 else {})} for i in range(10)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 4 rows at 96x64 and 6 at 64x64, in batches of 3: two shapes, one partial batch.
    args = [
        f"model.path={tiny_model}",
        f"dataset.path={tmp_path / 'p.jsonl'}",
        "mesh.tp=1",
        "generate.batch_size=3",
        "run.shard_size=10",
    ]
    cache = f"execution.compile_cache_dir={tmp_path / 'cache'}"
    res = launch(*args, f"output.dir={tmp_path / 'c'}", "execution.mode=compile", cache, env=QUICK_INDUCTOR)
    assert res.returncode == 0, res.stderr[-3000:]
    [rank0] = (tmp_path / "c" / "logs").glob("*/rank-0.log")  # the worker's own lines go to its log file
    assert "2 distinct batch shapes, 2 compiles" in rank0.read_text()
    first = json.loads((tmp_path / "c" / "state" / "shard-00000.json").read_text())
    assert first["compiles"] == 2 and first["compile_cache_hits"] == 0 and first["stages"]["warmup"] > 0
    # Within 2 levels of the same prompts through a bare diffusers loop, one prompt per call (an eager run of the
    # job would cost another launch), at each row's own size with the contract's seed.
    from test_edit import contract_seed

    got = read_rows(tmp_path / "c")
    for i, row in enumerate(rows):
        [bare] = bare_flux2(tiny_model, [contract_seed(str(i))], prompt=[row["prompt"]], height=row.get("height", 64))
        assert np.abs(pixels(got[str(i)]["image"]["bytes"]) - bare).max() <= 2, i
    res = launch(
        *args, f"output.dir={tmp_path / 'c'}", "execution.mode=compile", cache, "run.shards=all", env=QUICK_INDUCTOR
    )
    assert res.returncode == 0, res.stderr[-3000:]
    again = json.loads((tmp_path / "c" / "state" / "shard-00000.json").read_text())
    print(f"compile warm-up: {first['stages']['warmup']:.1f} s cold, {again['stages']['warmup']:.1f} s from cache")
    assert again["compile_cache_hits"] >= 2
