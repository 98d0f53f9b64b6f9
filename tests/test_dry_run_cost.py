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


def test_time_scales_with_steps_pixels_and_tp_and_names_a_local_folder(tmp_path):
    """launcher/models/speeds.py: FLUX.2-dev at 5.3 s an image on one H100, 28 steps, 1024x1024. Twice the steps,
    half the pixels (512x1024) and tp=2: 5.3 x 2 x 0.5 / 2 = 2.65 s; 100 images over 4 replicas: 66 s = 1.1 min.
    A local folder with no entry is named by its folder name."""
    from launcher.sizing import cost

    cfg = load_config("flux2_h100x8", ["generate.num_inference_steps=56", "generate.height=512", "mesh.tp=2"])
    assert cost.time_line(cfg, "h100", 100, 4) == (
        "# time: about 1.1 min for 100 images on 4 replicas (2.65 s per image per replica: 5.3 s at 28 steps, "
        "1024x1024, tp=1 on h100, scaled linearly to this job's steps, pixels and tp; published: Baseten's H100 "
        "baseline (0.98 s x 5.4); start-up and download not counted)"
    )
    (tmp_path / "my-model").mkdir()
    cfg.model.path = str(tmp_path / "my-model")
    assert cost.time_line(cfg, "h100", 100, 4) == (
        "# time: unknown: no measured or published seconds per image for my-model on h100 (launcher/models/speeds.py)"
    )


def test_durations_change_unit_at_a_whole_minute_hour_and_day():
    from launcher.sizing.cost import duration

    assert [duration(s) for s in (59, 60, 3599, 3600, 86399, 86400)] == [
        "59 s",
        "1.0 min",
        "60.0 min",
        "1.0 h",
        "24.0 h",
        "1.0 days",
    ]


def test_a_sweep_multiplies_the_images_of_the_cost_lines(launcher_main, capsys, tmp_path, default_model):
    """20 prompts x 3 guidance values = 60 images, at 64x64 PNG: 60 x 64^2 x 1.8 B = 432 KB."""
    sweep = "generate.sweep={guidance_scale:[2.5,4.0,5.0]}"
    lines = dry_run(launcher_main, capsys, f"output.dir={tmp_path / 'out'}", sweep)
    assert lines["output"][0].startswith("about 432.0 KB for 60 images (png, 64x64)")
    assert lines["time"][0].startswith("about 9 s for 60 images on 1 replica")


def test_download_line_of_a_built_model_a_gated_repo_without_a_token_and_paths(tmp_path, no_token):
    """Each download line whole: the tiny model built on first use, a gated repo with no token here, and paths
    that are no hub id (absolute, or ending in "/") even with one slash."""
    from launcher.sizing import cost

    cfg = load_config("tiny", [f"model.path={tmp_path / 'not-built-yet'}"])
    assert cfg.model.build
    assert cost.download_line(cfg) == "# download: none: the project's tiny model, built here on first use"
    cfg = load_config("flux2_h100x8")
    assert cost.download_line(cfg) == (
        "# download: about 111.3 GB for black-forest-labs/FLUX.2-dev, once, before the workers start; gated: the "
        "account must accept its license at https://huggingface.co/black-forest-labs/FLUX.2-dev (no token here: set "
        "HF_TOKEN or run `hf auth login`)"
    )
    for path in ("/no-such-model", "someone/"):
        cfg.model.path = path
        assert cost.download_line(cfg) == f"# download: unknown: {path} is neither a folder nor a hub id"


