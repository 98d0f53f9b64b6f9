"""The dry run says what the job will cost (issue 36): replicas and idle ones, output bytes against the room at the
target, the download and whether the repo is gated, and the expected time from measured or published seconds per
image, or "unknown". In-process dry runs (launcher_main), several checks per run."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import REPO

from launcher.config import load_config

TINY_TXT = REPO / "conf" / "prompts" / "tiny.txt"  # 20 prompts


def dry_run(launcher_main, capsys, *args: str) -> dict[str, list[str]]:
    """The dry run's `# key: ...` lines by key (warnings under "warning")."""
    assert launcher_main(["--dry-run", *args]) == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    lines: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("# ") and ": " in line:
            key, _, rest = line[2:].partition(": ")
            lines.setdefault(key, []).append(rest)
    return lines


@pytest.fixture
def prompts_160(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"a red fox number {i}\n" for i in range(160)))
    return path


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no saved login either


def test_idle_replicas_gated_download_and_unknown_time(launcher_main, capsys, prompts_160, tmp_path, no_token):
    """160 prompts on dp=8 at the default shard size (256) make one shard: 7 of 8 replicas idle, and 160 / 8 = 20
    prompts per shard would feed them all. FLUX.2-dev is gated (about 111 GB of bf16 weights: 32B + 24B
    parameters); no seconds per image are known for it on an H200."""
    out = f"output.dir={tmp_path / 'out'}"
    lines = dry_run(launcher_main, capsys, "conf=flux2_h200x8", f"dataset.path={prompts_160}", out)
    assert lines["replicas"] == ["8 (dp=8 x 1 worker); 1 shard to generate, 0.1 per replica"]
    [idle] = lines["warning"]
    assert idle.startswith("7 of 8 replicas will sit idle: 1 shard for 8 replicas; run.shard_size=20 makes 8 shards")
    [download] = lines["download"]
    assert download.startswith("about 111.3 GB for black-forest-labs/FLUX.2-dev, once, before the workers start")
    assert (
        "gated: the account must accept its license at https://huggingface.co/black-forest-labs/FLUX.2-dev" in download
    )
    assert "no token here: set HF_TOKEN" in download
    assert lines["time"] == [
        "unknown: no measured or published seconds per image for black-forest-labs/FLUX.2-dev on h200 "
        "(launcher/models/speeds.py)"
    ]
    assert lines["output"][0].startswith("about 288.0 MB for 160 images (png, 1024x1024)")  # 160 x 1024^2 x 1.8 B

    # 20 prompts a shard: every replica has one; on an H100 host (tp=2) a published time: 5.3 s per image on one
    # H100 at 28 steps and 1024^2, halved for 2 chips a replica, 160 images over 4 replicas = 106 s.
    os.environ["HF_TOKEN"] = "hf_stand_in"
    args = ("conf=flux2_h100x8", f"dataset.path={prompts_160}", "run.shard_size=20", f"{out}-2")
    lines = dry_run(launcher_main, capsys, *args)
    assert "warning" not in lines
    assert lines["replicas"] == ["4 (dp=4 x 1 worker); 8 shards to generate, 2.0 per replica"]
    [time] = lines["time"]
    assert time.startswith("about 1.8 min for 160 images on 4 replicas (2.65 s per image per replica: 5.3 s at 28")
    assert "published: Baseten" in time
    assert "(a token is set here)" in lines["download"][0]


def test_output_that_does_not_fit_is_a_warning(launcher_main, capsys, tmp_path):
    """1,000,000 images (50,000 prompts x 20) of 1024x1024 PNG at about 1.8 bytes a pixel: ~1.7 TiB, more than
    this disk has."""
    need = 1_000_000 * 1024 * 1024 * 1.8
    free = shutil.disk_usage(tmp_path).free
    assert free < need, "this test needs a disk with less than 1.7 TiB free"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a blue heron number {i}\n" for i in range(50_000)))
    lines = dry_run(
        launcher_main,
        capsys,
        "conf=flux2_klein_h100x8",
        f"dataset.path={prompts}",
        "generate.images_per_prompt=20",
        "run.shard_size=50",
        f"output.dir={tmp_path / 'big'}",
    )
    [output] = lines["output"]
    assert output.startswith("about 1.7 TB for 1000000 images (png, 1024x1024)") and " free there" in output
    [warning] = [w for w in lines["warning"] if "free" in w]
    assert warning.startswith(f"{tmp_path / 'big'} has ") and "the images need about 1.7 TB" in warning
    assert "free some space or choose another output.dir" in warning
    # 50,000 prompts, 50 a shard: 1,000 shards on 8 replicas
    assert lines["replicas"] == ["8 (dp=8 x 1 worker); 1000 shards to generate, 125.0 per replica"]
    assert not [w for w in lines["warning"] if "idle" in w]
    # InferenceBench's 0.57 s per image on one H100 at 4 steps, 1024^2: 1,000,000 x 0.57 / 8 replicas = 19.8 h
    assert lines["time"][0].startswith("about 19.8 h for 1000000 images on 8 replicas (0.57 s per image")


