"""launch.sh: dry runs (what would run, for each device and mode) and the TPU install hint."""

import pytest
from conftest import PROMPTS, launch

# conf tiny's dry runs read the checkout's built tiny model (conftest.default_model) instead of building one
pytestmark = pytest.mark.usefixtures("default_model")


def dry_run(*args):
    res = launch("--dry-run", *args, *([PROMPTS] if "conf=flux2_tp" in args else []))
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_dry_run_tiny(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # an explicit one wins (make mutants-e2e sets one)
    lines = dry_run()
    assert "export OMP_NUM_THREADS=1" in lines
    cmd = lines[-1].split()
    assert cmd[0] == "torchrun" and "--nproc-per-node=2" in cmd and "--standalone" in cmd
    assert cmd[cmd.index("-m") + 1 :] == ["launcher.worker.main", "conf=tiny"]


def test_workers_fork_from_a_preloaded_server_on_cpu_only(monkeypatch):
    from launcher.errors import ConfigError
    from launcher.host.worker_start import START_ENV, start_method

    # One worker too: the server is forked from the launcher and shares its torch import (worker_start.py)
    assert start_method("cpu", 2) == start_method("cpu", 1) == "forkserver"
    assert start_method("cuda", 8) == start_method("tpu", 8) == "subprocess"  # no device runtime in a forking process
    assert any("forks these workers" in ln for ln in dry_run())
    assert any("forks these workers" in ln for ln in dry_run("mesh.tp=1", "mesh.dp=1"))
    monkeypatch.setenv(START_ENV, "subprocess")
    assert start_method("cpu", 2) == "subprocess"
    assert not any("forks these workers" in ln for ln in dry_run())
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ConfigError, match="MESHGEN_WORKER_START='fork'"):
        start_method("cpu", 2)
    res = launch("--dry-run")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: MESHGEN_WORKER_START")


def test_dry_run_flux2_tp_needs_no_torch_tpu():
    lines = dry_run("conf=flux2_tp", "generate.seed=3")
    assert any("python -m torch.tpu.distributed" in ln and "nproc_per_node=8" in ln for ln in lines)
    assert "--nproc-per-node=8" in lines[-1] and "-m launcher.worker.main conf=flux2_tp generate.seed=3" in lines[-1]
    assert not any("TORCH_TPU_DEFER_AND_FUSE" in ln for ln in lines)


@pytest.mark.parametrize(
    ("mode", "env_line"), [("defer_and_fuse", "export TORCH_TPU_DEFER_AND_FUSE=1"), ("eager", None), ("compile", None)]
)
def test_dry_run_sets_the_mode_env_before_torch(mode, env_line):
    lines = dry_run("conf=flux2_tp", f"execution.mode={mode}")
    assert (env_line in lines) if env_line else not any("DEFER" in ln for ln in lines)
    assert lines[-1].startswith("torchrun")  # the env comes first: set before any worker imports torch


def test_dry_run_multi_host():
    lines = dry_run("conf=flux2_tp", "mesh.dp=2", "mesh.nodes=2")
    assert "--nnodes=2" in lines[-1] and "--nproc-per-node=8" in lines[-1] and "--standalone" not in lines[-1]


def test_tpu_without_torch_tpu_says_how_to_install(tmp_path):
    res = launch("conf=flux2_tp", f"output.dir={tmp_path / 'out'}")
    assert res.returncode == 2
    assert 'pip install -e ".[tpu]"' in res.stderr.strip().splitlines()[-1]
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_a_process_that_opened_an_object_store_is_not_forked_for_the_server(s3, tmp_path):
    """The workers' server is forked from the launcher only if the launcher never opened an object store's client
    (whatever opened it: the output, the prompts, a reference): launcher/host/launch.py asks opened_remote()."""
    import os
    import subprocess
    import sys

    code = (
        "from launcher.ledger.store import Store, opened_remote\n"
        "from launcher.sources.prompts import filesystem\n"
        f"Store({str(tmp_path)!r}); filesystem({str(tmp_path)!r})\n"
        "print(opened_remote())\n"
        "filesystem('s3://meshgen-test/prompts/*.txt')\n"
        "print(opened_remote())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **s3})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "True"]