def test_output_lines_at_an_exact_fit_and_on_an_object_store(monkeypatch, tmp_path):
    """The warning is for an output that will not fit: free == need fits. An object store has no free count."""
    from launcher.ledger.store import Store
    from launcher.sizing import cost

    cfg = load_config("tiny")
    need = 10 * 64 * 64 * 1.8  # 10 PNG images of 64x64 at 1.8 B a pixel
    assert cost.output_lines(cfg, ObjectStore(), 10) == [
        "# output: about 72.0 KB for 10 images (png, 64x64) at s3://bucket/out; free space not known there (an "
        "object store)"
    ]
    monkeypatch.setattr(cost, "free_bytes", lambda store: int(need))
    assert cost.output_lines(cfg, Store(str(tmp_path)), 10) == [
        f"# output: about 72.0 KB for 10 images (png, 64x64) at {tmp_path}; 72.0 KB free there"
    ]


class ObjectStore:
    """An object store as space.py sees one (no local folder), taking writes without a network."""

    is_local = False

    def __init__(self, refuse: OSError | None = None):
        self.refuse = refuse

    def __str__(self) -> str:
        return "s3://bucket/out"

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.refuse is not None:
            raise self.refuse

    def delete(self, rel: str) -> None:
        pass


def test_the_last_line_of_a_run_the_output_stopped(monkeypatch, tmp_path):
    """space.stopped_by_space: a local file system with no inode left is out of inodes; one that reports no inodes at
    all (btrfs: f_files 0) is out of space; an object store has no free count and says it refused writes; a
    refusal is cut to its first 200 characters."""
    from types import SimpleNamespace

    from launcher.ledger.store import Store
    from launcher.sizing.space import stopped_by_space

    cfg = load_config("tiny")
    real = os.statvfs

    def statvfs(files: int):
        """The real numbers of the folder, with `files` inodes in all and none free."""

        def fake(path):
            st = {k: getattr(real(path), k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail")}
            return SimpleNamespace(**st, f_files=files, f_ffree=0, f_favail=0)

        return fake

    for files, words in ((1000, "is out of inodes (0 free, "), (0, "is out of space (")):
        monkeypatch.setattr(os, "statvfs", statvfs(files))
        line = stopped_by_space(cfg, Store(str(tmp_path)), {}, "r1", True)
        assert line.startswith(f"error: {tmp_path} {words}"), (files, line)
    monkeypatch.setattr(os, "statvfs", real)
    said = {0: {"run_id": "r1", "out_of_space": True}}
    assert stopped_by_space(cfg, ObjectStore(), said, "r1", False) == (
        "error: s3://bucket/out is out of space (the store refused writes: a quota?); free some space and run the "
        "same command again to finish"
    )
    refused = PermissionError(13, "Permission denied " + "x" * 300)
    why = str(refused)[:200]
    assert stopped_by_space(cfg, ObjectStore(refused), {}, "r1", False) == (
        f"error: s3://bucket/out refuses writes ({why}); make it writable again and run the same command to finish"
    )


GIB = 1024**3


@pytest.fixture
def stand_in_weights(monkeypatch):
    """Components whose counts a test names: (library, class, config) -> the Counts in `weights[class]`, so the mesh
    plan's arithmetic is checked in whole GiB (2 bytes a parameter in bfloat16) without instantiating a model."""
    from launcher.sizing import memory

    weights: dict[str, memory.Counts] = {}
    monkeypatch.setattr(memory, "counts", lambda comp: weights[comp[1]])
    return weights


def bf16_gib(total: float, sharded: float = 0):
    """Counts of `total` GiB of bfloat16 weights, `sharded` GiB of them in layers the tp plan splits."""
    from launcher.sizing.memory import Counts

    return Counts(int(total * GIB) // 2, int(sharded * GIB) // 2, 0, 0)


def test_mesh_plan_of_stand_in_weights_on_a_10_gib_chip(stand_in_weights):
    """FLUX.2's settings (1 image of 1024x1024 a call: 2 GiB working margin) on an h100 said to hold 10 GiB, 9 usable.
    A UNet counts as the transformer, text encoders add up, a part the pipeline lacks is 0.0; exactly the usable
    memory fits, auto or not; a miss is refused by default."""
    from launcher.errors import ConfigError
    from launcher.sizing.mesh_plan import plan_mesh

    stand_in_weights.update(U=bf16_gib(2), E1=bf16_gib(1), E2=bf16_gib(4))
    comps = {"unet": ("diffusers", "U", {}), "text_encoder": ("t", "E1", {}), "text_encoder_2": ("t", "E2", {})}
    for tp in ("1", "auto"):
        cfg = load_config("flux2_h100x8", ["mesh.dp=1", f"mesh.tp={tp}", "mesh.chip_memory_gib=10"])
        plan = plan_mesh(cfg, "cuda", comps)  # 2 + 1 + 4 + 2 = 9 GiB of 9
        assert plan.line() == (
            "# mesh: dp=1 tp=1 (h100, 10 GiB per chip; per rank: transformer 2.0 GiB, text_encoder 5.0 GiB, "
            "vae 0.0 GiB)"
        )
    cfg = load_config("flux2_h100x8", ["mesh.dp=1", "mesh.tp=1", "mesh.chip_memory_gib=9.9"])
    with pytest.raises(ConfigError, match=r"^mesh dp=1 tp=1 does not fit: per-rank weights \(transformer 2.0, "):
        plan_mesh(cfg, "cuda", comps)


def test_offload_plans_one_model_at_a_time_at_tp_1(stand_in_weights):
    """execution.offload=model: the largest model (here the VAE) and the margin must fit; auto can only take tp=1."""
    from launcher.errors import ConfigError
    from launcher.sizing.mesh_plan import plan_mesh

    stand_in_weights.update(T=bf16_gib(7, 7), E=bf16_gib(1), V=bf16_gib(8), V6=bf16_gib(6))
    comps = {"transformer": ("d", "T", {}), "text_encoder": ("t", "E", {}), "vae": ("d", "V", {})}
    args = ["mesh.dp=1", "mesh.chip_memory_gib=10", "execution.offload=model"]
    with pytest.raises(ConfigError) as e:
        plan_mesh(load_config("flux2_h100x8", [*args, "mesh.tp=1"]), "cuda", comps)
    assert str(e.value) == (
        "mesh dp=1 tp=1 does not fit: per-rank weights (transformer 7.0, text_encoder 1.0, vae 8.0 GiB, on the chip "
        "one at a time (offload)) + 2.0 GiB working margin = 10.0 GiB > 9.0 GiB usable per h100 chip (10 GiB less 10% "
        "reserved); use a chip with more memory or a smaller generate.batch_size or size"
    )
    comps["vae"] = ("d", "V6", {})
    plan = plan_mesh(load_config("flux2_h100x8", [*args, "mesh.tp=auto"]), "cuda", comps)
    assert plan.tp == 1 and plan.why[0].startswith("tp=auto chose 1: ")


def test_auto_tp_tries_each_chip_of_the_host_and_no_more(stand_in_weights):
    """100 GiB of fully sharded weights need tp >= 15 on a 9 GiB-usable chip: with the chip count unknown, auto tries
    up to 8 (launcher/sizing/mesh_plan.py's default), with mesh.chips_per_host=3 up to 3."""
    from launcher.errors import ConfigError
    from launcher.sizing.mesh_plan import plan_mesh

    stand_in_weights.update(T=bf16_gib(100, 100))
    for per_host, top in (("null", 8), ("3", 3)):
        args = ["mesh.dp=1", "mesh.tp=auto", "mesh.chip_memory_gib=10", f"mesh.chips_per_host={per_host}"]
        with pytest.raises(ConfigError, match=rf"^mesh.tp=auto: no tp up to {top} fits a h100 chip: at tp={top}, "):
            plan_mesh(load_config("flux2_h100x8", args), "cuda", {"transformer": ("d", "T", {})})


def test_auto_tp_divides_the_text_encoders_heads_when_only_it_is_sharded(stand_in_weights):
    """A sharded text encoder of 240 GiB with 6 heads (and no num_key_value_heads, as configs before grouped-query
    attention) on an 80 GB H100 (72 GiB usable): tp=4 would fit (60 + 2 GiB) but does not divide 6 heads; tp=6 does."""
    from launcher.sizing.mesh_plan import plan_mesh

    stand_in_weights.update(T=bf16_gib(0.5), E=bf16_gib(240, 240))
    comps = {"transformer": ("d", "T", {}), "text_encoder": ("t", "E", {"num_attention_heads": 6})}
    cfg = load_config("flux2_h100x8", ["mesh.dp=1", "mesh.tp=auto", "model.shard_transformer=false"])
    assert plan_mesh(cfg, "cuda", comps).tp == 6


def test_on_cpu_the_processes_share_the_hosts_memory(stand_in_weights):
    """mesh.chip=cpu of 10 GiB: 9 GiB usable over the processes of the host (launcher/sizing/mesh_plan.py)."""
    from launcher.checks.settings import check_mesh
    from launcher.errors import ConfigError
    from launcher.sizing.mesh_plan import plan_mesh

    stand_in_weights.update(T6=bf16_gib(6), T8=bf16_gib(8))
    cpu = ["mesh.chip=cpu", "mesh.chip_memory_gib=10", "mesh.chips_per_host=1"]

    def plan(weights, *args):
        return plan_mesh(load_config("flux2_h100x8", [*cpu, *args]), "cpu", {"transformer": ("d", weights, {})})

    assert plan("T6", "mesh.dp=1", "mesh.tp=auto").tp == 1  # 6 + 2 GiB of 9
    with pytest.raises(ConfigError) as e:
        plan("T8", "mesh.dp=1", "mesh.tp=auto")  # 10 GiB of 9
    assert str(e.value).startswith("mesh.tp=auto: no tp up to 1 fits a cpu chip: at tp=1, ")
    assert "= 10.0 GiB > 9.0 GiB usable; " in str(e.value)
    with pytest.raises(ConfigError, match=r"^mesh.tp=auto: no tp up to 1 fits a cpu chip"):
        plan("T6", "mesh.dp=2", "mesh.tp=auto")  # 8 GiB of 4.5 each
    # 3 processes, or 1, over 2 hosts do not split: refused for that (check_mesh, after the plan), not for memory
    # nor with a ZeroDivisionError (1 // 2 = 0 processes a host)
    for dp, tp in ((3, "1"), (3, "auto"), (1, "1"), (1, "auto")):
        cfg = load_config("flux2_h100x8", [*cpu, f"mesh.dp={dp}", f"mesh.tp={tp}", "mesh.nodes=2"])
        assert plan_mesh(cfg, "cpu", {"transformer": ("d", "T6", {})}).tp == 1
        with pytest.raises(ConfigError, match=rf"^mesh.dp \* mesh.tp = {dp} processes do not split evenly"):
            check_mesh(cfg, "cpu", host=False)


def test_the_host_share_of_a_calls_images_is_over_the_processes_of_a_host():
    """launcher/sizing/work_bounds.py: half the host's memory over its processes (dp x tp / nodes)."""
    from launcher.errors import ConfigError
    from launcher.sizing.mesh_plan import plan_mesh

    for dp, tp, procs in ((1, 1, 1), (2, 2, 4)):
        cfg = load_config("flux2_h100x8", [f"mesh.dp={dp}", f"mesh.tp={tp}", "generate.batch_size=100000"])
        with pytest.raises(ConfigError, match=rf"^one pipeline call makes 100000 images .* over its {procs} processes"):
            plan_mesh(cfg, "cuda", None)


def test_a_mesh_line_in_tenths_of_a_gib():
    from launcher.sizing.mesh_plan import Chip, MeshPlan

    chip = Chip("h100", 80.0, 8)
    per_rank = {"transformer": 0, "text_encoder": 2000, "vae": 3 * GIB // 2}
    assert MeshPlan(1, 1, chip, per_rank).line() == (
        "# mesh: dp=1 tp=1 (h100, 80 GiB per chip; per rank: transformer 0.0 GiB, text_encoder <0.1 GiB, vae 1.5 GiB)"
    )
    assert MeshPlan(2, 1, Chip("v9", None, None), None).line() == (
        "# mesh: dp=2 tp=1 (v9, ? GiB per chip; per rank: unknown: the model's configs are neither local nor in the "
        "table of published checkpoints)"
    )


def test_a_model_whose_classes_cannot_be_built_gets_no_memory_check(tmp_path, monkeypatch):
    """A class this diffusers lacks: a warning and a mesh of unknown weights, not a crash."""
    from launcher.sizing.mesh_plan import detect_chip, plan_mesh

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path))
    cfg = load_config("flux2_h100x8", ["mesh.dp=1", "mesh.tp=1"])
    plan = plan_mesh(cfg, "cuda", {"transformer": ("diffusers", "NoSuchTransformerModel", {})})
    assert plan.per_rank is None and plan.line().endswith(
        "per rank: unknown: the model's configs are neither local nor in the table of published checkpoints)"
    )
    cfg.mesh.chip = "mi300"
    with pytest.raises(Exception) as e:
        detect_chip(cfg, "cuda")
    assert str(e.value) == (
        "mesh.chip=mi300 has no known memory (known: v5e, v5p, v6e, v7x, h100, h200); set mesh.chip_memory_gib"
    )


def test_lora_files_add_their_bytes_to_the_memory_need(tmp_path):
    """launcher/sizing/mesh_plan.py lora_bytes: each rank reads each LoRA file whole while fusing."""
    from launcher.sizing.mesh_plan import need_gib

    (tmp_path / "a.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "b.safetensors").write_bytes(b"\0" * 3000)
    loras = f"model.loras=[{{path:{tmp_path / 'a.safetensors'}}},{{path:{tmp_path / 'b.safetensors'}}}]"
    per_rank = {"transformer": GIB, "text_encoder": 0, "vae": 0}
    grown = need_gib(load_config("tiny", [loras]), per_rank) - need_gib(load_config("tiny"), per_rank)
    assert grown * GIB == pytest.approx(4000)


def test_a_quality_model_in_a_local_folder_is_counted_from_its_config(tmp_path, monkeypatch):
    """quality.clip_model as a folder: its config.json's CLIP, held whole in model.dtype (bfloat16: 2 bytes)."""
    import json

    import torch
    import transformers

    from launcher.sizing import memory

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path / "counts"))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1}
    text = {**vision, "vocab_size": 100, "max_position_embeddings": 16}
    config = {"vision_config": {**vision, "patch_size": 8, "image_size": 32}, "text_config": text, "projection_dim": 16}
    (tmp_path / "clip").mkdir()
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = transformers.CLIPModel(transformers.CLIPConfig.from_dict(config))
    params = sum(p.numel() for p in model.parameters())
    cfg = load_config(
        "tiny", ["model.dtype=bfloat16", "quality.clip_score=true", f"quality.clip_model={tmp_path / 'clip'}"]
    )
    assert memory.quality_bytes(cfg) == params * 2