def test_tiny_job_on_cpu_has_a_measured_time_and_room(launcher_main, capsys, tmp_path, default_model):
    lines = dry_run(launcher_main, capsys, f"output.dir={tmp_path / 'out'}")
    assert "warning" not in lines
    assert lines["replicas"] == ["1 (dp=1 x 1 worker); 3 shards to generate, 3.0 per replica"]  # 20 prompts, 8 a shard
    [time] = lines["time"]
    assert time.startswith("about 3 s for 20 images on 1 replica (0.15 s per image per replica") and "measured" in time
    assert lines["download"][0].startswith("none: model.path is a local folder (")
    assert lines["output"][0].startswith("about 144.0 KB for 20 images (png, 64x64)")  # 20 x 64^2 x 1.8 B


def test_download_line_says_cached_gated_open_or_unknown(monkeypatch, tmp_path, no_token):
    from launcher.sizing import cost, model_files

    # A hub snapshot: two names linked to one 3000-byte blob count once.
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_bytes(b"x" * 3000)
    snap = tmp_path / "snapshots" / "rev"
    (snap / "vae").mkdir(parents=True)
    (snap / "model_index.json").symlink_to(blob)
    (snap / "vae" / "diffusion_pytorch_model.safetensors").symlink_to(blob)
    (snap / "dangling.safetensors").symlink_to(tmp_path / "blobs" / "missing")
    cfg = load_config("flux2_h100x8")
    monkeypatch.setattr(model_files, "cached_root", lambda path: snap)
    assert (
        cost.download_line(cfg)
        == "# download: none: black-forest-labs/FLUX.2-dev is in the Hugging Face cache (2.9 KB on disk)"
    )
    monkeypatch.setattr(model_files, "cached_root", lambda path: None)
    assert "; not gated" in cost.download_line(load_config("qwenimage_h100x8"))
    assert "; gated or not: not known here" in cost.download_line(load_config("flux2_klein_h100x8"))
    cfg.model.path = "someone/unknown-model"
    assert cost.download_line(cfg).startswith("# download: size unknown (not in the published checkpoints' table)")


CUDA_CONFS = {  # conf -> (chip, dp, tp) it names
    "flux2_h100x8": ("h100", 4, 2),
    "flux2_h200x8": ("h200", 8, 1),
    "flux1_schnell_h100": ("h100", 1, 1),
    "sd35_medium_h100x8": ("h100", 8, 1),
    "flux2_klein_h100x8": ("h100", 8, 1),
    "qwenimage_h100x8": ("h100", 8, 1),
}


@pytest.mark.parametrize("conf", sorted(CUDA_CONFS))
def test_cuda_confs_dry_run_on_a_machine_without_a_gpu(conf, launcher_main, capsys, tmp_path, no_token):
    """Each CUDA conf names its chip and dry-runs here; its tp is the one mesh.tp=auto chooses (the memory plan:
    FLUX.2-dev fits one H200 but needs tp=2 on an H100 80 GB)."""
    chip, dp, tp = CUDA_CONFS[conf]
    args = (f"conf={conf}", f"dataset.path={TINY_TXT}", f"output.dir={tmp_path / 'out'}")
    lines = dry_run(launcher_main, capsys, *args)
    assert lines["device"] == [f"cuda (device=cuda), chip: {chip}"]
    assert lines["mesh"][0].startswith(f"dp={dp} tp={tp} ({chip}, {80 if chip == 'h100' else 141} GiB per chip")
    assert load_config(conf).mesh.chips_per_host in (None, 8)
    auto = dry_run(launcher_main, capsys, *args, "mesh.tp=auto", "mesh.dp=1")
    assert auto["mesh"][0].startswith(f"dp=1 tp={tp} ")
    assert any(w.startswith(f"tp=auto chose {tp}:") for w in auto["mesh"][1:])
