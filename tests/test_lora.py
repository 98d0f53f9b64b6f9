"""LoRAs (`model.loras`, issue 22): fused into each rank's tensor-parallel slice at load, through launch.sh.

Against bare diffusers: at tp=1 the images equal, bit for bit, a plain loop over a pipeline that diffusers itself
loaded the same LoRAs into (`load_lora_weights` + `fuse_lora(lora_scale=...)`, one LoRA after the other); at tp=2
they are within 2 levels of tp=1. The tiny LoRAs cover column-wise, row-wise and packed layers, an unsharded
layer, and text-encoder layers (sharded by transformers' plan on FLUX.2). FLUX.1's LoRA carries alpha keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import launch, max_diff, pixels, read_rows, worker_logs
from test_edit import contract_seed

from tools.make_tiny_lora import FLUX1, FLUX2, make_lora

PROMPTS = [{"id": "p0", "prompt": "a red cube on a wooden table"}, {"id": "p1", "prompt": "a quiet lake at dawn"}]
SCALES = (0.8, 1.0)
FAMILY = {  # family -> (max_sequence_length, call kwargs, LoRA modules, alpha)
    "flux2": (256, {"text_encoder_out_layers": (1, 2)}, FLUX2, None),
    "flux1": (32, {}, FLUX1, 2.0),
}


@pytest.fixture(scope="module")
def loras(tiny_family, tiny_model, tmp_path_factory):
    """loras(family) -> (model folder, [two LoRA files]), built once."""
    d, built = tmp_path_factory.mktemp("loras"), {}

    def get(family: str):
        if family not in built:
            model = tiny_model if family == "flux2" else tiny_family(family)
            _, _, modules, alpha = FAMILY[family]
            files = [make_lora(model, d / f"{family}-{s}.safetensors", modules, seed=s, alpha=alpha) for s in (1, 2)]
            built[family] = (model, files)
        return built[family]

    return get


def lora_override(files: list[Path], scales=SCALES) -> str:
    return "model.loras=[" + ",".join(f"{{path:{f},scale:{s}}}" for f, s in zip(files, scales, strict=True)) + "]"


@pytest.fixture(scope="module")
def lora_job(loras, tmp_path_factory):
    """lora_job(family, *overrides) -> (output folder, args); each distinct job runs once."""
    cache: dict[tuple, tuple] = {}

    def run(family: str, *overrides: str):
        if (family, overrides) not in cache:
            model, files = loras(family)
            d = tmp_path_factory.mktemp(f"{family}-lora")
            (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
            args = [
                f"model=tiny_{family}",
                f"model.path={model}",
                lora_override(files),
                f"dataset.path={d / 'p.jsonl'}",
                "dataset.id_column=id",
                f"generate.max_sequence_length={FAMILY[family][0]}",
                "generate.batch_size=1",
                "run.shard_size=1",
                *overrides,
            ]
            res = launch(*args, f"output.dir={d / 'out'}")
            assert res.returncode == 0, res.stderr[-3000:]
            cache[(family, overrides)] = (d / "out", args)
        return cache[(family, overrides)]

    return run


def diffusers_fused(model: Path, files: list[Path], scales=SCALES, dtype=None):
    """A bare pipeline with the LoRAs loaded and fused by diffusers itself, one after the other.

    FLUX.2's loader reads transformer keys only; its text-encoder keys go through the loader every other
    pipeline uses for its text encoder (`_load_lora_into_text_encoder`) and `fuse_text_encoder_lora`."""
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.loaders.lora_base import _load_lora_into_text_encoder, fuse_text_encoder_lora
    from diffusers.utils.peft_utils import recurse_remove_peft_layers

    pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype or torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for i, (f, s) in enumerate(zip(files, scales, strict=True)):
        name = f"l{i}"
        pipe.load_lora_weights(str(f), adapter_name=name)
        if "text_encoder" not in pipe._lora_loadable_modules:
            sd = type(pipe).lora_state_dict(str(f))
            _load_lora_into_text_encoder(sd, None, pipe.text_encoder, prefix="text_encoder", adapter_name=name)
            fuse_text_encoder_lora(pipe.text_encoder, lora_scale=s, adapter_names=[name])
            recurse_remove_peft_layers(pipe.text_encoder)
        pipe.fuse_lora(components=list(pipe._lora_loadable_modules), lora_scale=s, adapter_names=[name])
        pipe.unload_lora_weights()
    return pipe


def bare_images(family: str, pipe) -> dict[str, np.ndarray]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run on CPU
    try:
        max_len, extra, _, _ = FAMILY[family]
        return {
            r["id"]: (
                pipe(
                    prompt=[r["prompt"]],
                    generator=[torch.Generator("cpu").manual_seed(contract_seed(r["id"], 0))],
                    height=64,
                    width=64,
                    num_inference_steps=4,
                    guidance_scale=4.0,
                    max_sequence_length=max_len,
                    output_type="np",
                    **extra,
                ).images[0]
                * 255
            )
            .round()
            .astype("uint8")
            for r in PROMPTS
        }
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["flux2", "flux1"])
def test_loras_fused_at_tp1_equal_diffusers_and_tp2_within_2_levels(family, loras, lora_job):
    """dp=2 x tp=1: bitwise the bare pipeline with diffusers' own load + fuse; without the LoRAs the images
    differ; on FLUX.2, tp=2 (transformer and text encoder sharded, each rank fusing only its slices) within 2
    levels of it."""
    from diffusers import DiffusionPipeline

    model, files = loras(family)
    out1, _ = lora_job(family, "mesh.dp=2", "mesh.tp=1")
    got = read_rows(out1)
    ref = bare_images(family, diffusers_fused(model, files))
    for r in PROMPTS:
        assert np.array_equal(pixels(got[r["id"]]["image"]["bytes"]), ref[r["id"]]), r["id"]
    plain = DiffusionPipeline.from_pretrained(model)
    plain.set_progress_bar_config(disable=True)
    without = bare_images(family, plain)
    assert all(np.abs(without[k].astype(int) - ref[k]).max() > 8 for k in ref)  # a LoRA changes the images
    layers = sum(len(m) for m in FAMILY[family][2].values()) * 2
    assert f"fused 2 LoRA(s) into {layers} layers" in worker_logs(out1)

    if family == "flux2":  # FLUX.1's planned layers are a subset of FLUX.2's kinds (plain and packed row-wise)
        out2, _ = lora_job(family, "mesh.dp=1", "mesh.tp=2")
        logs = worker_logs(out2)
        assert "transformer sharded over tp=2" in logs and "text encoder sharded over tp=2" in logs
        assert max_diff(out1, out2) <= 2


def test_another_scale_on_a_done_folder_exits_2(lora_job, loras, launcher_main, capsys):
    out, args = lora_job("flux2", "mesh.dp=2", "mesh.tp=1")
    _, files = loras("flux2")
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert [e["scale"] for e in settings["model"]["loras"]] == list(SCALES)
    assert all(len(e["sha256"]) == 64 for e in settings["model"]["loras"])
    card = (out / "README.md").read_text()  # the dataset card names each LoRA, its scale and hash
    for f, s, e in zip(files, SCALES, settings["model"]["loras"], strict=True):
        assert f"- LoRA: a local file `{Path(f).name}` at scale {s} (sha256 {e['sha256']})" in card
    again = [a if not a.startswith("model.loras=") else lora_override(files, (0.5, 1.0)) for a in args]
    code = launcher_main([*again, f"output.dir={out}"])  # in this process: a refusal and a run with nothing to do
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "model.loras" in err and "0.5" in err.strip().splitlines()[-1]
    code = launcher_main([*args, f"output.dir={out}"])  # the same LoRAs and scales: nothing to do, exit 0
    err = capsys.readouterr().err
    assert code == 0 and "nothing to do" in err, err[-2000:]


def _no_loader_model(model: Path, d: Path) -> Path:
    """The tiny FLUX.2 under a pipeline class that diffusers has without a LoRA loader."""
    import shutil

    out = d / "no-loader"
    shutil.copytree(model, out)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "_class_name": "PixArtAlphaPipeline"}))
    return out


@pytest.mark.parametrize("case", ["missing", "no-match", "shapes", "no-loader"])
def test_preflight_refuses_a_lora_with_one_line(case, loras, tmp_path, launcher_main, capsys):
    """In this process (the refusal's line and code are the launcher's own; tests/test_bad_input.py runs refusals
    of every kind through ./launch.sh)."""
    import torch
    from safetensors.torch import load_file, save_file

    model, files = loras("flux2")
    lora, expected = files[0], ""
    if case == "missing":
        lora, expected = tmp_path / "nope.safetensors", "does not exist"
    elif case == "no-match":
        lora, expected = tmp_path / "other.safetensors", "none of its keys matches a module"
        save_file(
            {"transformer.nothing_here.lora_A.weight": torch.zeros(4, 8)}
            | {"transformer.nothing_here.lora_B.weight": torch.zeros(8, 4)},
            str(lora),
        )
    elif case == "shapes":
        sd = load_file(str(files[0]))
        key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
        sd[key] = torch.zeros(4, sd[key].shape[1] + 8)
        lora, expected = tmp_path / "shapes.safetensors", "do not match"
        save_file(sd, str(lora))
    else:
        model, expected = _no_loader_model(model, tmp_path), "no LoRA loader for PixArtAlphaPipeline"
    code = launcher_main(
        [
            f"model.path={model}",
            "mesh.tp=1",
            "mesh.dp=1",
            f"model.loras=[{{path:{lora}}}]",
            f"output.dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and last.startswith("error: ") and expected in last, last
    assert not (tmp_path / "out").exists()


def test_memory_plan_counts_the_loras_own_bytes(loras):
    from launcher.config import load_config
    from launcher.sizing.memory import GIB
    from launcher.sizing.mesh_plan import need_gib

    model, files = loras("flux2")
    per_rank = {"transformer": 3 * GIB, "text_encoder": GIB, "vae": GIB // 4}
    with_loras = need_gib(load_config("tiny", [f"model.path={model}", lora_override(files)]), per_rank)
    without = need_gib(load_config("tiny", [f"model.path={model}"]), per_rank)
    assert with_loras - without == pytest.approx(sum(f.stat().st_size for f in files) / GIB)


def test_a_hub_lora_is_downloaded_once_and_fused_under_model_offload(loras, tmp_path):
    """A LoRA given as a hub id (tests/fake_hub.py on loopback): fetched once, only the named file; the workers
    read it from the cache; its content hash is the fingerprint's. The run uses model offload (the fuse lands in
    weights under accelerate's hooks) and still gives diffusers' own fuse bit for bit."""
    import hashlib

    from fake_hub import FakeHub, serve

    model, files = loras("flux2")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.safetensors").write_bytes(files[0].read_bytes())
    (repo / "b.safetensors").write_bytes(files[1].read_bytes())
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    hub = FakeHub()
    hub.add_folder("meshgen-test/tiny-lora", repo)
    server = serve(hub)
    try:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
        out = tmp_path / "out"
        job = [
            f"model.path={model}",
            "model.loras=[{path:meshgen-test/tiny-lora,weight_name:b.safetensors,scale:0.5}]",
            f"dataset.path={tmp_path / 'p.jsonl'}",
            "dataset.id_column=id",
            "mesh.tp=1",
            "generate.batch_size=1",
            "execution.offload=model",
            f"output.dir={out}",
        ]
        res = launch(*job, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        got = [p.rsplit("/", 1)[1] for p in hub.requested("GET") if "/resolve/" in p]
        assert got.count("b.safetensors") == 1 and "a.safetensors" not in got, got
        assert "fused 1 LoRA(s)" in worker_logs(out)
        [entry] = json.loads((out / "run.json").read_text())["settings"]["model"]["loras"]
        assert entry == {"sha256": hashlib.sha256(files[1].read_bytes()).hexdigest(), "scale": 0.5}
        rows, ref = read_rows(out), bare_images("flux2", diffusers_fused(model, files[1:], scales=(0.5,)))
        for r in PROMPTS:
            assert np.array_equal(pixels(rows[r["id"]]["image"]["bytes"]), ref[r["id"]]), r["id"]
        before = len(hub.log)  # again: the cache answers, no request at all
        res = launch(*job, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        assert hub.log[before:] == []
    finally:
        server.shutdown()


@pytest.mark.timeout(60)  # with the library's retries alone it waits minutes
def test_a_hub_that_never_answers_is_one_line_in_seconds(silent_hub, monkeypatch):
    """A LoRA's hub id where the hub holds the connection and never answers: asked once (no retries, each of which
    would wait again), one line naming the setting, the hub and the wait."""
    import huggingface_hub.constants

    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.loras import ensure_downloaded

    endpoint, paths = silent_hub
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = load_config("tiny", ["model.loras=[{path:nobody/a-lora}]"])
    with pytest.raises(
        ConfigError, match=r"model.loras\[0\].path nobody/a-lora: the hub at .* did not answer within 1 s"
    ):
        ensure_downloaded(cfg)
    assert [p for p in paths if "nobody" in p] == ["/api/models/nobody/a-lora"], paths


def test_real_size_flux2_fuse_adds_only_the_loras_bytes_per_rank():
    """FLUX.2-dev's transformer on the meta device as rank 0 of tp=2 holds it (tools/bench/lora.py, in its own
    process for its fake process group): the fuse changes no weight's size and works in one bounded buffer, far
    below one whole delta of the largest layer, so a rank's extra bytes are the LoRA's own."""
    import subprocess
    import sys

    from conftest import REPO

    code = "import json; from tools.bench.lora import bench_real; print(json.dumps(bench_real(rank=4)))"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["layers"] == 8 * 12 + 48 * 2  # every planned linear: 12 per double block, 2 per single block
    assert r["weights_local_bytes_after"] == r["weights_local_bytes_before"]
    assert r["fuse_working_peak_bytes"] <= r["chunk_bytes"] + 2 * 2**20
    assert r["fuse_working_peak_bytes"] * 10 < r["largest_full_delta_bytes"]