def test_what_the_tp_plan_styles_split():
    """memory._style: column-wise and embeddings split weight and bias, row-wise the weight (its bias is added after
    the reduction), and styles that split no weight (replicated, sequence parallel, all-reduce) nothing."""
    from launcher.sizing.memory import Counts, _style

    splits = {
        "colwise": "all",
        "colwise_rep": "all",
        "packed_colwise": "all",
        "embedding_rowwise": "all",
        "embedding_colwise": "all",
        "rowwise": "weight",
        "rowwise_rep": "weight",
        "packed_rowwise": "weight",
        "replicate": None,
        "replicated_with_grad_allreduce": None,
        "sequence_parallel": None,
        "all_reduce": None,
    }
    assert {s: _style(s) for s in splits} == splits
    # A split that does not divide evenly: the first ranks hold one more (7 sharded over 2: 4 and 3), counted up.
    assert Counts(10, 7, 0, 0).rank_bytes(2, "bfloat16", True) == (3 + 4) * 2


def test_a_colwise_layers_bias_is_sharded_with_it(tmp_path, monkeypatch):
    """Qwen2 (Qwen-Image's text encoder family) has biases on q/k/v, which its plan splits column-wise; o_proj and
    down_proj are row-wise (weights only, no bias). By hand for hidden 64, 4 heads of 16, 2 key-value heads,
    MLP 128, 100 tokens: q 64x64 + 64, k and v 64x32 + 32 each, o 64x64, gate, up and down 64x128 each, and the
    embedding (split by vocabulary) 100x64."""
    from launcher.sizing import memory

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path))
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "vocab_size": 100, "model_type": "qwen2"}
    counts = memory.counts(("transformers", "Qwen2Model", config))
    assert counts.sharded == (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 100 * 64


def test_saved_buffers_count_and_counting_leaves_the_logging_alone(tmp_path, monkeypatch):
    """SD3.5's transformer saves its position embedding, a buffer of 384 x 384 positions x 1536 (its config's
    pos_embed_max_size and 24 heads of 64), beside its parameters. Counting silences diffusers' and transformers'
    config warnings, and nothing else: the launcher's own warnings still show. A config counted again in another
    key order is the same architecture: counted once (one cache entry)."""
    import json
    import logging

    import torch

    from launcher.models.checkpoints import PUBLISHED
    from launcher.sizing import memory

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path))
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)
    library, cls_name, config = PUBLISHED["stabilityai/stable-diffusion-3.5-medium"]["transformer"]
    counts = memory.counts((library, cls_name, config))
    assert root.level == logging.WARNING
    with torch.device("meta"):
        import diffusers

        params = sum(p.numel() for p in getattr(diffusers, cls_name).from_config(config).parameters())
    assert counts.total == params + 384 * 384 * 1536
    assert memory.counts((library, cls_name, dict(reversed(config.items())))) == counts
    assert len(json.loads(memory.cache_path().read_text())) == 1


def test_a_cached_pipeline_missing_a_component_is_not_complete(tmp_path, monkeypatch):
    """model_files.complete_in_cache decides whether the launcher downloads (launcher/checks/download.py): a
    snapshot whose model_index.json lists a VAE it lacks must be downloaded again."""
    import json

    from launcher.sizing import model_files

    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "model_index.json").write_text(json.dumps({"vae": ["diffusers", "AutoencoderKL"]}))
    monkeypatch.setattr(model_files, "cached_root", lambda path: snap)
    assert not model_files.complete_in_cache("someone/model")
    (snap / "vae").mkdir()  # a folder of configs only (no config.json: no weights expected)
    assert model_files.complete_in_cache("someone/model")


def test_a_shard_over_the_bound_names_the_shard_size_that_fits():
    """launcher/sizing/work_bounds.py: 1280 WebP images of 8192x8192 a prompt at 0.25 bytes a pixel are exactly the
    20 GiB bound of one shard: run.shard_size=2 is over it, and one prompt a shard fits."""
    from launcher.errors import ConfigError
    from launcher.sizing.work_bounds import check_work

    args = ["output.format=webp", "generate.height=8192", "generate.width=8192", "generate.images_per_prompt=1280"]
    with pytest.raises(ConfigError) as e:
        check_work(load_config("tiny", [*args, "run.shard_size=2"]), 1, host_bytes=2**50)
    assert str(e.value) == (
        "one shard would hold 2560 images (run.shard_size=2 x generate.images_per_prompt=1280 x 1 sweep variants) at "
        "up to 8192x8192: about 40.0 GiB of webp files, above the 20 GiB bound of one shard; use run.shard_size=1 or "
        "less"
    )
